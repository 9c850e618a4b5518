"""SSH private keys move from files on one Corral host into the database, encrypted
(machines_app.keystore), so every host reaches an SSH machine with the same key.

For each machine with a ``private_key_path``:

- the file is read and its text stored encrypted in ``private_key_sealed`` (Fernet, with
  a key derived from this installation's SECRET_KEY). A key Corral wrote itself — under
  the data directory's ``ssh/`` — is then deleted; a file an admin named elsewhere is left
  where it is (it is theirs), and Corral no longer reads it.
- a file that cannot be read (gone, unreadable, not text) is left as it is; the machine
  gets no key, its link is marked unreachable with the sentence
  :data:`KEY_NOT_MOVED`, and its admin page says that no key is stored and that the key
  must be pasted again. Nothing is guessed.

Pending stops (PendingStop.place) that named a key file get the sealed key the same way,
so a stop deferred before the upgrade still reaches its machine.
"""

from pathlib import Path

from django.conf import settings
from django.db import migrations, models

KEY_NOT_MOVED = ("the private key file {path} could not be read when keys moved into the database ({reason}): "
                 "paste the private key again in the admin")


def _read(path: str) -> tuple[str, str]:
    """(the key's text, '') or ('', why it cannot be read)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeError) as exc:
        return "", getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    if "PRIVATE KEY" not in text:
        return "", "it holds no private key"
    return text.strip() + "\n", ""


def keys_into_database(apps, schema_editor):
    from machines_app.keystore import seal_key

    Machine = apps.get_model("machines_app", "Machine")
    PendingStop = apps.get_model("machines_app", "PendingStop")
    own = (Path(settings.DATA_DIR) / "ssh").resolve()
    sealed_by_path: dict[str, str] = {}
    for machine in Machine.objects.exclude(private_key_path=""):
        text, reason = _read(machine.private_key_path)
        if not text:
            machine.link_state = "unreachable"
            machine.link_reason = KEY_NOT_MOVED.format(path=machine.private_key_path, reason=reason)
            machine.save(update_fields=["link_state", "link_reason"])
            continue
        machine.private_key_sealed = sealed_by_path[machine.private_key_path] = seal_key(text)
        machine.save(update_fields=["private_key_sealed"])
    for stop in PendingStop.objects.all():
        place = dict(stop.place or {})
        path = place.pop("private_key_path", None)
        if path is None:
            continue
        if path and path not in sealed_by_path:
            text, _ = _read(path)
            if text:
                sealed_by_path[path] = seal_key(text)
        place["private_key_sealed"] = sealed_by_path.get(path, "")
        stop.place = place
        stop.save(update_fields=["place"])
    for path in sealed_by_path:
        file = Path(path)
        if file.resolve().parent == own:
            file.unlink(missing_ok=True)


class Migration(migrations.Migration):

    dependencies = [
        ('machines_app', '0015_help_texts_in_plain_words'),
    ]

    operations = [
        migrations.AddField(
            model_name='machine',
            name='private_key_sealed',
            field=models.TextField(blank=True, editable=False, help_text='The private key pasted in the admin, encrypted with this installation\'s SECRET_KEY. Never shown again.', verbose_name='private key (encrypted)'),
        ),
        migrations.RunPython(keys_into_database, migrations.RunPython.noop),
        migrations.RemoveField(
            model_name='machine',
            name='private_key_path',
        ),
    ]

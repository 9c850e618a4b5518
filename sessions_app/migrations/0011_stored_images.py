"""Attached images move from files under ``<CORRAL_DATA_DIR>/images/`` into the database
(StoredImage), so every Corral host reads them.

Each ``<sha256>.<ext>`` file whose bytes still hash to its name is imported with the media
type its extension stands for, then deleted with its ``<sha256>.server.png`` (made again,
into the database, when a request needs it). A file that cannot be read, or whose bytes
no longer match its name, is left where it is: its messages show the image as no longer
stored, and the model is told so in words. The directory itself is removed once empty.
"""

import hashlib
from pathlib import Path

from django.conf import settings
from django.db import migrations, models

#: The extensions sessions_app.images wrote → media type.
MEDIA_TYPES = {"png": "image/png", "jpg": "image/jpeg", "webp": "image/webp", "gif": "image/gif"}


def files_into_database(apps, schema_editor):
    StoredImage = apps.get_model("sessions_app", "StoredImage")
    folder = Path(settings.DATA_DIR) / "images"
    if not folder.is_dir():
        return
    moved = []
    for path in sorted(folder.iterdir()):
        stem, _, ext = path.name.partition(".")
        if ext not in MEDIA_TYPES or len(stem) != 64 or path.is_symlink() or not path.is_file():
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if hashlib.sha256(data).hexdigest() != stem:
            continue
        StoredImage.objects.update_or_create(
            sha256=stem, defaults={"media_type": MEDIA_TYPES[ext], "data": data, "size": len(data)}
        )
        moved.append(path)
    for path in moved:
        path.unlink(missing_ok=True)
        (folder / f"{path.name.partition('.')[0]}.server.png").unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        pass  # something was left in it


class Migration(migrations.Migration):

    dependencies = [
        ('sessions_app', '0010_help_texts_in_plain_words'),
    ]

    operations = [
        migrations.CreateModel(
            name='StoredImage',
            fields=[
                ('sha256', models.CharField(help_text='SHA-256 of the bytes, 64 hex digits.', max_length=64, primary_key=True, serialize=False)),
                ('media_type', models.CharField(help_text='image/png, image/jpeg, image/webp or image/gif.', max_length=20)),
                ('data', models.BinaryField(help_text="The image's bytes as attached.")),
                ('size', models.PositiveIntegerField(help_text='Bytes.')),
                ('server_png', models.BinaryField(blank=True, help_text='The PNG sent to llama-server for a kind it cannot read.', null=True)),
                ('created', models.DateTimeField(auto_now_add=True)),
            ],
        ),
        migrations.RunPython(files_into_database, migrations.RunPython.noop),
    ]

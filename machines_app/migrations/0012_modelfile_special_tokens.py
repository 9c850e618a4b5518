from django.db import migrations, models


class Migration(migrations.Migration):
    """ModelFile.special_tokens: the template's special token strings, read from the GGUF
    vocabulary at discovery (None on rows discovered before: read at their next request)."""

    dependencies = [
        ("machines_app", "0011_machine_tool_containment"),
    ]

    operations = [
        migrations.AddField(
            model_name="modelfile",
            name="special_tokens",
            field=models.JSONField(blank=True, default=None, editable=False, null=True),
        ),
    ]

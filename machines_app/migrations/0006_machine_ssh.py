from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("machines_app", "0005_machine_workspace_roots_groups"),
    ]

    operations = [
        migrations.AddField(
            model_name="machine",
            name="link_state",
            field=models.CharField(
                choices=[
                    ("unchecked", "not checked yet"),
                    ("reachable", "reachable"),
                    ("unreachable", "unreachable"),
                    ("host_key_changed", "host key changed"),
                ],
                default="unchecked",
                max_length=20,
            ),
        ),
        migrations.AddField(
            model_name="machine",
            name="link_reason",
            field=models.TextField(blank=True, help_text="Why the machine is unreachable, in plain words."),
        ),
        migrations.AddField(
            model_name="machine",
            name="link_checked_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="machine",
            name="offered_host_key",
            field=models.TextField(
                blank=True,
                help_text="The key the machine offered when it was refused for a changed key (to re-pin).",
            ),
        ),
        migrations.AlterField(
            model_name="machine",
            name="private_key_path",
            field=models.CharField(
                blank=True,
                help_text="Path of the private key file on the Corral backend (a key pasted in the admin is stored "
                "under the data directory, mode 0600, and never shown again).",
                max_length=500,
            ),
        ),
        migrations.AlterField(
            model_name="machine",
            name="host_key",
            field=models.TextField(
                blank=True,
                help_text="Pinned host key ('ssh-ed25519 AAAA…', or known_hosts lines, plain or hashed); connections "
                "offering another key are refused.",
            ),
        ),
    ]

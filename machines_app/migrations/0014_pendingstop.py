import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    """PendingStop: a server whose stop could not reach its machine, stopped by the watch
    when the machine answers again (docs/behaviour.md §5 "no orphans")."""

    dependencies = [
        ("machines_app", "0013_memory_room"),
    ]

    operations = [
        migrations.CreateModel(
            name="PendingStop",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("place", models.JSONField(default=dict)),
                ("session_id", models.PositiveIntegerField(blank=True, null=True)),
                ("pid", models.PositiveIntegerField()),
                ("start_time", models.CharField(max_length=40)),
                ("port", models.PositiveIntegerField()),
                ("reason", models.TextField(blank=True, help_text="Why the machine could not be reached, as last tried.")),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("tried_at", models.DateTimeField(blank=True, null=True)),
                ("machine", models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL,
                                              to="machines_app.machine")),
            ],
        ),
    ]

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("machines_app", "0015_help_texts_in_plain_words"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="Quota",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                (
                    "tokens_per_day",
                    models.PositiveBigIntegerField(
                        help_text="Prompt tokens not taken from the prompt cache plus reply tokens, per UTC day (0: none at all)."
                    ),
                ),
                (
                    "group",
                    models.OneToOneField(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="usage_quota",
                        to="auth.group",
                    ),
                ),
                (
                    "user",
                    models.OneToOneField(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="usage_quota",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(
                            models.Q(("group__isnull", True), ("user__isnull", False)),
                            models.Q(("group__isnull", False), ("user__isnull", True)),
                            _connector="OR",
                        ),
                        name="quota_for_a_user_or_a_group",
                        violation_error_message="A quota is for one member or for one group: choose exactly one.",
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="UsageRecord",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("member_name", models.CharField(max_length=150)),
                ("machine_name", models.CharField(max_length=100)),
                (
                    "model_key",
                    models.CharField(
                        help_text="the model file's path in the machine's models directory", max_length=1000
                    ),
                ),
                ("model_name", models.CharField(help_text="its display name then", max_length=300)),
                (
                    "source",
                    models.CharField(choices=[("session", "session"), ("api", "API")], max_length=10),
                ),
                ("prompt_tokens", models.PositiveBigIntegerField(default=0)),
                ("cached_tokens", models.PositiveBigIntegerField(default=0)),
                ("completion_tokens", models.PositiveBigIntegerField(default=0)),
                ("seconds", models.FloatField(default=0.0)),
                ("at", models.DateTimeField(default=django.utils.timezone.now)),
                (
                    "machine",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="usage_records",
                        to="machines_app.machine",
                    ),
                ),
                (
                    "member",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="usage_records",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={
                "ordering": ["-at"],
                "indexes": [
                    models.Index(fields=["at"], name="usage_at_idx"),
                    models.Index(fields=["member", "at"], name="usage_member_at_idx"),
                ],
            },
        ),
    ]

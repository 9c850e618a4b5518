import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="Identity",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("issuer", models.CharField(help_text="The identity provider's issuer URL.", max_length=500)),
                ("subject", models.CharField(help_text="The provider's permanent id for this person (the sub claim).",
                                             max_length=255)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("last_login_at", models.DateTimeField(blank=True, null=True)),
                ("user", models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, related_name="sso_identity",
                                              to=settings.AUTH_USER_MODEL)),
            ],
            options={
                "verbose_name": "single sign-on identity",
                "verbose_name_plural": "single sign-on identities",
                "constraints": [models.UniqueConstraint(fields=("issuer", "subject"), name="sso_identity_once")],
            },
        ),
    ]

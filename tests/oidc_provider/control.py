"""Set the test identity provider up and change its people, from the command line:

    python -m tests.oidc_provider.control setup CLIENT_ID SECRET REDIRECT_URI
    python -m tests.oidc_provider.control put-user NAME PASSWORD EMAIL [GROUP ...]

``setup`` writes a fresh RSA key (cryptography), migrates and registers Corral as a
confidential client (authorization code, RS256, no consent screen); ``put-user`` creates
or updates one person and makes their groups exactly those given. ``IDP_DIR`` and
``DJANGO_SETTINGS_MODULE=tests.oidc_provider.settings`` in the environment.
"""

import os
import sys
from pathlib import Path


def write_key() -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    (Path(os.environ["IDP_DIR"]) / "rsa.pem").write_bytes(pem)


def main(argv: list[str]) -> None:
    command, *args = argv
    if command == "setup":
        write_key()
    import django

    django.setup()
    from django.contrib.auth.models import Group, User
    from django.core.management import call_command

    if command == "setup":
        from oauth2_provider.models import Application

        client_id, secret, redirect_uri = args
        call_command("migrate", verbosity=0)
        Application.objects.create(
            name="Corral", client_id=client_id, client_secret=secret, redirect_uris=redirect_uri,
            client_type=Application.CLIENT_CONFIDENTIAL, authorization_grant_type=Application.GRANT_AUTHORIZATION_CODE,
            algorithm=Application.RS256_ALGORITHM, skip_authorization=True,
        )
    elif command == "put-user":
        name, password, email, *groups = args
        user, _ = User.objects.get_or_create(username=name)
        user.email = email
        if not user.check_password(password):  # a new hash would end the person's login here
            user.set_password(password)
        user.save()
        user.groups.set([Group.objects.get_or_create(name=g)[0] for g in groups])
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])

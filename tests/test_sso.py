"""Single sign-on with OpenID Connect (docs/access.md, "Single sign-on").

A real provider runs beside Corral: a small Django project with django-oauth-toolkit
(tests/oidc_provider), its own port, SQLite file and RSA key made at start, Corral
registered there as a confidential client. Corral's daphne runs with CORRAL_OIDC_ISSUER
pointing at it (endpoints discovered) and password login switched off; Chromium clicks
"Sign in with Test Directory", signs in at the provider and lands back in Corral.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import httpx
import pytest
from django.contrib.auth.models import Group, User

from accounts_app.models import Identity
from machines_app.models import Machine
from sessions_app.models import AgentSession

from .conftest import ROOT, Stack, _database_url, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

CLIENT_ID = "corral-test"
CLIENT_SECRET = "corral-test-secret-0123456789"
PROVIDER = "Test Directory"


@dataclass
class Directory:
    """The running test provider; :meth:`put_user` changes its people."""

    url: str
    issuer: str
    env: dict

    def put_user(self, name: str, password: str, *groups: str) -> None:
        subprocess.run([sys.executable, "-m", "tests.oidc_provider.control", "put-user", name, password,
                        f"{name}@example.com", *groups], cwd=ROOT, env=self.env, check=True, timeout=120)


@dataclass
class SSO:
    directory: Directory
    corral: Stack


def _serves(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def sso(django_db_setup, tmp_path_factory):
    """The provider and a daphne of Corral set up against it, for this module."""
    from django.conf import settings

    from machines_app.transports import LocalTransport
    from project import data_dir

    idp_port, corral_port = LocalTransport().free_port(), LocalTransport().free_port()
    while corral_port == idp_port:
        corral_port = LocalTransport().free_port()
    idp_dir = tmp_path_factory.mktemp("idp")
    issuer = f"http://127.0.0.1:{idp_port}/o"
    idp_env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.oidc_provider.settings", "IDP_DIR": str(idp_dir),
               "IDP_ISSUER": issuer, "PYTHONUNBUFFERED": "1"}
    subprocess.run([sys.executable, "-m", "tests.oidc_provider.control", "setup", CLIENT_ID, CLIENT_SECRET,
                    f"http://127.0.0.1:{corral_port}/oidc/callback/"], cwd=ROOT, env=idp_env, check=True, timeout=120)
    idp_log = open(idp_dir / "idp.log", "ab")
    idp = subprocess.Popen([sys.executable, "-m", "django", "runserver", "--noreload", f"127.0.0.1:{idp_port}"],
                           cwd=ROOT, env=idp_env, stdout=idp_log, stderr=subprocess.STDOUT)
    corral = None
    try:
        wait_for(lambda: _serves(f"{issuer}/.well-known/openid-configuration"), 60, what="the provider to serve")
        data = tmp_path_factory.mktemp("sso-corral")
        data_dir.prepare(data)
        env = {
            **os.environ,
            "DATABASE_URL": _database_url(),
            "REDIS_URL": settings.REDIS_URL,
            "SECRET_KEY": settings.SECRET_KEY,
            "CORRAL_DATA_DIR": str(data),
            "PYTHONUNBUFFERED": "1",
            "CORRAL_OIDC_ISSUER": issuer,
            "CORRAL_OIDC_CLIENT_ID": CLIENT_ID,
            "CORRAL_OIDC_CLIENT_SECRET": CLIENT_SECRET,
            "CORRAL_OIDC_PROVIDER_NAME": PROVIDER,
            "CORRAL_PASSWORD_LOGIN": "off",
            # The provider is a development server on a machine the tests share.
            "CORRAL_OIDC_TIMEOUT": "60",
        }
        corral = Stack(base_url=f"http://127.0.0.1:{corral_port}", ws_base=f"ws://127.0.0.1:{corral_port}",
                       data_dir=data, env=env)
        corral.start_web()
        yield SSO(Directory(f"http://127.0.0.1:{idp_port}", issuer, idp_env), corral)
    finally:
        if corral is not None:
            corral.stop_web()
        idp.terminate()
        idp.wait(20)


def sign_in(page, sso: SSO, name: str, password: str) -> None:
    """From Corral's login page through the provider's sign-in, back to Corral's session list."""
    page.set_default_timeout(60_000)
    page.goto(sso.corral.base_url + "/login/")
    page.click(f"#sso-sign-in:has-text('Sign in with {PROVIDER}')")
    page.wait_for_url(f"{sso.directory.url}/accounts/login/**")
    page.fill("#id_username", name)
    page.fill("#id_password", password)
    page.click("#idp-sign-in")
    page.wait_for_url(sso.corral.base_url + "/")


def limited_machine(fake_machine, name: str, group: str) -> Machine:
    machine = fake_machine()
    Machine.objects.filter(pk=machine.pk).update(name=name, workspace_roots="")
    machine.allowed_groups.add(Group.objects.get_or_create(name=group)[0])
    return Machine.objects.get(pk=machine.pk)


def test_first_sign_in_creates_the_account_in_the_directory_groups_and_each_sign_in_follows_them(
        sso, page, fake_machine, tmp_path):
    gpu = limited_machine(fake_machine, "gpu-box", "gpu-team")
    limited_machine(fake_machine, "other-box", "others")
    sso.directory.put_user("dana", "dana-password-1", "gpu-team", "readers")

    sign_in(page, sso, "dana", "dana-password-1")
    dana = User.objects.get(username="dana")
    assert dana.email == "dana@example.com" and not dana.has_usable_password()
    assert sorted(dana.groups.values_list("name", flat=True)) == ["gpu-team", "readers"]
    assert Identity.objects.get(user=dana).issuer == sso.directory.issuer
    page.goto(sso.corral.base_url + "/machines/")
    page.get_by_text("gpu-box").first.wait_for()
    assert "other-box" not in page.content()

    # An open session page on the group's machine: she may act there now.
    session = AgentSession.objects.create(owner=dana, machine=gpu, status="idle", title="Flock", model_key="m.gguf",
                                          working_dir=str(tmp_path))
    page.goto(f"{sso.corral.base_url}/sessions/{session.pk}/")
    page.wait_for_selector("#composer #id_text")

    # The directory takes her out of the group; her next sign-in (the provider remembers
    # her: no password) brings that to Corral, and the open page drops to watching.
    sso.directory.put_user("dana", "dana-password-1", "readers")
    second = page.context.new_page()
    second.set_default_timeout(60_000)
    second.goto(sso.corral.base_url + "/login/")
    second.click("#sso-sign-in")
    second.wait_for_url(sso.corral.base_url + "/")
    assert list(dana.groups.values_list("name", flat=True)) == ["readers"]
    page.locator("#sharing-note", has_text="no longer act in it").wait_for()
    assert page.locator("#composer #id_text").count() == 0
    second.goto(sso.corral.base_url + "/machines/")
    second.locator("h1").first.wait_for()
    assert "gpu-box" not in second.content()
    assert User.objects.filter(username__startswith="dana").count() == 1  # the same account, found by sub


def test_password_login_is_off_but_for_superusers(sso, page):
    User.objects.create_superuser("root", password="root-password-1")
    User.objects.create_user("bob", password="bob-password-1")
    page.set_default_timeout(60_000)
    page.goto(sso.corral.base_url + "/login/")
    assert page.locator("#password-login").get_attribute("open") is None  # folded away
    page.click("#password-login summary")
    page.fill("#id_username", "bob")
    page.fill("#id_password", "bob-password-1")
    page.click("#password-login button[type=submit]")
    page.locator(".errorlist", has_text="Password login is switched off on this Corral, except for administrators: "
                                        f"use “Sign in with {PROVIDER}”.").wait_for()
    assert "/login/" in page.url
    page.fill("#id_username", "root")
    page.fill("#id_password", "root-password-1")
    page.click("#password-login button[type=submit]")
    page.wait_for_url(sso.corral.base_url + "/")


def _with_nonce(url: str, nonce: str) -> str:
    parts = urlsplit(url)
    query = [(k, nonce if k == "nonce" else v) for k, v in parse_qsl(parts.query, keep_blank_values=True)]
    return urlunsplit(parts._replace(query=urlencode(query)))


def test_an_answer_that_does_not_match_the_sign_in_ends_on_a_sentence(sso, page):
    page.set_default_timeout(60_000)
    callback = sso.corral.base_url + "/oidc/callback/"
    # No sign-in was started in this browser.
    response = page.goto(callback + "?code=forged&state=forged")
    assert response.status == 400
    page.locator("#sso-failed", has_text="it was not started in this browser, or it was used already").wait_for()

    # One was started, but this state is not its.
    page.goto(sso.corral.base_url + "/login/")
    page.click("#sso-sign-in")
    page.wait_for_url(f"{sso.directory.url}/accounts/login/**")
    response = page.goto(callback + "?code=forged&state=forged")
    assert response.status == 400
    page.locator("#sso-failed", has_text="(its state is unknown here)").wait_for()

    # The provider's ID token carries another nonce than the one this sign-in sent: Corral's
    # redirect to the provider is rewritten on its way (Corral's service worker, which
    # would fetch it out of Playwright's sight, kept out).
    sso.directory.put_user("erin", "erin-password-1", "gpu-team")
    page = page.context.browser.new_context(service_workers="block").new_page()
    page.set_default_timeout(60_000)

    def forge_nonce(route):
        response = route.fetch(max_redirects=0)
        location = _with_nonce(response.headers["location"], "forged-nonce")
        route.fulfill(response=response, headers={**response.headers, "location": location})

    authorize = sso.corral.base_url + "/oidc/authenticate/"
    page.route(authorize, forge_nonce)
    page.goto(sso.corral.base_url + "/login/")
    page.click("#sso-sign-in")
    page.wait_for_url(f"{sso.directory.url}/accounts/login/**")
    page.fill("#id_username", "erin")
    page.fill("#id_password", "erin-password-1")
    page.click("#idp-sign-in")
    page.wait_for_url(callback + "**")
    page.locator("#sso-failed", has_text="its nonce differs").wait_for()
    assert not User.objects.filter(username="erin").exists()
    page.unroute(authorize)

    # The person refuses at the provider: it answers with an error.
    response = page.goto(callback + "?error=access_denied&error_description=The+user+said+no")
    assert response.status == 403
    page.locator("#sso-failed", has_text=f"{PROVIDER} did not sign you in: The user said no.").wait_for()


def _settings_child(tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_OIDC") and k != "CORRAL_PASSWORD_LOGIN"}
    env.update({"CORRAL_DATA_DIR": str(tmp_path), "SECRET_KEY": "x" * 50, "DJANGO_SETTINGS_MODULE": "project.settings",
                **extra})
    return subprocess.run([sys.executable, "-c", "from django.conf import settings; settings.INSTALLED_APPS"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("extra", "said"), [
    ({"CORRAL_PASSWORD_LOGIN": "off"}, "CORRAL_PASSWORD_LOGIN=off needs single sign-on (CORRAL_OIDC_ISSUER)"),
    ({"CORRAL_OIDC_ISSUER": "https://id.example.com/realms/team"},
     "CORRAL_OIDC_ISSUER is set but CORRAL_OIDC_CLIENT_ID is not"),
    ({"CORRAL_OIDC_ISSUER": "id.example.com"}, "CORRAL_OIDC_ISSUER='id.example.com' is not valid"),
    ({"CORRAL_OIDC_ISSUER": "https://id.example.com", "CORRAL_OIDC_CLIENT_ID": "c", "CORRAL_OIDC_CLIENT_SECRET": "s",
      "CORRAL_OIDC_SCOPES": "email"}, "it must include openid"),
])
def test_settings_that_cannot_work_stop_corral_at_start(tmp_path, extra, said):
    result = _settings_child(tmp_path, **extra)
    assert result.returncode != 0 and said in result.stderr, result.stderr


def test_a_provider_that_does_not_answer_is_said_on_a_page(client, settings):
    from machines_app.transports import LocalTransport

    closed = LocalTransport().free_port()  # nothing listens there
    settings.CORRAL_OIDC_ISSUER = f"http://127.0.0.1:{closed}/o"
    settings.CORRAL_OIDC_PROVIDER_NAME = "Nowhere"
    settings.OIDC_RP_CLIENT_ID = "corral"
    response = client.get("/login/")
    assert b"Sign in with Nowhere" in response.content
    response = client.get("/oidc/authenticate/")
    assert response.status_code == 502
    assert "Corral could not reach Nowhere to sign you in: " \
           f"http://127.0.0.1:{closed}/o/.well-known/openid-configuration did not answer" in response.text


def test_without_single_sign_on_its_pages_are_not_there(client):
    assert b"sso-sign-in" not in client.get("/login/").content
    assert client.get("/oidc/authenticate/").status_code == 404
    assert client.get("/oidc/callback/?code=a&state=b").status_code == 404


def test_the_admin_lists_identities_and_changes_none(admin_client, django_user_model):
    dana = django_user_model.objects.create_user("dana")
    identity = Identity.objects.create(user=dana, issuer="https://id.example.com", subject="0f3c")
    listing = admin_client.get("/admin/accounts_app/identity/")
    assert listing.status_code == 200 and "Single sign-on identities" in listing.text and "0f3c" in listing.text
    assert admin_client.get("/admin/accounts_app/identity/add/").status_code == 403
    admin_client.post(f"/admin/accounts_app/identity/{identity.pk}/change/", {"subject": "other"})
    identity.refresh_from_db()
    assert identity.subject == "0f3c"

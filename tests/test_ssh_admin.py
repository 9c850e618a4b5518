"""Adding and looking after an SSH machine in the admin, against the real test sshd
(tests/sshd.py): the host key pinned with its fingerprint shown, the private key stored
in the database, encrypted, and never shown back, the machine list's state and actions (docs/ssh.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.db import connection
from django.test import Client

from machines_app import keystore, ssh
from machines_app.models import Machine
from sessions_app.models import AgentSession
from sessions_app.servers.models import ServerRecord

from .conftest import make_ssh_machine
from .sshd import keygen

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client(django_user_model):
    client = Client()
    client.force_login(django_user_model.objects.create_superuser("root", password="root-password-1"))
    return client


def fingerprint_of(line: str) -> str:
    return ssh.fingerprint(ssh.pinned_key(ssh.parse_pins(line, "h", 22), "h", 22))


def add_form(sshd, real_models_dir, llama_server_bin, **fields) -> dict:
    return {
        "name": "gpu1", "transport": "ssh", "host": "127.0.0.1", "port": sshd.port, "user": sshd.user,
        "private_key": Path(sshd.client_key).read_text(), "expected_fingerprint": "",
        "host_key": "", "models_dir": str(real_models_dir), "llama_server_path": llama_server_bin, "enabled": "on",
        **fields,
    }


def test_adding_a_machine_pins_its_host_key_and_hides_the_private_key(admin_client, sshd, real_models_dir,
                                                                      llama_server_bin, settings, tmp_path):
    settings.DATA_DIR = tmp_path / "data"
    private_key = Path(sshd.client_key).read_text()
    response = admin_client.post(
        "/admin/machines_app/machine/add/", add_form(sshd, real_models_dir, llama_server_bin), follow=True
    )
    page = response.content.decode()
    machine = Machine.objects.get(name="gpu1")
    expected = fingerprint_of(sshd.host_key_line)
    assert machine.host_key_fingerprint == expected
    assert machine.host_key == f"[127.0.0.1]:{sshd.port} {sshd.host_key_line}"  # as OpenSSH files it
    assert f"Pinned the host key [127.0.0.1]:{sshd.port} offers: {expected}" in page
    # The key is in the database, encrypted: no file on this host, no PEM in the column.
    assert not (settings.DATA_DIR / "ssh").exists()
    body = private_key.strip().splitlines()[1]
    with connection.cursor() as cursor:
        cursor.execute("SELECT private_key_sealed FROM machines_app_machine WHERE id = %s", [machine.pk])
        column = cursor.fetchone()[0]
    assert column and "PRIVATE KEY" not in column and body not in column and body[:20] not in column
    assert keystore.open_key(column).strip() == private_key.strip()
    change = admin_client.get(f"/admin/machines_app/machine/{machine.pk}/change/").content.decode()
    assert body not in page and body not in change  # never shown back
    assert expected in change
    client_fingerprint = ssh.fingerprint(ssh.parse_private_key(private_key))
    assert f"Stored, encrypted (public key {client_fingerprint})." in change

    listing = admin_client.post(
        "/admin/machines_app/machine/", {"action": "test_connection", "_selected_action": [machine.pk]}, follow=True
    ).content.decode()
    assert f"Machine &#x27;gpu1&#x27; answers as {sshd.user}" in listing
    assert Machine.objects.get(pk=machine.pk).link_state == "reachable"


def test_an_expected_fingerprint_that_differs_pins_nothing(admin_client, sshd, real_models_dir, llama_server_bin,
                                                          tmp_path, settings):
    settings.DATA_DIR = tmp_path / "data"
    wrong = fingerprint_of(keygen(tmp_path / "other"))
    response = admin_client.post(
        "/admin/machines_app/machine/add/",
        add_form(sshd, real_models_dir, llama_server_bin, expected_fingerprint=wrong),
    )
    page = response.content.decode()
    assert response.status_code == 200 and not Machine.objects.filter(name="gpu1").exists()
    assert f"not the expected {wrong}" in page and fingerprint_of(sshd.host_key_line) in page


@pytest.mark.parametrize("kind", ["nonsense", "public key", "passphrase"])
def test_a_key_that_cannot_be_used_is_refused(admin_client, sshd, real_models_dir, llama_server_bin, tmp_path, kind):
    import subprocess

    if kind == "nonsense":
        text, message = "-----BEGIN NONSENSE-----\nabc\n", "not an OpenSSH private key"
    elif kind == "public key":
        text, message = Path(sshd.client_key + ".pub").read_text(), "not an OpenSSH private key"
    else:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret-phrase", "-f", str(tmp_path / "locked")],
                       check=True)
        text, message = (tmp_path / "locked").read_text(), "protected by a passphrase"
    response = admin_client.post(
        "/admin/machines_app/machine/add/", add_form(sshd, real_models_dir, llama_server_bin, private_key=text)
    )
    assert message in response.content.decode()
    assert not Machine.objects.filter(name="gpu1").exists()


def test_nothing_answering_at_add_time_is_a_form_error(admin_client, sshd, real_models_dir, llama_server_bin):
    from machines_app.transports import LocalTransport

    response = admin_client.post(
        "/admin/machines_app/machine/add/",
        add_form(sshd, real_models_dir, llama_server_bin, port=LocalTransport().free_port()),
    )
    assert response.status_code == 200 and "cannot connect to [127.0.0.1]:" in response.content.decode()


def test_the_list_shows_state_running_sessions_and_repins_a_changed_key(admin_client, sshd, tmp_path,
                                                                         real_models_dir, llama_server_bin, alice):
    other = keygen(tmp_path / "other")
    machine = make_ssh_machine(sshd, real_models_dir, llama_server_bin, host_key=other, name="gpu2")
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir="/")
    ServerRecord.objects.create(session=session, machine=machine, model_key="m.gguf", pid=1, start_time="1", port=1,
                                log_path="/x")
    listing = admin_client.post(
        "/admin/machines_app/machine/", {"action": "test_connection", "_selected_action": [machine.pk]}, follow=True
    ).content.decode()
    assert "host key changed" in listing
    assert fingerprint_of(other) in listing and fingerprint_of(sshd.host_key_line) in listing
    assert '<td class="field-running_sessions">1</td>' in listing

    listing = admin_client.post(
        "/admin/machines_app/machine/", {"action": "repin_host_key", "_selected_action": [machine.pk]}, follow=True
    ).content.decode()
    assert f"host key re-pinned, {fingerprint_of(other)} → {fingerprint_of(sshd.host_key_line)}" in listing
    listing = admin_client.post(
        "/admin/machines_app/machine/", {"action": "test_connection", "_selected_action": [machine.pk]}, follow=True
    ).content.decode()
    assert "answers as" in listing
    assert Machine.objects.get(pk=machine.pk).link_state == "reachable"


def test_a_garbled_host_key_is_a_form_error(admin_client, sshd, real_models_dir, llama_server_bin):
    response = admin_client.post(
        "/admin/machines_app/machine/add/",
        add_form(sshd, real_models_dir, llama_server_bin, host_key="ssh-ed25519 not-base64!"),
    )
    assert "host key line 1 is not a public key" in response.content.decode()
    assert not Machine.objects.filter(name="gpu1").exists()


@pytest.mark.parametrize("host", ["-oProxyCommand=touch /tmp/pwned", "gpu1 gpu2", "root@gpu1"])
def test_a_host_that_is_not_a_name_is_a_form_error(admin_client, sshd, real_models_dir, llama_server_bin, host):
    response = admin_client.post(
        "/admin/machines_app/machine/add/", add_form(sshd, real_models_dir, llama_server_bin, host=host)
    )
    assert "A host is a name or an address" in response.content.decode()
    assert not Machine.objects.filter(name="gpu1").exists()

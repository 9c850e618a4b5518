"""Machines over SSH against a real OpenSSH server (tests/sshd.py): pinned host keys,
discovery over SFTP, quoting of every remote command, a real llama-server reached
through a forward (docs/ssh.md). The "remote" machine is this one over loopback, so the
real llama-server binary and the real GGUF files work there too."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from gguf import GGUFValueType

from machines_app import actions as machine_actions
from machines_app import catalog, keystore, ssh
from machines_app.discovery import discover
from machines_app.gguf import parse_head
from machines_app.llama_server import ServerSpec, build_argv, new_api_key, wait_until_ready
from machines_app.models import Machine
from machines_app.transports import LocalTransport, ProcessId, TransportError, transport_for

from .conftest import make_ssh_machine, wait_for
from .gguf_files import MiB, model, two_long_strings_model, write_split_set
from .sshd import keygen

pytestmark = pytest.mark.django_db


def fingerprint_of(line: str) -> str:
    return ssh.fingerprint(ssh.pinned_key(ssh.parse_pins(line, "h", 22), "h", 22))


# --- discovery: the same list as locally ----------------------------------------------------


HOSTILE_MODEL_NAME = """it's a "model" $(touch pwned-by-name) `id`.gguf"""


def models_tree(root: Path) -> Path:
    """Every discovery rule in one directory: a name shared by two files, a split set, a
    projector beside a model, an MTP head, a file name with spaces, quotes and $( )."""
    model(root, "a.gguf", "Twin")
    model(root, "sub/a.gguf", "Twin")
    write_split_set(root / "big", "X")
    model(root, "vision/eyes.gguf", "Eyes")
    model(root, "vision/mmproj-eyes-f16.gguf", "projector", arch="clip")
    model(root, "mtp.gguf", "Next", kv=[("llama.nextn_predict_layers", 1, GGUFValueType.UINT32)])
    model(root, HOSTILE_MODEL_NAME, "Quoted")
    (root / "notes.txt").write_text("not a model")
    return root


def test_it_lists_the_same_models_over_ssh_as_locally(sshd, tmp_path, llama_server_bin):
    root = models_tree(tmp_path / "models")
    machine = make_ssh_machine(sshd, root, llama_server_bin)
    remote = transport_for(machine)
    local = LocalTransport()

    def listed(transport):
        base = transport.expand_path(str(root))
        return discover(transport.list_gguf(base), lambda key, n, offset=0: transport.read_head(f"{base}/{key}", n, offset))

    over_ssh = listed(remote)
    assert over_ssh == listed(local)
    by_name = {m.display_name: m for m in over_ssh}
    assert {"Twin (a.gguf)", "Twin (sub/a.gguf)", "Split Model", "Eyes", "Next", "Quoted"} <= set(by_name)
    assert by_name["Split Model"].split_count == 3 and by_name["Split Model"].key == "big/X-00001-of-00003.gguf"
    assert by_name["Eyes"].has_vision and by_name["Next"].has_mtp
    assert by_name["Quoted"].key == HOSTILE_MODEL_NAME
    assert not list(Path.cwd().glob("pwned-by-name")) and not (Path.home() / "pwned-by-name").exists()


def test_it_refreshes_the_real_models_of_a_remote_machine(ssh_machine, local_machine):
    fields = ("key", "display_name", "architecture", "quantization", "context_length", "file_size", "has_mtp")
    assert list(catalog.models_for(ssh_machine).values_list(*fields)) == list(
        catalog.models_for(local_machine).values_list(*fields)
    )
    assert catalog.models_for(ssh_machine).filter(display_name__icontains="SmolLM2").exists()
    assert Machine.objects.get(pk=ssh_machine.pk).link_state == "reachable"


def test_a_missing_models_directory_names_the_machine(sshd, tmp_path, llama_server_bin):
    machine = make_ssh_machine(sshd, tmp_path / "nowhere", llama_server_bin)
    with pytest.raises(TransportError, match=f"does not exist on {machine.name}"):
        catalog.refresh_models(machine)
    assert "does not exist" in Machine.objects.get(pk=machine.pk).models_refresh_error


def test_a_model_the_machine_does_not_have_is_refused_naming_it(ssh_machine):
    with pytest.raises(catalog.ModelUnavailable, match=f"Machine '{ssh_machine.name}' has no model 'other.gguf'"):
        catalog.model_for_session(ssh_machine, "other.gguf")


def test_tilde_is_the_remote_users_home(ssh_machine):
    transport = transport_for(ssh_machine)
    home = os.path.expanduser("~")
    assert transport.expand_path("~") == home
    assert transport.expand_path("~/x/../y") == f"{home}/y"
    assert transport.expand_path("rel") == f"{home}/rel"
    assert transport.is_dir("~") and not transport.is_dir("~/surely-not-here-" + str(time.time_ns()))
    assert not transport.is_dir("a\x00b")


def test_a_huge_sparse_remote_file_is_read_by_its_head_only(ssh_machine, tmp_path):
    """20 GB on disk by its size, a few KiB of metadata: listed with its size, and the bytes
    asked of SFTP never exceed what the head needs (counted, not timed)."""
    root = tmp_path / "huge"
    path = model(root, "big.gguf", "Huge")
    with open(path, "r+b") as f:
        f.truncate(20 * 1024**3)
    transport = transport_for(ssh_machine)
    asked: list[int] = []

    def read_head(key, n, offset=0):
        asked.append(n)
        return transport.read_head(f"{root}/{key}", n, offset)

    [info] = discover(transport.list_gguf(str(root)), read_head)
    assert info.display_name == "Huge" and info.file_size == 20 * 1024**3 and info.error is None
    assert asked == [2 * 1024 * 1024]  # one head read of the first size; never the weights


def test_case_c42_a_long_remote_head_crosses_the_link_once(ssh_machine, tmp_path, monkeypatch):
    """Two 30 MiB strings in a 20 GB sparse file: every byte that arrives over the SSH
    channels while the machine's models are refreshed is counted (paramiko's
    ``Channel.recv``, what the SFTP client reads from), and comes to the metadata once,
    not the 92 MiB of reads that each started again at byte 0, nor the weights."""
    import paramiko

    root = tmp_path / "long"
    path = two_long_strings_model(root)
    with open(path, "r+b") as f:
        f.truncate(20 * 1024**3)
    with open(path, "rb") as f:
        metadata_end = parse_head(f.read(64 * MiB)).metadata_end
    Machine.objects.filter(pk=ssh_machine.pk).update(models_dir=str(root))
    machine = Machine.objects.get(pk=ssh_machine.pk)
    transport_for(machine).check()  # the link is up before counting
    received = []
    recv = paramiko.Channel.recv

    def counting_recv(channel, nbytes):
        data = recv(channel, nbytes)
        received.append(len(data))
        return data

    monkeypatch.setattr(paramiko.Channel, "recv", counting_recv)
    [model_file] = catalog.refresh_models(machine)
    monkeypatch.undo()
    assert model_file.display_name == "Long" and model_file.has_chat_template and model_file.file_size == 20 * 1024**3
    # the metadata plus at most the 2 MiB margin of the last read (and the SFTP framing)
    assert metadata_end < sum(received) < metadata_end + 3 * MiB


# --- host keys ------------------------------------------------------------------------------


def test_an_unknown_host_key_is_refused_with_its_fingerprint(sshd, real_models_dir, llama_server_bin):
    machine = make_ssh_machine(sshd, real_models_dir, llama_server_bin, host_key="")
    with pytest.raises(TransportError) as info:
        transport_for(machine).list_gguf(str(real_models_dir))
    message = str(info.value)
    assert f"[127.0.0.1]:{sshd.port}" in message and "is not pinned" in message
    assert fingerprint_of(sshd.host_key_line) in message
    machine.refresh_from_db()
    assert machine.host_key == "" and machine.link_state == "unreachable"  # never auto-accepted


def test_a_changed_host_key_is_refused_with_both_fingerprints_until_repinned(sshd, tmp_path, real_models_dir,
                                                                               llama_server_bin):
    other = keygen(tmp_path / "other_host_key")
    machine = make_ssh_machine(sshd, real_models_dir, llama_server_bin, host_key=other)
    with pytest.raises(TransportError) as info:
        transport_for(machine).is_dir("/")
    message = str(info.value)
    assert f"[127.0.0.1]:{sshd.port}" in message
    assert fingerprint_of(other) in message and fingerprint_of(sshd.host_key_line) in message
    machine.refresh_from_db()
    assert machine.link_state == "host_key_changed"
    assert machine.offered_key_fingerprint == fingerprint_of(sshd.host_key_line)
    # Refused from now on, even by a process that never saw the change, until re-pinned.
    with pytest.raises(TransportError, match="changed"):
        transport_for(Machine.objects.get(pk=machine.pk)).is_dir("/")
    machine_actions.do_repin(machine)
    machine.refresh_from_db()
    assert machine.host_key == f"[127.0.0.1]:{sshd.port} {sshd.host_key_line}"
    assert machine.host_key_fingerprint == fingerprint_of(sshd.host_key_line)
    assert transport_for(machine).is_dir("/")
    assert Machine.objects.get(pk=machine.pk).link_state == "reachable"


def test_a_non_standard_port_is_pinned_as_openssh_writes_it(sshd, tmp_path, real_models_dir, llama_server_bin):
    key_type, key_b64 = sshd.host_key_line.split()
    plain = f"[127.0.0.1]:{sshd.port} {key_type} {key_b64}"
    known = tmp_path / "known_hosts"
    known.write_text(plain + "\n")
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(known)], check=True, capture_output=True)
    hashed = known.read_text().strip()
    assert hashed.startswith("|1|")
    for pin in (plain, hashed, sshd.host_key_line):
        machine = make_ssh_machine(sshd, real_models_dir, llama_server_bin, host_key=pin)
        assert transport_for(machine).is_dir("/"), pin
    # The same key filed for port 22 is another host entry: not a pin for this port.
    machine = make_ssh_machine(sshd, real_models_dir, llama_server_bin, host_key=f"127.0.0.1 {key_type} {key_b64}")
    with pytest.raises(TransportError, match="is not pinned"):
        transport_for(machine).is_dir("/")
    assert ssh.host_entry("gpu1", 22) == "gpu1" and ssh.host_entry("gpu1", 2222) == "[gpu1]:2222"


def test_a_machine_without_a_stored_key_says_so(sshd, real_models_dir, llama_server_bin):
    machine = make_ssh_machine(sshd, real_models_dir, llama_server_bin, private_key_sealed="")
    with pytest.raises(TransportError, match=f"no SSH private key is stored for {machine.name}: paste it in the admin"):
        transport_for(machine).is_dir("/")


def test_a_key_sealed_under_another_secret_key_says_so(sshd, real_models_dir, llama_server_bin):
    sealed = keystore.seal_key(Path(sshd.client_key).read_text(), secret="the SECRET_KEY of another installation")
    machine = make_ssh_machine(sshd, real_models_dir, llama_server_bin, name="gpu1", private_key_sealed=sealed)
    with pytest.raises(TransportError) as refused:
        transport_for(machine).is_dir("/")
    assert ("the SSH key of gpu1 cannot be read with this installation's SECRET_KEY: paste it again in the admin"
            in str(refused.value))


def test_a_refused_private_key_says_so(sshd, tmp_path, real_models_dir, llama_server_bin):
    keygen(tmp_path / "stranger")
    machine = make_ssh_machine(sshd, real_models_dir, llama_server_bin,
                               private_key_sealed=keystore.seal_key((tmp_path / "stranger").read_text()))
    with pytest.raises(TransportError, match="refused the private key"):
        transport_for(machine).is_dir("/")


def test_nothing_listening_is_unreachable_quickly(real_models_dir, llama_server_bin, sshd, monkeypatch):
    """"Quickly": a refused connection fails on its first try, for that reason — neither
    waited out (ssh.CONNECT_TIMEOUT) nor tried again as a drop (ssh.CONNECT_TRIES)."""
    machine = make_ssh_machine(sshd, real_models_dir, llama_server_bin, port=LocalTransport().free_port())
    tries: list[object] = []

    class CountedLink(ssh.Link):
        def __init__(self, target) -> None:
            tries.append(target)
            super().__init__(target)

    monkeypatch.setattr(ssh.links, "Link", CountedLink)  # where machines' links are made
    with pytest.raises(TransportError, match="is unreachable") as info:
        transport_for(machine).is_dir("/")
    assert len(tries) == 1
    # paramiko's words for a refused connect ("timed out" would be a machine that hangs).
    assert "unable to connect to port" in str(info.value).lower(), info.value
    assert "timed out" not in str(info.value).lower(), info.value
    assert Machine.objects.get(pk=machine.pk).link_state == "unreachable"


@pytest.mark.parametrize("host", ["-oProxyCommand=touch /tmp/pwned", "gpu1; touch /tmp/pwned", "no-such-host.invalid"])
def test_a_hostile_or_unknown_host_is_only_a_name(sshd, real_models_dir, llama_server_bin, host):
    Path("/tmp/pwned").unlink(missing_ok=True)
    machine = make_ssh_machine(sshd, real_models_dir, llama_server_bin, host=host)
    with pytest.raises(TransportError, match="is unreachable: cannot reach"):
        transport_for(machine).is_dir("/")
    assert not Path("/tmp/pwned").exists()


# --- quoting --------------------------------------------------------------------------------

HOSTILE_DIRS = ["$(touch /tmp/pwned)", "'; rm -rf ~ #", 'a "b" `touch /tmp/pwned` c\\d', "-n"]


@pytest.mark.parametrize("name", HOSTILE_DIRS)
def test_hostile_working_directories_execute_nothing(ssh_machine, tmp_path, name):
    Path("/tmp/pwned").unlink(missing_ok=True)
    canary = Path.home() / f".corral-canary-{time.time_ns()}"
    canary.write_text("still here")
    workdir = tmp_path / name
    workdir.mkdir(parents=True)  # "/" in a name makes it a path: every part is created
    transport = transport_for(ssh_machine)
    try:
        assert transport.is_dir(str(workdir))
        log = f"{transport.private_dir()}/hostile-{time.time_ns()}.log"
        proc = transport.spawn(["/bin/pwd"], log, cwd=str(workdir))
        wait_for(lambda: not transport.process_alive(proc), 10, what="pwd to finish")
        assert transport.log_tail(log).splitlines()[-1] == str(workdir)  # it ran there, literally
        key = f"{workdir}/key file '$(id)'"
        transport.write_private(key, "secret\n")
        assert Path(key).read_text() == "secret\n" and Path(key).stat().st_mode & 0o777 == 0o600
        transport.remove(key)
        assert not Path(key).exists()
        transport.remove(log)
    finally:
        assert canary.read_text() == "still here"
        canary.unlink()
    assert not Path("/tmp/pwned").exists()


@pytest.mark.parametrize("binary", ["llama-server-nowhere", "$(touch /tmp/pwned)", "x; touch /tmp/pwned", "-v"])
def test_a_binary_not_on_the_path_is_refused_fast(ssh_machine, tmp_path, binary):
    """A binary only an interactive shell would find is refused at once, by name;
    a hostile "path" is only a name."""
    Path("/tmp/pwned").unlink(missing_ok=True)
    transport = transport_for(ssh_machine)
    # "Fast": spawn itself refuses it (no process, no log to wait on), not a start that fails later.
    with pytest.raises(TransportError, match="was not found on machine") as info:
        transport.spawn([binary, "--help"], str(tmp_path / "x.log"))
    assert str(info.value).startswith(binary)
    assert not Path("/tmp/pwned").exists() and not (tmp_path / "x.log").exists()


def test_a_garbled_pinned_key_is_refused_in_words(sshd, real_models_dir, llama_server_bin):
    machine = make_ssh_machine(sshd, real_models_dir, llama_server_bin, host_key="ssh-ed25519 not-base64!")
    with pytest.raises(TransportError, match="host key line 1 is not a public key"):
        transport_for(machine).is_dir("/")


def test_the_key_file_is_private_from_its_creation(ssh_machine, tmp_path):
    """A file planted at the key's path (world-readable, or a link elsewhere) is replaced,
    never written through."""
    transport = transport_for(ssh_machine)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("untouched")
    planted = tmp_path / "session.key"
    planted.symlink_to(elsewhere)
    transport.write_private(str(planted), "k\n")
    assert elsewhere.read_text() == "untouched"
    assert not planted.is_symlink() and planted.stat().st_mode & 0o777 == 0o600


# --- a real llama-server through a forward ----------------------------------------------------


def test_a_model_with_spaces_and_quotes_serves_through_the_forward(sshd, tmp_path, real_models_dir,
                                                                    llama_server_bin):
    smol = next(p for p in real_models_dir.iterdir() if "smol" in p.name.lower())
    root = tmp_path / "models dir 'quoted'"
    root.mkdir()
    (root / HOSTILE_MODEL_NAME).symlink_to(smol.resolve())
    machine = make_ssh_machine(sshd, root, llama_server_bin)
    catalog.refresh_models(machine)
    resolved = catalog.model_for_session(machine, HOSTILE_MODEL_NAME)
    transport = transport_for(machine)
    port = transport.free_port()
    api_key = new_api_key()
    key_file = f"{transport.private_dir()}/test-{port}.key"
    transport.write_private(key_file, api_key + "\n")
    log = f"{transport.private_dir()}/test-{port}.log"
    spec = ServerSpec(llama_server_bin, resolved.path, port, {"contextSize": 512}, api_key_file=key_file)
    proc = transport.spawn(build_argv(spec), log)
    try:
        wait_until_ready(transport, proc, transport.base_url(port), log, timeout=120, api_key=api_key)
        url = transport.base_url(port)
        assert url.startswith("http://127.0.0.1:") and not url.endswith(f":{port}")  # the forward, not the port
        props = httpx.get(f"{url}/props", headers={"Authorization": f"Bearer {api_key}"}, timeout=10).json()
        assert props["model_path"] == resolved.path
        assert httpx.get(f"{url}/props", timeout=10).status_code == 401  # the key travels through the forward
        assert (f"[127.0.0.1]:{sshd.port}", port) in ssh.open_forwards()
    finally:
        transport.stop(proc, grace=3)
        transport.release_port(port)
        transport.remove(key_file)
    assert not transport.process_alive(proc)
    assert (f"[127.0.0.1]:{sshd.port}", port) not in ssh.open_forwards()
    assert not list(Path.cwd().glob("pwned-by-name")) and not (Path.home() / "pwned-by-name").exists()


def test_a_detached_server_outlives_the_connection(ssh_machine, tmp_path):
    """Start, drop the connection at once, reconnect: the same process runs (stdin from
    /dev/null, output to the log, a session of its own)."""
    transport = transport_for(ssh_machine)
    proc = transport.spawn(["/bin/sleep", "30"], str(tmp_path / "sleep.log"))
    try:
        ssh.drop_link(transport.target)
        time.sleep(1)
        assert transport.process_alive(proc)
        assert not transport.process_alive(ProcessId(proc.pid, proc.start_time + "0"))  # a reused pid is not ours
    finally:
        transport.stop(proc, grace=1)
    assert not transport.process_alive(proc)


def test_a_command_that_talks_a_lot_is_capped_and_finishes(ssh_machine):
    """5 MiB on stdout and on stderr at once: it finishes, the output kept is capped and
    marked, and a command past its timeout is cut off."""
    transport = transport_for(ssh_machine)
    with transport._link() as link:
        status, output = link.run("head -c 5242880 /dev/zero | tr '\\0' a; head -c 5242880 /dev/zero >&2", timeout=60)
    assert status == 0
    assert output.endswith("[output truncated]") and len(output) < ssh.OUTPUT_LIMIT + 100
    with transport._link() as link, pytest.raises(ssh.LinkError, match="did not finish within 1 s"):
        link.run("sleep 5", timeout=1)


def test_working_directories_are_resolved_by_the_machine_itself(ssh_machine, tmp_path):
    """Workspace roots are compared on real paths as the serving machine resolves them
    (docs/access.md): a symlink that leaves a root is followed there, ~ is that account's
    home, a part that does not exist is kept, and hostile names are only names."""
    root = tmp_path / "root"
    (root / "inside").mkdir(parents=True)
    (root / "escape").symlink_to("/etc")
    remote, local = transport_for(ssh_machine), LocalTransport()
    for path in (str(root / "inside"), str(root / "escape"), str(root / "escape" / ".." / "x"),
                 str(root / "missing" / "deeper"), "~", "~/work", str(root / "$(touch pwned) it's"), "/tmp/../etc"):
        assert remote.real_path(path) == local.real_path(path), path
    assert remote.real_path(str(root / "escape")) == "/etc"
    assert not Path("pwned").exists() and not (Path.home() / "pwned").exists()
    with pytest.raises(TransportError):
        remote.real_path("~root/x")

"""A real OpenSSH server for the tests: Debian's ``sshd`` on a free loopback port.

Everything it uses lives in one temporary directory — a generated host key, a generated
client key in its own ``authorized_keys``, the config, the pid file, the log — so no
system file is changed. Key-only authentication; the tests' own user (root in CI, hence
``PermitRootLogin prohibit-password``). ``./corral test`` installs ``openssh-server`` when
``/usr/sbin/sshd`` is missing.
"""

from __future__ import annotations

import getpass
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

SSHD = os.environ.get("CORRAL_SSHD", "/usr/sbin/sshd")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keygen(path: Path, kind: str = "ed25519") -> str:
    """Generate a key pair at ``path`` (no passphrase); the public key line ``<type> <base64>``."""
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", "", "-f", str(path)], check=True)
    return " ".join(Path(f"{path}.pub").read_text().split()[:2])


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren, …) from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, pending = [], [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


class SshServer:
    """``start()``, ``kill()`` (sshd and every connection it serves, as a power cut would
    end them), ``start()`` again on the same port and with the same host key."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.user = getpass.getuser()
        self.host_key_line = keygen(root / "ssh_host_ed25519_key")
        keygen(root / "client_key")
        self.client_key = str(root / "client_key")
        (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
        self.config = root / "sshd_config"
        self.config.write_text(
            f"Port {self.port}\n"
            "ListenAddress 127.0.0.1\n"
            f"HostKey {root / 'ssh_host_ed25519_key'}\n"
            f"PidFile {root / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {root / 'authorized_keys'}\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "PermitRootLogin prohibit-password\n"
            "StrictModes no\n"
            "UsePAM no\n"
            "PrintMotd no\n"
            # MaxSessions and MaxStartups are left at OpenSSH's defaults (10 sessions per
            # connection; 10:30:100 unauthenticated connections), as on a real machine, so
            # a burst that only a raised limit would carry is seen here.
            "Subsystem sftp internal-sftp\n"
        )
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation directory
        log = open(self.root / "sshd.log", "ab")
        self.proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(self.config)], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(self.root / 'sshd.log').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    if s.recv(64).startswith(b"SSH-"):
                        return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("sshd did not answer within 15 s")

    def kill(self) -> None:
        """SIGKILL sshd and every process below it (the per-connection sshd processes and
        their shells): every TCP connection to it ends at once."""
        if self.proc is None:
            return
        for pid in [*descendants(self.proc.pid), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        self.proc = None

    def freeze(self) -> list[int]:
        """SIGSTOP sshd and its connections: the TCP connections stay open but nothing
        answers (a machine that hangs, a cable pulled without a reset). Returns the pids for
        :meth:`thaw`."""
        assert self.proc is not None
        pids = [self.proc.pid, *descendants(self.proc.pid)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass  # a connection that just ended
        return pids

    def thaw(self, pids: list[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

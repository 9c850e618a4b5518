"""Discovery over a slow SSH link.

    .venv/bin/python bench/discovery_ssh.py [--files 50] [--rtt-ms 50]

A models directory of ``--files`` links to the SmolLM2 GGUF file is refreshed over SSH
from a real OpenSSH server (tests/sshd.py, OpenSSH's default limits) reached through a
delaying TCP proxy on loopback: every byte is held ``rtt/2`` in each direction, so each
round trip costs ``--rtt-ms`` (bandwidth is not limited). Printed for the first refresh
(every head read) and a second one (nothing changed: no head read again):

- seconds (goal: the first under 5 s at 50 files and 50 ms);
- SFTP requests sent and the round trips they cost (times a request went out with none
  of ours in flight: the client waited a whole round trip for the link).

Before this, one ``read()`` of 32 KiB followed another: 50 files took 3,355 requests and
as many round trips (about three minutes at 50 ms).
"""

from __future__ import annotations

import argparse
import heapq
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from _setup import ROOT, boot  # bench/ is the script's own directory

DATA = boot("corral-discovery-")

sys.path.insert(0, str(ROOT))
from django.core.management import call_command  # noqa: E402

from machines_app import catalog, keystore, ssh  # noqa: E402
from machines_app.demo_models import packaged_model_paths  # noqa: E402
from machines_app.models import Machine  # noqa: E402
from machines_app.transports import ssh_target  # noqa: E402
from tests.sshd import SshServer  # noqa: E402


class DelayingProxy:
    """127.0.0.1:<port> → 127.0.0.1:<target>, each chunk delivered ``delay`` seconds after
    it arrived (in order, never coalesced into a longer wait: a pipeline stays a pipeline)."""

    def __init__(self, target: int, delay: float) -> None:
        self.target, self.delay = target, delay
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.sock.accept()
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((client, upstream), (upstream, client)):
                a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._pipe(a, b)

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        queue: list[tuple[float, int, bytes]] = []
        ready = threading.Condition()
        counter = iter(range(1 << 62))

        def read() -> None:
            while True:
                try:
                    data = source.recv(1 << 20)
                except OSError:
                    data = b""
                with ready:
                    heapq.heappush(queue, (time.monotonic() + self.delay, next(counter), data))
                    ready.notify()
                if not data:
                    return

        def write() -> None:
            while True:
                with ready:
                    while not queue:
                        ready.wait()
                    due, _, data = queue[0]
                    wait = due - time.monotonic()
                    if wait > 0:
                        ready.wait(wait)
                        continue
                    heapq.heappop(queue)
                if not data:
                    try:
                        sink.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    return
                try:
                    sink.sendall(data)
                except OSError:
                    return

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=50)
    parser.add_argument("--rtt-ms", type=float, default=50.0)
    args = parser.parse_args()
    call_command("migrate", verbosity=0)

    work = Path(tempfile.mkdtemp(prefix="corral-discovery-bench-"))
    source = next(path for path in packaged_model_paths().values() if "smollm2" in path.name.lower())
    models = work / "models"
    models.mkdir()
    for index in range(args.files):
        (models / f"smol-{index:03d}.gguf").symlink_to(source)

    server = SshServer(work / "sshd")
    server.start()
    proxy = DelayingProxy(server.port, args.rtt_ms / 2000)
    try:
        machine = Machine.objects.create(
            name="bench-gpu", transport="ssh", host="127.0.0.1", port=proxy.port, user=server.user,
            private_key_sealed=keystore.seal_key(Path(server.client_key).read_text()), host_key=server.host_key_line, models_dir=str(models),
            llama_server_path="llama-server",
        )
        started = time.monotonic()
        ping = ssh.link_for(ssh_target(machine))
        ping.run("true")
        rtt = time.monotonic() - started
        print(f"{args.files} files over SSH, connect + one command {rtt:.2f} s (added round trip {args.rtt_ms:g} ms)")
        for label in ("first refresh (every head read)", "second refresh (nothing changed)"):
            link = ssh.link_for(ssh_target(machine))
            before = (link.sftp_counts.requests, link.sftp_counts.round_trips)
            started = time.monotonic()
            found = catalog.refresh_models(machine)
            took = time.monotonic() - started
            requests = link.sftp_counts.requests - before[0]
            trips = link.sftp_counts.round_trips - before[1]
            assert len(found) == args.files and all(not m.error for m in found), [m.error for m in found][:3]
            print(f"  {label}: {took:.2f} s, {requests} SFTP requests, {trips} round trips")
    finally:
        ssh.drop_link(ssh_target(Machine.objects.get(name="bench-gpu")))
        server.kill()


if __name__ == "__main__":
    main()

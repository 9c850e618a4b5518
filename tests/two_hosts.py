"""Several Corral hosts on one box, for tests: each with its own data directory (so its own
host id), the second and later ones in network, PID, UTS and mount namespaces of their own.

A host in namespaces (``unshare --net --pid --uts --mount --fork --mount-proc``) has only a
loopback of its own and its own process table: it reaches PostgreSQL, Redis and any other
port the test names only through the bridges made here — ``socat`` from a unix socket
(the filesystem is shared, the network is not) to the same loopback port inside. So
``127.0.0.1:5432`` there is the box's PostgreSQL, while a llama-server started there
listens on that host's own loopback, and its pid is in that host's process table only:
what a second machine would be. Its host name is the box's (a cloned VM's).

:class:`Host` starts the production workers there (``python -m project.launcher worker
<kind>``, the command of docs/operations.md) and runs Django code there (:class:`Shell`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .conftest import ROOT, wait_for

#: Runs Django code sent on stdin, one JSON string a line; answers each with a line
#: "@@" + JSON ({"ok": <the code's ``result``>} or {"error": traceback}).
_SHELL = r"""
import json, os, sys, traceback
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
import django
django.setup()
for line in sys.stdin:
    space = {}
    try:
        exec(json.loads(line), space)
        out = {"ok": space.get("result")}
    except BaseException:
        out = {"error": traceback.format_exc()}
    sys.stdout.write("@@" + json.dumps(out, default=str) + "\n")
    sys.stdout.flush()
"""


class Shell:
    """A Django process on a host: :meth:`run` executes code there and returns what it put
    in ``result`` (JSON); an exception there is raised here as AssertionError with its
    traceback."""

    def __init__(self, argv: list[str], env: dict) -> None:
        self.proc = subprocess.Popen(argv + [sys.executable, "-c", _SHELL], cwd=ROOT, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)

    def run(self, code: str):
        self.proc.stdin.write(json.dumps(code) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"the shell exited ({self.proc.wait()}) running:\n{code}")
            if line.startswith("@@"):
                out = json.loads(line[2:])
                if "error" in out:
                    raise AssertionError(f"{out['error']}\nrunning:\n{code}")
                return out["ok"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class Host:
    """One Corral host: ``data`` (its CORRAL_DATA_DIR, prepared: its ``host_id``), ``env``
    (shared database, Redis and secret key; no CORRAL_HOST_ID, so the id is the data
    directory's), and with ``isolated`` its own namespaces, whose bridges carry the
    loopback ``ports`` to the box's."""

    def __init__(self, name: str, root: Path, env: dict, *, isolated: bool = False, ports: tuple[int, ...] = ()):
        from project import data_dir

        self.name = name
        self.data = root / name / "data"
        self.data.mkdir(parents=True)
        self.env = {**env, "CORRAL_DATA_DIR": str(self.data)}
        self.env.pop("CORRAL_HOST_ID", None)
        saved = os.environ.pop("CORRAL_HOST_ID", None)
        try:
            data_dir.prepare(self.data)
            self.id = data_dir.read_host_id(self.data)
        finally:
            if saved is not None:
                os.environ["CORRAL_HOST_ID"] = saved
        self.workers: dict[str, subprocess.Popen] = {}
        self.shells: list[Shell] = []
        self._bridges: list[subprocess.Popen] = []
        self._ns: subprocess.Popen | None = None
        self.ns_pid: int | None = None
        if isolated:
            self._isolate(root / name, ports)

    def _isolate(self, where: Path, ports: tuple[int, ...]) -> None:
        sockets = where / "bridges"
        sockets.mkdir()
        inside = ["ip link set lo up"]
        for port in ports:
            sock = sockets / f"{port}.sock"
            self._bridges.append(subprocess.Popen(
                ["socat", f"UNIX-LISTEN:{sock},fork,mode=600", f"TCP:127.0.0.1:{port}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            wait_for(sock.exists, 10, what=f"the bridge socket for port {port}")
            inside.append(f"socat TCP-LISTEN:{port},bind=127.0.0.1,fork,reuseaddr UNIX-CONNECT:{sock} &")
        inside.append("wait")
        self._ns = subprocess.Popen(
            ["unshare", "--net", "--pid", "--uts", "--mount", "--fork", "--mount-proc", "sh", "-c", "\n".join(inside)],
            start_new_session=True)

        def child() -> int | None:
            try:
                found = Path(f"/proc/{self._ns.pid}/task/{self._ns.pid}/children").read_text().split()
            except OSError:
                return None
            return int(found[0]) if found else None

        self.ns_pid = wait_for(child, 10, what="the host's namespaces")
        for port in ports:  # each bridge answers inside before anything relies on it
            wait_for(lambda port=port: self.run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"]).returncode == 0,
                     10, what=f"port {port} inside {self.name}")

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` as run on this host (inside its namespaces when it has them)."""
        if self.ns_pid is None:
            return argv
        return ["nsenter", "-t", str(self.ns_pid), "--net", "--pid", "--uts", "--mount", f"--wd={ROOT}", "--", *argv]

    def run(self, argv: list[str], *, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
        """``argv`` run to its end on this host (with ``env``, this host's by default)."""
        return subprocess.run(self.argv(argv), cwd=ROOT, env=env or self.env, capture_output=True, text=True,
                              **kwargs)

    def manage(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        done = self.run([sys.executable, "-m", "project.launcher", *args], timeout=timeout)
        assert done.returncode == 0, f"{self.name}: launcher {args}: {done.stdout}\n{done.stderr}"
        return done

    def shell(self) -> Shell:
        shell = Shell(self.argv([]), self.env)
        self.shells.append(shell)
        return shell

    def worker_command(self, kind: str, *extra: str) -> list[str]:
        return self.argv([sys.executable, "-m", "project.launcher", "worker", kind, *extra])

    def start_worker(self, kind: str, *extra: str, concurrency: int = 2) -> None:
        """This host's production worker of ``kind`` (turns, servers, housekeeping), with
        ``extra`` Celery arguments; returns once its liveness key is
        written (it consumes). Its output goes to ``<kind>.log`` beside the data directory."""
        import redis

        from project.channel_layer import channel_prefix

        log = open(self.data.parent / f"{kind}.log", "ab")
        self.workers[kind] = proc = subprocess.Popen(
            self.worker_command(kind, "-c", str(concurrency), *extra), cwd=ROOT, env=self.env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
        url = self.env["REDIS_URL"]
        key = f"{channel_prefix(url)}worker:{kind}@{self.id}"
        client = redis.Redis.from_url(url)

        def ready() -> bool:
            assert proc.poll() is None, f"{self.name}'s {kind} worker exited: {self.log(kind)[-3000:]}"
            return bool(client.exists(key))

        wait_for(ready, 120, interval=0.5, what=f"{self.name}'s {kind} worker")

    def log(self, kind: str) -> str:
        path = self.data.parent / f"{kind}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_worker(self, kind: str, sig: int = signal.SIGTERM) -> None:
        """Signal the worker's whole process group (the nsenter and the worker it forked)."""
        proc = self.workers.pop(kind, None)
        if proc is None:
            return
        try:
            os.killpg(proc.pid, sig)
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of the group
        except ProcessLookupError:
            pass

    def close(self) -> None:
        for kind in list(self.workers):
            self.stop_worker(kind)
        for shell in self.shells:
            shell.close()
        if self._ns is not None:  # its init gone, the kernel kills all in its PID namespace
            os.killpg(self._ns.pid, signal.SIGKILL)
            self._ns.wait()
        for bridge in self._bridges:
            bridge.kill()
            bridge.wait()


def wait_seconds(seconds: float) -> None:
    """Let the housekeeping run for a while (a check that something does *not* happen)."""
    time.sleep(seconds)

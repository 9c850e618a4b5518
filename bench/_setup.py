"""What every bench script does first: a throwaway data directory, an embedded Redis unless
REDIS_URL is set, and Django set up on them (as ``./corral run`` would); and the stack's
processes, started as ``./corral run`` starts them, with the CPU time they spend."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The embedded Redis started by :func:`boot` (None when REDIS_URL named one).
REDIS = None  # project.embedded_redis.EmbeddedRedis


def boot(prefix: str) -> Path:
    """Prepare and return the bench's own data directory (``CORRAL_DATA_DIR``)."""
    global REDIS
    sys.path.insert(0, str(ROOT))
    data = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ.setdefault("CORRAL_DATA_DIR", str(data))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

    from project.launcher import ensure_redis, prepare_data_dir

    prepare_data_dir()
    REDIS = ensure_redis(keep_url=False)
    if REDIS is not None:
        atexit.register(REDIS.stop)

    import django

    django.setup()
    return data


class Stack:
    """Daphne and one Celery worker per queue (the housekeeping one runs the periodic
    rounds), started like ``./corral run`` does (project/launcher.py), in the bench's
    data directory; logs in ``<data>/logs``.

    :meth:`cpu_seconds` is the CPU time (user + system, from ``/proc/<pid>/stat``) that
    Corral's own processes have spent so far: these, plus the embedded Redis. Not
    llama-server, which the servers worker starts but which is the model's, not Corral's.
    With ``sql_counts``, each process counts its SQL statements there (bench/counts.py).
    """

    def __init__(self, data: Path, port: int, *, turn_workers: int = 8, sql_counts: Path | None = None) -> None:
        from django.conf import settings

        from project import launcher, queues

        env = {**os.environ, "REDIS_URL": settings.REDIS_URL, "SECRET_KEY": settings.SECRET_KEY}
        if sql_counts is not None:  # bench/counts.py: each process counts its SQL statements
            from counts import COUNTING_PATH, SQL_COUNTS_ENV

            sql_counts.mkdir(exist_ok=True)
            env[SQL_COUNTS_ENV] = str(sql_counts)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(COUNTING_PATH), env.get("PYTHONPATH")]))
        bin_dir = Path(sys.executable).parent
        celery = [str(bin_dir / "celery"), "-A", "project"]
        quiet = launcher.QUIET_WORKER.split()  # as ./corral run starts them
        programs = {
            "web": [str(bin_dir / "daphne"), "-b", "127.0.0.1", "-p", str(port), "project.asgi:application"],
            "worker-turns": [*celery, "worker", "-Q", queues.TURNS, "-n", f"{queues.TURNS}@bench", "-P", "threads",
                             "-c", str(turn_workers), *quiet, "-l", "warning"],
            "worker-servers": [*celery, "worker", "-Q", queues.SERVERS, "-n", f"{queues.SERVERS}@bench",
                               "-P", "threads", "-c", str(queues.SERVERS_CONCURRENCY), *quiet, "-l", "warning"],
            "worker-housekeeping": [*celery, "worker", "-Q", queues.HOUSEKEEPING, "-n",
                                    f"{queues.HOUSEKEEPING}@bench", "-P", "threads",
                                    "-c", str(queues.HOUSEKEEPING_CONCURRENCY), *quiet, "-l", "warning"],
        }
        logs = data / "logs"
        logs.mkdir(exist_ok=True)
        self.port = port
        self.procs: dict[str, subprocess.Popen] = {}
        for name, argv in programs.items():
            with open(logs / f"{name}.log", "wb") as log:
                self.procs[name] = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def pids(self) -> dict[str, int]:
        pids = {name: proc.pid for name, proc in self.procs.items()}
        if REDIS is not None:
            pids["redis"] = REDIS.proc.pid
        return pids

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds spent so far by each of Corral's processes (name → seconds)."""
        return {name: process_cpu_seconds(pid) for name, pid in self.pids().items()}

    def settle(self, *, below: float = 0.05, timeout: float = 120.0) -> float:
        """Wait until the processes have started (imports, connections): their CPU over 2 s
        under ``below`` seconds per second, or ``timeout``; the last rate. A measurement
        begun earlier would count their start-up as the figure's cost."""
        deadline = time.monotonic() + timeout
        while True:
            before = self.cpu_seconds()
            time.sleep(2)
            rate = sum(cpu_spent(before, self.cpu_seconds()).values()) / 2
            if rate < below or time.monotonic() > deadline:
                return rate

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) spent so far by one process, all its threads, the ones
    that have ended included; 0 for a process that is gone.

    Read from the process's CPU-time clock (``clock_getcpuclockid``: Linux names it
    ``((~pid) << 3) | CPUCLOCK_SCHED``), which counts nanoseconds. ``/proc/<pid>/stat``
    counts clock ticks (10 ms): over a 400-token reply that lasts 2–3 s, six processes
    could each be off by a tick, ±0.15 ms per token on a figure whose goal is 0.5."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}

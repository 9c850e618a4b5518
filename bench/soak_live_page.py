"""Soak: an idle session page's websocket held open for a long time, counting reconnects.

    .venv/bin/python bench/soak_live_page.py [--seconds 3600] [--redis-socket-timeout S]

An idle page must stay connected (docs/live-page.md): this holds one websocket to an idle
session for ``--seconds`` (default one hour), reconnecting like the page does whenever
the server closes it, and prints every reconnect as it happens, then a summary: the
number of reconnects (the requirement is 0), how many of its messages arrived, and the
tracebacks daphne logged. Every ``--ping-every`` seconds (default 60) an event is
recorded, which must arrive over the held socket: a socket that stays open but no longer
receives would otherwise pass unseen.

``--redis-socket-timeout S`` adds ``socket_timeout=S`` to the Redis URL daphne is given,
the configuration in which an idle socket used to die every few seconds.

It runs daphne on a throwaway data directory with SQLite and an embedded Redis, unless
DATABASE_URL / REDIS_URL are set; no llama-server and no Celery worker are needed. Never
run by the tests (it takes an hour).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from urllib.parse import urlencode, urlsplit, urlunsplit

from _setup import ROOT, boot  # bench/ is the script's own directory

DATA = boot("corral-soak-")

import httpx  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.test import Client  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402


def with_socket_timeout(url: str, seconds: float | None) -> str:
    if seconds is None:
        return url
    parts = urlsplit(url)
    query = "&".join(q for q in (parts.query, urlencode({"socket_timeout": seconds})) if q)
    return urlunsplit(parts._replace(query=query))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3600.0, help="how long to hold the socket (default 3600)")
    parser.add_argument("--ping-every", type=float, default=60.0, help="seconds between checking events (default 60)")
    parser.add_argument("--redis-socket-timeout", type=float, default=None,
                        help="add socket_timeout=S to daphne's REDIS_URL (the configuration that used to break)")
    args = parser.parse_args()

    call_command("migrate", verbosity=0)
    from machines_app.models import Machine
    from sessions_app import actions
    from sessions_app.models import AgentSession

    user = get_user_model().objects.create_user("soak", password="soak-password-1")
    machine = Machine.objects.create(name="soak", models_dir=str(DATA))
    session = AgentSession.objects.create(owner=user, machine=machine, model_key="none.gguf", working_dir=str(DATA),
                                          status="idle", title="Soak")
    client = Client()
    client.force_login(user)
    cookie = f"sessionid={client.cookies['sessionid'].value}"

    redis_url = with_socket_timeout(settings.REDIS_URL, args.redis_socket_timeout)
    env = {**os.environ, "REDIS_URL": redis_url, "SECRET_KEY": settings.SECRET_KEY, "PYTHONUNBUFFERED": "1"}
    port = 19000 + os.getpid() % 1000
    log_path = DATA / "daphne.log"
    with open(log_path, "wb") as log:
        daphne = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "project.asgi:application"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/login/", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"daphne did not start; see {log_path}")
            time.sleep(0.2)
        print(f"holding an idle websocket for {args.seconds:.0f} s (daphne REDIS_URL {redis_url})", flush=True)

        received: list[int] = []
        reconnects = 0
        started = time.monotonic()
        stop = threading.Event()

        def pinger() -> None:
            while not stop.wait(args.ping_every):
                actions.record_event(session.pk, "error", {"message": f"soak ping at {time.monotonic() - started:.0f} s"})

        threading.Thread(target=pinger, daemon=True).start()
        while time.monotonic() - started < args.seconds:
            after = received[-1] if received else 0
            url = f"ws://127.0.0.1:{port}/ws/sessions/{session.pk}/?after={after}"
            try:
                with connect(url, additional_headers={"Cookie": cookie, "Origin": f"http://127.0.0.1:{port}"},
                             open_timeout=10) as ws:
                    while time.monotonic() - started < args.seconds:
                        try:
                            raw = ws.recv(timeout=1)
                        except TimeoutError:
                            continue
                        message = json.loads(raw)
                        if "seq" in message:  # who-is-watching lists carry none
                            received.append(message["seq"])
                    break
            except (ConnectionClosed, OSError) as exc:
                reconnects += 1
                code = getattr(getattr(exc, "rcvd", None), "code", None)
                print(f"{time.monotonic() - started:8.1f} s  reconnect #{reconnects} (close code {code}: {exc})",
                      flush=True)
                time.sleep(0.5)  # the page's first retry delay
        stop.set()
        sent = AgentSession.objects.get(pk=session.pk).last_seq
        tracebacks = log_path.read_text(errors="replace").count("Traceback")
        print(f"held {time.monotonic() - started:.0f} s: {reconnects} reconnects (need 0), "
              f"{len(set(received))} of {sent} events received, {tracebacks} tracebacks in daphne's log")
    finally:
        daphne.terminate()
        daphne.wait(20)


if __name__ == "__main__":
    main()

"""Many watchers joining one streaming session (the live page's scale, goals 5 and 6).

    .venv/bin/python bench/many_watchers.py [--watchers 50,200] [--rate 50] [--profile DIR]

One session streams a reply from the fixed-rate stand-in (bench/rate_server.py, ``--rate``
tokens a second, each token stamped with its index and the moment it was written). A
first watcher, the *probe*, follows it from the start; once tokens flow, W more websockets
open on the same session, 20 at a time in flight (as W pages opened at once would), and
stay open. Printed for each W:

- the live-token delay of the probe while the others join: for every token the stand-in
  wrote between the first join's start and the last socket's first who-is-watching list,
  the time until the probe first showed it (in a tail or stored text); the largest and
  the p95 (goal: none above 100 ms);
- who-is-watching messages: how many every socket received from the first join to the
  end of the reply, in all and per watcher (goal O(watchers): the count per watcher stays
  the same as W grows; each socket sent the list each time anyone joined was O(W²));
- Corral's CPU over the joins (daphne apart), and the Redis commands and database writes
  per join (bench/counts.py), counted.

The turns worker and the reply are the same as bench/many_sessions.py's; all watchers
are one user, as a team's wall screen would be, so the list itself changes only once.
``--profile DIR`` records daphne with py-spy over each W's joins and prints its top.
"""

from __future__ import annotations

import argparse
import asyncio
import html
import json
import os
import re
import subprocess
import time
from pathlib import Path

from _setup import Stack, boot, cpu_spent  # bench/ is the script's own directory
from counts import Tally
from profiling import Profiles
from stand_in import stand_in_machine
from websockets.exceptions import InvalidHandshake

DATA = boot("corral-watchers-")

from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.test import Client  # noqa: E402

TOKEN = re.compile(r"(\d+)@(\d+(?:\.\d+)?) ")
RAW = re.compile(r'<div class="body plain raw">(.*?)(?:<span class="tail"></span>)?</div>', re.S)
IN_FLIGHT = 20  # sockets opening at once


class Socket:
    """One watcher: counts its who-is-watching messages; the probe also notes, for every
    token, when it first showed it (ms after the stand-in wrote it)."""

    def __init__(self, url: str, headers: dict, *, probe: bool = False) -> None:
        self.url, self.headers, self.probe = url, headers, probe
        self.presence = 0
        self.first_presence = asyncio.Event()
        self.first_seen: dict[int, float] = {}  # token index → delay in ms
        self.written: dict[int, float] = {}  # token index → when the stand-in wrote it (wall-clock ms)
        self.text: list[str] = []
        self.ended = asyncio.Event()
        self.stop = asyncio.Event()
        self.task: asyncio.Future | None = None
        self.failed_handshakes = 0

    def _seen(self, piece: str, now: float) -> None:
        for match in TOKEN.finditer(piece):
            index, written = int(match.group(1)), float(match.group(2))
            if index not in self.first_seen:
                self.first_seen[index], self.written[index] = now - written, written

    async def run(self) -> None:
        """Open the socket and read until told to stop; a handshake that fails (daphne
        drops one its application has not accepted within 5 s) is tried again, as the
        page does (after 0.5 s, doubling up to 5 s), and counted."""
        from websockets.asyncio.client import connect

        backoff = 0.5
        while not self.stop.is_set():
            try:
                async with connect(self.url, additional_headers=self.headers, max_size=None) as ws:
                    reading = asyncio.ensure_future(self._read(ws))
                    await self.stop.wait()
                    reading.cancel()
                    return
            except (OSError, InvalidHandshake):
                self.failed_handshakes += 1
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _read(self, ws) -> None:
        started = False
        async for raw in ws:
            now = time.time() * 1000
            message = json.loads(raw)
            if "presence" in message:
                self.presence += 1
                self.first_presence.set()
                continue
            if not self.probe:
                continue
            for op in message.get("ops", []):
                if op["op"] == "tail" and op.get("id", "").startswith("a-"):
                    self._seen(op["text"], now)
                elif op["op"] == "text" and op.get("id", "").startswith("a-"):
                    self.text.append(op["text"])
                    self._seen("".join(self.text), now)
                elif op["op"] == "append" and 'class="msg assistant' in op.get("html", ""):
                    found = RAW.search(op["html"])
                    self.text.append(html.unescape(found.group(1)) if found else "")
                    self._seen("".join(self.text), now)
                    started = True
                elif started and op["op"] == "status" and op.get("status") == "idle":
                    self.ended.set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--watchers", default="50,200", help="comma-separated W (default 50,200)")
    parser.add_argument("--rate", type=float, default=50.0, help="tokens a second (default 50)")
    parser.add_argument("--profile", type=Path, help="record daphne with py-spy over the joins into DIR")
    args = parser.parse_args()
    counts = [int(w) for w in args.watchers.split(",")]
    os.environ["RATE_TOKENS_PER_SECOND"] = str(args.rate)

    print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    call_command("migrate", verbosity=0)
    from sessions_app import actions
    from sessions_app.models import AgentSession
    from sessions_app.servers.stop import stop_server

    machine, model_key = stand_in_machine(DATA)
    user = get_user_model().objects.create_user("wall", password="wall-password-1")
    client = Client()
    client.force_login(user)
    port = 16000 + os.getpid() % 1000
    headers = {"Cookie": f"sessionid={client.cookies['sessionid'].value}", "Origin": f"http://127.0.0.1:{port}"}
    stack = Stack(DATA, port, sql_counts=DATA / "sql-counts")
    tally = Tally(DATA / "sql-counts")
    # Long enough for the slowest joins seen (W = 200 on a loaded machine) to end well before it.
    tokens = int(args.rate * 90)
    session = actions.do_create_session(user, machine=machine, model_key=model_key, working_dir=str(DATA),
                                        server_params={}, sampling={"max_tokens": tokens}, permission_mode="manual")
    try:
        deadline = time.monotonic() + 900  # a loaded machine starts it slowly
        while AgentSession.objects.get(pk=session.pk).status != "idle":
            if time.monotonic() > deadline:
                raise SystemExit("timed out waiting for the stand-in to start")
            time.sleep(0.2)
        stack.settle()
        os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"  # the ORM calls here are the bench's own, in order
        for w in counts:
            print(asyncio.run(one_run(w, session.pk, user, port, headers, stack, tally, args.profile)), flush=True)
            stack.settle()
    finally:
        stop_server(session.pk)
        stack.stop()


async def one_run(w: int, session_id: int, user, port: int, headers: dict, stack, tally, profile) -> str:
    from sessions_app import actions
    from sessions_app.models import AgentSession

    def url() -> str:
        last = AgentSession.objects.get(pk=session_id).last_seq
        return f"ws://127.0.0.1:{port}/ws/sessions/{session_id}/?after={last}"

    probe = Socket(url(), headers, probe=True)
    probe_task = asyncio.ensure_future(probe.run())
    await asyncio.wait_for(probe.first_presence.wait(), 60)
    await asyncio.to_thread(actions.do_send_message, AgentSession.objects.get(pk=session_id), user, "go")
    while len(probe.first_seen) < 50:  # tokens flow
        await asyncio.sleep(0.05)
    await asyncio.sleep(1)
    presence_before = probe.presence
    sockets = [Socket(url(), headers) for _ in range(w)]
    await asyncio.to_thread(tally.start)
    profiles = Profiles({"daphne": stack.procs["web"].pid}, profile / f"W{w}", 15) if profile else None
    cpu_before = stack.cpu_seconds()
    gate = asyncio.Semaphore(IN_FLIGHT)
    joined_at = time.time() * 1000

    async def join(socket: Socket) -> None:
        async with gate:
            socket.task = asyncio.ensure_future(socket.run())
            await asyncio.wait_for(socket.first_presence.wait(), 600)

    await asyncio.gather(*(join(s) for s in sockets))
    all_joined = time.time() * 1000
    cpu = cpu_spent(cpu_before, stack.cpu_seconds())
    await asyncio.to_thread(tally.stop)
    await asyncio.wait_for(probe.ended.wait(), 300)
    await asyncio.sleep(1)  # lists still on their way
    presence = sum(s.presence for s in sockets) + probe.presence - presence_before
    for socket in [*sockets, probe]:
        socket.stop.set()
    await asyncio.gather(probe_task, *(s.task for s in sockets), return_exceptions=True)
    if profiles is not None:
        print("\n".join(profiles.summaries()), flush=True)
    # Tokens the stand-in wrote while the sockets joined: index → delay until the probe showed it.
    during = sorted(delay for index, delay in probe.first_seen.items()
                    if joined_at <= probe.written[index] <= all_joined)
    p95 = during[int(0.95 * (len(during) - 1))] if during else float("nan")
    worst = during[-1] if during else float("nan")
    return (f"W={w:3d} watchers joining one streaming session: joins took {(all_joined - joined_at) / 1000:.1f} s; "
            f"live-token delay while they joined: max {worst:.0f} ms, p95 {p95:.0f} ms over {len(during)} tokens "
            f"(goal: none above 100 ms); who-is-watching messages {presence} = {presence / (w + 1):.2f} per "
            f"watcher (goal O(watchers): the same per watcher at every W); Corral CPU over the joins "
            f"{sum(cpu.values()):.2f} s (daphne {cpu['web']:.2f} s); handshakes dropped and tried again "
            f"{sum(s.failed_handshakes for s in sockets)}\n"
            f"W={w:3d} counts: {tally.line(w, 'join')}")


if __name__ == "__main__":
    main()

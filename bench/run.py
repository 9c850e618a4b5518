"""Benchmarks for docs/behaviour.md §13, printed with their goals; run with ``.venv/bin/python bench/run.py``.

1. Corral's CPU per streamed token: the CPU time (``/proc/<pid>/stat``) of Corral's own
   processes — daphne, the three Celery workers, Redis — over one 400-token reply
   of SmolLM2 watched by one websocket client, divided by the reply's tokens. Goal:
   <= 0.5 ms per token. The stack's idle rate (housekeeping, heartbeats) is printed too.
2. Stream throughput: tokens/s seen by a websocket client of Corral vs a client reading
   the same llama-server directly (same model, prompt, seed, max_tokens; one run; median
   of 3). Goal: >= 0.97, alone and with a second session streaming at the same time (from
   the fixed-rate stand-in, bench/rate_server.py, so only Corral's work is added).
3. Many sessions: bench/many_sessions.py, run here with N = 1, 8, 32 sessions of 50 tokens/s
   each from the fixed-rate stand-in, one watcher each, on a stack of its own: delivered /
   sent (goal 1.000, in order, each watcher's text equal to the stored text), p50 / p95
   delay from the stand-in writing a token to the watcher showing it (goal p95 <= 100 ms at
   N = 32), and Corral's CPU per token.
4. Warm restart (docs/behaviour.md §5 warm prompts): a 5-turn conversation, Stop, Restart,
   one more turn: its cached prompt tokens / turn 5's prompt tokens. Goal: >= 0.95
   (without slot save/restore ≈ 0).
5. Page size: server time for a session page holding 10,000 events (goal <= 150 ms) and
   how many transcript rows it draws (older turns are paged: docs/live-page.md).
6. The live page at scale (bench/live_scale.py): 64 sessions × 50 tokens/s × 2 watchers
   each (goal: all delivered in order, p95 token delay <= 100 ms); 200 watchers joining
   one streaming session (goal: no live token delayed above 100 ms while they join,
   who-is-watching messages O(watchers)); and the Redis commands and database writes per
   100 tokens and per join, counted.
Also: prompt cache: on turn N+1, cached prompt tokens / turn N's prompt tokens, from the
   server's own timings. Goal: >= 0.95.
Goals of the turn's own cost (``turn_goals``; printed after item 1, or alone with ``--turn-only``):
 goal 1. time to first token: from the POST of a message to the first reply text on a page's
   websocket, against a client sending the same request (agent.request_for) to the same
   llama-server itself, to its first content chunk; 10 turns each, same conversation
   (cleared before each turn), warm cache, in separate phases (each would evict the other's
   prefix from the server's one slot). Goal: Corral adds <= 30 ms p50, <= 60 ms p95.
 goal 2. the idle stack with two session pages open: <= 3 ms CPU per second, all processes.
 goal 3. Corral's CPU per streamed token, idle cost included, with one and with two
   watchers: <= 0.3 ms at the box's llama-server token rate (printed beside it).

It runs the real stack (daphne, the Celery workers, llama-server on SmolLM2) in a
throwaway data directory with SQLite and an embedded Redis, unless DATABASE_URL /
REDIS_URL are set. Numbers are noisy on a shared machine: ``uptime`` is printed first.
``--page-only`` runs item 5 alone (no model, no stack); ``--cpu-only`` runs item 1 and the
goals alone; ``--turn-only`` the goals alone; ``--idle-only`` goal 2 alone (with
``--profile DIR``, each process recorded by py-spy over it: bench/profiling.py; with
``--turn-only``, daphne and the turns worker over goal 3's first reply too); ``--live-only``
runs item 6 alone.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import live_scale
from _setup import ROOT, Stack, boot, cpu_spent  # bench/ is the script's own directory
from profiling import Profiles

DATA = boot("corral-bench-")

import httpx  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.test import Client  # noqa: E402

PROMPT = "Write a long, detailed story about a shepherd and her flock in the mountains."
MAX_TOKENS = 400
SEED = 42
RUNS = 3
RATE_SERVER = ROOT / "bench" / "rate_server.py"


def wait_for(predicate, timeout, what, explain=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}" + (f": {explain()}" if explain else ""))


def direct_tokens_per_second(base_url: str, api_key: str) -> float:
    """A client reading llama-server's stream itself: predicted tokens over first→last token."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "stream": True, "max_tokens": MAX_TOKENS,
            "seed": SEED, "temperature": 0, "stream_options": {"include_usage": True}}
    first = last = None
    tokens = 0
    headers = {"Authorization": f"Bearer {api_key}"}  # the server answers only its key's holder
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return (tokens - 1) / (last - first)


def rate_server_script() -> str:
    """A llama-server path that runs the fixed-rate stand-in (what a Machine starts)."""
    script = DATA / "rate-llama-server"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {RATE_SERVER} \"$@\"\n")
    script.chmod(0o755)
    return str(script)


def turn_state(session_id: int) -> str:
    """What a bench waiting for a turn prints when it gives up (status, lease, last events)."""
    from sessions_app.models import AgentSession, TranscriptEvent

    s = AgentSession.objects.get(pk=session_id)
    tail = TranscriptEvent.objects.filter(session_id=session_id).order_by("-seq")[:6]
    return (f"status={s.status} turn_active={s.turn_active} lease={s.lease_owner!r} until {s.lease_expires}; "
            f"last events: {[(e.seq, e.kind) for e in reversed(tail)]}")


def main() -> None:
    page_only = "--page-only" in sys.argv[1:]  # item 5 alone: no model, no stack
    cpu_only = "--cpu-only" in sys.argv[1:]  # item 1 alone
    warm_only = "--warm-only" in sys.argv[1:]  # item 4 (and the prompt cache) alone, then item 5
    turn_only = "--turn-only" in sys.argv[1:]  # goals 1-3 alone (the turn's own cost)
    idle_only = "--idle-only" in sys.argv[1:]  # goal 2 alone (the idle stack)
    turn_only = turn_only or idle_only
    print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    call_command("migrate", verbosity=0)
    from machines_app import catalog
    from machines_app.demo_models import packaged_model_paths
    from machines_app.management.commands.corral_setup import packaged_llama_server
    from machines_app.models import Machine
    from sessions_app import actions
    from sessions_app.models import AgentSession, TranscriptEvent
    from sessions_app.servers.models import ServerRecord

    models = DATA / "models"
    models.mkdir()
    smol = packaged_model_paths()["smollm2"]
    (models / smol.name).symlink_to(smol)
    machine = Machine.objects.create(name="bench", models_dir=str(models), llama_server_path=packaged_llama_server())
    # The stand-in runs this checkout's bench/rate_server.py, which the sandbox hides (it
    # hides Corral's code and data directory): started without one, as a test stand-in.
    stand_in = Machine.objects.create(name="stand-in", models_dir=str(models), llama_server_path=rate_server_script(),
                                      bwrap_path="")
    catalog.refresh_models(machine)
    catalog.refresh_models(stand_in)
    user = get_user_model().objects.create_user("bench", password="bench-password-1")

    client = Client()
    if page_only:
        page_size(user, machine, smol.name, client)
        return
    if "--live-only" in sys.argv[1:]:
        print("\n".join(live_scale.lines()))
        return
    many = many_sessions() if not (cpu_only or warm_only or turn_only) else []
    scale = live_scale.lines() if not (cpu_only or warm_only or turn_only) else []
    port = 18000 + os.getpid() % 1000
    stack = Stack(DATA, port)
    try:
        session = actions.do_create_session(
            user, machine=machine, model_key=smol.name, working_dir=str(DATA), server_params={"contextSize": 4096},
            sampling={"temperature": 0, "seed": SEED, "max_tokens": MAX_TOKENS}, permission_mode="manual",
        )
        second = None if turn_only else actions.do_create_session(
            user, machine=stand_in, model_key=smol.name, working_dir=str(DATA), server_params={},
            sampling={"max_tokens": 100_000}, permission_mode="manual",
        )
        for s in (session, second) if second else (session,):
            wait_for(lambda s=s: AgentSession.objects.get(pk=s.pk).status == "idle", 180, "the model to load",
                     lambda s=s: turn_state(s.pk))
        if warm_only:
            prompt_cache_and_warm_restart(session, machine, user, smol.name)
            return
        record = ServerRecord.objects.get(session=session)
        base_url = f"http://127.0.0.1:{record.port}"
        client.force_login(user)
        cookie = f"sessionid={client.cookies['sessionid'].value}"
        if turn_only:
            if idle_only:
                print(*idle_goal(stack, session, port, cookie), sep="\n", flush=True)
            else:
                turn_goals(stack, session, user, port, cookie, base_url, record.api_key)
            return

        from websockets.sync.client import connect

        def one_run(run: int, label: str) -> dict:
            direct = direct_tokens_per_second(base_url, record.api_key)
            after = AgentSession.objects.get(pk=session.pk).last_seq
            times: list[float] = []
            done = threading.Event()

            def listen():
                with connect(f"ws://127.0.0.1:{port}/ws/sessions/{session.pk}/?after={after}",
                             additional_headers={"Cookie": cookie, "Origin": f"http://127.0.0.1:{port}"}) as ws:
                    for raw in ws:
                        message = json.loads(raw)
                        for op in message["ops"]:
                            if op["op"] in ("text", "tail", "append") and "a-" in (op.get("id", "") + op.get("html", "")[:80]):
                                times.append(time.perf_counter())
                        if any(op.get("op") == "status" and op.get("status") == "idle" for op in message["ops"]):
                            done.set()
                            return

            listener = threading.Thread(target=listen, daemon=True)
            listener.start()
            time.sleep(0.5)
            actions.do_clear(AgentSession.objects.get(pk=session.pk), user)  # same prompt as the direct client
            cpu_before = stack.cpu_seconds()
            started = time.monotonic()
            actions.do_send_message(AgentSession.objects.get(pk=session.pk), user, PROMPT)
            if not done.wait(1200):  # a loaded machine can run SmolLM2 at 1-2 tokens/s
                raise SystemExit(f"timed out waiting for the reply: {turn_state(session.pk)}")
            cpu = cpu_spent(cpu_before, stack.cpu_seconds())
            wall = time.monotonic() - started
            usage = TranscriptEvent.objects.filter(session=session, kind="usage").last().payload
            tokens = usage["completion_tokens"]
            seen = (tokens - 1) / (times[-1] - times[0])
            print(f"  {label} run {run + 1}: direct {direct:.1f} tok/s, browser {seen:.1f} tok/s, "
                  f"ratio {seen / direct:.3f}; {tokens} tokens, Corral CPU {sum(cpu.values()):.2f} s over {wall:.1f} s "
                  f"= {sum(cpu.values()) / tokens * 1000:.2f} ms/token "
                  f"({', '.join(f'{k} {v:.2f}' for k, v in cpu.items())})")
            return {"ratio": seen / direct, "own": seen / usage["predicted_per_second"], "cpu": cpu,
                    "tokens": tokens, "wall": wall}

        # The stack's CPU while nothing streams (housekeeping, heartbeats), per second.
        stack.settle()
        idle_before = stack.cpu_seconds()
        time.sleep(10)
        idle = sum(cpu_spent(idle_before, stack.cpu_seconds()).values()) / 10

        alone = [one_run(run, "alone") for run in range(RUNS)]
        ms = [sum(r["cpu"].values()) / r["tokens"] * 1000 for r in alone]
        median = alone[ms.index(statistics.median(ms))]
        print(f"1. Corral CPU per streamed token (median of {RUNS}, {median['tokens']}-token reply): "
              f"{statistics.median(ms):.2f} ms  (goal <= 0.5 ms)")
        print("   by process: " + ", ".join(f"{k} {v / median['tokens'] * 1000:.2f}" for k, v in median["cpu"].items())
              + f" ms/token; idle stack {idle * 1000:.0f} ms CPU per second "
              f"(= {idle * median['wall'] / median['tokens'] * 1000:.2f} ms/token of the figure above)")
        turn_goals(stack, session, user, port, cookie, base_url, record.api_key)
        if cpu_only:
            return

        with_second = []
        for run in range(RUNS):
            actions.do_send_message(AgentSession.objects.get(pk=second.pk), user, "stream for a while")
            wait_for(lambda: AgentSession.objects.get(pk=second.pk).status == "running", 30, "the second session",
                     lambda: turn_state(second.pk))
            with_second.append(one_run(run, "with a second session streaming"))
            actions.do_interrupt(AgentSession.objects.get(pk=second.pk), user)
            wait_for(lambda: not AgentSession.objects.get(pk=second.pk).turn_active, 30,
                     "the second session to stop", lambda: turn_state(second.pk))
        print(f"2. stream throughput browser / direct (median of {RUNS}): alone "
              f"{statistics.median(r['ratio'] for r in alone):.3f}, with a second session streaming "
              f"{statistics.median(r['ratio'] for r in with_second):.3f}  (goal >= 0.97 both)")
        print(f"   browser / llama-server's own rate in the same run: "
              f"{statistics.median(r['own'] for r in alone):.3f} (what the pipeline adds; the rest is CPU "
              "that Corral's processes take from llama-server)")
        print("\n".join(many))
        print("\n".join(scale))
        prompt_cache_and_warm_restart(session, machine, user, smol.name)
    finally:
        stack.stop()
        from sessions_app.servers.stop import stop_server

        for record in ServerRecord.objects.all():
            stop_server(record.session_id)
        if warm_only:
            page_size(user, machine, smol.name, client)

    if not warm_only:
        page_size(user, machine, smol.name, client)


def many_sessions() -> list[str]:
    """3. bench/many_sessions.py for N = 1, 8, 32, on a stack of its own (run before this
    script's own starts, so the two never share the CPU); the lines to print."""
    import _setup

    # A data directory of its own, and its own embedded Redis unless REDIS_URL was given.
    own_env = {k: v for k, v in os.environ.items() if k != "CORRAL_DATA_DIR"}
    if _setup.REDIS is not None:
        own_env.pop("REDIS_URL", None)
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "many_sessions.py"), "--sessions", "1,8,32",
                          "--rate", "50", "--seconds", "10"], capture_output=True, text=True, env=own_env)
    lines = ["3. many sessions (bench/many_sessions.py --sessions 1,8,32 --rate 50 --seconds 10):"]
    lines += [f"   {line}" for line in run.stdout.splitlines() if line.startswith("N=")]
    if run.returncode != 0 or len(lines) == 1:
        lines.append(f"   many_sessions.py failed (exit {run.returncode}): {run.stderr.strip()[-2000:]}")
    return lines


def prompt_cache_and_warm_restart(session, machine, user, model_key: str) -> None:
    """The prompt cache over a growing conversation, then 4. the warm restart."""
    from sessions_app import actions
    from sessions_app.models import AgentSession, TranscriptEvent

    # prompt cache reuse over a growing conversation
    actions.do_clear(AgentSession.objects.get(pk=session.pk), user)
    AgentSession.objects.filter(pk=session.pk).update(sampling={"temperature": 0, "seed": SEED, "max_tokens": 40})
    previous_prompt = None
    cache_ratios = []
    for turn in range(4):
        ends = TranscriptEvent.objects.filter(session=session, kind="turn_end").count()
        actions.do_send_message(AgentSession.objects.get(pk=session.pk), user, f"Tell me fact number {turn + 1}.")
        wait_for(lambda ends=ends: TranscriptEvent.objects.filter(session=session, kind="turn_end").count() > ends,
                 300, "the turn", lambda: turn_state(session.pk))
        usage = TranscriptEvent.objects.filter(session=session, kind="usage").last().payload
        if previous_prompt:
            cache_ratios.append(usage.get("cache_n", 0) / previous_prompt)
            print(f"  turn {turn + 1}: prompt {usage['prompt_tokens']}, cached {usage.get('cache_n')}, "
                  f"new {usage.get('prompt_n')}; cached / previous prompt = {cache_ratios[-1]:.3f}")
        previous_prompt = usage["prompt_tokens"]
    print(f"   prompt cache reuse (min over turns): {min(cache_ratios):.3f}  (goal >= 0.95)")
    warm_restart(machine, user, model_key)


def page_size(user, machine, model_key: str, client) -> None:
    """5. a session page with 10,000 events: server time and transcript rows drawn."""
    import re

    from sessions_app.models import AgentSession, TranscriptEvent

    big = AgentSession.objects.create(owner=user, machine=machine, model_key=model_key, working_dir=str(DATA),
                                      status="idle")
    events, seq = [], 0
    for turn in range(250):
        rows = [("message_taken", {"text": f"question {turn}", "author": "bench", "queued_id": None})]
        rows += [("assistant_text", {"text": f"word{i} "}) for i in range(30)]
        rows += [("tool_start", {"id": f"c{turn}", "tool": "read_file", "arguments": "{}", "input": {}}),
                 ("tool_end", {"id": f"c{turn}", "output": "x" * 200, "ok": True})]
        rows += [("assistant_text", {"text": f"more{i} "}) for i in range(5)]
        rows += [("usage", {"prompt_tokens": 100}), ("turn_end", {"reason": "done"})]
        for kind, payload in rows:
            seq += 1
            events.append(TranscriptEvent(session=big, seq=seq, kind=kind, payload=payload))
    TranscriptEvent.objects.bulk_create(events)
    AgentSession.objects.filter(pk=big.pk).update(last_seq=seq)
    client.force_login(user)
    timings = []
    for _ in range(5):
        started = time.perf_counter()
        response = client.get(f"/sessions/{big.pk}/", HTTP_HOST="127.0.0.1")
        timings.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200
    html = response.content.decode()
    transcript = html[html.index('id="transcript"'):]
    rows = len(re.findall(r'<(?:div|details) class="(?:msg|usage|note|divider)[^"]*" id="', transcript))
    print(f"5. page with {seq} events: median {statistics.median(timings):.0f} ms server time  (goal <= 150 ms); "
          f"{rows} transcript rows drawn, {len(html) // 1024} KiB")


def warm_restart(machine, user, model_key: str) -> None:
    """4. A 5-turn conversation, its server stopped and started again, one more turn: how
    much of the earlier prompt came warm from the restored slot (needs the worker running)."""
    from sessions_app import actions
    from sessions_app.models import AgentSession, TranscriptEvent

    def fresh():
        return AgentSession.objects.get(pk=session.pk)

    def turn(text):
        ends = TranscriptEvent.objects.filter(session=session, kind="turn_end").count()
        actions.do_send_message(fresh(), user, text)
        wait_for(lambda: TranscriptEvent.objects.filter(session=session, kind="turn_end").count() > ends
                 and not fresh().turn_active, 120, "the turn")
        return TranscriptEvent.objects.filter(session=session, kind="usage").last().payload

    session = actions.do_create_session(
        user, machine=machine, model_key=model_key, working_dir=str(DATA), server_params={"contextSize": 4096},
        sampling={"temperature": 0, "seed": SEED, "max_tokens": 40}, permission_mode="manual",
    )
    wait_for(lambda: fresh().status == "idle", 180, "the model to load")
    for n in range(5):
        usage = turn(f"Tell me fact number {n + 1} about sheep.")
    previous_prompt = usage["prompt_tokens"]
    actions.do_stop(fresh(), user)
    wait_for(lambda: fresh().status == "stopped", 60, "the stop")
    started = time.perf_counter()
    actions.do_restart(fresh(), user)
    wait_for(lambda: fresh().status == "idle", 180, "the restart")
    ready_s = time.perf_counter() - started
    usage = turn("And one more fact.")
    warm = usage.get("cached_tokens", usage.get("cache_n")) or 0
    print(f"4. warm restart: turn 5 prompt {previous_prompt}, after stop+start cached {warm} "
          f"(ratio {warm / previous_prompt:.3f}, goal >= 0.95); restart to ready {ready_s:.1f} s")
    actions.do_stop(fresh(), user)


# --- goals of the turn's own cost: first token, idle stack, CPU per token --------------------------

TTFT_RUNS = 10
TTFT_PROMPT = "Say hello in one short sentence."
TTFT_MAX_TOKENS = 8
IDLE_SECONDS = 20
#: ``--profile DIR``: goal 2 records each process with py-spy over its measurement into DIR.
PROFILE_DIR = Path(sys.argv[sys.argv.index("--profile") + 1]) if "--profile" in sys.argv[1:-1] else None


class Page:
    """An open session page's websockets: the session's (its messages, with the time each
    came, in :attr:`messages`) and the attention socket every page opens."""

    def __init__(self, port: int, session_id: int, cookie: str, after: int) -> None:
        import queue

        from websockets.sync.client import connect

        headers = {"Cookie": cookie, "Origin": f"http://127.0.0.1:{port}"}
        self.messages: queue.Queue = queue.Queue()
        self.socket = connect(f"ws://127.0.0.1:{port}/ws/sessions/{session_id}/?after={after}",
                              additional_headers=headers)
        self.attention = connect(f"ws://127.0.0.1:{port}/ws/attention/", additional_headers=headers)
        self.threads = [threading.Thread(target=self._read, args=(ws, ws is self.socket), daemon=True)
                        for ws in (self.socket, self.attention)]
        for thread in self.threads:
            thread.start()

    def _read(self, ws, keep: bool) -> None:
        try:
            for raw in ws:
                if keep:
                    self.messages.put((time.perf_counter(), json.loads(raw)))
        except Exception:  # closed
            return

    def drain(self) -> None:
        while not self.messages.empty():
            self.messages.get_nowait()

    def wait(self, found, timeout: float = 300.0) -> float:
        """The time the first message for which ``found(message)`` holds came."""
        deadline = time.monotonic() + timeout
        while True:
            at, message = self.messages.get(timeout=max(0.1, deadline - time.monotonic()))
            if found(message):
                return at

    def close(self) -> None:
        self.socket.close()
        self.attention.close()


def reply_text_shown(message: dict) -> bool:
    """Whether a page message shows an assistant block's text (its id ``a-<seq>``)."""
    return any(op.get("op") in ("text", "tail", "append")
               and (str(op.get("id", "")).startswith("a-") or 'id="a-' in op.get("html", "")[:200])
               for op in message.get("ops", []))


def turn_ended(message: dict) -> bool:
    return any(op.get("op") == "status" and op.get("status") == "idle" for op in message.get("ops", []))


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def thread_wakeups(pids: dict[str, int]) -> dict[str, int]:
    """``<process> <tid> <thread name>`` → its voluntary context switches so far (each a
    wake-up after a wait), from ``/proc/<pid>/task/*/status``."""
    found = {}
    for name, pid in pids.items():
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines()
                              if ":\t" in line)
            except OSError:
                continue
            found[f"{name} {task.name} {status['Name'].strip()}"] = int(status["voluntary_ctxt_switches"])
    return found


def idle_goal(stack: Stack, session, port: int, cookie: str) -> list[str]:
    """2. The stack's CPU while nothing streams and two session pages are open (their
    sockets: the session's and the attention socket each), per second."""
    from sessions_app.models import AgentSession

    after = AgentSession.objects.get(pk=session.pk).last_seq
    pages = [Page(port, session.pk, cookie, after) for _ in range(2)]
    try:
        stack.settle()
        profiles = Profiles({k: v for k, v in stack.pids().items() if k != "redis"}, PROFILE_DIR, IDLE_SECONDS) if PROFILE_DIR else None
        switches = thread_wakeups(stack.pids())
        before = stack.cpu_seconds()
        time.sleep(IDLE_SECONDS)
        spent = cpu_spent(before, stack.cpu_seconds())
        if profiles is not None:
            print("\n".join(profiles.summaries()), flush=True)
            after = thread_wakeups(stack.pids())
            print("wake-ups per second by thread (voluntary context switches):")
            for key, count in sorted(after.items(), key=lambda item: -(item[1] - switches.get(item[0], 0))):
                if count - switches.get(key, 0):
                    print(f"   {(count - switches.get(key, 0)) / IDLE_SECONDS:6.2f}  {key}")
    finally:
        for page in pages:
            page.close()
    total = sum(spent.values()) / IDLE_SECONDS * 1000
    return [f"goal 2. idle stack, 2 pages open, {IDLE_SECONDS} s: {total:.1f} ms CPU per second  (goal <= 3)",
            "   by process: " + ", ".join(f"{k} {v / IDLE_SECONDS * 1000:.1f}" for k, v in spent.items())]


def first_token_goal(session, user, port: int, cookie: str, base_url: str, api_key: str) -> list[str]:
    """1. Time to first token: from the POST of a message to the page showing the reply's
    first text, against a client sending the same request to the same llama-server itself
    (to its first ``content`` chunk). Same conversation each time (cleared before each
    turn), warm prompt cache; the two run in separate phases, since each would evict the
    other's prefix from the server's one slot. TTFT_RUNS each, after one unmeasured."""
    import re

    from sessions_app import actions, agent
    from sessions_app.completions import CompletionClient
    from sessions_app.events import load_events
    from sessions_app.models import AgentSession

    AgentSession.objects.filter(pk=session.pk).update(
        sampling={"temperature": 0, "seed": SEED, "max_tokens": TTFT_MAX_TOKENS})
    name, _, value = cookie.partition("=")
    web = httpx.Client(base_url=f"http://127.0.0.1:{port}", cookies={name: value}, timeout=60)  # + csrftoken
    page_html = web.get(f"/sessions/{session.pk}/").text
    csrf = re.search(r'"X-CSRFToken": "([^"]+)"', page_html).group(1)
    headers = {"X-CSRFToken": csrf, "HX-Request": "true", "Origin": f"http://127.0.0.1:{port}",
               "Referer": f"http://127.0.0.1:{port}/sessions/{session.pk}/"}
    page = Page(port, session.pk, cookie, AgentSession.objects.get(pk=session.pk).last_seq)
    corral = []
    try:
        for run in range(TTFT_RUNS + 1):
            actions.do_clear(AgentSession.objects.get(pk=session.pk), user)
            time.sleep(0.3)
            page.drain()
            started = time.perf_counter()
            answer = web.post(f"/sessions/{session.pk}/send/", data={"text": TTFT_PROMPT}, headers=headers)
            assert answer.status_code == 200, answer.status_code
            shown = page.wait(reply_text_shown)
            page.wait(turn_ended)
            if run:
                corral.append((shown - started) * 1000)
    finally:
        page.close()
    # The same request, as the step built it for the last turn (its events up to its message).
    events = load_events(session.pk)
    taken = max(i for i, e in enumerate(events) if e.kind == "message_taken")
    request = agent.request_for(AgentSession.objects.select_related("machine").get(pk=session.pk),
                                events[:taken + 1])
    body = CompletionClient(base_url).request_body(request.messages, tools=request.definitions,
                                                   sampling=request.sampling)
    direct = []
    for run in range(TTFT_RUNS + 1):
        started = time.perf_counter()
        first = None
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {api_key}"}) as response:
            for line in response.iter_lines():
                if first is None and line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        first = time.perf_counter()
        if run:
            direct.append((first - started) * 1000)
    p50 = statistics.median(corral) - statistics.median(direct)
    p95 = percentile(corral, 95) - percentile(direct, 95)
    return [f"goal 1. time to first token, {TTFT_RUNS} turns each: Corral p50 {statistics.median(corral):.0f} ms, "
            f"p95 {percentile(corral, 95):.0f} ms; direct p50 {statistics.median(direct):.0f} ms, "
            f"p95 {percentile(direct, 95):.0f} ms",
            f"   Corral adds p50 {p50:.0f} ms  (goal <= 30), p95 {p95:.0f} ms  (goal <= 60)"]


def cpu_per_token_goal(stack: Stack, session, user, port: int, cookie: str, watchers: int) -> str:
    """3. Corral's CPU per streamed token (all its processes, idle cost included) over a
    MAX_TOKENS reply watched by ``watchers`` pages; median of RUNS."""
    from sessions_app import actions
    from sessions_app.models import AgentSession, TranscriptEvent

    AgentSession.objects.filter(pk=session.pk).update(
        sampling={"temperature": 0, "seed": SEED, "max_tokens": MAX_TOKENS})
    results = []
    for _run in range(RUNS):
        actions.do_clear(AgentSession.objects.get(pk=session.pk), user)
        after = AgentSession.objects.get(pk=session.pk).last_seq
        pages = [Page(port, session.pk, cookie, after) for _ in range(watchers)]
        profiles = None
        try:
            stack.settle()
            if PROFILE_DIR is not None and _run == 0:  # the first run of each, recorded by py-spy
                profiles = Profiles({k: stack.pids()[k] for k in ("web", "worker-turns")},
                                    PROFILE_DIR / f"goal3-{watchers}", 600, rate=1000)
            before = stack.cpu_seconds()
            actions.do_send_message(AgentSession.objects.get(pk=session.pk), user, PROMPT)
            for page in pages:
                page.wait(turn_ended, timeout=1200)
            cpu = cpu_spent(before, stack.cpu_seconds())
        finally:
            for page in pages:
                page.close()
            if profiles is not None:
                profiles.stop()
                print("\n".join(profiles.summaries(25)), flush=True)
        usage = TranscriptEvent.objects.filter(session=session, kind="usage").last().payload
        results.append((sum(cpu.values()) / usage["completion_tokens"] * 1000, cpu, usage))
    results.sort(key=lambda r: r[0])
    ms, cpu, usage = results[len(results) // 2]
    tokens = usage["completion_tokens"]
    return (f"goal 3. CPU per streamed token, {watchers} watcher{'s' if watchers > 1 else ''}: {ms:.2f} ms  "
            f"(goal <= 0.3; llama-server at {usage.get('predicted_per_second', 0):.0f} tok/s, {tokens} tokens; "
            + ", ".join(f"{k} {v / tokens * 1000:.2f}" for k, v in cpu.items()) + ")")


def turn_goals(stack, session, user, port, cookie, base_url, api_key) -> None:
    """Print goals 1-3 (the turn's own cost), each measured against its goal."""
    print(*idle_goal(stack, session, port, cookie), sep="\n", flush=True)
    print(*first_token_goal(session, user, port, cookie, base_url, api_key), sep="\n", flush=True)
    for watchers in (1, 2):
        print(cpu_per_token_goal(stack, session, user, port, cookie, watchers), flush=True)


if __name__ == "__main__":
    main()

"""The turns worker's own CPU per streamed token, measured in this process (goal 3 of
bench/run.py, its ``worker-turns`` part).

    .venv/bin/python bench/turn_step.py [--rate 140] [--tokens 400] [--turns 3] [--profile FILE]

Starts a stack (bench/_setup.py) with the fixed-rate stand-in (bench/rate_server.py) as
the session's llama-server, then stops the stack's turns worker and runs each turn's step
here (``agent.run_turn_step``), as the worker's thread would: the step's CPU (this
process's CPU-time clock, all its threads: the stream's, the interrupt watcher's, the
lease keeper's) over the tokens streamed, without the worker's start-up or the rest of
the box in the numbers. ``--profile FILE`` writes a cProfile of the steps' own thread
(``pstats``, wall-clock: a sleep shows as the call that sleeps) and prints its top; for
where the CPU goes, sample it instead: ``py-spy record --rate 1000 --nonblocking --format
raw -o FILE -- .venv/bin/python bench/turn_step.py``, then read the stacks under
``run_turn_step`` and ``watch_interrupt``. Printed too: the Redis commands per 100 tokens
(Redis's own INFO commandstats, before and after each turn) and the events the turn stored.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import subprocess
import time
from pathlib import Path

from _setup import Stack, boot
from stand_in import stand_in_machine

DATA = boot("corral-turn-step-")

from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402


def redis_calls() -> dict[str, int]:
    """Redis's calls per command so far (INFO commandstats)."""
    import redis
    from django.conf import settings

    stats = redis.Redis.from_url(settings.REDIS_URL).info("commandstats")
    return {name.removeprefix("cmdstat_"): value["calls"] for name, value in stats.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=140.0)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--profile")
    parser.add_argument("--read-every", type=float, help="seconds between two reads of the stream (an experiment)")
    args = parser.parse_args()
    os.environ["RATE_TOKENS_PER_SECOND"] = str(args.rate)
    print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    call_command("migrate", verbosity=0)
    from sessions_app import actions, agent
    from sessions_app.models import AgentSession, TranscriptEvent
    from sessions_app.servers.stop import stop_server

    if args.read_every is not None:
        from sessions_app.agent import completion
        completion.READ_EVERY = args.read_every
    machine, model_key = stand_in_machine(DATA)
    script = Path(machine.llama_server_path)  # the servers worker starts it without this process's environment
    script.write_text(script.read_text().replace("exec ", f"RATE_TOKENS_PER_SECOND={args.rate:g} exec ", 1))
    user = get_user_model().objects.create_user("step", password="step-password-1")
    stack = Stack(DATA, 17500 + os.getpid() % 400)
    try:
        session = actions.do_create_session(user, machine=machine, model_key=model_key, working_dir=str(DATA),
                                            server_params={}, sampling={"max_tokens": args.tokens},
                                            permission_mode="manual")
        deadline = time.monotonic() + 300
        while AgentSession.objects.get(pk=session.pk).status != "idle":
            if time.monotonic() > deadline:
                raise SystemExit("timed out waiting for the stand-in to start")
            time.sleep(0.2)
        turns_worker = stack.procs.pop("worker-turns")
        turns_worker.terminate()
        turns_worker.wait(30)
        profile = cProfile.Profile() if args.profile else None
        results = []
        for _ in range(args.turns):
            actions.do_clear(AgentSession.objects.get(pk=session.pk), user)
            actions.do_send_message(AgentSession.objects.get(pk=session.pk), user, "go")
            after = AgentSession.objects.get(pk=session.pk).last_seq
            redis_before = redis_calls()
            cpu, wall = time.process_time(), time.monotonic()
            if profile is not None:
                profile.enable()
            agent.run_turn_step(session.pk)
            if profile is not None:
                profile.disable()
            cpu, wall = time.process_time() - cpu, time.monotonic() - wall
            redis_after = redis_calls()
            events = list(TranscriptEvent.objects.filter(session_id=session.pk, seq__gt=after).order_by("seq"))
            texts = [e for e in events if e.kind == "assistant_text"]
            text = "".join(e.payload["text"] for e in texts)
            tokens = text.count("@")
            assert tokens == args.tokens, (tokens, [e.kind for e in events])
            publish = redis_after.get("publish", 0) - redis_before.get("publish", 0)
            commands = sum(redis_after.values()) - sum(redis_before.values()) - 1  # less the INFO itself
            results.append((cpu / tokens * 1000, wall))
            diff = {k: v - redis_before.get(k, 0) for k, v in redis_after.items() if v - redis_before.get(k, 0)}
            print(f"  Redis commands: {diff}")
            print(f"turn: {cpu * 1000:.0f} ms CPU over {wall:.2f} s = {cpu / tokens * 1000:.3f} ms/token; "
                  f"Redis {commands / tokens * 100:.1f} commands (publish {publish / tokens * 100:.1f}) per 100 "
                  f"tokens; {len(events)} events stored ({len(texts)} assistant_text)", flush=True)
        results.sort()
        print(f"median: {results[len(results) // 2][0]:.3f} ms/token of the step's CPU at {args.rate:g} tok/s")
        if profile is not None:
            profile.dump_stats(args.profile)
            stats = pstats.Stats(args.profile)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(40)
    finally:
        stack.stop()
        for session_id in AgentSession.objects.values_list("pk", flat=True):
            stop_server(session_id)


if __name__ == "__main__":
    main()

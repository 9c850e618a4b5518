"""Run by tests/test_db_cut.py in a process of its own, on a PostgreSQL database of its own
(``DATABASE_URL``): a real turn step whose database backend is terminated
(``pg_terminate_backend``, from another connection) while the reply streams.

``python -m tests.db_cut_step WORKDIR MODELS_DIR``: migrates, makes a machine whose
llama-server is the stand-in (tests/fake_llama_server.py, a scripted slow reply), starts
its server, sends a message and runs the step in a thread. At the step's first streamed
text the step's own backend pid is read on its connection; this process's main thread
terminates that backend from a plain psycopg connection, then lets the step go on. Once
the step has returned, a second message is sent and run (the turn after a cut must work).
Prints one JSON line: what the transcript and the session row hold after each step.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

WORDS = " ".join(f"word{i}" for i in range(60))


def fake_server(directory: Path, script: list) -> str:
    path = directory / "script.json"
    path.write_text(json.dumps(script))
    wrapper = directory / "fake-llama-server"
    fake = Path(__file__).resolve().parent / "fake_llama_server.py"
    wrapper.write_text(f"#!/bin/sh\nexport FAKE_SCRIPT={path}\nexec {sys.executable} {fake} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


def main(workdir: Path, models_dir: str) -> None:
    from project import data_dir

    data_dir.prepare(Path(os.environ["CORRAL_DATA_DIR"]))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    import psycopg
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection

    from machines_app import catalog
    from machines_app.models import Machine
    from sessions_app import actions, agent, dispatch
    from sessions_app.models import AgentSession, TranscriptEvent
    from sessions_app.servers.start import start_server
    from sessions_app.servers.stop import stop_server

    call_command("migrate", verbosity=0)
    # The steps run here, and only here: nothing reaches a broker another worker reads.
    dispatch.enqueue = lambda task, *args: True

    alice = get_user_model().objects.create_user("alice", password="pw-alice-1")
    machine = Machine.objects.create(
        name="fake", models_dir=models_dir, workspace_roots="",
        llama_server_path=fake_server(workdir, [{"text": WORDS, "delay": 0.05}, {"text": "the second answer"}]),
    )
    catalog.refresh_models(machine)
    key = machine.model_files.get(architecture="llama").key
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key=key, working_dir=str(workdir),
                                          status=AgentSession.Status.LOADING)
    start_server(session.pk)

    step_backend: list[int] = []
    cut = threading.Event()
    first_tail = agent.Step.tail

    def tail(self, kind, text, after):
        if not step_backend:
            with connection.cursor() as cursor:  # the step's own connection, on its thread
                cursor.execute("SELECT pg_backend_pid()")
                step_backend.append(cursor.fetchone()[0])
            cut.wait(30)
            # The step's next read is a plain query outside any transaction (the look for
            # an interrupt between tool calls is one): Django does not reconnect after it
            # fails, so whatever the step does next meets the dead connection again.
            self.interrupted()
        return first_tail(self, kind, text, after)

    agent.Step.tail = tail

    def run_step() -> dict:
        done = threading.Event()
        threading.Thread(target=lambda: (agent.run_turn_step(session.pk, worker="turns@dbcut"), done.set()),
                         daemon=True).start()
        return done

    actions.do_send_message(AgentSession.objects.get(pk=session.pk), alice, "first")
    done = run_step()
    deadline = time.monotonic() + 60
    while not step_backend and time.monotonic() < deadline:
        time.sleep(0.05)
    db = settings.DATABASES["default"]
    with psycopg.connect(host=db["HOST"], port=db["PORT"] or 5432, user=db["USER"], dbname=db["NAME"],
                         password=db.get("PASSWORD") or None, autocommit=True) as killer:
        terminated = killer.execute("SELECT pg_terminate_backend(%s)", (step_backend[0],)).fetchone()[0]
    cut.set()
    finished = done.wait(120)

    def state() -> dict:
        row = AgentSession.objects.get(pk=session.pk)
        return {
            "events": [[e.kind, e.payload] for e in TranscriptEvent.objects.filter(session=session).order_by("seq")],
            "lease_owner": row.lease_owner, "turn_active": row.turn_active, "status": row.status,
        }

    after_cut = {"terminated": terminated, "finished": finished, **state()}
    actions.do_send_message(AgentSession.objects.get(pk=session.pk), alice, "second")
    second_done = run_step().wait(120)
    print(json.dumps({"after_cut": after_cut, "second_finished": second_done, "after_second": state()}))
    stop_server(session.pk)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])

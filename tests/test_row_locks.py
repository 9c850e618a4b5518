"""Row locks never deadlock with foreign-key checks (PostgreSQL).

CI met a real deadlock: a member changed a session's setting (the session row locked,
written twice, its keys checked at commit) while a start was admitted on the session's
machine (the machine row locked, then a memory claim pointing at the session written).
Each transaction held one row while its foreign-key check asked for a share of the
other's. Corral's row locks are ``FOR NO KEY UPDATE``: they serialise writers and let key
checks through (sessions_app.events.locked).
"""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction

from machines_app.models import Machine
from sessions_app.events import locked
from sessions_app.models import AgentSession
from sessions_app.room import lock_machine

from .conftest import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def _waiting_on_a_lock() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                       "AND datname = current_database()")
        return cursor.fetchone()[0]


def test_a_setting_changed_while_a_start_is_admitted_on_its_machine_does_not_deadlock(
        django_user_model, tmp_path):
    if connection.vendor != "postgresql":
        pytest.skip("row locks and foreign-key checks are PostgreSQL's (SQLite locks the whole file)")
    owner = django_user_model.objects.create(username="alice")
    machine = Machine.objects.create(name="m", models_dir=str(tmp_path))
    session = AgentSession.objects.create(owner=owner, machine=machine, model_key="m.gguf",
                                          working_dir=str(tmp_path), status="idle")
    session_held, machine_held, admitted = threading.Event(), threading.Event(), []
    errors: list[BaseException] = []

    def setting() -> None:  # as actions._change_setting, then one more write of the row
        try:
            with transaction.atomic():
                locked(session.pk)
                AgentSession.objects.filter(pk=session.pk).update(visibility="team_watch")
                # A second write of a row this transaction wrote: PostgreSQL checks its
                # foreign keys (the machine's among them) at commit whatever changed.
                AgentSession.objects.filter(pk=session.pk).update(title="renamed")
                session_held.set()
                machine_held.wait(30)
                wait_for(lambda: _waiting_on_a_lock() >= 1, 30, what="the admission to wait for the session")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    def admission() -> None:  # as room.admit: the machine first, then a row about the session
        try:
            session_held.wait(30)
            with transaction.atomic():
                lock_machine(machine.pk)
                machine_held.set()
                locked(session.pk)
                admitted.append(True)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=setting), threading.Thread(target=admission)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert errors == [] and admitted == [True]
    assert AgentSession.objects.get(pk=session.pk).visibility == "team_watch"

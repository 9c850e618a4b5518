"""A turn step whose database connection is cut mid-reply.

Real PostgreSQL is needed even when the suite runs on SQLite: the cut is
``pg_terminate_backend`` on the step's own backend, from another connection, at the
step's first streamed text. The step runs in a process of its own on a database of its
own, ``corral_dbcut`` (tests/db_cut_step.py), created afresh on the server named by
``CORRAL_TEST_POSTGRES`` (default ``postgres://postgres@127.0.0.1:5432``, trust login).
Without a PostgreSQL server there, this test fails: it does not skip.

It used to fail its error handling and its lease release on the same dead connection:
the page stayed ``running`` until the lease lapsed (~1 min), then blamed a worker that
never stopped. Now the step reconnects, ends the turn in words and lets go of the lease
before it returns, and the next message is answered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from urllib.parse import urlsplit

import psycopg
from django.conf import settings

from sessions_app import agent

from .conftest import ROOT

SERVER = os.environ.get("CORRAL_TEST_POSTGRES", "postgres://postgres@127.0.0.1:5432")
DATABASE = "corral_dbcut"


def _fresh_database() -> str:
    url = urlsplit(SERVER)
    with psycopg.connect(host=url.hostname, port=url.port or 5432, user=url.username or "postgres",
                         password=url.password, dbname="postgres", autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {DATABASE}")
    return f"{SERVER.rstrip('/')}/{DATABASE}"


def test_a_step_whose_database_connection_is_cut_ends_its_turn_in_words_and_lets_go(tmp_path, real_models_dir):
    env = {**os.environ, "DATABASE_URL": _fresh_database(), "CORRAL_DATA_DIR": str(tmp_path / "data"),
           "SECRET_KEY": settings.SECRET_KEY, "REDIS_URL": settings.REDIS_URL, "CORRAL_LEASE_SECONDS": "60",
           "CORRAL_STOP_GRACE": "2"}
    work = tmp_path / "work"
    work.mkdir()
    result = subprocess.run([sys.executable, "-m", "tests.db_cut_step", str(work), str(real_models_dir)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])

    cut = report["after_cut"]
    assert cut["terminated"] is True and cut["finished"] is True
    # The turn is over, in words, and the lease handed back: nothing waits for it to lapse.
    assert cut["lease_owner"] == "" and cut["turn_active"] is False and cut["status"] == "idle", cut
    errors = [payload["message"] for kind, payload in cut["events"] if kind == "error"]
    assert errors == [agent.DATABASE_LOST], errors
    assert [payload["reason"] for kind, payload in cut["events"] if kind == "turn_end"] == ["error"]
    assert not any(kind == "notice" for kind, _ in cut["events"])  # no worker blamed

    # The next message is taken and answered as usual.
    assert report["second_finished"] is True
    second = report["after_second"]
    assert [payload["reason"] for kind, payload in second["events"] if kind == "turn_end"] == ["error", "done"]
    replies = [payload["text"] for kind, payload in second["events"] if kind == "assistant_text"]
    assert "".join(replies).endswith("the second answer"), replies  # stored in fragments
    assert second["lease_owner"] == "" and second["turn_active"] is False

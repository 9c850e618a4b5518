"""A frozen llama-server (SIGSTOP: its pid still there, nothing answers) ends in words in
bounded time: the watch asks it ``GET /health`` within ``CORRAL_HEALTH_TIMEOUT`` and the
session shows ``unknown`` with a sentence, back to ``idle`` once it answers again; a
reply's stream that sends nothing for ``CORRAL_STREAM_IDLE_SECONDS`` is abandoned with a
sentence, not after the 30-minute cap. Real llama-server, real worker and its rounds."""

from __future__ import annotations

import os
import signal

import pytest

from machines_app.llama_server import Endpoint, does_not_answer
from sessions_app.completions import CompletionClient, CompletionError
from sessions_app.servers.models import ServerRecord
from sessions_app.servers.records import server_endpoint
from sessions_app.servers.watch import check_session_server

from .conftest import wait_for
from .helpers import converse_once, fresh, idle_seeded_session

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]


def test_a_frozen_server_is_unknown_in_words_and_idle_again_once_it_answers(stack, local_machine, alice, tmp_path,
                                                                            settings):
    session = idle_seeded_session(local_machine, alice, tmp_path)
    converse_once(session, alice, "Hello.")
    record = ServerRecord.objects.get(session=session)
    endpoint = server_endpoint(fresh(session))
    assert not does_not_answer(endpoint, 5)
    settings.CORRAL_HEALTH_TIMEOUT = 1.0
    os.kill(record.pid, signal.SIGSTOP)
    try:
        assert does_not_answer(endpoint, 1)
        # A reply asked of it now: abandoned after the idle bound, in words.
        client = CompletionClient(endpoint.url, api_key=endpoint.api_key, idle_timeout=2)
        with pytest.raises(CompletionError, match="llama-server sent nothing for 2 seconds"):
            list(client.stream([{"role": "user", "content": "Still there?"}]))
        check_session_server(session.pk)
        assert fresh(session).status == "unknown"
        errors = [e.payload["message"] for e in fresh(session).events.filter(kind="error")]
        assert any("llama-server does not answer" in m and "frozen" in m for m in errors), errors
        assert ServerRecord.objects.filter(session=session, pid=record.pid).exists()  # not taken for dead
    finally:
        os.kill(record.pid, signal.SIGCONT)
    wait_for(lambda: (check_session_server(session.pk), fresh(session).status)[1] == "idle", 30,
             what="idle again once it answers")


def test_a_refused_connection_is_not_called_frozen():
    """Nothing listening: the process check explains that (exited), not the health bound."""
    assert not does_not_answer(Endpoint("http://127.0.0.1:9"), 1)

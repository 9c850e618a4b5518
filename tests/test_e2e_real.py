"""The real path end to end.

Real llama-server on the SmolLM2 GGUF, started by the product's Celery task in a real
worker, real Redis, the test database, daphne serving a real websocket.
"""

from __future__ import annotations

import pytest
from django.test import Client

from sessions_app.models import AgentSession, TranscriptEvent

from .conftest import WSRecorder, model_key, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]


def status_of(session: AgentSession) -> str:
    return AgentSession.objects.values_list("status", flat=True).get(pk=session.pk)


def turn_ended(session: AgentSession) -> bool:
    return TranscriptEvent.objects.filter(session=session, kind="turn_end").exists()


def test_it_streams_a_real_reply_into_the_transcript_and_the_websocket(stack, local_machine, alice, tmp_path):
    client = Client()
    client.force_login(alice)
    response = client.post(
        "/sessions/new/",
        {
            "machine": local_machine.pk,
            "model_key": model_key(local_machine, "llama"),
            "working_dir": str(tmp_path),
            "permission_mode": "manual",
            "speculative": "auto",
            "contextSize": 2048,
            "max_tokens": 40,
            "temperature": 0,
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    session = AgentSession.objects.get(owner=alice)
    wait_for(lambda: status_of(session) == "idle", 120, what="the session to become idle")

    ws = WSRecorder(
        stack.ws_url(session.pk, after=0),
        cookie=f"sessionid={client.cookies['sessionid'].value}",
        origin=stack.base_url,
    )
    try:
        response = client.post(f"/sessions/{session.pk}/send/", {"text": "Say hello to the team in one sentence."})
        assert response.status_code == 200
        wait_for(lambda: turn_ended(session), 120, what="the turn to end")

        events = list(TranscriptEvent.objects.filter(session=session).order_by("seq"))
        kinds = [e.kind for e in events]
        assert "message_taken" in kinds
        reply = "".join(e.payload["text"] for e in events if e.kind == "assistant_text")
        assert reply.strip(), f"empty reply; transcript kinds: {kinds}"
        assert kinds.count("assistant_text") > 1, "the reply should arrive as several streamed fragments"
        usage = next(e.payload for e in events if e.kind == "usage")
        assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
        assert isinstance(usage["seed"], int)
        assert usage.get("predicted_per_second", 0) > 0
        assert not [e for e in events if e.kind == "error"]

        last = events[-1].seq
        wait_for(lambda: ws.seqs and ws.seqs[-1] >= last, 20, what="the websocket to catch up")
        assert ws.seqs == list(range(1, ws.seqs[-1] + 1)), "websocket events out of order, missing or doubled"
        streamed = "".join(
            op["text"] for m in ws.messages for op in m["ops"] if op["op"] == "text"
        )
        assert streamed and streamed in reply
        assert status_of(session) == "idle"
    finally:
        ws.close()

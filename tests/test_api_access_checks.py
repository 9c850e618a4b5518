"""The checks that end an API request under way (api_app.views: _Access, _held, _relay):
what happens when the check itself fails, and when access was found lost just before the
request went to llama-server. llama-server is stood in for by an httpx transport that
answers after a delay (a non-streamed reply comes back whole, late); the rest is the
view's own code."""

from __future__ import annotations

import asyncio
import json
import types
from typing import Any

import httpx
from django.db import OperationalError

from api_app import serving, views
from api_app.serving import ApiError
from machines_app.llama_server import Endpoint
from usage_app import quota

ANSWER = {"choices": [{"message": {"role": "assistant", "content": "hello"}}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def _slow_server(monkeypatch, seconds: float, sent: list[bytes]) -> None:
    async def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.content)
        await asyncio.sleep(seconds)
        return httpx.Response(200, json=ANSWER)

    monkeypatch.setattr(views, "_client", lambda: httpx.AsyncClient(transport=httpx.MockTransport(answer)))


def _quiet_bookkeeping(monkeypatch, finished: list) -> None:
    """The lease, the hold and the usage row, noted instead of written."""
    monkeypatch.setattr(serving, "renew", lambda session_id: None)
    monkeypatch.setattr(quota, "renew_hold", lambda hold: None)
    monkeypatch.setattr(serving, "finished", lambda session_id: finished.append(("finished", session_id)))
    monkeypatch.setattr(views, "_request_finished",
                        lambda user, model, usage, seconds, timings=None, hold=None:
                        finished.append(("usage", usage, hold)))


def _relay(access: views._Access):
    user: Any = types.SimpleNamespace()
    model: Any = types.SimpleNamespace()
    return views._relay(user, model, 7, 11, Endpoint("http://llama.invalid"), b"{}", stream=False, access=access)


def test_a_failing_access_check_does_not_fail_a_request_that_was_answered(monkeypatch):
    """The access check reads the database every ACCESS_CHECK_SECONDS; a read that fails
    (the database restarting, the connection cut: CASES C66c) must not turn a reply that
    llama-server wrote whole into a 500 with nothing counted and the lease and the hold
    left behind. Found: the renewing task dies with the error, renewals and checks stop,
    and _held's exit re-raises it (only CancelledError is suppressed)."""
    monkeypatch.setattr(views, "ACCESS_CHECK_SECONDS", 0.1)
    sent: list[bytes] = []
    finished: list = []
    _slow_server(monkeypatch, 0.6, sent)
    _quiet_bookkeeping(monkeypatch, finished)
    failures = []

    def access_lost(key_id, machine_id):
        failures.append(1)
        if len(failures) == 1:
            raise OperationalError("terminating connection due to administrator command")
        return None

    monkeypatch.setattr(serving, "access_lost", access_lost)
    response = asyncio.run(_relay(views._Access(1, 2)))
    assert response.status_code == 200, response.content
    assert json.loads(response.content) == ANSWER
    assert ("finished", 7) in finished and ("usage", ANSWER["usage"], 11) in finished, finished
    assert len(failures) >= 2, "the checks stopped after the first one failed"


def test_access_found_lost_as_the_server_became_ready_is_not_served(monkeypatch):
    """The check runs beside the wait for the server (both through the request's one
    database thread). When its read finds the key revoked while the wait's next look at
    the server is queued behind it, ``lost`` is set after the wait looked at it and the
    wait returns the ready endpoint. Found: the request is sent anyway, and every later
    check returns at once because ``lost`` is already set, so the client is never closed:
    the reply is served whole to a revoked key. Forced here: the check's read takes 0.3 s
    and the server is ready from the moment it began."""
    import time

    from django.test import AsyncRequestFactory

    monkeypatch.setattr(views, "ACCESS_CHECK_SECONDS", 0.1)
    monkeypatch.setattr(views, "POLL_SECONDS", 0.05)
    sent: list[bytes] = []
    finished: list = []
    _slow_server(monkeypatch, 0.3, sent)
    _quiet_bookkeeping(monkeypatch, finished)
    released: list = []
    model = types.SimpleNamespace(machine=types.SimpleNamespace(name="gpu1"), machine_id=2, key="smol.gguf")
    key = types.SimpleNamespace(pk=1, user=types.SimpleNamespace())

    async def key_of(request):
        return key

    checked = []

    def access_lost(key_id, machine_id):
        checked.append(time.monotonic())
        time.sleep(0.3)
        return ApiError(401, "invalid_api_key", "This API key ('x', corral-abcde…) was revoked.")

    monkeypatch.setattr(views, "_key_of", key_of)
    monkeypatch.setattr(serving, "resolve", lambda user, wanted: model)
    monkeypatch.setattr(quota, "reserve", lambda user: (11, None))
    monkeypatch.setattr(quota, "release", lambda hold: released.append(hold))
    monkeypatch.setattr(serving, "claim", lambda user, model: (7, 0))
    monkeypatch.setattr(serving, "server_state", lambda session_id, after: serving.ServerState(
        endpoint=Endpoint("http://llama.invalid") if checked else None))
    monkeypatch.setattr(serving, "access_lost", access_lost)
    request = AsyncRequestFactory().post("/v1/chat/completions", {"model": "gpu1/smol", "messages": [
        {"role": "user", "content": "Hi"}]}, content_type="application/json")
    response = asyncio.run(views.chat_completions(request))
    assert checked, "the check never ran"
    assert response.status_code == 401, (response.status_code, response.content, sent)
    assert json.loads(response.content)["error"]["message"].startswith("Corral ended this request: ")
    assert not sent, "the request went to llama-server after its access was found lost"
    assert released == [11] and ("finished", 7) in finished


def test_a_request_on_a_machine_deleted_meanwhile_is_counted_and_its_hold_dropped(transactional_db, alice):
    """The machine is deleted while a request on it is served (access_lost then ends the
    request: 403 "removed from Corral"). Its usage row keeps the machine's name
    (UsageRecord.machine is SET_NULL: rows outlive machines) and the request's hold is
    dropped. Found: the row is written with the deleted machine's id, the deferred foreign
    key fails the transaction at commit (IntegrityError), and the hold's release, in the
    same transaction, is rolled back with it: usage lost, hold left until it lapses, and
    the error escapes the stream's clean-up."""
    from django.db import IntegrityError

    from machines_app.models import Machine, ModelFile
    from usage_app.models import Hold, Quota, UsageRecord

    machine = Machine.objects.create(name="gpu-gone", models_dir="/nonexistent", workspace_roots="")
    model = ModelFile.objects.create(machine=machine, key="smol.gguf", display_name="Smol")
    model = ModelFile.objects.select_related("machine").get(pk=model.pk)  # as the request holds it
    Quota.objects.create(user=alice, tokens_per_day=10**9)
    hold, _ = quota.reserve(alice)
    assert hold is not None
    assert serving.access_lost(0, machine.pk) is not None  # (no key 0: 401, as for any deleted key)
    Machine.objects.filter(pk=machine.pk).delete()
    try:
        views._request_finished(alice, model, {"prompt_tokens": 5, "completion_tokens": 7}, 1.0, None, hold)
    except IntegrityError as exc:
        raise AssertionError(f"the request's end failed: {exc}") from None
    row = UsageRecord.objects.get(member=alice)
    assert (row.machine_id, row.machine_name, row.completion_tokens) == (None, "gpu-gone", 7)
    assert not Hold.objects.filter(pk=hold).exists()


def test_a_request_of_an_account_deleted_meanwhile_is_counted_under_its_name(transactional_db, alice):
    """The account is deleted while its request is served (its keys go with it:
    access_lost ends the request, 401). The usage row names the account, as a session's
    rows of a deleted account do (member None, member_name)."""
    from machines_app.models import Machine, ModelFile
    from usage_app.models import UsageRecord

    machine = Machine.objects.create(name="gpu1", models_dir="/nonexistent", workspace_roots="")
    model = ModelFile.objects.select_related("machine").get(
        pk=ModelFile.objects.create(machine=machine, key="smol.gguf", display_name="Smol").pk)
    type(alice).objects.filter(pk=alice.pk).delete()
    views._request_finished(alice, model, {"prompt_tokens": 5, "completion_tokens": 7}, 1.0, None, None)
    row = UsageRecord.objects.get()
    assert (row.member_id, row.member_name, row.machine_id, row.completion_tokens) == (None, "alice", machine.pk, 7)


def test_access_lost_while_a_non_streamed_reply_is_written_ends_it_within_the_check(monkeypatch):
    """A non-streamed request: llama-server sends nothing until the whole reply is written.
    The access is lost meanwhile; the check closes the request's client, which breaks off
    the wait for the headers (a real socket here: a server that reads the request and then
    says nothing for 5 s), and the client gets the refusal, not a 500 or the reply."""
    import time

    async def scenario():
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            await asyncio.sleep(5)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            user: Any = types.SimpleNamespace()
            model: Any = types.SimpleNamespace()
            began = time.monotonic()
            response = await views._relay(user, model, 7, 11, Endpoint(f"http://127.0.0.1:{port}"), b"{}",
                                          stream=False, access=views._Access(1, 2))
            return response, time.monotonic() - began
        finally:
            server.close()

    monkeypatch.setattr(views, "ACCESS_CHECK_SECONDS", 0.2)
    finished: list = []
    _quiet_bookkeeping(monkeypatch, finished)
    monkeypatch.setattr(serving, "access_lost", lambda key_id, machine_id: ApiError(
        401, "invalid_api_key", "This API key ('x', corral-abcde…) was revoked."))
    response, seconds = asyncio.run(scenario())
    assert response.status_code == 401, (response.status_code, response.content)
    assert json.loads(response.content)["error"]["message"].startswith("Corral ended this request: ")
    assert seconds < 2, seconds
    assert ("finished", 7) in finished

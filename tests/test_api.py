"""The OpenAI-compatible API (docs/api.md), through the official ``openai`` client against
daphne, a real Celery worker and the real llama-server on SmolLM2: keys made and revoked on
the member's page, the refusals in OpenAI's error shape, non-streamed and streamed replies
(llama-server's own SSE frames, usage included), and one shared server per model file."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta

import httpx
import openai
import pytest
from django.contrib.auth.models import Group
from django.test import Client
from django.utils import timezone

from api_app import keys, serving
from api_app.models import ApiKey
from api_app.views import Usage, usage_from_timings
from machines_app.llama_server import auth_headers
from machines_app.models import Machine
from sessions_app.models import AgentSession
from sessions_app.server_state import idle_sessions
from sessions_app.servers import stop
from sessions_app.servers.models import ServerRecord, SlotSave
from sessions_app.servers.records import server_endpoint
from usage_app.models import Quota, UsageRecord

from .conftest import model_key, wait_for

pytestmark = [pytest.mark.django_db(transaction=True)]


def make_key(user, name: str = "tests") -> str:
    return keys.create_key(user, name)[1]


def smol_id(machine: Machine) -> str:
    return serving.model_id(machine.name, model_key(machine, "llama"))


def client_for(stack, token: str) -> openai.OpenAI:
    # max_retries=0: a refusal must come back as it is, not retried.
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=token, max_retries=0, timeout=300)


def long_stream(stack, token: str, model: str, max_tokens: int):
    """A streamed completion of ``max_tokens`` tokens exactly (``ignore_eos``: SmolLM2 cannot
    end it sooner) as ``token``'s owner, opened with httpx (a context manager: the response)."""
    return httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", timeout=300,
                        headers={"Authorization": f"Bearer {token}"},
                        json={"model": model, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                              "messages": [{"role": "user", "content": "Tell me a long story."}]})


# --- the member's page -------------------------------------------------------------------------


def test_a_key_is_shown_once_stored_hashed_and_revoked_on_the_members_page(alice, bob):
    page = Client()
    page.force_login(alice)
    made = page.post("/settings/api-keys/", {"name": "laptop editor"})
    assert made.status_code == 200
    assert made["Cache-Control"] == "no-store"
    key = ApiKey.objects.get(user=alice)
    html = made.content.decode()
    start = html.index('id="new-key-value"')
    token = html[start:].split('value="', 1)[1].split('"', 1)[0]
    assert token.startswith("corral-") and len(token) > 40
    assert key.digest == hashlib.sha256(token.encode()).hexdigest()
    assert token not in str(ApiKey.objects.filter(pk=key.pk).values().get()), "the key itself is never stored"
    assert key.prefix == token[: len(key.prefix)] and len(key.prefix) < len(token) // 2

    again = page.get("/settings/api-keys/").content.decode()
    assert token not in again, "a key is shown only on the answer that made it"
    assert "laptop editor" in again and key.prefix in again and "never" in again

    assert page.post("/settings/api-keys/", {"name": "  "}).status_code == 400

    # bob cannot revoke alice's key
    other = Client()
    other.force_login(bob)
    other.post(f"/settings/api-keys/{key.pk}/revoke/")
    assert ApiKey.objects.get(pk=key.pk).revoked_at is None

    assert page.post(f"/settings/api-keys/{key.pk}/revoke/").status_code == 302
    assert ApiKey.objects.get(pk=key.pk).revoked_at is not None
    listed = page.get("/settings/api-keys/").content.decode()
    assert "revoked" in listed and f"/settings/api-keys/{key.pk}/revoke/" not in listed


def test_the_usage_reader_takes_usage_and_timings_from_frames_cut_anywhere():
    stream = (b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
              b'data: {"choices":[{"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,'
              b'"completion_tokens":2,"total_tokens":7},"timings":{"predicted_n":2}}\n\ndata: [DONE]\n\n')
    for cut in range(1, len(stream), 7):
        seen = Usage()
        seen.feed(stream[:cut])
        seen.feed(stream[cut:])
        assert seen.usage == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
        assert seen.timings == {"predicted_n": 2}
    assert usage_from_timings({"cache_n": 30, "prompt_n": 1, "predicted_n": 4}) == {
        "prompt_tokens": 31, "completion_tokens": 4, "total_tokens": 35}
    assert usage_from_timings(None) == {} and usage_from_timings({"prompt_n": "x"}) == {}


# --- refusals, in OpenAI's shape ------------------------------------------------------------------


def test_refusals_come_in_openais_error_shape_with_their_status(stack, local_machine, alice):
    smol = smol_id(local_machine)
    message = [{"role": "user", "content": "Hello"}]

    # The openai client will not send a request without a key: a bare HTTP one then.
    no_key = httpx.post(f"{stack.base_url}/v1/chat/completions", json={"model": smol, "messages": message})
    assert no_key.status_code == 401 and no_key.headers["WWW-Authenticate"].startswith("Bearer")
    assert no_key.json()["error"]["code"] == "missing_api_key" and "API keys page" in no_key.json()["error"]["message"]
    assert set(no_key.json()["error"]) == {"message", "type", "param", "code"}

    with pytest.raises(openai.AuthenticationError) as wrong:
        client_for(stack, "corral-not-a-key").models.list()
    assert wrong.value.code == "invalid_api_key"

    token = make_key(alice)
    ApiKey.objects.filter(user=alice).update(revoked_at="2026-01-02T03:04:00Z")
    with pytest.raises(openai.AuthenticationError) as revoked:
        client_for(stack, token).chat.completions.create(model=smol, messages=message)
    assert "was revoked on 2026-01-02 03:04" in revoked.value.message

    token = make_key(alice)
    api = client_for(stack, token)
    locked = Machine.objects.create(name="locked", models_dir=local_machine.models_dir,
                                    llama_server_path=local_machine.llama_server_path, workspace_roots="")
    locked.allowed_groups.add(Group.objects.create(name="shepherds"))
    with pytest.raises(openai.PermissionDeniedError) as forbidden:
        api.chat.completions.create(model="locked/SmolLM2-135M-Instruct.Q4_1", messages=message)
    assert forbidden.value.status_code == 403 and forbidden.value.code == "machine_not_allowed"
    assert "limited to some groups" in forbidden.value.message
    assert not [m.id for m in api.models.list() if m.id.startswith("locked/")], "a key lists only its owner's machines"

    with pytest.raises(openai.NotFoundError) as unknown:
        api.chat.completions.create(model=f"{local_machine.name}/no-such-model", messages=message)
    assert unknown.value.code == "model_not_found" and "GET /v1/models" in unknown.value.message
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="nowhere/x", messages=message)

    with pytest.raises(openai.BadRequestError) as tools:
        api.chat.completions.create(model=smol, messages=message, tools=[{"type": "function", "function": {
            "name": "ls", "parameters": {"type": "object", "properties": {}}}}])
    assert tools.value.code == "tools_not_supported" and "runs no tools" in tools.value.message

    assert httpx.get(f"{stack.base_url}/v1/models").status_code == 401
    assert not AgentSession.objects.filter(purpose="api").exists(), "no refused request starts a server"


def test_a_model_too_big_for_its_machine_is_refused_with_the_numbers(stack, local_machine, alice):
    Machine.objects.filter(pk=local_machine.pk).update(memory_budget_mib=1)
    api = client_for(stack, make_key(alice))
    with pytest.raises(openai.InternalServerError) as too_big:
        api.chat.completions.create(model=smol_id(local_machine), messages=[{"role": "user", "content": "Hi"}])
    assert too_big.value.status_code == 503 and too_big.value.code == "server_unavailable"
    assert "cannot start on local" in too_big.value.message and "Choose a smaller" in too_big.value.message
    assert not ServerRecord.objects.exists()


# --- real replies ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("stop_servers_after")
def test_replies_stream_or_not_from_one_shared_server(stack, local_machine, alice, bob):
    smol = smol_id(local_machine)
    api = client_for(stack, make_key(alice))
    assert smol in [m.id for m in api.models.list()]
    assert api.models.retrieve(smol).owned_by == local_machine.name

    reply = api.chat.completions.create(model=smol, messages=[{"role": "user", "content": "Say hello."}],
                                        max_tokens=16, temperature=0)
    assert reply.choices[0].message.content.strip()
    # The reply names the model as /v1/models and the picker do (the name inside the GGUF),
    # never by where its file lies on the machine.
    name = local_machine.model_files.get(key=model_key(local_machine, "llama")).display_name
    assert reply.model == name and local_machine.models_dir not in reply.model_dump_json()
    assert api.models.retrieve(smol).model_extra["name"] == name
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0
    first = ServerRecord.objects.get()
    session = AgentSession.objects.get(purpose="api")
    assert (first.session_id, session.machine_id, session.model_key) == (session.pk, local_machine.pk,
                                                                          model_key(local_machine, "llama"))
    assert ApiKey.objects.get(user=alice).last_used_at is not None
    # The key owner's usage, as the server reported it (docs/usage.md).
    wait_for(lambda: UsageRecord.objects.filter(member=alice, source="api").exists(), 30, what="alice's usage row")
    row = UsageRecord.objects.get(member=alice, source="api")
    assert (row.prompt_tokens, row.completion_tokens) == (reply.usage.prompt_tokens, reply.usage.completion_tokens)
    assert (row.machine_id, row.model_key) == (local_machine.pk, model_key(local_machine, "llama"))

    # Streamed, by another member: the same server (same pid), llama-server's frames as they are.
    bob_api = client_for(stack, make_key(bob))
    chunks = list(bob_api.chat.completions.create(
        model=smol, messages=[{"role": "user", "content": "Count to three."}], max_tokens=16, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() and len(chunks) > 2
    assert {c.model for c in chunks} == {name}
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens > 0
    assert ServerRecord.objects.get().pid == first.pid
    wait_for(lambda: UsageRecord.objects.filter(member=bob, source="api").exists(), 30, what="bob's usage row")
    row = UsageRecord.objects.get(member=bob, source="api")
    assert (row.prompt_tokens, row.completion_tokens) == (usage[-1].prompt_tokens, usage[-1].completion_tokens)

    # A spent daily quota refuses the next request with OpenAI's 429, before the server is asked.
    Quota.objects.create(user=bob, tokens_per_day=1)
    with pytest.raises(openai.RateLimitError) as refused:
        bob_api.chat.completions.create(model=smol, messages=[{"role": "user", "content": "Again?"}], max_tokens=4)
    assert refused.value.status_code == 429 and "tokens for today" in refused.value.message
    assert UsageRecord.objects.filter(member=bob).count() == 1
    assert AgentSession.objects.filter(purpose="api").count() == 1

    # The raw stream: SSE frames ending in [DONE], usage and timings in them.
    token = make_key(alice, "raw")
    seen = Usage()
    body = b""
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {token}"},
                      json={"model": smol, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                            "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for chunk in response.iter_raw():
            body += chunk
            seen.feed(chunk)
    frames = [f for f in body.split(b"\n\n") if f.strip()]
    assert local_machine.models_dir.encode() not in body and b".gguf" not in body
    assert all(f.startswith(b"data: ") for f in frames) and frames[-1] == b"data: [DONE]"
    assert json.loads(frames[0][6:])["object"] == "chat.completion.chunk"
    # Not asked for, usage is not in the stream (it is passed on as llama-server sent it);
    # Corral counts it from the timings of the last frame.
    assert not seen.usage and seen.timings
    counted = usage_from_timings(seen.timings)
    assert counted["prompt_tokens"] > 0 and 0 < counted["completion_tokens"] <= 8
    assert ServerRecord.objects.get().pid == first.pid

    # Stopped, the shared server leaves no saved slot: it reads every request cold, and its
    # slot would only keep members' prompts on the machine's disk.
    stop.stop_server(session.pk)
    assert not ServerRecord.objects.filter(session_id=session.pk).exists()
    assert not SlotSave.objects.filter(session_id=session.pk).exists()

    # Hidden from every page: not in the staff's session list, listed as Corral's own on the machines page.
    assert not AgentSession.objects.visible_to(alice).filter(purpose="api").exists()
    assert serving.SYSTEM_USERNAME == AgentSession.objects.get(purpose="api").owner.username


def test_server_flags_name_the_model_without_a_comma_and_keep_no_shared_prompt_cache():
    from machines_app.llama_server import ServerSpec, alias_flag, build_argv

    assert alias_flag("Qwen3, 8B ,Instruct") == ["--alias", "Qwen3 8B Instruct"]  # llama-server splits at commas
    assert alias_flag(" , ") == [] and alias_flag("") == [] and alias_flag("A\x00B\nC") == ["--alias", "A B C"]
    argv = build_argv(ServerSpec("/bin/llama-server", "/m/x.gguf", 8123, {}, alias="SmolLM2"))
    assert argv[argv.index("--alias") + 1] == "SmolLM2" and "--cache-ram" not in argv
    # A server shared by members keeps no prompt cache in RAM (docs/api.md "One server, many members").
    argv = build_argv(ServerSpec("/bin/llama-server", "/m/x.gguf", 8123, {}, shared=True))
    assert argv[argv.index("--cache-ram") + 1] == "0"


@pytest.mark.usefixtures("stop_servers_after")
def test_requests_sent_at_once_cannot_all_pass_on_the_last_token(stack, local_machine, alice):
    """The quota check and the hold of a token are one step: of requests sent at once with
    one token left, one is let through and the others are refused, though none of them has
    recorded any usage yet when the others are checked (usage_app.quota.reserve)."""
    import threading

    from usage_app.models import Hold

    smol, token = smol_id(local_machine), make_key(alice)
    # The server is up first, so that every request is checked while the first still runs.
    client_for(stack, token).chat.completions.create(model=smol, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=1)
    wait_for(lambda: UsageRecord.objects.filter(member=alice).exists(), 30, what="alice's first usage row")
    Quota.objects.create(user=alice, tokens_per_day=quota_used(alice) + 1)
    n = 6
    start, answers = threading.Barrier(n), []

    def send() -> None:
        start.wait()
        answers.append(httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=300,
                                  headers={"Authorization": f"Bearer {token}"},
                                  json={"model": smol, "max_tokens": 8,
                                        "messages": [{"role": "user", "content": "Tell me a long story."}]}))

    threads = [threading.Thread(target=send) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [200] + [429] * (n - 1), [a.text for a in answers]
    refused = [a.json()["error"] for a in answers if a.status_code == 429]
    assert all(e["code"] == "insufficient_quota" and "tokens for today" in e["message"] for e in refused)
    wait_for(lambda: UsageRecord.objects.filter(member=alice).count() == 2, 30, what="the one let through recorded")
    assert not Hold.objects.exists(), "a finished request lets go of its hold"
    with pytest.raises(openai.RateLimitError):
        client_for(stack, token).chat.completions.create(model=smol, messages=[{"role": "user", "content": "Hi"}])


def quota_used(member) -> int:
    from usage_app.quota import used_today

    return used_today(member)


@pytest.mark.usefixtures("stop_servers_after")
def test_a_sleeping_api_server_is_woken_by_the_next_request(stack, local_machine, alice):
    from sessions_app.servers.stop import sleep_server

    smol = smol_id(local_machine)
    api = client_for(stack, make_key(alice))
    api.chat.completions.create(model=smol, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    session = AgentSession.objects.get(purpose="api")
    first = ServerRecord.objects.get().pid
    # A server serving a request (its lease held) is neither idle nor put to sleep.
    AgentSession.objects.filter(pk=session.pk).update(api_busy_until=timezone.now() + timedelta(hours=1))
    assert session.pk not in idle_sessions(local_machine)
    assert not sleep_server(session.pk)
    AgentSession.objects.filter(pk=session.pk).update(api_busy_until=None)
    assert idle_sessions(local_machine) == [session.pk]
    assert sleep_server(session.pk)
    assert AgentSession.objects.get(pk=session.pk).status == "sleeping" and not ServerRecord.objects.exists()
    reply = api.chat.completions.create(model=smol, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert reply.choices[0].message.content is not None
    assert ServerRecord.objects.get().pid != first
    assert AgentSession.objects.filter(purpose="api").count() == 1


# --- a request's lease and hold while llama-server has not answered yet ---------------------------


@pytest.mark.usefixtures("stop_servers_after")
def test_a_request_keeps_its_lease_and_hold_while_llama_server_has_not_answered_yet(stack, local_machine, alice,
                                                                                     monkeypatch):
    """llama-server sends a non-streamed reply's headers only once the whole reply is
    written. While Corral waits for them the server is serving the request: its lease (``api_busy_until``,
    docs/api.md "Servers") and the request's quota hold (docs/usage.md "API requests in
    flight") are renewed every ``RENEW_SECONDS`` then too, or a reply longer than the lease
    could be put to sleep under it and a hold could lapse while its request still runs.
    The view runs in this process (Django's async test client, the real llama-server that
    the stack's worker starts) with ``RENEW_SECONDS`` made short, and each renewal is noted."""
    import asyncio
    import time

    from asgiref.sync import sync_to_async
    from django.db import connections
    from django.test import AsyncClient

    from usage_app import quota

    smol, token = smol_id(local_machine), make_key(alice)
    client_for(stack, token).chat.completions.create(model=smol, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=1)
    Quota.objects.create(user=alice, tokens_per_day=10**9)
    monkeypatch.setattr(serving, "RENEW_SECONDS", 0.1)
    renewed: dict[str, list[float]] = {"lease": [], "hold": []}
    real_renew, real_renew_hold = serving.renew, quota.renew_hold

    def renew(session_id):
        renewed["lease"].append(time.monotonic())
        real_renew(session_id)

    def renew_hold(hold_id):
        if hold_id is not None:
            renewed["hold"].append(time.monotonic())
        real_renew_hold(hold_id)

    monkeypatch.setattr(serving, "renew", renew)
    monkeypatch.setattr(quota, "renew_hold", renew_hold)
    waits: list[tuple[float, float]] = []  # (sent, answered) of each request to llama-server
    real_send = httpx.AsyncClient.send

    async def send(self, request, **kwargs):
        sent = time.monotonic()
        try:
            return await real_send(self, request, **kwargs)
        finally:
            waits.append((sent, time.monotonic()))

    monkeypatch.setattr(httpx.AsyncClient, "send", send)

    async def long_reply():
        try:
            # Not streamed: nothing comes back until the reply's last token.
            return await AsyncClient().post(
                "/v1/chat/completions", {"model": smol, "max_tokens": 200, "ignore_eos": True, "temperature": 0,
                                         "messages": [{"role": "user", "content": "Tell me a long story."}]},
                content_type="application/json", headers={"Authorization": f"Bearer {token}"})
        finally:
            await sync_to_async(connections.close_all)()  # the database thread's, before the test database goes

    answer = asyncio.run(long_reply())
    assert answer.status_code == 200, answer.content
    [(sent, answered)] = waits
    assert answered - sent > 0.5, f"llama-server answered too quickly to judge: {answered - sent:.2f} s"
    for kind, times in renewed.items():
        during = [t for t in times if sent < t < answered]
        assert len(during) >= 2, f"{kind} renewed {len(during)} times in the {answered - sent:.1f} s of the wait"


@pytest.mark.usefixtures("stop_servers_after")
def test_a_stream_the_client_cuts_counts_the_tokens_the_server_read_and_wrote(stack, local_machine, alice):
    """A client that closes the connection in the middle of a streamed reply has had the
    prompt read and part of the reply written: those tokens count against its owner's
    quota (docs/usage.md "API requests in flight"), or cutting every reply one frame
    before its end would make the API free. llama-server's count reaches Corral in every
    frame (``timings`` per token, which Corral asks for on streams), so the last frame
    relayed says how far the server got; the hold is dropped at once."""
    from usage_app.models import Hold

    smol, token = smol_id(local_machine), make_key(alice)
    Quota.objects.create(user=alice, tokens_per_day=10**9)
    received = 0
    with long_stream(stack, token, smol, 400) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                received += bool(choices[0].get("delta", {}).get("content"))
            if received >= 20:
                break  # the client goes away mid-reply
    row = wait_for(lambda: UsageRecord.objects.filter(member=alice, source="api").first(), 30,
                   what="the cut request's usage row")
    assert row.prompt_tokens > 5 and row.completion_tokens >= 20, (row.prompt_tokens, row.completion_tokens)
    wait_for(lambda: not Hold.objects.filter(member=alice).exists(), 10, what="the cut request's hold dropped")


@pytest.mark.usefixtures("stop_servers_after")
def test_a_grammar_nested_deep_enough_to_end_the_shared_server_is_refused(stack, local_machine, alice, bob):
    """llama-server's grammar parser recurses once per level of parentheses: alice's
    ``grammar`` nested 200,000 deep overflowed its stack, the server every member's API
    requests share died (a request of bob's in flight would have been broken off) and the
    next request started it again. Refused with 400 before it reaches the server, also
    when closing parentheses hidden in a literal come first; a grammar that nests a few
    levels still constrains the reply."""
    smol = smol_id(local_machine)
    alice_key, bob_key = make_key(alice), make_key(bob)
    hi = [{"role": "user", "content": "Hi"}]

    def ask(token: str, **extra) -> httpx.Response:
        return httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=300,
                          headers={"Authorization": f"Bearer {token}"},
                          json={"model": smol, "max_tokens": 4, "messages": hi, **extra})

    shaped = ask(alice_key, grammar='root ::= ("y" ("e" ("s")))')
    assert shaped.status_code == 200 and shaped.json()["choices"][0]["message"]["content"] == "yes"
    pid = ServerRecord.objects.get().pid
    n = 200_000
    for grammar in ("root ::= " + "(" * n + '"a"' + ")" * n,
                    'root ::= "' + ")" * n + '" ' + "(" * n + '"a"' + ")" * n):
        refused = ask(alice_key, grammar=grammar)
        assert refused.status_code == 400, refused.text[:300]
        assert refused.json()["error"]["param"] == "grammar" and "nests parentheses" in refused.json()["error"]["message"]
    assert ask(bob_key).status_code == 200
    assert ServerRecord.objects.get().pid == pid, "the shared server never went down"


@pytest.mark.usefixtures("stop_servers_after")
def test_a_client_that_leaves_before_a_whole_reply_comes_back_is_still_counted(stack, local_machine, alice):
    """A non-streamed reply comes back only once llama-server has written all of it. A
    client that gave up waiting (its timeout) closed the connection, the server stopped
    and nothing was recorded: the tokens read and written were free, and the request's
    hold stayed until it lapsed. The request is finished on the server instead, counted
    whole, and its hold dropped (docs/usage.md "API requests in flight")."""
    from usage_app.models import Hold

    smol, token = smol_id(local_machine), make_key(alice)
    Quota.objects.create(user=alice, tokens_per_day=10**9)
    client_for(stack, token).chat.completions.create(model=smol, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=1)  # the server is up first
    wait_for(lambda: UsageRecord.objects.filter(member=alice).count() == 1, 30, what="the first usage row")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=1.5,
                   headers={"Authorization": f"Bearer {token}"},
                   json={"model": smol, "max_tokens": 500, "ignore_eos": True,
                         "messages": [{"role": "user", "content": "Tell me a long story."}]})
    wait_for(lambda: UsageRecord.objects.filter(member=alice).count() == 2, 600, interval=0.5,
             what="the abandoned request's usage row")
    row = UsageRecord.objects.filter(member=alice).order_by("-pk").first()
    assert row.prompt_tokens > 5 and row.completion_tokens == 500
    assert not Hold.objects.filter(member=alice).exists()


@pytest.mark.usefixtures("stop_servers_after")
@pytest.mark.parametrize("change", ["revoke the key", "leave the machine's groups", "turn the account off"])
def test_access_lost_while_a_reply_streams_ends_the_reply_as_a_new_request_would_be_refused(
        stack, local_machine, alice, change):
    """What refuses a new request ends one under way (docs/api.md "Keys"): the key revoked,
    its owner no longer in the machine's groups, or the account turned off, while a long
    reply (``ignore_eos``: it cannot end by itself first) streams. The stream ends with
    an error frame saying why, llama-server stops writing (the next request is answered
    at once), and the tokens written so far count."""
    smol, token = smol_id(local_machine), make_key(alice)
    Quota.objects.create(user=alice, tokens_per_day=10**9)
    received, error = 0, None
    with long_stream(stack, token, smol, 6000) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            frame = json.loads(line[6:])
            if "error" in frame:
                error = frame["error"]
                continue
            choices = frame.get("choices") or [{}]
            received += bool(choices[0].get("delta", {}).get("content"))
            if received == 5:  # streaming: the access changes now
                if change == "revoke the key":
                    ApiKey.objects.filter(user=alice).update(revoked_at=timezone.now())
                elif change == "leave the machine's groups":
                    local_machine.allowed_groups.add(Group.objects.create(name="shepherds"))
                else:
                    type(alice).objects.filter(pk=alice.pk).update(is_active=False)
    expected = {"revoke the key": (401, "invalid_api_key", "was revoked on"),
                "leave the machine's groups": (403, "machine_not_allowed", "limited to some groups"),
                "turn the account off": (401, "invalid_api_key", "is turned off")}[change]
    assert error is not None, f"the reply ran to its end ({received} frames) after the access changed"
    assert error["code"] == expected[1] and error["message"].startswith("Corral ended this request: ")
    assert expected[2] in error["message"], error
    assert received < 6000
    row = wait_for(lambda: UsageRecord.objects.filter(member=alice, source="api").first(), 30,
                   what="the ended request's usage row")
    assert row.completion_tokens >= 5
    # llama-server stopped writing the ended reply (its connection was closed): its one
    # slot is free, not still writing 6,000 tokens for nobody.
    endpoint = server_endpoint(AgentSession.objects.get(purpose="api"))

    def slot_free() -> bool:
        slots = httpx.get(f"{endpoint.url}/slots", headers=auth_headers(endpoint.api_key), timeout=10).json()
        return not any(slot["is_processing"] for slot in slots)

    wait_for(slot_free, 30, interval=0.5, what="llama-server to stop the ended reply")
    assert UsageRecord.objects.get(member=alice, source="api").completion_tokens < 6000


@pytest.mark.usefixtures("stop_servers_after")
def test_a_client_that_leaves_before_its_stream_begins_is_counted_and_its_server_freed(stack, local_machine, alice):
    """The client's leaving reaches Django at any moment; here after the view returned its
    stream and before Django began to send it (the headers not yet written): the frames
    are never iterated, so their own clean-up does not run. The request is still cut as a
    stream the client cut is (api_app.views._Stream): the prompt llama-server read counts,
    the hold is dropped, and llama-server stops writing. Django's ASGI application is
    driven here in-process, with a client that leaves just then; the server is the real
    one the workers started."""
    import asyncio

    from django.core.asgi import get_asgi_application

    from api_app import views
    from usage_app.models import Hold

    smol, token = smol_id(local_machine), make_key(alice)
    Quota.objects.create(user=alice, tokens_per_day=10**9)
    host = stack.base_url.removeprefix("http://")
    body = json.dumps({"model": smol, "max_tokens": 6000, "ignore_eos": True, "stream": True,
                       "messages": [{"role": "user", "content": "Tell me a long story."}]}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 80),
             "headers": [(b"host", host.encode()), (b"authorization", f"Bearer {token}".encode()),
                         (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    sent: list[dict] = []

    async def leave_before_the_stream() -> None:
        headers_out = asyncio.Event()
        asked = 0

        async def receive() -> dict:
            nonlocal asked
            asked += 1
            if asked == 1:
                return {"type": "http.request", "body": body, "more_body": False}
            await headers_out.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            if message["type"] == "http.response.start":
                headers_out.set()
                await asyncio.sleep(60)  # the client is gone before the headers are written

        await get_asgi_application()(scope, receive, send)
        while views._abandoned:  # the clean-up runs on this loop: let it end
            await asyncio.sleep(0.1)

    asyncio.run(leave_before_the_stream())
    assert [m["type"] for m in sent] == ["http.response.start"] and sent[0]["status"] == 200, sent
    row = wait_for(lambda: UsageRecord.objects.filter(member=alice, source="api").first(), 30,
                   what="the request's usage row")
    assert row.prompt_tokens > 5, (row.prompt_tokens, row.completion_tokens)
    wait_for(lambda: not Hold.objects.filter(member=alice).exists(), 10, what="the request's hold dropped")
    endpoint = server_endpoint(AgentSession.objects.get(purpose="api"))
    wait_for(lambda: not any(s["is_processing"] for s in httpx.get(
        f"{endpoint.url}/slots", headers=auth_headers(endpoint.api_key), timeout=10).json()), 30, interval=0.5,
        what="llama-server to stop the request's reply")

"""What the live pages cost daphne (docs/live-page.md, "What it costs"), counted, never
timed: a page joining a session costs the database the same few statements however many
pages already watch, one write (its presence row), and the transcript the page already
holds is read once per seq for all the pages that open at it (counted on daphne's
database thread); a streamed tail is encoded once for all the sockets that get it.

The sockets run as daphne runs them: ``asyncio.run`` on this thread, so every
``database_sync_to_async`` — Channels' session and login lookups included — goes to
asgiref's one database thread of the process, where the statements are counted.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from asgiref.sync import SyncToAsync
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.db import connections

from machines_app.models import Machine
from project.asgi import application
from sessions_app.live import broadcast, consumers, live_link
from sessions_app.models import AgentSession, TranscriptEvent, Watcher

from .helpers import HOST, cookie_of

pytestmark = pytest.mark.django_db(transaction=True)

#: Pages opened one after another on the same session.
PAGES = 6


class DatabaseThreadCount:
    """Statements run on daphne's database thread, by first word (``SELECT``, ``INSERT``, …)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def _count(self, execute, sql, params, many, context):
        self.counts[sql.lstrip().split(None, 1)[0].upper()] += 1
        return execute(sql, params, many, context)

    def _on_thread(self, change) -> None:
        SyncToAsync.single_thread_executor.submit(lambda: change(connections["default"].execute_wrappers)).result(10)

    def __enter__(self) -> DatabaseThreadCount:
        self._on_thread(lambda wrappers: wrappers.append(self._count))
        return self

    def __exit__(self, *exc) -> None:
        self._on_thread(lambda wrappers: wrappers.remove(self._count))

    def taken(self) -> Counter:
        """The counts so far, and start again from zero."""
        taken, self.counts = self.counts, Counter()
        return taken


def a_session_with_a_reply(owner, tmp_path) -> AgentSession:
    """A team-watched session whose transcript holds one exchange: a message taken and
    its reply in three stored parts (a page opened at its end primes from them)."""
    machine = Machine.objects.create(name="m1", models_dir=str(tmp_path))
    session = AgentSession.objects.create(owner=owner, machine=machine, model_key="m.gguf", working_dir=str(tmp_path),
                                          status="idle", visibility=AgentSession.Visibility.TEAM_WATCH)
    events = [("message_taken", {"text": "hello"}),
              *[("assistant_text", {"text": f"part {n} "}) for n in range(3)]]
    for seq, (kind, payload) in enumerate(events, start=1):
        TranscriptEvent.objects.create(session=session, seq=seq, kind=kind, payload=payload)
    AgentSession.objects.filter(pk=session.pk).update(last_seq=len(events))
    return session


def test_a_join_costs_the_same_few_statements_however_many_pages_watch(alice, bob, tmp_path, monkeypatch):
    """PAGES pages of alice and bob open one after another at the transcript's end, each
    waiting for its first who-is-watching list. Each join is counted from its handshake
    to that list: one write (its presence row, one ``INSERT``), the same statements for
    every join of the same reader (none grows with the pages already open), the
    transcript's state at seq 4 read by the first only, and at most ``BUDGET`` in all — Channels' session and login lookups, the access check, the page's
    state, the missed events, the list. Before: 17 statements (the session read three
    times, the account twice, the presence row's select-then-insert, the transcript's
    tail for every page)."""
    session = a_session_with_a_reply(alice, tmp_path)
    cookies = [cookie_of(alice), cookie_of(bob)]
    monkeypatch.setattr(live_link, "_open", set())
    consumers.clear_join_cache()
    per_join: list[Counter] = []

    async def scenario() -> None:
        pages: list[WebsocketCommunicator] = []
        with DatabaseThreadCount() as count:
            try:
                for n in range(PAGES):
                    cookie = cookies[n % 2]
                    comm = WebsocketCommunicator(application, f"/ws/sessions/{session.pk}/?after=4", headers=[
                        (b"origin", b"http://" + HOST), (b"host", HOST), (b"cookie", cookie.encode())])
                    assert (await comm.connect(timeout=10))[0]
                    pages.append(comm)
                    while "presence" not in await comm.receive_json_from(timeout=10):
                        pass
                    await asyncio.sleep(0.1)  # the board's other sends, if any, are made
                    per_join.append(count.taken())
            finally:
                for comm in pages:
                    await comm.disconnect()

    asyncio.run(scenario())
    assert Watcher.objects.count() == 0
    statements = [sum(v for k, v in c.items() if k not in ("BEGIN", "COMMIT", "SAVEPOINT", "RELEASE"))
                  for c in per_join]
    writes = [c["INSERT"] + c["UPDATE"] + c["DELETE"] for c in per_join]
    inserts = [c["INSERT"] for c in per_join]
    assert inserts == [1] * PAGES and writes == [1] * PAGES, per_join
    # alice's joins and bob's apart: bob, a member, is asked whether he may answer "always".
    alices, bobs = statements[0::2], statements[1::2]
    assert len(set(alices[1:])) == 1 and len(set(bobs)) == 1, f"statements per join grew: {statements}"
    # The transcript the pages hold at seq 4 (its open reply, the messages' versions, the
    # last server_ready) is read by the first join only.
    assert alices[0] == alices[1] + 3, statements
    assert max(statements) <= BUDGET, f"statements per join: {statements} ({per_join[-2:]})"


#: Statements one join may cost at most (:func:`test_a_join_costs_the_same_few_statements_however_many_pages_watch`).
BUDGET = 10


def test_a_streamed_tail_is_encoded_once_for_all_the_sockets_that_get_it(alice, bob, tmp_path, monkeypatch):
    """PAGES pages follow a reply being streamed; each tail the worker publishes reaches
    every page, as the same frame, and is encoded to JSON once in all (each socket
    encoding its own was PAGES encodings a tail)."""
    session = a_session_with_a_reply(alice, tmp_path)
    cookies = [cookie_of(alice), cookie_of(bob)]
    monkeypatch.setattr(live_link, "_open", set())
    encoded: list[object] = []
    real_dumps = consumers.json.dumps

    def dumps(value, *args, **kwargs):
        encoded.append(value)
        return real_dumps(value, *args, **kwargs)

    monkeypatch.setattr(consumers.json, "dumps", dumps)
    frames: list[list[str]] = []

    async def scenario() -> None:
        pages: list[WebsocketCommunicator] = []
        try:
            for n in range(PAGES):
                comm = WebsocketCommunicator(application, f"/ws/sessions/{session.pk}/?after=4", headers=[
                    (b"origin", b"http://" + HOST), (b"host", HOST), (b"cookie", cookies[n % 2].encode())])
                assert (await comm.connect(timeout=10))[0]
                pages.append(comm)
            for comm in pages:  # every page's lists, up to the one naming both readers
                while (await comm.receive_json_from(timeout=10)).get("presence") != ["alice", "bob"]:
                    pass
            encoded.clear()
            for text in ("part 3 ", "part 3 and 4 "):
                await get_channel_layer().group_send(broadcast.group_name(session.pk), {
                    "type": "transcript.tail", "after": 4, "kind": "assistant_text", "text": text})
                frames.append([await comm.receive_from(timeout=10) for comm in pages])
        finally:
            for comm in pages:
                await comm.disconnect()

    asyncio.run(scenario())
    for text, sent in zip(("part 3 ", "part 3 and 4 "), frames, strict=True):
        assert len(set(sent)) == 1 and consumers.json.loads(sent[0])["ops"][0]["text"] == text, sent
    tails = [value for value in encoded if isinstance(value, dict) and value.get("ops", [{}])[0].get("op") == "tail"]
    assert len(tails) == 2, tails


def test_a_reply_is_parsed_and_rendered_once_for_all_the_pages_that_follow_it(alice, bob, tmp_path, monkeypatch):
    """PAGES pages follow a streaming reply; one more stored part (each page's fold looks
    for new formulas in the whole text) and the turn's end (each page's fold renders the
    closed reply's Markdown) reach every page: the text is parsed once and rendered once
    for all of them (each page parsing and rendering its own was PAGES of each)."""
    from sessions_app.live import markdown

    session = a_session_with_a_reply(alice, tmp_path)
    cookies = [cookie_of(alice), cookie_of(bob)]
    monkeypatch.setattr(live_link, "_open", set())
    parsed, rendered = [], []
    real_formulas, real_render = markdown.formulas, markdown._MD.render
    monkeypatch.setattr(markdown, "formulas", lambda md, text: parsed.append(text) or real_formulas(md, text))
    monkeypatch.setattr(markdown._MD, "render", lambda text, *a: rendered.append(text) or real_render(text, *a))
    last = f"and {tmp_path.name} $x^2$ "  # a text no earlier test of this process rendered
    received: list[list[dict]] = []

    async def scenario() -> None:
        pages: list[WebsocketCommunicator] = []
        try:
            for n in range(PAGES):
                comm = WebsocketCommunicator(application, f"/ws/sessions/{session.pk}/?after=4", headers=[
                    (b"origin", b"http://" + HOST), (b"host", HOST), (b"cookie", cookies[n % 2].encode())])
                assert (await comm.connect(timeout=10))[0]
                pages.append(comm)
            for comm in pages:
                while (await comm.receive_json_from(timeout=10)).get("presence") != ["alice", "bob"]:
                    pass
            parsed.clear()
            rendered.clear()
            for seq, kind, payload in ((5, "assistant_text", {"text": last}), (6, "turn_end", {})):
                await get_channel_layer().group_send(broadcast.group_name(session.pk), {
                    "type": "transcript.event", "seq": seq, "kind": kind, "payload": payload})
                received.append([await comm.receive_json_from(timeout=10) for comm in pages])
        finally:
            for comm in pages:
                await comm.disconnect()

    asyncio.run(scenario())
    whole = "part 0 part 1 part 2 " + last
    assert [[message["seq"] for message in messages] for messages in received] == [[5] * PAGES, [6] * PAGES]
    closed = [op for op in received[1][0]["ops"] if op["op"] == "replace"]
    assert closed and "x" in closed[0]["html"] and tmp_path.name in closed[0]["html"], received[1][0]
    assert parsed == [whole], parsed
    assert rendered == [whole], rendered


def test_a_socket_behind_sends_only_the_newest_of_the_tails_waiting_for_it(alice, tmp_path, monkeypatch):
    """Three tails reach a page's queue before its consumer runs (a daphne fallen behind):
    the page is sent the newest only — it holds all the text of the others — and a tail
    arriving alone afterwards is sent as ever (each tail sent was three frames)."""
    session = a_session_with_a_reply(alice, tmp_path)
    monkeypatch.setattr(live_link, "_open", set())
    cookie = cookie_of(alice)
    tails: list[str] = []

    async def scenario() -> None:
        comm = WebsocketCommunicator(application, f"/ws/sessions/{session.pk}/?after=4", headers=[
            (b"origin", b"http://" + HOST), (b"host", HOST), (b"cookie", cookie.encode())])
        assert (await comm.connect(timeout=10))[0]
        try:
            while "presence" not in await comm.receive_json_from(timeout=10):
                pass
            channel = (await database_sync_to_async(Watcher.objects.get)(session=session)).channel_name
            layer = get_channel_layer()
            queue = layer.channels[channel]
            for text in ("part 3 ", "part 3 and 4 ", "part 3 and 4 and 5 "):  # no await between: all three wait
                queue.put_nowait(layer.serialize({"type": "transcript.tail", "after": 4, "kind": "assistant_text",
                                                  "text": text}))
            tails.append((await comm.receive_json_from(timeout=10))["ops"][0]["text"])
            assert await comm.receive_nothing(timeout=0.5)
            await get_channel_layer().group_send(broadcast.group_name(session.pk), {
                "type": "transcript.tail", "after": 4, "kind": "assistant_text", "text": "part 3 and 4 and 5 and 6 "})
            tails.append((await comm.receive_json_from(timeout=10))["ops"][0]["text"])
        finally:
            await comm.disconnect()

    asyncio.run(scenario())
    assert tails == ["part 3 and 4 and 5 ", "part 3 and 4 and 5 and 6 "]

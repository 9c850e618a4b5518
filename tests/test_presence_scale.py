"""Who is watching costs O(watchers) per change, not O(watchers²) (docs/sharing.md, "Who
is here"): counted on real websockets through a real daphne, never timed."""

from __future__ import annotations

import pytest
from django.test import Client
from websockets.exceptions import InvalidHandshake

from machines_app.models import Machine
from sessions_app.models import AgentSession, Watcher

from .conftest import WSRecorder, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

#: Sockets of one person opened on one session, one after another.
TABS = 12


def cookie_of(user) -> str:
    client = Client()
    client.force_login(user)
    return f"sessionid={client.cookies['sessionid'].value}"


def opened(url: str, cookie: str, origin: str) -> WSRecorder:
    """A socket opened as the page opens it: a handshake daphne dropped (one not accepted
    within its 5 s, on a machine busy with other work) is tried again."""
    for _ in range(2):
        try:
            return WSRecorder(url, cookie=cookie, origin=origin)
        except (InvalidHandshake, OSError):
            continue
    return WSRecorder(url, cookie=cookie, origin=origin)


def test_each_join_sends_the_list_to_the_joiner_and_only_a_change_of_names_to_everyone(stack, alice, bob, tmp_path):
    """TABS sockets of alice join one after another, then one of bob. Each socket gets the
    list once when it joins and once more when bob's name is added: 2 × TABS + 1 lists in
    all. (Every socket told of every join was TABS × (TABS + 1) / 2 + TABS + 1 = 91.)"""
    machine = Machine.objects.create(name="m1", models_dir=str(tmp_path))
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf",
                                          working_dir=str(tmp_path), status="idle",
                                          visibility=AgentSession.Visibility.TEAM_WATCH)
    alices_cookie = cookie_of(alice)
    sockets: list[WSRecorder] = []
    try:
        for n in range(TABS):
            ws = opened(stack.ws_url(session.pk), alices_cookie, stack.base_url)
            sockets.append(ws)
            wait_for(lambda ws=ws: ws.presence, 15, what=f"tab {n + 1}'s first list")
            assert ws.presence == [["alice"]]
        bobs = opened(stack.ws_url(session.pk), cookie_of(bob), stack.base_url)
        sockets.append(bobs)
        for ws in sockets:
            wait_for(lambda ws=ws: ws.presence and ws.presence[-1] == ["alice", "bob"], 15, what="bob's name")
        assert Watcher.objects.filter(session=session).count() == TABS + 1
        # Anything sent after bob's list would be a list sent twice; a last change flushes
        # the sockets: bob leaves, and every alice socket's next list is alice alone.
        bobs.close()
        for ws in sockets[:TABS]:
            wait_for(lambda ws=ws: ws.presence[-1] == ["alice"], 15, what="bob's name to go")
        for ws in sockets[:TABS]:
            assert ws.presence == [["alice"], ["alice", "bob"], ["alice"]]
        assert bobs.presence == [["alice", "bob"]]
        assert sum(len(ws.presence) for ws in sockets) == 3 * TABS + 1
    finally:
        for ws in sockets:
            ws.close()

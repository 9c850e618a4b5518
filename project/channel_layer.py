"""The Channels layer: channels_redis's, with a Redis read timeout its blocking read fits in.

A websocket consumer waits for its next group message with a blocking ``BZPOPMIN`` of
``brpop_timeout`` seconds (5 in channels_redis 4). redis-py gives up on any read after
its ``socket_timeout``: 5 s by default since redis-py 8, or whatever the Redis URL says
(``redis://…?socket_timeout=1``). When that is not longer than the blocking read, every
idle socket's read fails with ``TimeoutError: Timeout reading from …``, the consumer
dies, the page shows "reconnecting…" and the log fills with tracebacks, every few
seconds (docs/live-page.md).

This layer keeps the configured timeout (it still notices a Redis that went silent) but
never lets it be shorter than the blocking read plus :data:`READ_MARGIN`.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode

from channels_redis.core import RedisChannelLayer as ChannelsRedisLayer

#: Seconds a read may take beyond the blocking read's own timeout: Redis answers an empty
#: BZPOPMIN only when that timeout is over, and the answer still has to arrive.
READ_MARGIN = 5.0


def read_timeout_for(host: dict, blocking_seconds: float) -> dict:
    """``host`` (a channels_redis host entry) with a ``socket_timeout`` longer than a
    blocking read of ``blocking_seconds``.

    The timeout is taken from the URL (``address``) when it names one — redis-py lets
    URL options win over keyword arguments, so it moves out of the URL — else from the
    entry; an explicit ``None`` (no timeout at all) is kept. A value that is not a
    number is left where it is, for redis-py to refuse with its own message.
    """
    host = dict(host)
    floor = blocking_seconds + READ_MARGIN
    configured: object = host.get("socket_timeout", floor)
    address = host.get("address")
    if isinstance(address, str):
        # Only the query is rewritten: urlunsplit would turn "unix:///path" into "unix:/path".
        base, _, query_string = address.partition("?")
        query = parse_qsl(query_string, keep_blank_values=True)
        in_url = [value for key, value in query if key == "socket_timeout"]
        if in_url:
            try:
                configured = float(in_url[-1])
            except ValueError:
                return host
            rest = urlencode([(key, value) for key, value in query if key != "socket_timeout"])
            host["address"] = f"{base}?{rest}" if rest else base
    if configured is None:
        host["socket_timeout"] = None
    else:
        host["socket_timeout"] = max(float(configured), floor)  # type: ignore[arg-type]
    return host


class RedisChannelLayer(ChannelsRedisLayer):
    """channels_redis's layer whose connections wait longer than its blocking read."""

    def __init__(self, hosts=None, **kwargs) -> None:
        super().__init__(hosts=hosts, **kwargs)
        self.hosts = [read_timeout_for(host, self.brpop_timeout) for host in self.hosts]

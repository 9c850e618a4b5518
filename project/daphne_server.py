"""daphne's server without its two clocks: what they did is done when something happens.

daphne's ``Server`` looks at every connection on two timers of its own, for as long as it
runs: each second for applications that ended (to log an error, answer 500, forget the
connection; and to cancel one that outlived its socket by ``--application-close-timeout``)
and every two seconds for timeouts (a websocket's keep-alive ping after ``--ping-interval``
seconds without a frame, its handshake and lifetime limits, ``--http-timeout``). And
twisted's HTTP factory, under it, formats the date for its access log lines every second,
whether a request comes or not. An idle daphne with pages open woke two and a half times a
second for them, most of its wake-ups (docs/live-page.md, "What it costs").

:class:`QuietServer` does the same work when it is due:

- an application is looked at the moment it ends (a callback on its future), and a
  connection the moment it closes, and once more just after ``application_close_timeout``
  if its application still runs then;
- the timeouts are looked at when the earliest one falls due (a websocket's next ping, a
  handshake's or a request's limit), and two seconds after a new connection, whatever it
  is; a look serves every connection due within two seconds of the first, so a ping is
  never more than two seconds late, as with daphne's own pace.

- twisted's access log date is formatted when a line is logged (:class:`QuietHTTPFactory`).

The rules themselves are daphne's (``Server.application_checker`` and the protocols'
``check_timeouts``, called as they are). :func:`install` makes daphne's command line use
this server: ``project/asgi.py`` calls it, so every way of starting daphne on Corral's
application (``./corral run``, a systemd unit, a test) gets it without another argument.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import daphne.server
from daphne.http_protocol import HTTPFactory, WebRequest
from daphne.server import Server
from daphne.ws_protocol import WebSocketProtocol
from twisted.internet import reactor as _reactor
from twisted.web.http import datetimeToLogString

#: twisted's reactor (daphne's asyncio one), as daphne uses it (twisted types the module
#: as its interfaces, whose methods mypy reads unbound).
reactor: Any = _reactor

logger = logging.getLogger("daphne.server")

#: Seconds of daphne's own timeout pace: a timeout is looked at no later than this after it
#: falls due, and a connection this long after it opened.
TICK = 2.0
#: Seconds after a limit that its look comes: daphne compares with ``>``.
SLACK = 0.05


class QuietServer(Server):
    """daphne's ``Server``, its looks made when due (module docstring), not on a clock."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._to_reap: set = set()  # connections noticed (an application ended, a socket closed), to look at
        self._reap_call: Any = None  # the planned look at them (a twisted DelayedCall)
        self._timeouts_call: Any = None  # the planned look at the timeouts

    # --- applications that ended, connections that closed

    def create_application(self, protocol, scope):
        queue = super().create_application(protocol, scope)
        instance = self.connections.get(protocol, {}).get("application_instance")
        if instance is not None:
            instance.add_done_callback(lambda _future: self._look_at(protocol))
        return queue

    def protocol_disconnected(self, protocol) -> None:
        super().protocol_disconnected(protocol)
        self._look_at(protocol)
        # An application still running by then is cancelled (daphne's rule, in _reap).
        reactor.callLater(self.application_close_timeout + SLACK, self._look_at, protocol)

    def application_checker(self) -> None:
        """Every connection looked at once, as daphne's own checker does each second; here
        only when daphne's ``run`` calls it, a second after the start."""
        for protocol in list(self.connections):
            self._reap(protocol)

    def _look_at(self, protocol) -> None:
        """Look at ``protocol`` soon, in a call of its own (never inside the callback that
        noticed it), together with the others noticed meanwhile."""
        self._to_reap.add(protocol)
        if self._reap_call is None:
            self._reap_call = reactor.callLater(0, self._reap_noticed)

    def _reap_noticed(self) -> None:
        self._reap_call = None
        noticed, self._to_reap = self._to_reap, set()
        for protocol in noticed:
            self._reap(protocol)

    def _reap(self, protocol) -> None:
        """daphne's ``application_checker`` for one connection: cancel an application that
        outlived its closed connection by ``application_close_timeout``, report one that
        raised (the log; a 500 or a close if the connection is open), forget an ended one,
        and the connection once both have ended."""
        details = self.connections.get(protocol)
        if details is None:
            return
        disconnected = details.get("disconnected", None)
        instance = details.get("application_instance", None)
        if disconnected and time.time() - disconnected > self.application_close_timeout:
            if instance and not instance.done():
                logger.warning("Application instance %r for connection %s took too long to shut down and was killed.",
                               instance, repr(protocol))
                instance.cancel()
        if instance and instance.done():
            try:
                exception = instance.exception()
            except asyncio.CancelledError:
                pass
            else:
                if exception:
                    if isinstance(exception, KeyboardInterrupt):
                        self.stop()  # the application asks the server to exit (daphne's tests)
                    else:
                        logger.error("Exception inside application: %s", exception, exc_info=exception)
                        if not disconnected:
                            protocol.handle_exception(exception)
            del details["application_instance"]
            instance = None
        if not instance and disconnected:
            del self.connections[protocol]

    # --- timeouts and keep-alive pings

    def protocol_connected(self, protocol) -> None:
        super().protocol_connected(protocol)
        self._check_timeouts_at(time.time() + TICK)

    def timeout_checker(self) -> None:
        """daphne's look at every connection's timeouts (``check_timeouts``: a ping, a
        close, a 503), then the next look planned for when one falls due."""
        self._timeouts_call = None
        for protocol in list(self.connections):
            protocol.check_timeouts()
        now = time.time()
        dues = sorted(due for due in (self._next_timeout(protocol, now) for protocol in self.connections)
                      if due is not None)
        if dues:
            # The ones due within a tick of the first share its look (pings of pages opened
            # together: one wake-up, not one each).
            self._check_timeouts_at(max(due for due in dues if due <= dues[0] + TICK))

    def _check_timeouts_at(self, at: float) -> None:
        """Plan the next look at the timeouts for ``at`` (``time.time()`` seconds) unless
        one is planned sooner. A time already past (a limit whose look did not end it: a
        socket closing) is looked at again after a tick, daphne's pace."""
        delay = at - time.time()
        if delay <= 0:
            delay = TICK
        planned = self._timeouts_call
        if planned is not None and planned.active():
            if planned.getTime() <= reactor.seconds() + delay:
                return
            planned.cancel()
        self._timeouts_call = reactor.callLater(delay, self.timeout_checker)

    def _next_timeout(self, protocol, now: float) -> float | None:
        """When ``protocol``'s ``check_timeouts`` may next do something (``time.time()``
        seconds), read from what it compares; None when never; a tick from ``now`` for a
        connection this cannot read (not yet set up, or a kind it does not know)."""
        if isinstance(protocol, WebSocketProtocol):
            opened = getattr(protocol, "socket_opened", None)
            if opened is None:
                return now + TICK
            dues = []
            if self.websocket_timeout >= 0:
                dues.append(opened + self.websocket_timeout)
            if protocol.state == protocol.STATE_CONNECTING:
                dues.append(opened + self.websocket_connect_timeout)
            elif protocol.state == protocol.STATE_OPEN:
                dues.append(protocol.last_ping + self.ping_interval)
            return min(dues) + SLACK if dues else None
        if isinstance(protocol, WebRequest):
            if not self.http_timeout:
                return None
            start = getattr(protocol, "request_start", None)
            return start + self.http_timeout + SLACK if start is not None else now + TICK
        return now + TICK


class QuietHTTPFactory(HTTPFactory):
    """daphne's HTTP factory, the date of twisted's access log lines formatted for each
    line (twisted formats it every second, on a timer, in case a line comes)."""

    def _updateLogDateTime(self) -> None:  # noqa: N802 (twisted's name)
        # twisted's own also plans the next call, a second on: started once, never again.
        self._logDateTime = datetimeToLogString(self.reactor.seconds())

    def log(self, request) -> None:
        self._updateLogDateTime()
        super().log(request)


def install() -> None:
    """Make daphne's command line (``daphne …``, ``python -m daphne …``) run
    :class:`QuietServer` with :class:`QuietHTTPFactory`: it builds its server after
    loading the application, from this class attribute, and the server its factory from
    daphne.server's name."""
    from daphne.cli import CommandLineInterface

    CommandLineInterface.server_class = QuietServer
    daphne.server.HTTPFactory = QuietHTTPFactory

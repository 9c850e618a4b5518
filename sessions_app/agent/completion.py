"""One streamed completion of a step (docs/behaviour.md §6), in the phases
:meth:`~sessions_app.agent.step.Step.complete` runs: send the request, watch for an
interrupt from a thread of its own, read the stream into the transcript, then say how the
reply failed or ended and record its usage.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator

from django.conf import settings
from django.db import connection

from machines_app.llama_server import Endpoint

from .. import db_link, metering
from ..completions.deltas import Delta, Finish, Progress, ReasoningDelta, TextDelta, ToolCallFragment, Usage
from ..completions.errors import CompletionError
from ..completions.pacing import AbortableHTTP
from ..completions.tool_calls import ToolCall, ToolCallAssembler
from ..servers import watch
from ..transcript import Kind, TurnEnd
from .fragments import READ_EVERY, Fragments
from .lease import LeasedStep
from .request import Request

EMPTY_REPLY = "The model returned an empty reply."
#: The error after a reply whose way to its machine broke (``link``: what failed, in words).
LINK_BROKEN_REPLY = "{link} The reply above is cut off; send another message once the machine answers."
#: The notice after a reply that llama-server stopped at ``max_tokens`` (``finish_reason: length``).
LENGTH_LIMIT = ("The reply stopped at its length limit (max_tokens {max_tokens}). Send \"go on\" to continue it, "
                "or raise max_tokens in Settings.")
PROGRESS_EVERY = 0.5  # seconds: the longest a watcher's "n / N tokens" lags behind
INTERRUPT_POLL_EVERY = 0.5  # seconds: an interrupt stops the stream within about a second


class Completion:
    """One completion of ``step``'s turn, sending ``request``, and what its reply brought so far.

    The stream is read in the step's thread; a watcher thread looks for an interrupt and
    closes the connection (``interrupted`` is then set), so an interrupt works even while
    llama-server sends nothing (a long prompt being processed). Streamed text goes through
    ``pending`` (:class:`Fragments`), the calls' fragments into ``assembler``; ``usage`` and
    ``finish_reason`` are the server's last word on them. ``produced``: anything a person
    can see — text or reasoning that is not only white space — so far.

    Used once, in order: :meth:`send`, :meth:`read`, always :meth:`close` after
    :meth:`send`, then :meth:`failed` or :meth:`record_usage` and :meth:`say_how_it_ended`.
    """

    def __init__(self, step: LeasedStep, request: Request) -> None:
        self.step = step
        self.request = request
        self.assembler = ToolCallAssembler()
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self.pending = Fragments(step.record, step.tail)
        self.http = AbortableHTTP(read_every=READ_EVERY, before_read=self.pending.at_read)
        self.stop_watching = threading.Event()
        self.interrupted = threading.Event()
        self.watcher = threading.Thread(target=self.watch_interrupt, name=f"interrupt-{step.session_id}",
                                        daemon=True)
        # Anything a person can see or a call that can run: a reply with none of it is said
        # to be empty (an empty "<think></think>", a call the server never named).
        self.produced = False
        # What the page's progress line says (docs/live-page.md, "Progress"): the prompt read
        # so far (llama-server's prompt_progress), then the reply's tokens so far — one
        # streamed chunk is one token — at most every PROGRESS_EVERY seconds.
        self.tokens, self.shown_at = 0, 0.0
        self.stream: Generator[Delta, None, None] | None = None

    # --- send the request ---------------------------------------------------------------

    def send(self, server: Endpoint) -> None:
        """Start the watcher, then open the stream to ``server`` (nothing is sent until the
        stream is first read)."""
        self.watcher.start()
        request = self.request
        self.stream = self.step.client_factory(server.url, http=self.http.client, api_key=server.api_key,
                                               idle_timeout=settings.CORRAL_STREAM_IDLE_SECONDS).stream(
            request.messages, tools=request.definitions, sampling=request.sampling,
            opens_thinking=bool(request.ready.get("opens_thinking"))
        )

    # --- the interrupt watcher ------------------------------------------------------------

    def watch_interrupt(self) -> None:
        """The watcher thread: every INTERRUPT_POLL_EVERY, an interrupt asked for breaks the
        connection off; in between, :meth:`Fragments.flush_due` shows and stores what waits."""
        # Wakes for the next interrupt poll, or sooner when flush_due has something to
        # do: a few times a second while a reply streams in bursts, not every 50 ms.
        pending = self.pending
        next_poll = time.monotonic() + INTERRUPT_POLL_EVERY
        try:
            while True:
                wait = next_poll - time.monotonic()
                due = pending.seconds_to_due()
                if self.stop_watching.wait(max(0.0, wait if due is None else min(wait, due))):
                    return
                try:
                    pending.flush_due()
                    if time.monotonic() < next_poll:
                        continue
                    next_poll = time.monotonic() + INTERRUPT_POLL_EVERY
                    if self.step.interrupted():
                        self.interrupted.set()
                        self.http.abort()
                        return
                except db_link.LOST:
                    # This thread's connection was cut: a new one at the next poll; the
                    # step's own thread meets the cut too and ends the turn in words.
                    db_link.reconnect()
        finally:
            connection.close()

    # --- the stream loop -------------------------------------------------------------------

    def read(self) -> None:
        """Read the stream to its end, or until the watcher saw an interrupt: text and
        reasoning into ``pending``, the calls' fragments into ``assembler``, the progress to
        the watchers. Raises what the stream raises (CompletionError, or an httpx error or
        RuntimeError once the watcher broke the connection off)."""
        assert self.stream is not None, "send() first"
        for delta in self.stream:
            if self.interrupted.is_set():
                break
            if isinstance(delta, Progress):
                self.step.progress(phase="prompt", processed=delta.processed, total=delta.total)
                continue
            if isinstance(delta, TextDelta | ReasoningDelta | ToolCallFragment):
                self.tokens += 1
                if time.monotonic() - self.shown_at >= PROGRESS_EVERY:
                    self.shown_at = time.monotonic()
                    self.step.progress(phase="reply", tokens=self.tokens)
            if isinstance(delta, TextDelta):
                self.produced = self.produced or not delta.text.isspace()
                self.pending.add(Kind.ASSISTANT_TEXT, delta.text)
            elif isinstance(delta, ReasoningDelta):
                self.produced = self.produced or not delta.text.isspace()
                self.pending.add(Kind.REASONING, delta.text)
            else:
                self.pending.due()
            if isinstance(delta, ToolCallFragment):
                self.assembler.feed(delta.fragments)
            elif isinstance(delta, Usage):
                self.usage = delta
            elif isinstance(delta, Finish):
                self.finish_reason = delta.reason or self.finish_reason
        self.pending.flush()

    def close(self) -> None:
        """Store what is left, stop the watcher, and close the stream and its connection:
        llama-server stops generating."""
        self.pending.flush()
        self.stop_watching.set()
        if self.stream is not None:
            self.stream.close()  # closes the HTTP response: llama-server stops generating
        self.http.close()
        self.watcher.join(2)

    # --- how it failed or ended, and its usage -------------------------------------------------

    def failed(self, exc: CompletionError) -> TurnEnd:
        """The stream broke off with ``exc`` (not by an interrupt): say why, in the right
        words — a person's *Stop server*, a broken way to the machine, or the server's own."""
        step = self.step
        if exc.status is None and step.server_stop_asked():
            # Stop server killed the server under the stream before the watcher saw
            # the flag: a person's stop, not a server failure.
            return step.cut_by_stop(self.produced)
        link = watch.link_broken(step.session_id) if exc.status is None else None
        if link is not None:
            # It was the way to the machine that broke, not llama-server: say so.
            step.error(LINK_BROKEN_REPLY.format(link=link) if self.produced else link)
            return TurnEnd.ERROR
        step.error(str(exc), context_exceeded=exc.context_exceeded)
        if exc.status is None:  # no HTTP answer at all: is the server still there?
            watch.check_session_server(step.session_id)
        return TurnEnd.ERROR

    def record_usage(self) -> None:
        """The ``usage`` event of a reply the server reported on (its usage or how it
        finished), with the seed and the sampling in force; the usage row (usage_app) goes
        with the event, in its transaction."""
        if self.usage is None and self.finish_reason is None:
            return
        request = self.request
        payload = self.usage.as_payload() if self.usage is not None else {}
        payload.update({"seed": request.seed, "finish_reason": self.finish_reason, "sampling": request.in_force,
                        "sampling_from": request.sources})
        metering.record_completion(self.step.session_id, self.step.owner, payload, self.usage, request.model,
                                   model_key=request.model_key,
                                   model_name=request.ready.get("model") or request.model_key)

    def say_how_it_ended(self, calls: list[ToolCall]) -> None:
        """A notice for a reply without ``calls`` that was empty or stopped at max_tokens."""
        if not self.produced and not calls:
            self.step.record(Kind.NOTICE, {"message": EMPTY_REPLY})
        elif self.finish_reason == "length" and not calls:
            # Said, because a reply cut at max_tokens looks like one that finished.
            self.step.record(Kind.NOTICE, {"message": LENGTH_LIMIT.format(
                max_tokens=self.request.sampling.get("max_tokens"))})

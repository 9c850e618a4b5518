"""The turn loop (docs/behaviour.md §6): fold the transcript, stream a completion, run the calls.

A turn is driven by *steps*. A step claims the session's lease with a conditional
UPDATE (docs/behaviour.md C16: a second copy of the same step — a redelivered task, a recovery run —
finds the lease held and leaves), folds the transcript to learn where the turn stands,
and goes on from there: run the calls that are allowed, ask about the first one that is
not (then end: no worker waits for a person, docs/behaviour.md §8), or ask the model again. Where a
turn stands is never kept in memory, so a restarted worker picks it up from the
transcript.

The completion client, the catalogue loader and the tool runner are parameters, so tests
can script the server side of a stream while everything else stays real.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from django.conf import settings
from django.db import connection

from machines_app import catalog
from machines_app.llama_server import Endpoint
from machines_app.models import ModelFile
from machines_app.transports import TransportError

from . import (
    actions,
    allowances,
    callcard,
    completions,
    control_tokens,
    db_link,
    images,
    lifecycle,
    machine_use,
    metering,
    tool_results,
    tools,
    transcript,
    turns,
)
from .completions import (
    AbortableHTTP,
    CompletionClient,
    CompletionError,
    Finish,
    Progress,
    ReasoningDelta,
    TextDelta,
    ToolCallAssembler,
    ToolCallFragment,
    Usage,
)
from .events import load_events, storable
from .live import broadcast
from .models import AgentSession, McpServer, TranscriptEvent
from .transcript import Kind, TurnEnd

Status = AgentSession.Status
log = logging.getLogger(__name__)

MAX_ROUNDS = 32  # docs/behaviour.md §6.5
ROUND_LIMIT_MESSAGE = (
    f"Stopped after {MAX_ROUNDS} tool calls in one turn; send another message to carry on, "
    "or ask for something narrower."
)
REFUSED_RESULT = "The user refused this call of {tool}; it was not run."
WORKER_LOST_RESULT = (
    "The result of this call is unknown: the worker running it stopped while it ran, and it was not run again."
)
SERVER_LOST_RESULT = (
    "The result of this call is unknown: llama-server stopped while it ran, and it was not run again."
)
WORKER_LOST_REPLY = (
    "The worker running this turn stopped while the model was replying; the reply above is partial. "
    "Send another message to carry on."
)
EMPTY_REPLY = "The model returned an empty reply."
#: The error of a turn whose step lost its database connection (sessions_app/db_link.py).
DATABASE_LOST = (
    "The turn stopped: Corral lost its connection to the database while working on it. What is shown "
    "above was kept; send another message to carry on."
)
#: The notice after a reply that a person's *Stop server* broke off (docs/transcript.md).
STOPPED_REPLY = "The reply above is cut off: llama-server was stopped while it was replying."
#: The error after a reply whose way to its machine broke (``link``: what failed, in words).
LINK_BROKEN_REPLY = "{link} The reply above is cut off; send another message once the machine answers."
#: The result of a call whose arguments were not one JSON object (docs/behaviour.md §9, C04):
#: the model is told why, so it can call again; the call is neither run nor asked about.
MALFORMED_RESULT = (
    "This call of {tool} was not run: its arguments were not valid JSON ({error}). "
    "Call {tool} again with its arguments as one JSON object."
)
#: The result of a call in a reply that stopped before it was finished (docs/behaviour.md §9).
CUT_CALL_RESULT = (
    "This call of {tool} was not run: the reply stopped before it was finished ({why}), "
    "so its arguments may be incomplete."
)
CUT_CALL_WHY = {"length": "the length limit, max_tokens", None: "the server did not say it had finished"}
#: The notice after a reply that stopped in the middle of a tool call.
CUT_CALL_NOTICE = {
    "length": ("The reply stopped in the middle of a tool call at its length limit (max_tokens {max_tokens}); "
               "the call was not run. Send \"go on\" to let the model try again, or raise max_tokens in Settings."),
    None: ("The reply ended in the middle of a tool call (the server did not say it had finished); the call "
           "was not run. Send another message to carry on."),
}
#: The notice after a reply that llama-server stopped at ``max_tokens`` (``finish_reason: length``).
LENGTH_LIMIT = ("The reply stopped at its length limit (max_tokens {max_tokens}). Send \"go on\" to continue it, "
                "or raise max_tokens in Settings.")
FRAGMENT_FLUSH_EVERY = 0.05  # seconds: the longest streamed text waits before watchers see it
FRAGMENT_STORE_EVERY = 0.5  # seconds: the longest streamed text waits to be stored
#: Seconds between the starts of two reads of a reply's stream: tokens gather in the socket
#: and are read, handed on and shown as one burst (completions.AbortableHTTP).
READ_EVERY = FRAGMENT_FLUSH_EVERY
PROGRESS_EVERY = 0.5  # seconds: the longest a watcher's "n / N tokens" lags behind
INTERRUPT_POLL_EVERY = 0.5  # seconds: an interrupt stops the stream within about a second
#: Seconds between two looks for an interrupt while a tool runs: Stop reply ends it within
#: about half a second (the tool's own poll adds a few hundredths).
TOOL_INTERRUPT_POLL_EVERY = 0.25
CALL_ID = re.compile(r"[A-Za-z0-9_.-]{1,80}")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "max_tokens", "seed")
#: The sampling values a usage line reports as in force (docs/behaviour.md §17), besides the seed.
REPORTED_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty")

#: ``factory(base_url, http=httpx.Client, api_key=str)`` → a completion client using that
#: HTTP client and sending the server's key.
ClientFactory = Callable[..., CompletionClient]


def request_sampling(sampling: dict, default_max_tokens: int | None = None) -> tuple[dict, int]:
    """The sampling parameters for one request and the seed it uses (docs/behaviour.md §14: a session
    without a fixed seed draws one per request, recorded with the usage). A session without
    a ``max_tokens`` gets ``default_max_tokens`` (the deployment's
    ``CORRAL_DEFAULT_MAX_TOKENS``): a reply never runs on until the context is full."""
    params = {k: sampling[k] for k in SAMPLING_KEYS if sampling.get(k) not in (None, "")}
    if "max_tokens" not in params and default_max_tokens is not None:
        params["max_tokens"] = default_max_tokens
    if "seed" not in params:
        params["seed"] = secrets.randbelow(2**31)
    return params, int(params["seed"])


def sampling_in_force(sent: dict, model_defaults: dict, server_defaults: dict) -> tuple[dict, dict]:
    """Which sampling values a request ran with and where each came from (docs/behaviour.md
    §17): what the session sent > the model file's ``general.sampling.*`` defaults >
    llama-server's own. ``server_defaults`` is what ``GET /props`` reported at the start
    (``default_generation_settings.params``: it already includes the file's defaults,
    which llama-server applies itself). Returns ``(values, sources)``, sources being
    ``"session"``, ``"model"`` or ``"server"`` per name; names no source knows are left out."""
    values: dict = {}
    sources: dict = {}
    for name in REPORTED_SAMPLING:
        for source, known in (("session", sent), ("model", model_defaults), ("server", server_defaults)):
            value = known.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                values[name], sources[name] = value, source
                break
    return values, sources


def catalogue_of(events) -> tools.Catalogue:
    """The tool catalogue recorded when the server became ready (the last one wins)."""
    return tools.Catalogue.from_payload(transcript.last_catalogue(events))


def rounds_in_turn(events) -> int:
    """How many times the model asked for tools in the open turn (batches of tool_start)."""
    rounds, in_batch, counting = 0, False, False
    for event in events:
        if event.kind == Kind.TURN_END:
            rounds, counting = 0, False
        elif event.kind == Kind.MESSAGE_TAKEN and not counting:
            rounds, counting = 0, True
        if event.kind == Kind.TOOL_START:
            if not in_batch:
                rounds += 1
            in_batch = True
        elif event.kind in (Kind.TOOL_END, Kind.ASSISTANT_TEXT, Kind.MESSAGE_TAKEN, Kind.TURN_END):
            in_batch = False
    return rounds


class Fragments:
    """Streamed text on its way to the watchers and into the transcript (docs/live-page.md,
    "What it costs").

    Each stored event costs a transaction, a push and a websocket message; one per token
    would spend more CPU than the model does (docs/behaviour.md §13). So text is stored in
    batches of ``FRAGMENT_STORE_EVERY`` seconds, one event each, and in between the
    watchers are shown what has streamed since as a *tail* (``tail(kind, text, after)``:
    all the text not stored yet, after stored event ``after``; pushed, never stored).

    The stream is read in bursts (``READ_EVERY`` apart, completions.AbortableHTTP), and
    :meth:`at_read` runs at the end of each, before the next read: it stores a block's
    first text (so the block is on the page at once) and shows the rest as a tail. So a
    watcher sees each token within about ``READ_EVERY`` of its arrival. :meth:`add` keeps
    the batches (a change of kind stores the batch before it, keeping order; text that
    has waited a store window is stored), as does :meth:`due` for anything else that
    streams (a call's arguments, usage). :meth:`flush_due` — the step's watcher thread,
    when :meth:`seconds_to_due` says — covers a stream gone quiet and a client that reads
    without bursts: it shows text not shown for ``FRAGMENT_FLUSH_EVERY``, and stores text
    that has waited a store window. So no text waits for the next fragment, and a worker
    that dies loses at most the last ``FRAGMENT_STORE_EVERY`` of text.

    Thread-safe (the stream's thread and the watcher's). A write that fails in the
    watcher's thread (the lease lost: turns.LeaseLost) is raised in the stream's thread at
    its next :meth:`add`, :meth:`at_read` or :meth:`flush`.
    """

    def __init__(self, record: Callable[[str, dict], int], tail: Callable[[str, str, int], None]) -> None:
        self.record = record
        self.tail = tail
        self.lock = threading.Lock()
        self.kind: str | None = None
        self.parts: list[str] = []
        self.oldest = 0.0  # time.monotonic() of the first part not stored
        self.unshown: float | None = None  # … of the first part no watcher was shown
        self.stored_seq: int | None = None  # the last event stored of this block
        self.started = False  # whether the reply has begun (any text, call or usage)
        self.failed: Exception | None = None

    def add(self, kind: str, text: str) -> None:
        if not text:
            return
        with self.lock:
            self._raise_failure()
            self.started = True
            if kind != self.kind:
                self._store()
                self.kind, self.stored_seq = kind, None
            now = time.monotonic()
            if not self.parts:
                self.oldest = now
            if self.unshown is None:
                self.unshown = now
            self.parts.append(text)
            self._due(now)

    def due(self) -> None:
        """Store what is due (the stream's thread, at every delta of the reply but its text)."""
        with self.lock:
            self._raise_failure()
            self.started = True
            self._due(time.monotonic())

    def at_read(self) -> bool:
        """The end of a burst (the stream's thread, before it reads again): store a
        block's first text, show the rest. False until the reply has begun (while the
        prompt is read): the reads are paced only from then on (completions.AbortableHTTP),
        so the reply's first token is read, stored and shown the moment it comes."""
        with self.lock:
            self._raise_failure()
            now = time.monotonic()
            self._due(now)
            if self.parts:
                if self.stored_seq is None:
                    self._store()
                elif self.unshown is not None:
                    self._show()
            return self.started

    def seconds_to_due(self) -> float | None:
        """Seconds until :meth:`flush_due` has something to do; None while nothing waits
        (the watcher then sleeps until its next interrupt poll)."""
        with self.lock:
            if not self.parts or self.failed is not None:
                return None
            due = self.oldest + FRAGMENT_STORE_EVERY
            if self.stored_seq is not None and self.unshown is not None:
                due = min(due, self.unshown + FRAGMENT_FLUSH_EVERY)
            return max(0.0, due - time.monotonic())

    def flush_due(self) -> None:
        """Show text no burst end has shown for a whole ``FRAGMENT_FLUSH_EVERY``, and
        store only text that has waited a whole store window (the watcher's thread: its
        database connection is not the stream's, so it writes only when the stream has
        gone quiet)."""
        with self.lock:
            if self.failed is None:
                try:
                    now = time.monotonic()
                    self._due(now, quiet=True)
                    if (self.parts and self.stored_seq is not None and self.unshown is not None
                            and now - self.unshown >= FRAGMENT_FLUSH_EVERY):
                        self._show()
                except Exception as exc:  # raised in the stream's thread instead
                    self.failed = exc

    def flush(self) -> None:
        with self.lock:
            self._raise_failure()
            self._store()

    def _due(self, now: float, *, quiet: bool = False) -> None:
        if not self.parts:
            return
        if self.stored_seq is None and not quiet:
            if now - self.oldest >= FRAGMENT_FLUSH_EVERY:
                self._store()
        elif now - self.oldest >= FRAGMENT_STORE_EVERY:
            self._store()

    def _show(self) -> None:
        self.unshown = None
        self.tail(self.kind, "".join(self.parts), self.stored_seq)

    def _raise_failure(self) -> None:
        if self.failed is not None:
            failed, self.failed = self.failed, None
            self.parts = []
            raise failed

    def _store(self) -> None:
        if self.parts and self.kind:
            text, self.parts, self.unshown = "".join(self.parts), [], None
            self.stored_seq = self.record(self.kind, {"text": text})
        self.parts = []


def question_details(call: dict, entry: dict, working_dir: str, in_force: list) -> dict:
    """What a question about ``call`` says besides its id and tool (the ``question`` payload,
    docs/transcript.md): the scopes "always" may cover (``offers``); for an MCP tool, what
    its server claims (``claims``: readOnlyHint, shown, never trusted) and, when an
    allowance for it no longer matches, what changed in its definition (``changed``)."""
    details: dict = {"offers": [{"scope": scope} for scope in allowances.offers(call, entry, working_dir)]}
    if entry.get("origin") == tools.ORIGIN_MCP:
        hint = (entry.get("annotations") or {}).get("readOnlyHint")
        details["claims"] = ("its server says it only reads (readOnlyHint)" if hint is True
                             else "its server does not say it only reads")
        for allowance in in_force:
            scope = allowance["scope"]
            if (scope.get("kind") == "mcp" and scope.get("server") == entry.get("server")
                    and scope.get("remote_name") == entry.get("remote_name")):
                details["changed"] = allowances.changes(scope.get("definition") or {}, entry) or ["its definition"]
    return details


@dataclass(frozen=True)
class Request:
    """What one completion of a turn sends (:func:`request_for`): the chat ``messages``, the
    tool ``definitions``, the ``sampling`` body keys with the ``seed`` they use, and what
    its usage line reports (``in_force``, ``sources``: :func:`sampling_in_force`). Also the
    tool ``catalogue`` and the last ``ready`` event's payload it was read from, and the
    session's ``model_key`` and its ``model`` file row (None when the machine lists none);
    ``missing``: the images the messages carry whose stored bytes are gone (said in words
    in their place, docs/behaviour.md §16)."""

    catalogue: tools.Catalogue
    messages: list[dict]
    definitions: list[dict]
    sampling: dict
    seed: int
    in_force: dict
    sources: dict
    ready: dict
    model_key: str
    model: ModelFile | None
    missing: list[transcript.ImageRef] = field(default_factory=list)


def request_for(session: AgentSession, events) -> Request:
    """The request the turn of ``session`` (its ``machine`` loaded) sends next, folded from
    its transcript ``events``; the session's sampling and prompt are read fresh from the
    database, so changes made while the turn runs apply to its next request. Raises
    TransportError when the model's special tokens must be read from a machine that does
    not answer. (``bench/run.py`` sends the same request straight to llama-server.)"""
    catalogue = catalogue_of(events)
    fresh = AgentSession.objects.get(pk=session.pk)  # sampling and prompt changes apply now
    # docs/behaviour.md §17: the prompt in force is the first message of every request; an
    # unchanged prompt keeps the request's prefix byte-identical (the prompt cache).
    # Images go as data URIs only to a model started with its projector
    # (docs/behaviour.md §16); for any other they are said in words.
    takes_images = catalog.vision(session.machine, session.model_key)[1]
    missing: list[transcript.ImageRef] = []

    def image_url(ref: transcript.ImageRef) -> str | None:
        url = images.data_uri(ref)
        if url is None:
            missing.append(ref)
        return url

    messages = transcript.build_messages(
        events,
        system_prompt=fresh.system_prompt_in_force(),
        image_url=image_url if takes_images else None,
    )
    sampling, seed = request_sampling(fresh.sampling, settings.CORRAL_DEFAULT_MAX_TOKENS)
    ready = transcript.last_server_ready(events)
    model = ModelFile.objects.filter(machine_id=fresh.machine_id, key=fresh.model_key).first()
    # docs/security.md: what was typed, returned or written reaches the server as text,
    # never as the template's control tokens (the transcript keeps it as it was).
    specials = catalog.special_tokens(model) if model else ()
    messages = control_tokens.neutralise(messages, specials)
    in_force, sources = sampling_in_force(
        sampling, model.sampling_defaults if model else {}, ready.get("sampling_defaults") or {}
    )
    # A server started with a built-in template runs llama.cpp's legacy template engine,
    # which refuses any request with tools ("tools param requires --jinja flag").
    definitions = catalogue.definitions() if ready.get("jinja", True) else []
    # The template writes the tools' descriptions and schemas (an MCP server's words) into
    # the prompt too: they are text of the request like any message.
    definitions = control_tokens.neutralise_tools(definitions, specials)
    return Request(catalogue, messages, definitions, sampling, seed, in_force, sources, ready, fresh.model_key, model,
                   missing)


class Step:
    """One claimed step of one session's turn, holding its lease as ``owner``.

    Every write goes through the lease (turns.record_for_step, finish_turn(owner=…)): a
    step that was taken over raises turns.LeaseLost at its next write and ends without
    touching the turn, so two steps never write one turn at once."""

    def __init__(
        self,
        session_id: int,
        owner: str,
        client_factory: ClientFactory,
        run_tool: Callable[..., tools.ToolResult],
    ) -> None:
        self.session_id = session_id
        self.owner = owner
        self.client_factory = client_factory
        self.run_tool = run_tool

    def record(self, kind: str, payload: dict) -> int:
        return turns.record_for_step(self.session_id, self.owner, kind, payload)

    def tail(self, kind: str, text: str, after: int) -> None:
        """Show the watchers a reply's text not stored yet (see :class:`Fragments`)."""
        broadcast.push_tail(self.session_id, after, kind, storable(text))

    def progress(self, **state) -> None:
        """Tell the watchers how far the completion is (broadcast.push_progress): never stored."""
        broadcast.push_progress(self.session_id, state)

    def error(self, message: str, *, context_exceeded: bool = False) -> None:
        self.record(Kind.ERROR, {"message": message, **({"context_exceeded": True} if context_exceeded else {})})

    def say_missing_images(self, events, missing: list[transcript.ImageRef]) -> None:
        """docs/behaviour.md §16: an image whose bytes are gone goes to the model as a note
        (transcript.IMAGE_MISSING), never silently: the session says which image the model
        did not see, once per turn."""
        if not missing:
            return
        start = max((i for i, event in enumerate(events) if event.kind == Kind.MESSAGE_TAKEN), default=0)
        said = {event.payload.get("message") for event in events[start:] if event.kind == Kind.NOTICE}
        for ref in {ref["sha256"]: ref for ref in missing}.values():
            sentence = images.missing_sentence(ref)
            if sentence not in said:
                self.record(Kind.NOTICE, {"message": sentence})
                said.add(sentence)

    def finish(self, reason: TurnEnd) -> None:
        turns.finish_turn(self.session_id, reason, owner=self.owner)

    def interrupted(self) -> bool:
        """An interrupt was asked for, the session was deleted under the step, or another
        step holds the lease now (checked every INTERRUPT_POLL_EVERY while a reply streams)."""
        return not AgentSession.objects.filter(
            pk=self.session_id, interrupt_requested=False, lease_owner=self.owner
        ).exists()

    def server_stop_asked(self) -> bool:
        """Whether a stop of the server on purpose broke this turn off: a stop is under way
        or done (``lifecycle.stop_under_way``), or the session asks its turn to stop and no
        ``interrupted`` event was recorded since the turn's message (``actions.do_stop``
        asks before its stop task runs, without one; *Stop reply* always records one)."""
        if lifecycle.stop_under_way(self.session_id):
            return True
        if not AgentSession.objects.filter(pk=self.session_id, interrupt_requested=True).exists():
            return False
        events = TranscriptEvent.objects.filter(session_id=self.session_id)
        taken = events.filter(kind=Kind.MESSAGE_TAKEN).order_by("-seq").values_list("seq", flat=True).first() or 0
        return not events.filter(kind=Kind.INTERRUPTED, seq__gt=taken).exists()

    def stop_reason(self) -> TurnEnd:
        """Why a turn asked to stop ends: ``stopped`` by a stop of its server, else ``interrupted``."""
        return TurnEnd.STOPPED if self.server_stop_asked() else TurnEnd.INTERRUPTED

    def cut_by_stop(self, produced: bool) -> TurnEnd:
        """A reply broken off by *Stop server*: its text stays, a notice says it is cut, and
        the turn ends ``stopped`` (the ``server_stopped`` event names who stopped it)."""
        if produced:
            self.record(Kind.NOTICE, {"message": STOPPED_REPLY})
        return TurnEnd.STOPPED

    def run(self, resumed_after_loss: bool) -> None:
        session = AgentSession.objects.select_related("machine").get(pk=self.session_id)
        if session.status == Status.LOADING:
            return  # docs/behaviour.md §4: the message waits; start_server enqueues the step once ready
        events = load_events(self.session_id)
        if not transcript.open_turn(events) or session.interrupt_requested:
            self.finish(self.stop_reason() if session.interrupt_requested else TurnEnd.DONE)
            return
        if (resumed_after_loss or transcript.reply_cut_off(events)) and not transcript.pending_calls(events):
            # A step died mid-reply (its worker killed, or Redis or the database failing
            # under it): never answer the same message twice from half a stream.
            self.error(WORKER_LOST_REPLY)
            self.finish(TurnEnd.INTERRUPTED)
            return
        machine_use.check_turn(self, session)  # its author may no longer use the machine: ends here
        server = lifecycle.server_endpoint(session) if session.status not in Status.server_down() else None
        if server is None or session.status == Status.UNKNOWN:
            self.error(
                "llama-server is not running for this session; restart it and send again."
            )
            self.finish(TurnEnd.ERROR)
            return
        read = events  # the first round folds the transcript read above: nothing was written since
        while True:
            events = read if read is not None else load_events(self.session_id)  # later rounds read it again
            read = None
            if transcript.pending_calls(events):
                if not self.run_calls(session, events, server):
                    return  # waiting for a person, or interrupted
                continue
            if rounds_in_turn(events) >= MAX_ROUNDS:
                self.error(ROUND_LIMIT_MESSAGE)
                self.finish(TurnEnd.LIMIT)
                return
            outcome = self.complete(session, events, server)
            if outcome is not None:
                self.finish(outcome)
                return

    # --- one completion -----------------------------------------------------------------

    def complete(self, session: AgentSession, events, server: Endpoint) -> TurnEnd | None:
        """Stream one completion into the transcript. Returns None when the reply asked
        for tools (their tool_start events are recorded), else why the turn ends:
        ``TurnEnd.DONE``, ``ERROR`` or ``INTERRUPTED``."""
        turns.step_status(self.session_id, self.owner, Status.RUNNING)
        request = request_for(session, events)
        catalogue, messages, definitions = request.catalogue, request.messages, request.definitions
        sampling, seed, in_force, sources, ready = (request.sampling, request.seed, request.in_force,
                                                    request.sources, request.ready)
        self.say_missing_images(events, request.missing)
        assembler = ToolCallAssembler()
        usage: Usage | None = None
        finish_reason = None
        # The stream is read here; a watcher thread looks for an interrupt and closes the
        # connection, so an interrupt works even while llama-server sends nothing (a long
        # prompt being processed).
        pending = Fragments(self.record, self.tail)
        http = AbortableHTTP(read_every=READ_EVERY, before_read=pending.at_read)
        stop_watching = threading.Event()
        interrupted = threading.Event()

        def watch_interrupt() -> None:
            # Wakes for the next interrupt poll, or sooner when flush_due has something to
            # do: a few times a second while a reply streams in bursts, not every 50 ms.
            next_poll = time.monotonic() + INTERRUPT_POLL_EVERY
            try:
                while True:
                    wait = next_poll - time.monotonic()
                    due = pending.seconds_to_due()
                    if stop_watching.wait(max(0.0, wait if due is None else min(wait, due))):
                        return
                    try:
                        pending.flush_due()
                        if time.monotonic() < next_poll:
                            continue
                        next_poll = time.monotonic() + INTERRUPT_POLL_EVERY
                        if self.interrupted():
                            interrupted.set()
                            http.abort()
                            return
                    except db_link.LOST:
                        # This thread's connection was cut: a new one at the next poll; the
                        # step's own thread meets the cut too and ends the turn in words.
                        db_link.reconnect()
            finally:
                connection.close()

        watcher = threading.Thread(target=watch_interrupt, name=f"interrupt-{self.session_id}", daemon=True)
        watcher.start()
        stream = self.client_factory(server.url, http=http.client, api_key=server.api_key,
                                     idle_timeout=settings.CORRAL_STREAM_IDLE_SECONDS).stream(
            messages, tools=definitions, sampling=sampling, opens_thinking=bool(ready.get("opens_thinking"))
        )
        # Anything a person can see — text or reasoning that is not only white space — or a
        # call that can run: a reply with none of it is said to be empty (an empty
        # "<think></think>", a call the server never named).
        produced = False
        # What the page's progress line says (docs/live-page.md, "Progress"): the prompt read
        # so far (llama-server's prompt_progress), then the reply's tokens so far — one
        # streamed chunk is one token — at most every PROGRESS_EVERY seconds.
        tokens, shown_at = 0, 0.0
        try:
            for delta in stream:
                if interrupted.is_set():
                    break
                if isinstance(delta, Progress):
                    self.progress(phase="prompt", processed=delta.processed, total=delta.total)
                    continue
                if isinstance(delta, TextDelta | ReasoningDelta | ToolCallFragment):
                    tokens += 1
                    if time.monotonic() - shown_at >= PROGRESS_EVERY:
                        shown_at = time.monotonic()
                        self.progress(phase="reply", tokens=tokens)
                if isinstance(delta, TextDelta):
                    produced = produced or not delta.text.isspace()
                    pending.add(Kind.ASSISTANT_TEXT, delta.text)
                elif isinstance(delta, ReasoningDelta):
                    produced = produced or not delta.text.isspace()
                    pending.add(Kind.REASONING, delta.text)
                else:
                    pending.due()
                if isinstance(delta, ToolCallFragment):
                    assembler.feed(delta.fragments)
                elif isinstance(delta, Usage):
                    usage = delta
                elif isinstance(delta, Finish):
                    finish_reason = delta.reason or finish_reason
            pending.flush()
        except CompletionError as exc:
            pending.flush()  # what was seen stays (docs/behaviour.md §6: an interrupted reply is kept)
            if not interrupted.is_set():
                if exc.status is None and self.server_stop_asked():
                    # Stop server killed the server under the stream before the watcher saw
                    # the flag: a person's stop, not a server failure.
                    return self.cut_by_stop(produced)
                link = lifecycle.link_broken(self.session_id) if exc.status is None else None
                if link is not None:
                    # It was the way to the machine that broke, not llama-server: say so.
                    self.error(LINK_BROKEN_REPLY.format(link=link) if produced else link)
                    return TurnEnd.ERROR
                self.error(str(exc), context_exceeded=exc.context_exceeded)
                if exc.status is None:  # no HTTP answer at all: is the server still there?
                    lifecycle.check_session_server(self.session_id)
                return TurnEnd.ERROR
        except (httpx.HTTPError, RuntimeError):
            if not interrupted.is_set():
                raise
        finally:
            pending.flush()
            stop_watching.set()
            stream.close()  # closes the HTTP response: llama-server stops generating
            http.close()
            watcher.join(2)
        if usage is not None or finish_reason is not None:
            payload = usage.as_payload() if usage is not None else {}
            payload.update({"seed": seed, "finish_reason": finish_reason, "sampling": in_force,
                            "sampling_from": sources})
            # The usage row (usage_app) goes with the event, in its transaction.
            metering.record_completion(self.session_id, self.owner, payload, usage, request.model,
                                       model_key=request.model_key,
                                       model_name=ready.get("model") or request.model_key)
        if interrupted.is_set():
            return self.cut_by_stop(produced) if self.server_stop_asked() else TurnEnd.INTERRUPTED
        calls = assembler.calls()
        if not produced and not calls:
            self.record(Kind.NOTICE, {"message": EMPTY_REPLY})
        elif finish_reason == "length" and not calls:
            # Said, because a reply cut at max_tokens looks like one that finished.
            self.record(Kind.NOTICE, {"message": LENGTH_LIMIT.format(max_tokens=sampling.get("max_tokens"))})
        if not calls:
            return TurnEnd.DONE
        # docs/behaviour.md §9: only whole calls run. A reply that stopped at its length limit,
        # or without saying it had finished, stopped inside its last call: what its arguments
        # were meant to be is unknown, so none of its calls is run or asked about.
        cut = finish_reason in CUT_CALL_WHY
        # docs/behaviour.md §9: every call of the reply is recorded, in order, before any runs, so the
        # fold knows they belong to one assistant message. Results are paired by call id,
        # so an id the transcript has seen before (some servers number calls call_0,
        # call_1 in every reply) is replaced by a fresh one.
        used = {e.payload.get("id") for e in events if e.kind == Kind.TOOL_START}
        call_ids: list[tuple[str, str]] = []
        # Each call's arguments parsed, and a file a write or edit would change read from the
        # machine (docs/behaviour.md §8), before any call is recorded: a slow or failing
        # machine delays or fails no half-recorded batch.
        parsed = [
            callcard.recorded(call.name, call.arguments if call.raw_arguments is None else call.raw_arguments,
                              working_dir=session.working_dir, transport=lambda: lifecycle.tool_view(session.machine))
            for call in calls
        ]
        for index, call in enumerate(calls):
            # Ids go into URLs and DOM ids: anything but a plain token is replaced too.
            fresh = call.id not in used and CALL_ID.fullmatch(call.id or "")
            call_id = call.id if fresh else f"call_{secrets.token_hex(12)}"
            used.add(call_id)
            entry = catalogue.get(call.name)
            self.record(
                Kind.TOOL_START,
                {
                    "id": call_id,
                    "tool": call.name,
                    "arguments": call.arguments,
                    "raw_arguments": call.raw_arguments,
                    # Parsed once (above): what the card shows is what the tool receives.
                    **parsed[index],
                    "origin": entry.origin if entry else None,
                    "server": entry.server if entry else None,
                    "writes": entry.writes if entry else None,
                    "display_name": entry.display_name if entry else call.name,
                },
            )
            call_ids.append((call_id, call.name))
        if cut:
            why = CUT_CALL_WHY[finish_reason]
            for call_id, name in call_ids:
                self.record(Kind.TOOL_END, {"id": call_id, "output": CUT_CALL_RESULT.format(tool=name, why=why),
                                            "ok": False})
            self.record(Kind.NOTICE, {"message": CUT_CALL_NOTICE[finish_reason].format(
                max_tokens=sampling.get("max_tokens"))})
            return TurnEnd.DONE
        return None

    # --- the calls and the gate (docs/behaviour.md §8) ---------------------------------------------------

    def run_calls(self, session: AgentSession, events, server: Endpoint) -> bool:
        """Run the pending calls in order. False when the step must end here: a question
        was asked (status awaiting_input) or the turn was interrupted."""
        catalogue = catalogue_of(events)
        answers = {e.payload.get("id"): e.payload for e in events if e.kind == Kind.ANSWERED}
        asked = {e.payload.get("id") for e in events if e.kind == Kind.QUESTION}
        running = {e.payload.get("id") for e in events if e.kind == Kind.TOOL_RUNNING}
        # Only what a person who may still give it granted (docs/access.md).
        in_force = machine_use.standing(session, transcript.allowances(events))
        for call in transcript.pending_calls(events):
            call_id, name = call["id"], call["tool"]
            if self.interrupted():
                self.finish(self.stop_reason())
                return False
            if call_id in running:
                # Started by a worker that died: a command may have run; never re-run it silently.
                self.record(Kind.TOOL_END, {"id": call_id, "output": WORKER_LOST_RESULT, "ok": False})
                continue
            entry = catalogue.get(name)
            if entry is None:
                output = tools.UNKNOWN_TOOL_RESULT.format(name=name)
                self.record(Kind.TOOL_END, {"id": call_id, "output": output, "ok": False})
                continue
            problem = call.get("arguments_error") or completions.arguments_problem(call.get("raw_arguments"))
            if problem:
                # Never run as {} (C04): the model is told why, and nobody is asked.
                output = MALFORMED_RESULT.format(tool=name, error=problem)
                self.record(Kind.TOOL_END, {"id": call_id, "output": output, "ok": False})
                continue
            answer = answers.get(call_id, {}).get("answer")
            if answer == transcript.ANSWER_REFUSE:
                output = REFUSED_RESULT.format(tool=name)
                self.record(Kind.TOOL_END, {"id": call_id, "output": output, "ok": False})
                continue
            # The mode is read for each call that would be asked about: a bypass whose owner lost
            # the right to it ends here, before this call (actions.gate_mode).
            described = entry.as_payload()
            if (
                answer is None
                and not any(allowances.matches(a, call, described, session.working_dir) for a in in_force)
                and actions.gate_mode(self.session_id) != AgentSession.PermissionMode.BYPASS
            ):
                if call_id not in asked:
                    turns.ask_question(self.session_id, call_id, name, owner=self.owner,
                                       **question_details(call, described, session.working_dir, in_force))
                return False
            if not self.execute(session, entry, call, server):
                return False  # the server died under the call: its turn was ended with the session
            if self.interrupted():
                self.finish(self.stop_reason())
                return False
        return True

    def execute(self, session: AgentSession, entry: tools.ToolEntry, call: dict, server: Endpoint) -> bool:
        """Run one call and record its result, cut to ``CORRAL_TOOL_RESULT_MAX_CHARS``
        (tool_results.cap; ``full_chars`` then says how long it was). While it runs, a thread
        looks for an interrupt and cancels it (docs/behaviour.md §9: Stop reply ends a running
        tool within a second). False when the server died under a call it ran: the call's
        result says so and the turn has ended with the session's ``exited``."""
        machine_use.check_call(self, session, call)  # not run for someone cut off from the machine
        turns.step_status(self.session_id, self.owner, Status.RUNNING)
        self.record(Kind.TOOL_RUNNING, {"id": call["id"]})
        cancel, done = threading.Event(), threading.Event()

        def watch_interrupt() -> None:
            # Only a row seen asking to stop cancels: this thread's connection cannot see
            # rows its caller has not committed (a test's transaction), and a deleted
            # session's tool ends at its own timeout anyway.
            try:
                while not done.wait(TOOL_INTERRUPT_POLL_EVERY):
                    try:
                        row = AgentSession.objects.filter(pk=self.session_id).values_list(
                            "interrupt_requested", "lease_owner").first()
                    except db_link.LOST:
                        db_link.reconnect()  # a new connection at the next look
                        continue
                    if row is not None and (row[0] or row[1] != self.owner):
                        cancel.set()
                        return
            finally:
                connection.close()

        try:
            # What Corral runs or reads for the call reaches no more than a tool in the
            # machine's sandbox (docs/security.md "What a tool can reach").
            transport = lifecycle.tool_view(session.machine)
        except TransportError:
            transport = None  # the built-ins then go to llama-server, which says what is wrong
        watcher = threading.Thread(target=watch_interrupt, name=f"tool-interrupt-{self.session_id}", daemon=True)
        watcher.start()
        try:
            result = self.run_tool(
                entry,
                call.get("input") or {},
                base_url=server.url,
                api_key=server.api_key,
                cwd=session.working_dir,
                mcp_servers=McpServer.objects.configs(),
                transport=transport,
                cancel=cancel,
            )
        finally:
            done.set()
            watcher.join(2)
        output, total = tool_results.cap(result.output, settings.CORRAL_TOOL_RESULT_MAX_CHARS)
        server_lost = (entry.origin == tools.ORIGIN_MACHINE and not result.ok
                       and lifecycle.server_gone(self.session_id))
        if server_lost:
            output, total = SERVER_LOST_RESULT, None
        payload = {"id": call["id"], "output": output, "ok": result.ok and not server_lost}
        if total is not None:
            payload["full_chars"] = total
        self.record(Kind.TOOL_END, payload)
        if server_lost:
            lifecycle.check_session_server(self.session_id)  # says so, status exited, ends the turn
            if AgentSession.objects.filter(pk=self.session_id, turn_active=True, lease_owner=self.owner).exists():
                self.error("llama-server is not running for this session; restart it and send again.")
                self.finish(TurnEnd.ERROR)
            return False
        return True


def run_turn_step(
    session_id: int,
    *,
    client_factory: ClientFactory = CompletionClient,
    run_tool: Callable[..., tools.ToolResult] | None = None,
    worker: str | None = None,
) -> None:
    """Advance the session's open turn as far as it can go without a person (docs/behaviour.md §6, §8).

    ``worker``: the nodename of the Celery worker running the step, recorded in the lease
    so a step whose worker died is taken over without waiting for the lease to lapse.

    Returns without doing anything when another step holds the lease, when no turn is
    open, or while the model is still loading (the server's readiness re-enqueues the
    step). Every failure ends the turn with an error event in the user's terms.
    """
    owner = turns.step_owner(worker)
    previous = turns.claim_step(session_id, owner)
    if previous is None:
        return
    step = Step(session_id, owner, client_factory, run_tool or tools.run_tool)
    try:
        with turns.LeaseKeeper(session_id, owner):
            step.run(resumed_after_loss=bool(previous))
    except machine_use.TurnCutOff:
        pass  # recorded and finished by machine_use (docs/access.md)
    except turns.LeaseLost:
        # Taken over (see turns.LeaseLost): the step that holds the lease now owns the turn.
        log.warning("session %s: this step lost its lease and stopped", session_id)
    except Exception as exc:  # the turn must end, whatever broke
        if db_link.lost(exc):
            # The connection died under the step (sessions_app/db_link.py): what follows
            # needs a new one, or it fails the same way and the page stays ``running``.
            log.warning("session %s: the database connection was lost during the step: %s", session_id, exc)
            db_link.reconnect()
            message = DATABASE_LOST
        else:
            log.exception("turn step failed for session %s", session_id)
            message = f"The turn stopped because of an internal error ({type(exc).__name__}); the log has details."

        def end() -> None:
            if not AgentSession.objects.filter(pk=session_id).exists():
                log.info("session %s was deleted while its turn ran", session_id)
                return
            step.error(message)
            step.finish(TurnEnd.ERROR)

        try:
            db_link.retrying(end)
        except turns.LeaseLost:
            pass
        except db_link.LOST as again:
            log.warning("session %s: the turn could not be ended (database unreachable: %s); recovery will", session_id,
                        again)
    finally:
        try:
            db_link.retrying(lambda: turns.release_lease(session_id, owner))
        except db_link.LOST as exc:
            log.warning("session %s: the lease could not be released (%s); it lapses", session_id, exc)

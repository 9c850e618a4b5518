"""A claimed step of a session's turn as its lease sees it (docs/behaviour.md C16): its
writes, its pushes to the watchers, the end of its turn, and its looks for an interrupt.

:class:`LeasedStep` is what the turn loop's parts are handed (the completion, the calls
and the gate); :class:`~sessions_app.agent.step.Step` adds the loop itself.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import images, tools, transcript, turns
from ..completions.client import CompletionClient
from ..events import storable
from ..live import broadcast
from ..models import AgentSession, TranscriptEvent
from ..servers import watch
from ..transcript import Kind, TurnEnd

#: The notice after a reply that a person's *Stop server* broke off (docs/transcript.md).
STOPPED_REPLY = "The reply above is cut off: llama-server was stopped while it was replying."

#: ``factory(base_url, http=httpx.Client, api_key=str)`` → a completion client using that
#: HTTP client and sending the server's key.
ClientFactory = Callable[..., CompletionClient]


class LeasedStep:
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
        return not turns.may_go_on(self.session_id, self.owner)

    def server_stop_asked(self) -> bool:
        """Whether a stop of the server on purpose broke this turn off: a stop is under way
        or done (``watch.stop_under_way``), or the session asks its turn to stop and no
        ``interrupted`` event was recorded since the turn's message (``actions.do_stop``
        asks before its stop task runs, without one; *Stop reply* always records one)."""
        if watch.stop_under_way(self.session_id):
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

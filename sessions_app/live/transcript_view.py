"""The one fold from transcript events to what the browser shows: :class:`TranscriptView`,
the first paint's items and the live operations a page applies (static/corral/session.js),
from the same rules (docs/behaviour.md §12).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, TypedDict

from django.template.loader import render_to_string

from ..models import Access
from ..transcript import Kind, Versions
from ..transcript import allowances as transcript_allowances
from .header import context_gauge, context_size, render_gauge, render_model_details, render_status, template_info
from .items import (
    BLOCK_KINDS,
    OWNER,
    Block,
    Viewer,
    allowance_items,
    attach_context,
    event_item,
    formula_items,
    is_restart,
    render_allowances,
    render_item,
    render_queued,
    tool_item,
)

# --- live operations: what :class:`TranscriptView` sends a page (static/corral/session.js applies them)


class AppendOp(TypedDict):
    op: Literal["append"]
    target: str  # the dom id of the container
    html: str


class TextOp(TypedDict):
    op: Literal["text"]  # more text for an open reply block
    id: str
    text: str


class ReplaceOp(TypedDict):
    op: Literal["replace"]
    id: str
    html: str


class RemoveOp(TypedDict):
    op: Literal["remove"]
    id: str


class StatusOp(TypedDict):
    op: Literal["status"]
    status: str
    html: str


class ValueOp(TypedDict):
    op: Literal["value"]  # a control that follows a setting changed elsewhere
    id: str
    value: str


class ExchangeOp(TypedDict):
    op: Literal["exchange"]  # every item of one exchange shown or hidden (versions)
    seq: int
    hidden: bool


class ReloadOp(TypedDict):
    op: Literal["reload"]  # the viewer's rights changed: the page reloads


LiveOp = AppendOp | TextOp | ReplaceOp | RemoveOp | StatusOp | ValueOp | ExchangeOp | ReloadOp


def build_items(events: Iterable, session_id: int = 0, viewer: Viewer = OWNER) -> list[dict]:
    """The display items of a whole transcript, in page order (first paint), for
    ``viewer``: the :class:`TranscriptView` fold over every event, without operations."""
    view = TranscriptView(session_id, viewer=viewer)
    view.prime(events)
    return view.page_items()


#: How many turns a session page draws at first, and how many each "Show earlier turns"
#: adds (docs/live-page.md): a transcript of 10,000 events is not 10,000 rows at once.
TURNS_PER_PAGE = 10


def turn_items(events: Iterable, session_id: int = 0, viewer: Viewer = OWNER, *, followed: bool = False,
               call_events=None, versions: Versions | None = None) -> list[dict]:
    """The display items of a run of whole turns (``events`` from a ``message_taken``, or
    from the start, up to the next ``message_taken`` or the end), as the whole fold
    (:func:`build_items`) draws them. ``followed``: more turns come after (an earlier
    page), so a reply block still open at its end is closed, as the next turn's message
    closes it in the whole fold. ``call_events`` and ``versions`` as for :class:`TranscriptView`."""
    view = TranscriptView(session_id, call_events=call_events, viewer=viewer, versions=versions)
    view.prime(events)
    if followed:
        view._close([], render=False)
    return view.page_items()


def gauge_of(events: Iterable, n_ctx: int | None = None) -> dict:
    """The context gauge (:func:`context_gauge`) folded from ``events`` — the ``usage``
    and ``cleared`` events are enough; a ``server_ready`` among them moves ``n_ctx`` as
    live — as :meth:`TranscriptView.gauge` gives it after the same events; ``n_ctx`` as
    :func:`context_size` gives it."""
    view = TranscriptView(0, n_ctx=n_ctx)
    for event in events:
        view._follow_context(event.kind, event.payload)
    return view.gauge()


class TranscriptView:
    """The one fold from transcript events to what the browser shows.

    Fed events in sequence order, it keeps the page's items (``#transcript``, in page
    order: :meth:`page_items` is the first paint) and returns, for each event, the
    operations that bring a page showing the events before it up to date (live
    updates). So a reloaded page and a live one are two uses of the same rules
    (``tests/test_one_renderer.py`` proves page(events[:k]) + live(events[k:]) ==
    page(events) for every k).

    One per websocket connection, or one per first paint. :meth:`prime` feeds events
    the page already has, without operations. Operations are :data:`LiveOp` (JSON-able
    dicts: append, text, replace, remove, status, value, exchange; ``reload`` is added by
    the consumer when the viewer's rights changed); each kind of event has its handler in
    ``_HANDLERS``, every other kind is an item of its own. Buttons are rendered for
    ``viewer``, the same on first paint and live. The queue (``#queue``), the status badge, the tool
    list and the header are drawn from the session on first paint; only their live
    operations come from here.

    ``call_events(call_id, before_seq)`` returns the earlier events of a tool call the
    view did not see (a page primed after that call started).

    Versions of a message sent again (:class:`sessions_app.transcript.Versions`): every
    item carries the exchange it belongs to (``data-exchange``: the seq of the message
    before it) and is hidden while another version of that message is in force; a user
    message with versions shows "‹ 2/3 ›" (``#versions-<seq>``). A change of version is
    ``{"op": "exchange", "seq": …, "hidden": bool}`` (every item of that exchange, drawn
    here or not) and a ``replace`` of each pager. ``versions``: a fold already fed with the
    whole transcript's messages (a page that shows only its last turns); without it the
    view folds what it sees.
    """

    def __init__(self, session_id: int, call_events=None, machine_name: str = "", viewer: Viewer = OWNER,
                 n_ctx: int | None = None, allowance_events=None, versions: Versions | None = None) -> None:
        self.session_id = session_id
        self.versions = versions if versions is not None else Versions()
        self.exchange: int | None = None  # the seq of the last message_taken seen
        self.item_exchange: dict[str, int | None] = {}  # dom id → the exchange it belongs to
        # The list of allowances (``#allowances``) is redrawn whole when a grant or a revoke
        # arrives: ``allowance_events(upto_seq)`` gives every event it folds from (the view
        # may have been primed after the grants); without it, the ones this view saw.
        self.allowance_events = allowance_events
        self.allowance_seen: list = []
        # The context gauge (``#context-gauge``): n_ctx as the last server_ready said (or
        # the session's contextSize until one does), tokens used as the last usage said.
        self.n_ctx = n_ctx
        self.context_used: int | None = None
        self.machine_name = machine_name
        self.viewer = viewer
        self.call_events = call_events
        self.block: Block | None = None
        # dom id → item, in page order; a reply block stays a Block (made an item when
        # shown), so a long reply is not joined again at every fragment.
        self.items: dict[str, dict | Block] = {}
        self.calls: dict[str, list] = {}  # call id → the call's events seen so far
        self.ready: dict = {}  # the latest server_ready payload: the template the tool list speaks of

    def know_messages(self, events: Iterable) -> None:
        """Learn the versions of every message before the events the view will be primed
        with (``events``: the :data:`VERSION_KINDS` events up to the page's last seq), and
        which exchange the page's last items belong to."""
        for event in events:
            self.versions.feed(event)
            if event.kind == Kind.MESSAGE_TAKEN:
                self.exchange = event.seq

    def prime(self, events: Iterable) -> None:
        for event in events:
            self.feed(event, render=False)

    def page_items(self) -> list[dict]:
        return [self._decorated(dom_id, item) for dom_id, item in self.items.items()]

    def _decorated(self, dom_id: str, item: dict | Block) -> dict:
        """The item as drawn now: with its exchange, hidden or not, and a user message's pager."""
        drawn = item.as_item() if isinstance(item, Block) else dict(item)
        exchange = self.item_exchange.get(dom_id)
        drawn["exchange"] = exchange
        drawn["hidden"] = self.versions.hidden(exchange)
        if drawn.get("type") == "user" and exchange is not None:
            drawn["pager"] = self.pager(exchange)
        return drawn

    def pager(self, seq: int) -> dict:
        """What ``_versions.html`` draws for the user message ``seq``."""
        return {"seq": seq, "session_id": self.session_id, "can_act": self.viewer.can_act,
                **(self.versions.pager(seq) or {})}

    def _version_ops(self, change: tuple[int, int] | None, render: bool) -> list[LiveOp]:
        if change is None or not render:
            return []
        hidden, shown = change
        ops = [{"op": "exchange", "seq": hidden, "hidden": True}, {"op": "exchange", "seq": shown, "hidden": False}]
        for seq in self.versions.group(shown):
            ops.append({"op": "replace", "id": f"versions-{seq}",
                        "html": render_to_string("sessions_app/_versions.html", {"pager": self.pager(seq)})})
        return ops

    def gauge(self) -> dict:
        return context_gauge(self.context_used, self.n_ctx)

    def _follow_context(self, kind: str, payload: dict) -> bool:
        """Move the gauge on the events that change it; True when it changed."""
        if kind == Kind.SERVER_READY and (said := context_size(payload, None)) is not None:
            self.n_ctx = said
            return True
        if kind == Kind.USAGE and isinstance(payload.get("prompt_tokens"), int):
            self.context_used = payload["prompt_tokens"] + (payload.get("completion_tokens") or 0)
            return True
        if kind == Kind.CLEARED:
            # The next request starts from nothing; what the server still caches is not sent.
            self.context_used = 0
            return True
        return False

    def _show(self, item: dict | Block, ops: list[LiveOp], render: bool, *, known: bool | None = None) -> None:
        """Put ``item`` on the page: a new one at the end, a known one in its place.
        ``known`` overrides what the view saw (a page primed after the item appeared)."""
        dom_id = item.dom_id if isinstance(item, Block) else item["dom_id"]
        if known is None:
            known = dom_id in self.items
        self.items[dom_id] = item
        self.item_exchange.setdefault(dom_id, self.exchange)
        if render:
            html = render_item(self._decorated(dom_id, item))
            if known:
                ops.append({"op": "replace", "id": dom_id, "html": html})
            else:
                ops.append({"op": "append", "target": "transcript", "html": html})

    def _close(self, ops: list[LiveOp], render: bool) -> None:
        if self.block is None:
            return
        self.block.open = False
        self._show(self.block, ops, render)
        self.block = None

    def feed(self, event, *, render: bool = True) -> list[LiveOp]:
        ops = self._feed(event, render)
        if self._follow_context(event.kind, event.payload) and render:
            ops.append({"op": "replace", "id": "context-gauge", "html": render_gauge(self.gauge())})
        return ops

    def _allowances_op(self, event) -> ReplaceOp:
        events = (self.allowance_events(event.seq) if self.allowance_events is not None
                  else self.allowance_seen)
        in_force = transcript_allowances(events)
        return {"op": "replace", "id": "allowances",
                "html": render_allowances(allowance_items(in_force, self.session_id, self.viewer))}

    def _feed(self, event, render: bool) -> list[LiveOp]:
        ops: list[LiveOp] = []
        handler = self._HANDLERS.get(event.kind, TranscriptView._on_item)
        handler(self, event, render, ops)
        return ops

    # --- one handler per kind (``_HANDLERS``); each appends its operations to ``ops`` ---

    def _on_allowance_revoked(self, event, render: bool, ops: list[LiveOp]) -> None:
        self.allowance_seen.append(event)
        if render:
            ops.append(self._allowances_op(event))
        self._show(event_item(event, self.session_id), ops, render)

    def _on_answered(self, event, render: bool, ops: list[LiveOp]) -> None:
        # An answer may grant an allowance (its scope): the list follows; the answer itself
        # belongs to its call's row.
        self.allowance_seen.append(event)
        if render and event.payload.get("scope"):
            ops.append(self._allowances_op(event))
        self._on_tool(event, render, ops)

    def _on_status(self, event, render: bool, ops: list[LiveOp]) -> None:
        payload = event.payload
        if render:
            ops.append({"op": "status", "status": payload.get("status"), "html": render_status(payload["status"])})
        if is_restart(payload):  # the one status event that shows: a note, like a stop's
            self._close(ops, render)
            self._show(event_item(event, self.session_id), ops, render)

    def _on_catalogue(self, event, render: bool, ops: list[LiveOp]) -> None:
        if render:
            html = render_to_string("sessions_app/_tool_list.html",
                                    {"tools": event.payload.get("tools", []), "machine_name": self.machine_name,
                                     "template": template_info(self.ready)})
            ops.append({"op": "replace", "id": "tool-list", "html": html})

    def _on_turn_end(self, event, render: bool, ops: list[LiveOp]) -> None:
        self._close(ops, render)  # shows nothing but ends the reply block

    def _on_queued(self, event, render: bool, ops: list[LiveOp]) -> None:
        if render:
            ops.append({"op": "append", "target": "queue",
                        "html": render_queued(self.session_id, event.payload, self.viewer)})

    def _on_dropped(self, event, render: bool, ops: list[LiveOp]) -> None:
        if render:
            ops.append({"op": "remove", "id": f"q-{event.payload.get('id')}"})

    def _on_tool(self, event, render: bool, ops: list[LiveOp]) -> None:
        kind = event.kind
        if kind == Kind.TOOL_START:
            self._close(ops, render)
        call_id = event.payload.get("id", "")
        if call_id not in self.calls:
            # A call begins with its tool_start: only a view that missed it asks for the rest.
            missed = kind != Kind.TOOL_START and self.call_events is not None
            self.calls[call_id] = list(self.call_events(call_id, event.seq)) if missed else []
        self.calls[call_id].append(event)
        if any(e.kind == Kind.TOOL_START for e in self.calls[call_id]):
            # A call's row appears with its tool_start and is redrawn in place after.
            item = {**tool_item(self.calls[call_id]), "session_id": self.session_id,
                    "can_act": self.viewer.can_act, "can_grant": self.viewer.can_grant}
            self._show(item, ops, render, known=kind != Kind.TOOL_START)

    def _on_settings(self, event, render: bool, ops: list[LiveOp]) -> None:
        payload = event.payload
        if render:
            # The controls that show a setting follow a change made elsewhere.
            if payload.get("permission_mode"):
                ops.append({"op": "value", "id": "permission-mode", "value": payload["permission_mode"]})
            if payload.get("visibility"):
                ops.append({"op": "value", "id": "visibility", "value": payload["visibility"]})
            if "takes_images" in payload:
                # The composer offers attachments only while the model takes images.
                ops.append({"op": "replace", "id": "attach",
                            "html": render_to_string("sessions_app/_attach.html",
                                                     attach_context(bool(payload["takes_images"])))})
            if "title" in payload:
                # A rename: the heading (and, through it, the tab title: session.js) follows,
                # and so do the title fields (Rename, Settings): saving one never puts the old
                # title back.
                title = payload["title"] or f"Session {self.session_id}"
                ops.append({"op": "replace", "id": "session-title",
                            "html": render_to_string("sessions_app/_title.html", {"title": title})})
                ops.append({"op": "value", "id": "rename-title", "value": payload["title"]})
                ops.append({"op": "value", "id": "id_title", "value": payload["title"]})
            if payload.get("model"):
                ops.append({"op": "replace", "id": "model-name",
                            "html": render_to_string("sessions_app/_model_name.html",
                                                     {"name": payload["model"], "key": payload.get("model_key", "")})})
        self._on_item(event, render, ops)

    def _on_note(self, event, render: bool, ops: list[LiveOp]) -> None:
        # Shown after the open block (if any) without closing it.
        self._show(event_item(event, self.session_id), ops, render)

    def _on_block_text(self, event, render: bool, ops: list[LiveOp]) -> None:
        block_type = BLOCK_KINDS[event.kind]
        text = event.payload.get("text", "")
        if self.block is not None and self.block.type == block_type:
            self.block.parts.append(text)
            found = self.block.new_formulas()
            if render:
                ops.append({"op": "text", "id": self.block.dom_id, "text": text})
                if found:
                    ops.append({"op": "append", "target": f"{self.block.dom_id}-math",
                                "html": render_to_string("sessions_app/_formulas.html",
                                                         {"formulas": formula_items(found)})})
            return
        self._close(ops, render)
        self.block = Block(block_type, event.seq, [text])
        self.block.new_formulas()
        self._show(self.block, ops, render)

    def _on_version_chosen(self, event, render: bool, ops: list[LiveOp]) -> None:
        self._close(ops, render)
        ops.extend(self._version_ops(self.versions.feed(event), render))

    def _on_server_ready(self, event, render: bool, ops: list[LiveOp]) -> None:
        self.ready = dict(event.payload)
        self._on_item(event, render, ops)
        if render:  # the header says what the new server's model can do
            payload = event.payload
            ops.append({"op": "replace", "id": "model-details",
                        "html": render_model_details(payload.get("model", ""), payload.get("model_key", ""),
                                                     payload.get("model_facts") or {}, template_info(self.ready),
                                                     context_size(payload, None))})

    def _on_item(self, event, render: bool, ops: list[LiveOp]) -> None:
        """Every other kind: it closes the open block and shows as an item of its own."""
        kind, payload = event.kind, event.payload
        self._close(ops, render)
        change = None
        if kind == Kind.MESSAGE_TAKEN:
            self.exchange = event.seq
            change = self.versions.feed(event)
            if payload.get("queued_id") and render:
                ops.append({"op": "remove", "id": f"q-{payload['queued_id']}"})
        elif kind == Kind.CLEARED:
            self.versions.feed(event)
        item = event_item(event, self.session_id)
        if item is not None and item.get("context_exceeded"):
            # The Clear it offers is drawn for this viewer (only whom may clear sees it).
            item.update(session_id=self.session_id, can_manage=self.viewer.access >= Access.MANAGE)
        if item is not None:
            self._show(item, ops, render)
        ops.extend(self._version_ops(change, render))

    _HANDLERS: dict[Kind, Callable[[TranscriptView, Any, bool, list[LiveOp]], None]] = {
        Kind.ALLOWANCE_REVOKED: _on_allowance_revoked,
        Kind.ANSWERED: _on_answered,
        Kind.STATUS: _on_status,
        Kind.CATALOGUE: _on_catalogue,
        Kind.TURN_END: _on_turn_end,
        Kind.MESSAGE_QUEUED: _on_queued,
        Kind.MESSAGE_DROPPED: _on_dropped,
        Kind.TOOL_START: _on_tool,
        Kind.TOOL_RUNNING: _on_tool,
        Kind.TOOL_END: _on_tool,
        Kind.QUESTION: _on_tool,
        Kind.SETTINGS: _on_settings,
        Kind.INTERRUPTED: _on_note,
        Kind.SERVER_STOPPED: _on_note,
        Kind.ASSISTANT_TEXT: _on_block_text,
        Kind.REASONING: _on_block_text,
        Kind.VERSION_CHOSEN: _on_version_chosen,
        Kind.SERVER_READY: _on_server_ready,
    }

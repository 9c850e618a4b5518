"""What the browser sees of a transcript: display items and live operations (docs/behaviour.md §12).

Both the first paint and the live updates go through the same templates
(``sessions_app/_item.html``), so a reloaded page and a live one look the same. HTML
is only ever produced by templates (autoescaped) and by the Markdown sanitiser.

Blocks: consecutive ``assistant_text`` fragments form one assistant block, consecutive
``reasoning`` fragments one reasoning block. While a block is open the browser appends
fragments as plain text; when it closes it is replaced by its rendered Markdown.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from django.template.loader import render_to_string

from .markdown import render_markdown
from .models import Access, AgentSession
from .transcript import Kind, actor

#: Kinds that neither show nor close a block.
SILENT_KINDS = frozenset({Kind.STATUS, Kind.CATALOGUE})
#: Kinds that show nothing but end the reply block (an interrupted reply has no usage).
CLOSING_KINDS = frozenset({Kind.TURN_END})
#: The queue's kinds: shown apart from the transcript (pending bubbles), closing nothing.
QUEUE_KINDS = frozenset({Kind.MESSAGE_QUEUED, Kind.MESSAGE_DROPPED})
#: Notes that may arrive while a reply still streams (an interrupt is seen a moment after
#: the click): shown after the block, never splitting it.
NOTE_KINDS = frozenset({Kind.INTERRUPTED})
#: Kinds that belong to one tool call's row (keyed by the call id in the payload).
TOOL_KINDS = frozenset({Kind.TOOL_START, Kind.TOOL_RUNNING, Kind.TOOL_END, Kind.QUESTION, Kind.ANSWERED})


@dataclass(frozen=True)
class Viewer:
    """Who a page is rendered for: it decides which buttons show (question answers,
    withdraw). The views check again on every click; hiding is for the person's sake."""

    user_id: int | None = None
    access: Access = Access.MANAGE

    @property
    def can_act(self) -> bool:
        return self.access >= Access.ACT


#: The session's owner (and what tests of the page's shape use when no viewer matters).
OWNER = Viewer()


def _username(payload) -> str:
    who = actor(payload)
    return who["username"] if who else ""


def queued_item(payload: dict, viewer: Viewer = OWNER) -> dict:
    """A pending bubble: the message, its author, and whether this viewer may withdraw it."""
    author = actor(payload)
    return {
        "id": payload.get("id", ""),
        "text": payload.get("text", ""),
        "author": author["username"] if author else "",
        "can_withdraw": viewer.access.may_withdraw(viewer.user_id, author["id"] if author else None),
    }


def tool_item(events: Iterable) -> dict:
    """One call's row from its events, in order: the call, whether it ran, the question
    and its answer, the output (docs/behaviour.md §12: questions appear on the tool's own row)."""
    item: dict = {"type": "tool", "question_open": False, "answer": None, "output": None, "running": False}
    for event in events:
        payload = event.payload
        if event.kind == Kind.TOOL_START:
            item.update(
                call_id=payload.get("id", ""),
                dom_id=f"tool-{payload.get('id', '')}",
                tool=payload.get("tool", ""),
                display_name=payload.get("display_name") or payload.get("tool", ""),
                input=payload.get("input"),
                arguments=payload.get("arguments", ""),
                raw_arguments=payload.get("raw_arguments"),
                origin=payload.get("origin"),
                server=payload.get("server"),
                writes=payload.get("writes"),
            )
        elif event.kind == Kind.TOOL_RUNNING:
            item["running"] = True
        elif event.kind == Kind.QUESTION:
            item["question_open"] = True
        elif event.kind == Kind.ANSWERED:
            item["question_open"] = False
            item["answer"] = payload
            item["answered_by"] = _username(payload)
        elif event.kind == Kind.TOOL_END:
            item["running"] = False
            item["output"] = payload.get("output", "")
            item["ok"] = payload.get("ok", True)
    return item
BLOCK_KINDS = {Kind.ASSISTANT_TEXT: "assistant", Kind.REASONING: "reasoning"}


@dataclass
class Block:
    type: str  # "assistant" | "reasoning"
    start_seq: int
    parts: list[str] = field(default_factory=list)
    open: bool = True

    @property
    def dom_id(self) -> str:
        return f"{self.type[0]}-{self.start_seq}"

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def as_item(self) -> dict:
        text = self.text
        item = {"type": self.type, "dom_id": self.dom_id, "text": text, "open": self.open}
        if not self.open and self.type == "assistant":
            item["html"] = render_markdown(text)
        return item


def _setting(key: str, value) -> str:
    """A settings value as a person reads it: ``{"top_k": 40}`` → ``top_k=40``."""
    if key == "visibility" and value in AgentSession.Visibility.values:
        return AgentSession.Visibility(value).label.lower()
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "defaults"
    return str(value)


def usage_line(usage: dict) -> str:
    """A ``usage`` payload as one line: ``"context 812 tokens · 790 warm · reply 41 tokens ·
    38.2 tok/s · seed 7 · finish: length"``; parts the server did not report are left out,
    and so are their separators. *Warm* is how many prompt tokens came from the prompt
    cache — kept by the server, or restored from a saved slot (docs/behaviour.md §5):
    ``cached_tokens``, else llama-server's own ``cache_n``."""
    parts = []
    if usage.get("prompt_tokens") is not None:
        parts.append(f"context {usage['prompt_tokens']} tokens")
    warm = usage.get("cached_tokens", usage.get("cache_n"))
    if warm is not None:
        parts.append(f"{warm} warm")
    if usage.get("completion_tokens") is not None:
        parts.append(f"reply {usage['completion_tokens']} tokens")
    speed = usage.get("predicted_per_second")
    if isinstance(speed, int | float) and speed:
        parts.append(f"{speed:.1f} tok/s")
    if usage.get("seed") is not None:
        parts.append(f"seed {usage['seed']}")
    if usage.get("finish_reason") and usage["finish_reason"] != "stop":
        parts.append(f"finish: {usage['finish_reason']}")
    return " · ".join(parts)


def event_item(event) -> dict | None:
    """The display item of one non-block event, or None when it shows nothing by itself."""
    kind, payload, seq = event.kind, event.payload, event.seq
    dom_id = f"ev-{seq}"
    if kind == Kind.MESSAGE_TAKEN:
        return {"type": "user", "dom_id": dom_id, "text": payload.get("text", ""), "author": _username(payload)}
    if kind == Kind.ERROR:
        return {"type": "error", "dom_id": dom_id, "message": payload.get("message", "")}
    if kind == Kind.NOTICE:
        return {"type": "note", "dom_id": dom_id, "text": payload.get("message", "")}
    if kind == Kind.USAGE:
        return {"type": "usage", "dom_id": dom_id, "usage": payload, "line": usage_line(payload)}
    if kind == Kind.CLEARED:
        return {"type": "cleared", "dom_id": dom_id, "by": _username(payload)}
    if kind == Kind.INTERRUPTED:
        return {"type": "note", "dom_id": dom_id, "text": f"Interrupted by {_username(payload) or 'someone'}."}
    if kind == Kind.SERVER_STOPPED:
        who = _username(payload)
        if payload.get("reason") == "idle":
            # docs/behaviour.md §5 "sleep": the prompt cache was saved; the next message wakes it.
            text = f"llama-server put to sleep by {who}." if who else "llama-server put to sleep after its idle time."
            return {"type": "note", "dom_id": dom_id, "text": text + " The next message starts it again."}
        return {"type": "note", "dom_id": dom_id, "text": f"llama-server stopped by {who}." if who else "llama-server stopped."}
    if kind == Kind.SERVER_READY:
        text = f"llama-server is ready with {payload.get('model', '')}."
        if payload.get("warm_tokens"):
            text += f" Prompt cache restored: {payload['warm_tokens']} tokens warm."
        return {"type": "note", "dom_id": dom_id, "text": text}
    if kind == Kind.SETTINGS:
        parts = ", ".join(f"{key} → {_setting(key, value)}" for key, value in payload.items() if key != "by")
        who = _username(payload)
        return {"type": "note", "dom_id": dom_id, "text": f"{who} changed settings: {parts}" if who else f"Settings: {parts}"}
    return None


def build_items(events: Iterable, session_id: int = 0, viewer: Viewer = OWNER) -> list[dict]:
    """The display items of a whole transcript, in page order (first paint), for
    ``viewer``: the :class:`TranscriptView` fold over every event, without operations."""
    view = TranscriptView(session_id, viewer=viewer)
    view.prime(events)
    return view.page_items()


def prime_window(events: list) -> list:
    """The events a :class:`TranscriptView` needs to pick up a page that already shows
    ``events`` (in seq order): those after the last one that leaves nothing open (a block
    may still be streaming, notes may follow it). The rest are already final on the page."""
    quiet = set(BLOCK_KINDS) | SILENT_KINDS | QUEUE_KINDS | NOTE_KINDS
    start = 0
    for index, event in enumerate(events):
        if event.kind not in quiet:
            start = index + 1
    return events[start:]


def render_item(item: dict) -> str:
    return render_to_string("sessions_app/_item.html", {"item": item})


def render_queued(session_id: int, payload: dict, viewer: Viewer = OWNER) -> str:
    return render_to_string("sessions_app/_queued.html", {"q": queued_item(payload, viewer), "session_id": session_id})


def render_presence(usernames: list[str]) -> str:
    """The "watching now" line of a session page (first paint and every change)."""
    return render_to_string("sessions_app/_presence.html", {"watching": usernames})


def render_status(status: str) -> str:
    return render_to_string("sessions_app/_status.html", {"status": status})


class TranscriptView:
    """The one fold from transcript events to what the browser shows.

    Fed events in sequence order, it keeps the page's items (``#transcript``, in page
    order: :meth:`page_items` is the first paint) and returns, for each event, the
    operations that bring a page showing the events before it up to date (live
    updates). So a reloaded page and a live one are two uses of the same rules
    (``tests/test_one_renderer.py`` proves page(events[:k]) + live(events[k:]) ==
    page(events) for every k).

    One per websocket connection, or one per first paint. :meth:`prime` feeds events
    the page already has, without operations. Operations (JSON-able dicts):
    ``{"op": "append", "target": id, "html": …}``, ``{"op": "text", "id": id, "text": …}``,
    ``{"op": "replace", "id": id, "html": …}``, ``{"op": "remove", "id": id}``,
    ``{"op": "status", "status": …, "html": …}``, ``{"op": "value", "id": id, "value": …}``
    (a control that follows a setting changed elsewhere), ``{"op": "reload"}`` (added by
    the consumer when the viewer's rights changed). Buttons are rendered for ``viewer``,
    the same on first paint and live. The queue (``#queue``), the status badge, the tool
    list and the header are drawn from the session on first paint; only their live
    operations come from here.

    ``call_events(call_id, before_seq)`` returns the earlier events of a tool call the
    view did not see (a page primed after that call started).
    """

    def __init__(self, session_id: int, call_events=None, machine_name: str = "", viewer: Viewer = OWNER) -> None:
        self.session_id = session_id
        self.machine_name = machine_name
        self.viewer = viewer
        self.call_events = call_events
        self.block: Block | None = None
        # dom id → item, in page order; a reply block stays a Block (made an item when
        # shown), so a long reply is not joined again at every fragment.
        self.items: dict[str, dict | Block] = {}
        self.calls: dict[str, list] = {}  # call id → the call's events seen so far

    def prime(self, events: Iterable) -> None:
        for event in events:
            self.feed(event, render=False)

    def page_items(self) -> list[dict]:
        return [item.as_item() if isinstance(item, Block) else item for item in self.items.values()]

    def _show(self, item: dict | Block, ops: list[dict], render: bool, *, known: bool | None = None) -> None:
        """Put ``item`` on the page: a new one at the end, a known one in its place.
        ``known`` overrides what the view saw (a page primed after the item appeared)."""
        dom_id = item.dom_id if isinstance(item, Block) else item["dom_id"]
        if known is None:
            known = dom_id in self.items
        self.items[dom_id] = item
        if render:
            html = render_item(item.as_item() if isinstance(item, Block) else item)
            if known:
                ops.append({"op": "replace", "id": dom_id, "html": html})
            else:
                ops.append({"op": "append", "target": "transcript", "html": html})

    def _close(self, ops: list[dict], render: bool) -> None:
        if self.block is None:
            return
        self.block.open = False
        self._show(self.block, ops, render)
        self.block = None

    def feed(self, event, *, render: bool = True) -> list[dict]:
        ops: list[dict] = []
        kind, payload = event.kind, event.payload
        if kind == Kind.STATUS:
            if render:
                ops.append({"op": "status", Kind.STATUS: payload.get("status"), "html": render_status(payload["status"])})
            return ops
        if kind == Kind.CATALOGUE:
            if render:
                html = render_to_string("sessions_app/_tool_list.html",
                                        {"tools": payload.get("tools", []), "machine_name": self.machine_name})
                ops.append({"op": "replace", "id": "tool-list", "html": html})
            return ops
        if kind in SILENT_KINDS:
            return ops
        if kind in CLOSING_KINDS:
            self._close(ops, render)
            return ops
        if kind == Kind.MESSAGE_QUEUED:
            if render:
                html = render_queued(self.session_id, payload, self.viewer)
                ops.append({"op": "append", "target": "queue", "html": html})
            return ops
        if kind == Kind.MESSAGE_DROPPED:
            return [{"op": "remove", "id": f"q-{payload.get('id')}"}] if render else []
        if kind in TOOL_KINDS:
            if kind == Kind.TOOL_START:
                self._close(ops, render)
            call_id = payload.get("id", "")
            if call_id not in self.calls:
                self.calls[call_id] = list(self.call_events(call_id, event.seq)) if self.call_events else []
            self.calls[call_id].append(event)
            if any(e.kind == Kind.TOOL_START for e in self.calls[call_id]):
                # A call's row appears with its tool_start and is redrawn in place after.
                item = {**tool_item(self.calls[call_id]), "session_id": self.session_id,
                        "can_act": self.viewer.can_act}
                self._show(item, ops, render, known=kind != Kind.TOOL_START)
            return ops
        if kind == Kind.SETTINGS and payload.get("permission_mode") and render:
            ops.append({"op": "value", "id": "permission-mode", "value": payload["permission_mode"]})
        if kind == Kind.SETTINGS and payload.get("visibility") and render:
            ops.append({"op": "value", "id": "visibility", "value": payload["visibility"]})
        if kind == Kind.SETTINGS and payload.get("model") and render:
            ops.append({"op": "replace", "id": "model-name",
                        "html": render_to_string("sessions_app/_model_name.html", {"name": payload["model"],
                                                                                   "key": payload.get("model_key", "")})})
        if kind in NOTE_KINDS:
            # Shown after the open block (if any) without closing it.
            self._show(event_item(event), ops, render)
            return ops
        block_type = BLOCK_KINDS.get(kind)
        text = payload.get("text", "")
        if block_type and self.block is not None and self.block.type == block_type:
            self.block.parts.append(text)
            if render:
                ops.append({"op": "text", "id": self.block.dom_id, "text": text})
            return ops
        self._close(ops, render)
        if block_type:
            self.block = Block(block_type, event.seq, [text])
            self._show(self.block, ops, render)
            return ops
        if kind == Kind.MESSAGE_TAKEN and payload.get("queued_id") and render:
            ops.append({"op": "remove", "id": f"q-{payload['queued_id']}"})
        item = event_item(event)
        if item is not None:
            self._show(item, ops, render)
        return ops

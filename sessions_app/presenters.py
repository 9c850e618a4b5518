"""What the browser sees of a transcript: display items and live operations (SPEC §12).

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
from .transcript import actor

#: Kinds that neither show nor close a block.
SILENT_KINDS = frozenset({"status", "catalogue"})
#: Kinds that show nothing but end the reply block (an interrupted reply has no usage).
CLOSING_KINDS = frozenset({"turn_end"})
#: The queue's kinds: shown apart from the transcript (pending bubbles), closing nothing.
QUEUE_KINDS = frozenset({"message_queued", "message_dropped"})
#: Notes that may arrive while a reply still streams (an interrupt is seen a moment after
#: the click): shown after the block, never splitting it.
NOTE_KINDS = frozenset({"interrupted"})
#: Kinds that belong to one tool call's row (keyed by the call id in the payload).
TOOL_KINDS = frozenset({"tool_start", "tool_running", "tool_end", "question", "answered"})


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
    and its answer, the output (SPEC §12: questions appear on the tool's own row)."""
    item: dict = {"type": "tool", "question_open": False, "answer": None, "output": None, "running": False}
    for event in events:
        payload = event.payload
        if event.kind == "tool_start":
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
        elif event.kind == "tool_running":
            item["running"] = True
        elif event.kind == "question":
            item["question_open"] = True
        elif event.kind == "answered":
            item["question_open"] = False
            item["answer"] = payload
            item["answered_by"] = _username(payload)
        elif event.kind == "tool_end":
            item["running"] = False
            item["output"] = payload.get("output", "")
            item["ok"] = payload.get("ok", True)
    return item
BLOCK_KINDS = {"assistant_text": "assistant", "reasoning": "reasoning"}


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


def event_item(event) -> dict | None:
    """The display item of one non-block event, or None when it shows nothing by itself."""
    kind, payload, seq = event.kind, event.payload, event.seq
    dom_id = f"ev-{seq}"
    if kind == "message_taken":
        return {"type": "user", "dom_id": dom_id, "text": payload.get("text", ""), "author": _username(payload)}
    if kind == "error":
        return {"type": "error", "dom_id": dom_id, "message": payload.get("message", "")}
    if kind == "usage":
        return {"type": "usage", "dom_id": dom_id, "usage": payload}
    if kind == "cleared":
        return {"type": "cleared", "dom_id": dom_id, "by": _username(payload)}
    if kind == "interrupted":
        return {"type": "note", "dom_id": dom_id, "text": f"Interrupted by {_username(payload) or 'someone'}."}
    if kind == "server_stopped":
        who = _username(payload)
        return {"type": "note", "dom_id": dom_id, "text": f"llama-server stopped by {who}." if who else "llama-server stopped."}
    if kind == "server_ready":
        return {"type": "note", "dom_id": dom_id, "text": f"llama-server is ready with {payload.get('model', '')}."}
    if kind == "settings":
        parts = ", ".join(f"{key} → {_setting(key, value)}" for key, value in payload.items() if key != "by")
        who = _username(payload)
        return {"type": "note", "dom_id": dom_id, "text": f"{who} changed settings: {parts}" if who else f"Settings: {parts}"}
    return None


def build_items(events: Iterable, session_id: int = 0, viewer: Viewer = OWNER) -> list[dict]:
    """The display items of a whole transcript, in order (first paint), for ``viewer``."""
    items: list[dict] = []
    block: Block | None = None
    calls: dict[str, list] = {}
    held_notes: list[dict] = []
    for event in events:
        if event.kind in NOTE_KINDS and block is not None:
            held_notes.append(event_item(event))
            continue
        if event.kind in TOOL_KINDS:
            call_id = event.payload.get("id", "")
            if event.kind == "tool_start":
                calls[call_id] = []
                if block is not None:
                    block.open = False
                    items.append(block.as_item())
                    block = None
                items.append({"type": "tool-placeholder", "call_id": call_id})
            calls.setdefault(call_id, []).append(event)
            continue
        block_type = BLOCK_KINDS.get(event.kind)
        if event.kind in SILENT_KINDS or event.kind in QUEUE_KINDS:
            continue
        if block_type:
            if block is not None and block.type == block_type:
                block.parts.append(event.payload.get("text", ""))
                continue
            if block is not None:
                block.open = False
                items.append(block.as_item())
            block = Block(block_type, event.seq, [event.payload.get("text", "")])
            continue
        if block is not None:
            block.open = False
            items.append(block.as_item())
            block = None
        items.extend(held_notes)
        held_notes = []
        item = event_item(event)
        if item is not None:
            items.append(item)
    if block is not None:
        items.append(block.as_item())
    items.extend(held_notes)
    return [
        {**tool_item(calls[item["call_id"]]), "session_id": session_id, "can_act": viewer.can_act}
        if item["type"] == "tool-placeholder" else item
        for item in items
    ]


def render_item(item: dict) -> str:
    return render_to_string("sessions_app/_item.html", {"item": item})


def render_queued(session_id: int, payload: dict, viewer: Viewer = OWNER) -> str:
    return render_to_string("sessions_app/_queued.html", {"q": queued_item(payload, viewer), "session_id": session_id})


def render_presence(usernames: list[str]) -> str:
    """The "watching now" line of a session page (first paint and every change)."""
    return render_to_string("sessions_app/_presence.html", {"watching": usernames})


def render_status(status: str) -> str:
    return render_to_string("sessions_app/_status.html", {"status": status})


class LiveRenderer:
    """Turns events, fed in sequence order, into browser operations.

    One per websocket connection. ``prime()`` feeds events the browser already has (to
    know an open block) without producing operations. Operations (JSON-able dicts):
    ``{"op": "append", "target": id, "html": …}``, ``{"op": "text", "id": id, "text": …}``,
    ``{"op": "replace", "id": id, "html": …}``, ``{"op": "remove", "id": id}``,
    ``{"op": "status", "status": …, "html": …}``, ``{"op": "value", "id": id, "value": …}``
    (a control that follows a setting changed elsewhere), ``{"op": "reload"}`` (added by
    the consumer when the viewer's rights changed). Buttons are rendered for
    ``viewer``, as on the first paint.
    """

    def __init__(self, session_id: int, call_events=None, machine_name: str = "", viewer: Viewer = OWNER) -> None:
        self.session_id = session_id
        self.machine_name = machine_name
        self.viewer = viewer
        self.block: Block | None = None
        # call id → that call's events so far (read from the database by the consumer).
        self.call_events = call_events

    def prime(self, events: Iterable) -> None:
        for event in events:
            self.feed(event, render=False)

    def _close(self, ops: list[dict], render: bool) -> None:
        if self.block is None:
            return
        self.block.open = False
        if render:
            ops.append({"op": "replace", "id": self.block.dom_id, "html": render_item(self.block.as_item())})
        self.block = None

    def feed(self, event, *, render: bool = True) -> list[dict]:
        ops: list[dict] = []
        kind, payload = event.kind, event.payload
        if kind == "status":
            if render:
                ops.append({"op": "status", "status": payload.get("status"), "html": render_status(payload["status"])})
            return ops
        if kind == "catalogue":
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
        if kind == "message_queued":
            if render:
                html = render_queued(self.session_id, payload, self.viewer)
                ops.append({"op": "append", "target": "queue", "html": html})
            return ops
        if kind == "message_dropped":
            return [{"op": "remove", "id": f"q-{payload.get('id')}"}] if render else []
        if kind in TOOL_KINDS:
            if kind == "tool_start":
                self._close(ops, render)
            if render and self.call_events is not None:
                item = tool_item([*self.call_events(payload.get("id", ""), event.seq), event])
                item["session_id"] = self.session_id
                item["can_act"] = self.viewer.can_act
                html = render_item(item)
                if kind == "tool_start":
                    ops.append({"op": "append", "target": "transcript", "html": html})
                else:
                    ops.append({"op": "replace", "id": item["dom_id"], "html": html})
            return ops
        if kind == "settings" and payload.get("permission_mode") and render:
            ops.append({"op": "value", "id": "permission-mode", "value": payload["permission_mode"]})
        if kind == "settings" and payload.get("visibility") and render:
            ops.append({"op": "value", "id": "visibility", "value": payload["visibility"]})
        if kind == "settings" and payload.get("model") and render:
            ops.append({"op": "replace", "id": "model-name",
                        "html": render_to_string("sessions_app/_model_name.html", {"name": payload["model"],
                                                                                   "key": payload.get("model_key", "")})})
        if kind in NOTE_KINDS:
            # Appended after the open block (if any) without closing it.
            return [{"op": "append", "target": "transcript", "html": render_item(event_item(event))}] if render else []
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
            if render:
                ops.append({"op": "append", "target": "transcript", "html": render_item(self.block.as_item())})
            return ops
        if kind == "message_taken" and payload.get("queued_id") and render:
            ops.append({"op": "remove", "id": f"q-{payload['queued_id']}"})
        item = event_item(event)
        if item is not None and render:
            ops.append({"op": "append", "target": "transcript", "html": render_item(item)})
        return ops

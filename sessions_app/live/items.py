"""What each transcript event shows on the session page: its display item (a dict the
templates draw) and the kinds that decide how events group (docs/behaviour.md §12).

HTML is only ever produced by templates (autoescaped) and by the Markdown sanitiser. The
fold that puts these items in page order, first paint and live alike, is
:class:`sessions_app.live.transcript_view.TranscriptView`; the sentences of settings,
usage and progress are :mod:`sessions_app.live.sentences`'.

Blocks: consecutive ``assistant_text`` fragments form one assistant block, consecutive
``reasoning`` fragments one reasoning block. While a block is open the browser appends
fragments as plain text; when it closes it is replaced by its rendered Markdown.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from django.template.loader import render_to_string
from django.urls import reverse

from .. import allowances, callcard, images, text_files
from ..export import imported_text
from ..models import Access
from ..transcript import Kind, actor, image_refs
from .markdown import formula_html, render_markdown, reply_formulas
from .sentences import settings_text, usage_line, username

#: Kinds that neither show nor close a block (but a Restart's ``status``: :func:`is_restart`).
SILENT_KINDS = frozenset({Kind.STATUS, Kind.CATALOGUE})
#: Kinds that show nothing but end the reply block (an interrupted reply has no usage).
CLOSING_KINDS = frozenset({Kind.TURN_END})
#: The queue's kinds: shown apart from the transcript (pending bubbles), closing nothing.
QUEUE_KINDS = frozenset({Kind.MESSAGE_QUEUED, Kind.MESSAGE_DROPPED})
#: Notes that may arrive while a reply still streams (an interrupt is seen a moment after
#: the click; a server stopped under a reply is said stopped before its last fragment is
#: stored): shown after the block, never splitting it.
NOTE_KINDS = frozenset({Kind.INTERRUPTED, Kind.SERVER_STOPPED})
#: Kinds that belong to one tool call's row (keyed by the call id in the payload).
TOOL_KINDS = frozenset({Kind.TOOL_START, Kind.TOOL_RUNNING, Kind.TOOL_END, Kind.QUESTION, Kind.ANSWERED})
#: The kinds :class:`transcript.Versions` folds: which messages are versions of one another.
VERSION_KINDS = (Kind.MESSAGE_TAKEN, Kind.VERSION_CHOSEN, Kind.CLEARED)
#: The kinds :func:`transcript.allowances` folds: the list of allowances follows them.
ALLOWANCE_KINDS = (Kind.ANSWERED, Kind.ALLOWANCE_REVOKED)


@dataclass(frozen=True)
class Viewer:
    """Who a page is rendered for: it decides which buttons show (question answers,
    withdraw). The views check again on every click; hiding is for the person's sake."""

    user_id: int | None = None
    access: Access = Access.MANAGE
    #: Whether "always" is offered (actions.may_grant_always); None: as the access says
    #: (the owner and staff may, a member who may only act may not).
    may_grant: bool | None = None

    @property
    def can_act(self) -> bool:
        return self.access >= Access.ACT

    @property
    def can_grant(self) -> bool:
        if self.may_grant is not None:
            return self.may_grant and self.can_act
        return self.access >= Access.MANAGE


#: The session's owner (and what tests of the page's shape use when no viewer matters).
OWNER = Viewer()


def image_items(session_id: int, payload) -> list[dict]:
    """The thumbnails of a user message: each image's URL under its session (the only way
    to fetch it, docs/security.md), a text alternative (``image 1 of 2, PNG, 14 KB``) and,
    for an image no longer stored, the sentence shown in its place (``missing``)."""
    refs = image_refs(payload)
    kept = images.stored({ref["sha256"] for ref in refs})
    return [
        {
            "url": reverse("session_image", args=[session_id, ref["sha256"],
                                                  images.EXTENSIONS.get(ref["media_type"], "bin")]),
            "alt": f"image {number} of {len(refs)}, {ref['media_type'].removeprefix('image/').upper()}, "
                   f"{images.megabytes(ref['size'])}",
            # Said in words in place of a broken thumbnail (docs/behaviour.md §16).
            "missing": "" if ref["sha256"] in kept else
                       f"Image {number} is no longer stored in Corral: the model does not see it.",
        }
        for number, ref in enumerate(refs, start=1)
    ]


def attach_context(takes_images: bool) -> dict:
    """What the composer's attach control (``_attach.html``) shows: images offered only when
    the session's model takes them (docs/behaviour.md §16), text files always; with the limits."""
    return {"takes_images": takes_images, "image_accept": images.ACCEPT, "image_limits": images.limits_sentence(),
            "image_max_bytes": images.max_bytes(), "image_max_count": images.max_count(),
            "text_limits": text_files.limits_sentence(), "text_max_bytes": text_files.max_bytes()}


def queued_item(payload: dict, viewer: Viewer = OWNER, session_id: int = 0) -> dict:
    """A pending bubble: the message, its images, its author, and whether this viewer may
    withdraw it."""
    author = actor(payload)
    return {
        "id": payload.get("id", ""),
        "text": payload.get("text", ""),
        "images": image_items(session_id, payload),
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
                card=callcard.card(payload),
            )
        elif event.kind == Kind.TOOL_RUNNING:
            item["running"] = True
        elif event.kind == Kind.QUESTION:
            item["question_open"] = True
            tool = payload.get("tool", "")
            offers = payload.get("offers") if isinstance(payload.get("offers"), list) else []
            item["offers"] = [{"index": index, "text": always_button(tool, offer.get("scope") or {})}
                              for index, offer in enumerate(offers) if isinstance(offer, dict)]
            item["changed"] = [str(part) for part in payload.get("changed") or []]
            item["claims"] = payload.get("claims", "")
        elif event.kind == Kind.ANSWERED:
            item["question_open"] = False
            item["answer"] = payload
            item["answered_by"] = username(payload)
            scope = payload.get("scope")
            item["answer_scope"] = allowances.label(payload.get("tool") or "", scope) if isinstance(scope, dict) else ""
        elif event.kind == Kind.TOOL_END:
            item["running"] = False
            item["output"] = payload.get("output", "")
            item["ok"] = payload.get("ok", True)
    return item


def always_button(tool: str, scope: Mapping) -> str:
    """The words of an "always" button for one offered scope: "Always allow this exact
    command", "Always allow commands starting with “git status”", "Always allow writes to
    notes.txt", "Always allow writes to files in src/"."""
    kind = scope.get("kind")
    if kind == "exact":
        return "Always allow this exact command"
    if kind == "prefix":
        # Quoted as sh reads it (shlex.join): ["git status"] is one word, never "git" "status".
        words = [str(word) for word in scope.get("words") or []]
        return f"Always allow commands starting with “{callcard.escape(shlex.join(words))}”"
    return f"Always allow {allowances.label(tool, scope)}"


def allowance_items(in_force: Iterable[Mapping], session_id: int, viewer: Viewer = OWNER) -> list[dict]:
    """The session page's list of allowances in force (``transcript.allowances``): what
    each covers in words, who granted it and when, and whether this viewer may revoke it
    (whoever may act: asking again needs no permission)."""
    return [
        {"seq": allowance["seq"], "tool": allowance["tool"], "what": allowances.label(allowance["tool"], allowance["scope"]),
         "by": (allowance.get("by") or {}).get("username", ""), "at": allowance.get("at"),
         "session_id": session_id, "can_revoke": viewer.can_act}
        for allowance in in_force
    ]


def render_allowances(items: list[dict]) -> str:
    return render_to_string("sessions_app/_allowances.html", {"allowances": items})


BLOCK_KINDS = {Kind.ASSISTANT_TEXT: "assistant", Kind.REASONING: "reasoning"}


@dataclass
class Block:
    type: str  # "assistant" | "reasoning"
    start_seq: int
    parts: list[str] = field(default_factory=list)
    open: bool = True
    # The formulas of an open reply, in the order they appeared: the preview of a reply
    # still streaming draws each with the server's MathML (sessions_app/tex.py).
    formulas: list[tuple[str, bool]] = field(default_factory=list)

    def new_formulas(self) -> list[tuple[str, bool]]:
        """The formulas of an assistant block's text not noted before (noted now)."""
        if self.type != "assistant":
            return []
        found = [f for f in reply_formulas(self.text) if f not in self.formulas]
        self.formulas.extend(found)
        return found

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
        elif self.type == "assistant":
            item["math"] = formula_items(self.formulas)
        return item


def formula_items(found: Iterable[tuple[str, bool]]) -> list[dict]:
    """Formulas as the open reply's math list draws them (``sessions_app/_formulas.html``)."""
    return [{"tex": tex, "display": display, "html": formula_html(tex, display)} for tex, display in found]


def is_restart(status_payload) -> bool:
    """Whether a ``status`` payload is a person starting the server again: ``loading`` with
    ``by``, which ``actions.do_restart`` writes for a Restart and ``actions._wake`` for a
    message that wakes a sleeping server (``reason`` ``"wake"``); a first start, a model
    change and the watch's "loading again" name no one in it. Shown as "llama-server
    restarted by alice." or "llama-server woken by a message from alice." (docs/sharing.md,
    "Who did what")."""
    return status_payload.get("status") == "loading" and bool(username(status_payload))


def event_item(event, session_id: int = 0) -> dict | None:
    """The display item of one non-block event, or None when it shows nothing by itself."""
    kind, payload, seq = event.kind, event.payload, event.seq
    dom_id = f"ev-{seq}"
    if kind == Kind.MESSAGE_TAKEN:
        again = ("edited and sent again" if payload.get("edited") else "sent again") if payload.get("replaces") else ""
        return {"type": "user", "dom_id": dom_id, "text": payload.get("text", ""), "author": username(payload),
                "images": image_items(session_id, payload), "again": again}
    if kind == Kind.ERROR:
        return {"type": "error", "dom_id": dom_id, "message": payload.get("message", ""), "log": payload.get("log", ""),
                "context_exceeded": bool(payload.get("context_exceeded"))}
    if kind == Kind.NOTICE:
        return {"type": "note", "dom_id": dom_id, "text": payload.get("message", "")}
    if kind == Kind.USAGE:
        return {"type": "usage", "dom_id": dom_id, "usage": payload, "line": usage_line(payload)}
    if kind == Kind.CLEARED:
        return {"type": "cleared", "dom_id": dom_id, "by": username(payload)}
    if kind == Kind.ALLOWANCE_REVOKED:
        scope = payload.get("scope")
        what = allowances.label(payload.get("tool") or "", scope) if isinstance(scope, dict) else "an allowance"
        return {"type": "note", "dom_id": dom_id,
                "text": f"{username(payload) or 'Someone'} revoked the allowance for {what}: it is asked about again."}
    if kind == Kind.INTERRUPTED:
        return {"type": "note", "dom_id": dom_id, "text": f"Interrupted by {username(payload) or 'someone'}."}
    if kind == Kind.SERVER_STOPPED:
        who = username(payload)
        if payload.get("reason") == "idle":
            # docs/behaviour.md §5 "sleep": the prompt cache was saved; the next message wakes it.
            text = f"llama-server put to sleep by {who}." if who else "llama-server put to sleep after its idle time."
            return {"type": "note", "dom_id": dom_id, "text": text + " The next message starts it again."}
        if payload.get("reason") == "restart":  # the restart's own note names who asked (below)
            return {"type": "note", "dom_id": dom_id, "text": "llama-server stopped for the restart."}
        return {"type": "note", "dom_id": dom_id, "text": f"llama-server stopped by {who}." if who else "llama-server stopped."}
    if kind == Kind.IMPORTED:
        return {"type": "note", "dom_id": dom_id, "text": imported_text(payload)}
    if kind == Kind.STATUS and is_restart(payload):
        if payload.get("reason") == "wake":
            text = f"llama-server woken by a message from {username(payload)}."
            return {"type": "note", "dom_id": dom_id, "text": text}
        return {"type": "note", "dom_id": dom_id, "text": f"llama-server restarted by {username(payload)}."}
    if kind == Kind.SERVER_READY:
        text = f"llama-server is ready with {payload.get('model', '')}."
        if payload.get("warm_tokens"):
            text += f" Prompt cache restored: {payload['warm_tokens']} tokens warm."
        return {"type": "note", "dom_id": dom_id, "text": text}
    if kind == Kind.SETTINGS:
        return {"type": "note", "dom_id": dom_id, "text": settings_text(payload, first=seq == 1)}
    return None


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
    return render_to_string("sessions_app/_queued.html",
                            {"q": queued_item(payload, viewer, session_id), "session_id": session_id})


def render_presence(usernames: list[str]) -> str:
    """The "watching now" line of a session page (first paint and every change)."""
    return render_to_string("sessions_app/_presence.html", {"watching": usernames})

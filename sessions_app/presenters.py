"""What the browser sees of a transcript: display items and live operations (docs/behaviour.md §12).

Both the first paint and the live updates go through the same templates
(``sessions_app/_item.html``), so a reloaded page and a live one look the same. HTML
is only ever produced by templates (autoescaped) and by the Markdown sanitiser.

Blocks: consecutive ``assistant_text`` fragments form one assistant block, consecutive
``reasoning`` fragments one reasoning block. While a block is open the browser appends
fragments as plain text; when it closes it is replaced by its rendered Markdown.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from django.template.loader import render_to_string
from django.urls import reverse

from . import allowances, callcard, images, text_files
from .export import imported_text
from .markdown import formula_html, render_markdown, reply_formulas
from .models import Access, AgentSession
from .transcript import Kind, Versions, actor, image_refs
from .transcript import allowances as transcript_allowances

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



# --- live operations: what :class:`TranscriptView` sends a page (static/session.js applies them)


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


def _username(payload) -> str:
    who = actor(payload)
    return who["username"] if who else ""


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
            item["answered_by"] = _username(payload)
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
    """Formulas as the open reply's math list draws them (``_formula.html``)."""
    return [{"tex": tex, "display": display, "html": formula_html(tex, display)} for tex, display in found]


#: How a ``settings`` payload key reads on the page (the session's own field names are
#: the code's; ``model_key`` is a path, shown only when no display name came with it).
SETTING_LABELS = {"model": "model", "model_key": "model", "permission_mode": "tool calls", "server_params": "server",
                  "sampling": "sampling", "system_prompt": "system prompt", "title": "title",
                  "visibility": "visibility"}
#: Server parameters by the words of the form (llama-server's flags: docs/behaviour.md §5).
SERVER_PARAM_WORDS = {"contextSize": "context size", "gpuLayers": "GPU layers", "threads": "threads",
                      "speculative": "speculative decoding"}


#: A sharing change as a sentence (after the name of who made it), docs/sharing.md.
SHARED_WORDS = {
    AgentSession.Visibility.PRIVATE: "made the session private",
    AgentSession.Visibility.TEAM_WATCH: "shared the session with the team, to watch",
    AgentSession.Visibility.TEAM_ACT: "shared the session with the team, to watch and act",
}


def _setting(key: str, value) -> str:
    """A settings value as a person reads it: ``{"top_k": 40}`` → ``top_k 40``,
    ``{"contextSize": 2048}`` → ``context size 2048``, ``{}`` → the defaults."""
    if key == "system_prompt":
        text = " ".join(str(value).split())
        return f"“{text[:77]}…”" if len(text) > 80 else (f"“{text}”" if text else "the default")
    if key == "visibility" and value in AgentSession.Visibility.values:
        return AgentSession.Visibility(value).label.lower()
    if key == "permission_mode" and value in AgentSession.PermissionMode.values:
        return AgentSession.PermissionMode(value).label.lower()
    if key == "title" and not value:
        return "none (Session <number>)"
    if isinstance(value, dict):
        if not value:
            return "defaults"
        words = SERVER_PARAM_WORDS if key == "server_params" else {}
        return ", ".join(f"{words.get(k, k)} {v}" for k, v in sorted(value.items()))
    return str(value)


def settings_text(payload: dict, *, first: bool = False) -> str:
    """A ``settings`` event as one plain line. The session's first one (``first``) says
    how it started: ``"Started by alice with SmolLM2 135M — tool calls: ask before each
    tool call; server: defaults; sampling: defaults."``; later ones say what changed:
    ``"bob changed settings: title → Flock"``, and a sharing change alone is a sentence:
    ``"alice shared the session with the team, to watch."``. A ``reason`` (the gate turned back on) is
    the line's last sentence."""
    who = _username(payload)
    # In SETTING_LABELS' order, never the payload's: PostgreSQL's jsonb keeps keys in an
    # order of its own, and the line must read the same from either database.
    keys = [k for k in SETTING_LABELS if k in payload and not (k == "model_key" and "model" in payload)]
    reason = payload.get("reason")
    if first and "model_key" in payload:
        model = payload.get("model") or payload["model_key"]
        rest = "; ".join(f"{SETTING_LABELS[k]}: {_setting(k, payload[k])}" for k in keys if k not in ("model", "model_key"))
        text = f"Started{f' by {who}' if who else ''} with {model}" + (f" — {rest}." if rest else ".")
    elif keys == ["visibility"] and who and payload["visibility"] in SHARED_WORDS:
        text = f"{who} {SHARED_WORDS[payload['visibility']]}."
    else:
        parts = ", ".join(f"{SETTING_LABELS[k]} → {_setting(k, payload[k])}" for k in keys)
        text = f"{who} changed settings: {parts}" if who else (f"Settings: {parts}" if parts else "")
    if reason:
        text = f"{text} {reason}" if text else str(reason)
    return text


#: The order the usage line names sampling values in: a fixed one, since PostgreSQL's
#: jsonb does not keep a payload's key order (the page and the live op must agree).
SAMPLING_ORDER = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "max_tokens", "seed")


def _sampling_order(item: tuple[str, object]) -> tuple[int, str]:
    name = item[0]
    return (SAMPLING_ORDER.index(name) if name in SAMPLING_ORDER else len(SAMPLING_ORDER), name)


def usage_line(usage: dict) -> str:
    """A ``usage`` payload as one line: ``"context 812 tokens · 790 warm · reply 41 tokens ·
    38.2 tok/s · draft 71% accepted (45 of 63) · seed 7 · temperature 0.25 (model), top_k 40 (server) · finish: length"``
    (the sampling values in force and where each came from, docs/behaviour.md §17); parts
    the server did not report are left out, and so are their separators. *Warm* is how
    many prompt tokens came from the prompt cache — kept by the server, or restored from a
    saved slot (docs/behaviour.md §5): ``cached_tokens``, else llama-server's own ``cache_n``."""
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
    drafted, accepted = usage.get("draft_n"), usage.get("draft_n_accepted")
    if isinstance(drafted, int) and isinstance(accepted, int) and drafted > 0:
        # Speculative decoding (a draft model or MTP): how many drafted tokens the model kept.
        parts.append(f"draft {round(100 * accepted / drafted)}% accepted ({accepted} of {drafted})")
    if usage.get("seed") is not None:
        parts.append(f"seed {usage['seed']}")
    in_force = usage.get("sampling")
    if isinstance(in_force, dict) and in_force:
        sources = usage.get("sampling_from") if isinstance(usage.get("sampling_from"), dict) else {}
        parts.append(", ".join(
            f"{name} {_sampling_value(value)}" + (f" ({sources[name]})" if sources.get(name) else "")
            for name, value in sorted(in_force.items(), key=_sampling_order)
        ))
    if usage.get("finish_reason") and usage["finish_reason"] != "stop":
        parts.append(f"finish: {usage['finish_reason']}")
    return " · ".join(parts)


def progress_text(state: Mapping) -> str:
    """A completion's progress as the page says it: ``"reading the conversation: 1,536 /
    4,210 tokens"`` while llama-server reads the prompt, ``"writing the reply: 87 tokens"``
    while it streams; ``""`` for a state it does not know."""
    def number(key):
        value = state.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

    if state.get("phase") == "prompt" and number("processed") is not None and number("total"):
        return f"reading the conversation: {number('processed'):,} / {number('total'):,} tokens"
    if state.get("phase") == "reply" and number("tokens") is not None:
        return f"writing the reply: {number('tokens'):,} token{'s' if number('tokens') != 1 else ''}"
    return ""


def _sampling_value(value):
    """A sampling value as a person set it: llama-server reports its defaults as 32-bit
    floats widened (``0.800000011920929``), shown to six places (``0.8``)."""
    return round(value, 6) if isinstance(value, float) else value


def is_restart(status_payload) -> bool:
    """Whether a ``status`` payload is a person starting the server again: ``loading`` with
    ``by``, which ``actions.do_restart`` writes for a Restart and ``actions._wake`` for a
    message that wakes a sleeping server (``reason`` ``"wake"``); a first start, a model
    change and the watch's "loading again" name no one in it. Shown as "llama-server
    restarted by alice." or "llama-server woken by a message from alice." (docs/sharing.md,
    "Who did what")."""
    return status_payload.get("status") == "loading" and bool(_username(status_payload))


def event_item(event, session_id: int = 0) -> dict | None:
    """The display item of one non-block event, or None when it shows nothing by itself."""
    kind, payload, seq = event.kind, event.payload, event.seq
    dom_id = f"ev-{seq}"
    if kind == Kind.MESSAGE_TAKEN:
        again = ("edited and sent again" if payload.get("edited") else "sent again") if payload.get("replaces") else ""
        return {"type": "user", "dom_id": dom_id, "text": payload.get("text", ""), "author": _username(payload),
                "images": image_items(session_id, payload), "again": again}
    if kind == Kind.ERROR:
        return {"type": "error", "dom_id": dom_id, "message": payload.get("message", ""), "log": payload.get("log", ""),
                "context_exceeded": bool(payload.get("context_exceeded"))}
    if kind == Kind.NOTICE:
        return {"type": "note", "dom_id": dom_id, "text": payload.get("message", "")}
    if kind == Kind.USAGE:
        return {"type": "usage", "dom_id": dom_id, "usage": payload, "line": usage_line(payload)}
    if kind == Kind.CLEARED:
        return {"type": "cleared", "dom_id": dom_id, "by": _username(payload)}
    if kind == Kind.ALLOWANCE_REVOKED:
        scope = payload.get("scope")
        what = allowances.label(payload.get("tool") or "", scope) if isinstance(scope, dict) else "an allowance"
        return {"type": "note", "dom_id": dom_id,
                "text": f"{_username(payload) or 'Someone'} revoked the allowance for {what}: it is asked about again."}
    if kind == Kind.INTERRUPTED:
        return {"type": "note", "dom_id": dom_id, "text": f"Interrupted by {_username(payload) or 'someone'}."}
    if kind == Kind.SERVER_STOPPED:
        who = _username(payload)
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
            text = f"llama-server woken by a message from {_username(payload)}."
            return {"type": "note", "dom_id": dom_id, "text": text}
        return {"type": "note", "dom_id": dom_id, "text": f"llama-server restarted by {_username(payload)}."}
    if kind == Kind.SERVER_READY:
        text = f"llama-server is ready with {payload.get('model', '')}."
        if payload.get("warm_tokens"):
            text += f" Prompt cache restored: {payload['warm_tokens']} tokens warm."
        return {"type": "note", "dom_id": dom_id, "text": text}
    if kind == Kind.SETTINGS:
        return {"type": "note", "dom_id": dom_id, "text": settings_text(payload, first=seq == 1)}
    return None


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


def context_size(ready: Mapping | None, otherwise: int | None) -> int | None:
    """The context size in tokens the page's gauge shows: ``n_ctx`` as the ``server_ready``
    payload ``ready`` says it (GET /props, docs/behaviour.md §17), else ``otherwise`` (the
    session's contextSize, what the server was started with; None for its default). The
    one reading of that fact for the first paint, the socket's view and the live fold."""
    said = ready.get("n_ctx") if ready else None
    return said if isinstance(said, int) else otherwise


def gauge_of(events: Iterable, n_ctx: int | None = None) -> dict:
    """The context gauge (:func:`context_gauge`) folded from ``events`` — the ``usage``
    and ``cleared`` events are enough; a ``server_ready`` among them moves ``n_ctx`` as
    live — as :meth:`TranscriptView.gauge` gives it after the same events; ``n_ctx`` as
    :func:`context_size` gives it."""
    view = TranscriptView(0, n_ctx=n_ctx)
    for event in events:
        view._follow_context(event.kind, event.payload)
    return view.gauge()


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


#: chat_template_caps (GET /props) → the name :func:`model_details` reads it by (docs/behaviour.md §17).
TEMPLATE_CAPS = (("supports_tools", "tools"), ("supports_system_role", "system role"),
                 ("supports_preserve_reasoning", "reasoning"))


def template_info(ready: dict, remembered: dict | None = None) -> dict:
    """What the page says about the model's chat template, from the latest ``server_ready``
    payload (``ready``) or, before a server has said, the caps remembered on the model file.

    ``{"known": bool, "caps": [(label, bool), …], "cannot_call_tools": bool}``: a template
    cannot take tools when llama-server reported ``supports_tools`` false, or the server
    runs a built-in template (``jinja`` false: a request with tools is refused).
    """
    caps = ready.get("chat_template_caps") or remembered or {}
    no_jinja = ready.get("jinja") is False
    return {
        "known": bool(caps) or no_jinja,
        "caps": [(label, bool(caps.get(key))) for key, label in TEMPLATE_CAPS if key in caps],
        "cannot_call_tools": no_jinja or caps.get("supports_tools") is False,
    }


def model_facts(model) -> dict:
    """What the header's model details say of a model file (a ``ModelFile``, or None when
    the file is gone from the machine's list): its GGUF identity as read from its head
    (docs/behaviour.md §3) and the template its server uses. The same dict rides on
    ``server_ready`` (``lifecycle.server_facts``), so a live page says it of a new model."""
    if model is None:
        return {}
    return {"size_label": model.size_label, "quantization": model.quantization,
            "context_length": model.context_length, "takes_images": bool(model.projector_key),
            "own_template": bool(model.has_chat_template or model.chat_template or model.chat_template_file),
            "template_label": model.template_label}


def model_details(facts: Mapping, template: dict, n_ctx: int | None = None) -> list[str]:
    """The header's model details as sentences a member would say: size and quantisation,
    context, images, tools, and the chat template where it matters.

    ``facts``: :func:`model_facts`; ``template``: :func:`template_info` (what llama-server
    reported of the template at its last start); ``n_ctx``: the running server's context in
    tokens (:func:`context_size`). Sentences the facts do not support are left out, e.g.
    ``["135M parameters, quantised as Q8_0.", "Holds 4,096 tokens of conversation (trained
    on up to 8,192).", "Reads text only: it cannot see images.", "Can call tools."]``.
    """
    sentences = []
    size, quant = facts.get("size_label"), facts.get("quantization")
    if size and quant:
        sentences.append(f"{size} parameters, quantised as {quant}.")
    elif size or quant:
        sentences.append(f"{size} parameters." if size else f"Quantised as {quant}.")
    trained = facts.get("context_length")
    if n_ctx and trained and n_ctx != trained:
        sentences.append(f"Holds {n_ctx:,} tokens of conversation (trained on up to {trained:,}).")
    elif n_ctx or trained:
        sentences.append(f"Holds {(n_ctx or trained):,} tokens of conversation.")
    if "takes_images" in facts:
        sentences.append("Takes images as well as text." if facts["takes_images"]
                         else "Reads text only: it cannot see images.")
    if template.get("cannot_call_tools"):
        sentences.append("This model cannot call tools: its chat template takes none.")
    elif dict(template.get("caps") or ()).get("tools"):
        sentences.append("Can call tools.")
    else:
        sentences.append("Whether it can call tools is known once its server has started.")
    if facts and not facts.get("own_template", True):
        # As the model picker says it (ModelFile.template_label): llama-server then falls back
        # on a generic template, and what it reports is that one's.
        sentences.append("Its file has no chat template, so llama-server uses a generic one: replies may be poor.")
    elif dict(template.get("caps") or ()).get("system role") is False:
        sentences.append("Its chat template has no place for a system prompt.")
    return sentences


def render_model_details(name: str, key: str, facts: Mapping, template: dict, n_ctx: int | None = None) -> str:
    return render_to_string("sessions_app/_model_details.html",
                            {"model_name": name, "model_key": key,
                             "model_details": model_details(facts, template, n_ctx)})


def render_status(status: str) -> str:
    return render_to_string("sessions_app/_status.html", {"status": status})


def context_gauge(used: int | None, n_ctx: int | None) -> dict:
    """The header's context gauge: ``used`` tokens in the server's context after the last
    reply (the last ``usage``: prompt + reply tokens; 0 after a clear) of ``n_ctx`` (the
    slot's size, from ``server_ready``); ``percent`` when both are known."""
    percent = min(100, round(100 * used / n_ctx)) if used is not None and n_ctx else None
    return {"used": used, "n_ctx": n_ctx, "percent": percent,
            "high": round(n_ctx * 0.8) if n_ctx else None}


def render_gauge(gauge: dict) -> str:
    return render_to_string("sessions_app/_gauge.html", {"gauge": gauge})


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

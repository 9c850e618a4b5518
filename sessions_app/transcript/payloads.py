"""What each kind of transcript event carries (docs/transcript.md): one payload type per
:class:`~.vocabulary.Kind`, and :func:`check_payload`, which every write of an event calls.

The types are ``TypedDict``s read at run time too: :func:`check_payload` reads their
required and optional keys, and the import of a transcript file reads their annotations
(``typing.get_type_hints``), so every name an annotation uses must be importable here.
This module must not import Django.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

from .vocabulary import Actor, ImageRef, Kind

# One payload type per kind: what :func:`check_payload` (called by every write of an
# event) holds a payload to. Keys not listed are refused, so a typo never reaches a
# transcript that the folds would then silently misread.


class SettingsPayload(TypedDict, total=False):
    model_key: str
    model: str
    permission_mode: str
    sampling: dict
    server_params: dict
    system_prompt: str
    title: str
    visibility: str
    takes_images: bool
    by: Actor
    reason: str


class _StatusPayloadRequired(TypedDict):
    status: str


class StatusPayload(_StatusPayloadRequired, total=False):
    by: Actor
    reason: str  # "wake": a person's message woke a sleeping server (with ``by``)


class _ServerReadyPayloadRequired(TypedDict):
    model_key: str
    model: str


class ServerReadyPayload(_ServerReadyPayloadRequired, total=False):
    # What llama-server said about itself in GET /props once ready (docs/behaviour.md §17).
    chat_template: str  # "" the file's own; a built-in name; or the template file's path
    chat_template_caps: dict  # chat_template_caps as reported: supports_tools, supports_system_role, …
    jinja: bool  # False when started with a built-in template (legacy engine: no tools in a request)
    sampling_defaults: dict  # default_generation_settings.params: temperature, top_k, top_p, min_p, …
    n_ctx: int  # the slot's context size in tokens, from GET /props (when the server says)
    warm_tokens: int  # prompt tokens restored from a saved slot (docs/behaviour.md §5 warm prompts)
    opens_thinking: bool  # the generation prompt ends inside "<think>": replies start as reasoning
    # What the header's model details say of the file (live.header.model_facts): size_label,
    # quantization, context_length, takes_images, own_template, template_label.
    model_facts: dict


class CataloguePayload(TypedDict):
    tools: list


class _ServerStoppedPayloadRequired(TypedDict):
    reason: str  # "stopped" (a person), "restart", "idle" (put to sleep: docs/behaviour.md §5)


class ServerStoppedPayload(_ServerStoppedPayloadRequired, total=False):
    by: Actor


class _MessageQueuedPayloadRequired(TypedDict):
    id: str
    text: str


class MessageQueuedPayload(_MessageQueuedPayloadRequired, total=False):
    by: Actor
    images: list[ImageRef]
    author: str  # transcripts written before "by": the author's username


class MessageDroppedPayload(TypedDict):
    id: str
    by: Actor


class _MessageTakenPayloadRequired(TypedDict):
    text: str
    queued_id: str | None


class MessageTakenPayload(_MessageTakenPayloadRequired, total=False):
    by: Actor | None
    images: list[ImageRef]
    author: str  # transcripts written before "by"
    # Sent again (regenerate, or edit and send): the seq of the message_taken this one
    # takes the place of in the conversation (build_messages drops the replaced reply).
    replaces: int
    edited: bool  # the text was changed (edit), not the same (regenerate)


class TextPayload(TypedDict):
    text: str


class _ToolStartPayloadRequired(TypedDict):
    id: str
    tool: str
    arguments: str  # JSON text, as the model wrote it (or "{}")


class ToolStartPayload(_ToolStartPayloadRequired, total=False):
    raw_arguments: str | None
    # Why the received arguments are not one JSON object, in words: the call is not run.
    arguments_error: str
    input: dict
    # Parsed once when the call is recorded (sessions_app/callcard.py, docs/behaviour.md §8):
    duplicate_keys: list  # keys named more than once in the arguments (the last value counts)
    file_before: dict  # a file write or edit: the file as it was then ({"path", "state", ...})
    origin: str | None
    server: str | None
    writes: bool | None
    display_name: str


class _QuestionPayloadRequired(TypedDict):
    id: str
    tool: str


class QuestionPayload(_QuestionPayloadRequired, total=False):
    # What "always" may cover for this call (sessions_app.allowances.offers); only these
    # may be granted. Absent (questions asked before scopes): no "always" is offered.
    offers: list[dict]
    # An MCP tool allowed before whose definition changed since: what changed, in words.
    changed: list[str]
    # What an MCP server claims about the tool (readOnlyHint), shown, never trusted.
    claims: str


class _AnsweredPayloadRequired(TypedDict):
    id: str
    tool: str | None
    answer: str


class AnsweredPayload(_AnsweredPayloadRequired, total=False):
    by: Actor
    reason: str
    scope: dict  # with allow_always: what it covers (sessions_app/allowances.py)


class AllowanceRevokedPayload(TypedDict):
    seq: int  # the seq of the ``answered`` event that granted the allowance
    tool: str  # the grant's tool and scope, copied, so the event reads on its own
    scope: dict
    by: Actor


class CallPayload(TypedDict):
    id: str


class _ToolEndRequired(TypedDict):
    id: str
    output: str  # cut to CORRAL_TOOL_RESULT_MAX_CHARS, as the model and the page see it
    ok: bool


class ToolEndPayload(_ToolEndRequired, total=False):
    full_chars: int  # the result's length before it was cut; absent when whole


class UsagePayload(TypedDict, total=False):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prompt_n: int
    cache_n: int
    predicted_n: int
    predicted_per_second: float
    prompt_per_second: float
    draft_n: int  # speculative decoding: tokens drafted (llama-server's timings)
    draft_n_accepted: int  # … and kept
    prompt_ms: float  # milliseconds reading the prompt (llama-server's timings)
    predicted_ms: float  # … and generating the reply
    seed: int
    finish_reason: str | None
    sampling: dict  # the values in force (docs/behaviour.md §17)
    sampling_from: dict  # name → "session" | "model" | "server"


class MessagePayload(TypedDict):
    message: str


class _ErrorPayloadRequired(TypedDict):
    message: str  # one plain sentence: what failed, what to try


class ErrorPayload(_ErrorPayloadRequired, total=False):
    log: str  # the raw lines behind it (a server's last log lines), shown folded
    context_exceeded: bool  # the request did not fit the context (docs/behaviour.md C07): offer Clear


class VersionChosenPayload(TypedDict):
    seq: int  # the message_taken whose version (that message and its reply) is in force again
    by: Actor


class ByPayload(TypedDict):
    by: Actor


class TurnEndPayload(TypedDict):
    reason: str


class ImportedPayload(TypedDict):
    by: Actor  # who imported the file (the new session's owner)
    events: int  # how many events came from the file: the ones just before this one
    first_seq: int  # the seq the first of them had in the file's session


PAYLOADS: dict[Kind, Any] = {  # Kind → its payload TypedDict
    Kind.SETTINGS: SettingsPayload,
    Kind.STATUS: StatusPayload,
    Kind.SERVER_READY: ServerReadyPayload,
    Kind.CATALOGUE: CataloguePayload,
    Kind.SERVER_STOPPED: ServerStoppedPayload,
    Kind.MESSAGE_QUEUED: MessageQueuedPayload,
    Kind.MESSAGE_DROPPED: MessageDroppedPayload,
    Kind.MESSAGE_TAKEN: MessageTakenPayload,
    Kind.ASSISTANT_TEXT: TextPayload,
    Kind.REASONING: TextPayload,
    Kind.TOOL_START: ToolStartPayload,
    Kind.QUESTION: QuestionPayload,
    Kind.ANSWERED: AnsweredPayload,
    Kind.TOOL_RUNNING: CallPayload,
    Kind.TOOL_END: ToolEndPayload,
    Kind.USAGE: UsagePayload,
    Kind.ERROR: ErrorPayload,
    Kind.NOTICE: MessagePayload,
    Kind.INTERRUPTED: ByPayload,
    Kind.CLEARED: ByPayload,
    Kind.TURN_END: TurnEndPayload,
    Kind.ALLOWANCE_REVOKED: AllowanceRevokedPayload,
    Kind.VERSION_CHOSEN: VersionChosenPayload,
    Kind.IMPORTED: ImportedPayload,
}


class InvalidEvent(ValueError):
    """An event that is not in the vocabulary: an unknown kind, a missing or unknown key."""


def check_payload(kind: str, payload: Mapping[str, Any]) -> Kind:
    """The :class:`Kind` of ``kind`` after checking ``payload`` against its payload type:
    every required key present, no key the type does not list. Raises :class:`InvalidEvent`."""
    try:
        known = Kind(kind)
    except ValueError:
        raise InvalidEvent(f"unknown event kind {kind!r}") from None
    shape = PAYLOADS[known]
    missing = shape.__required_keys__ - payload.keys()
    unknown = payload.keys() - shape.__required_keys__ - shape.__optional_keys__
    if missing or unknown:
        raise InvalidEvent(f"{kind} payload: missing {sorted(missing)}, unknown {sorted(unknown)}")
    return known

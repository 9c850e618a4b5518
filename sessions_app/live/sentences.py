"""Settings, usage and progress as the session page says them: one plain line each
(docs/behaviour.md §12, §17; docs/sharing.md for who changed what).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..models import AgentSession
from ..transcript import actor


def username(payload) -> str:
    """Who an event names as its actor (``transcript.actor``): a username, or ``""``."""
    who = actor(payload)
    return who["username"] if who else ""


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
    who = username(payload)
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
        said = usage.get("sampling_from")
        sources: dict = said if isinstance(said, dict) else {}
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

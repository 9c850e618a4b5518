"""The session page's header: the model's details, the context gauge and the status
badge, drawn on first paint and redrawn live (docs/behaviour.md §17, docs/live-page.md).
"""

from __future__ import annotations

from collections.abc import Mapping

from django.template.loader import render_to_string


def context_size(ready: Mapping | None, otherwise: int | None) -> int | None:
    """The context size in tokens the page's gauge shows: ``n_ctx`` as the ``server_ready``
    payload ``ready`` says it (GET /props, docs/behaviour.md §17), else ``otherwise`` (the
    session's contextSize, what the server was started with; None for its default). The
    one reading of that fact for the first paint, the socket's view and the live fold."""
    said = ready.get("n_ctx") if ready else None
    return said if isinstance(said, int) else otherwise


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
    ``server_ready`` (``servers.ready.server_facts``), so a live page says it of a new model."""
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

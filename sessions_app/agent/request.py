"""What one completion of a turn sends (:class:`Request`, :func:`request_for`): the
messages folded from the transcript, the tool definitions, and the sampling with the seed
it uses and where each value in force came from (docs/behaviour.md §14, §16, §17).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from django.conf import settings

from machines_app import catalog
from machines_app.models import ModelFile

from .. import control_tokens, images, tools, transcript
from ..models import AgentSession
from .folds import catalogue_of

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "max_tokens", "seed")
#: The sampling values a usage line reports as in force (docs/behaviour.md §17), besides the seed.
REPORTED_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty")


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

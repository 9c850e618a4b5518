"""Starting, readying, watching and stopping ``llama-server`` through a Transport (docs/behaviour.md §5).

No Django import: the session lifecycle (:mod:`sessions_app.lifecycle`) wires this to the
database and the transcript.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from .transports import ProcessId, Transport, TransportError

#: Server parameters → llama-server flags (docs/behaviour.md §5). Sampling parameters are not flags:
#: they ride on every request, so changing them never reloads a model.
SERVER_FLAGS = {"contextSize": "-c", "gpuLayers": "-ngl", "threads": "-t"}

HEALTH_INTERVAL = 0.25  # docs/behaviour.md §5: poll /health about four times a second

#: Seconds a slot save or restore may take: the whole KV cache of a long conversation goes
#: to or comes from the machine's disk (hundreds of MB for a large model and context).
SLOT_IO_TIMEOUT = 120.0


def new_api_key() -> str:
    """A fresh random key for one llama-server (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def auth_headers(api_key: str) -> dict[str, str]:
    """The header that opens a llama-server started with ``--api-key-file``.

    llama-server answers 401 to every request without it except ``/health`` and the model
    list; Corral sends it on every request it makes (completions, ``/tools``, ``/props``,
    ``/slots``), so the permission gate is the only way a tool runs (docs/security.md).
    """
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass(frozen=True)
class Endpoint:
    """How this backend reaches one session's llama-server: ``url`` is the server root
    (``http://127.0.0.1:<port>``, no ``/v1``) and ``api_key`` its own key. The key is left
    out of ``repr`` so a log line or a traceback never shows it."""

    url: str
    api_key: str = field(default="", repr=False)


class ServerStartError(Exception):
    """llama-server did not become ready. ``str()`` is the user-facing sentence, ending
    with the server's last log lines ("It last said: …")."""


@dataclass(frozen=True)
class ServerSpec:
    """What to start: the binary, the model's absolute path there, the session's server
    parameters (``contextSize``, ``gpuLayers``, ``threads``, ``speculative``) and the path
    of the 0600 file on that machine holding the server's own API key."""

    binary: str
    model_path: str
    port: int
    params: dict
    has_mtp: bool = False
    api_key_file: str = ""
    slot_dir: str = ""


def build_argv(spec: ServerSpec) -> list[str]:
    """The llama-server command line for one session (docs/behaviour.md §5).

    Loopback only, always, and answering only the holder of its key: ``--api-key-file``
    (never ``--api-key``: a command line is readable by every user through ``ps``);
    ``--tools all`` (the permission gate, not a flag, decides whether
    a call runs); one slot (``-np 1``: extra slots split the context and slow speculative
    decoding); ``--slot-save-path`` when a slot directory is given (docs/behaviour.md §5 warm
    prompts); ``--spec-type draft-mtp`` only for a file with an MTP head and speculation not
    turned off (asking for it without a head makes llama-server exit).
    """
    argv = [spec.binary, "-m", spec.model_path, "--host", "127.0.0.1", "--port", str(spec.port)]
    if spec.api_key_file:
        argv += ["--api-key-file", spec.api_key_file]
    argv += ["--tools", "all", "-np", "1"]
    if spec.slot_dir:
        # Slot save/restore (docs/behaviour.md §5 "warm prompts"): llama-server only writes
        # and reads files under this directory, by names it validates.
        argv += ["--slot-save-path", spec.slot_dir]
    for param, flag in SERVER_FLAGS.items():
        value = spec.params.get(param)
        if value not in (None, ""):
            argv += [flag, str(int(value))]
    if spec.has_mtp and spec.params.get("speculative") != "off":
        argv += ["--spec-type", "draft-mtp"]
    return argv


def failure_message(headline: str, log_tail: str) -> str:
    """A start failure in the user's terms, with the server's own last words."""
    tail = log_tail.strip()
    return f"{headline}. It last said:\n{tail}" if tail else f"{headline}."


# --- slot save / restore (docs/behaviour.md §5 "warm prompts") -----------------------------------


class SlotError(Exception):
    """A slot save or restore that llama-server refused or never answered; ``str()`` says
    why in its own words (e.g. "Unable to restore slot, no available space in KV cache or
    invalid slot save file")."""


def slot_dir(private_dir: str) -> str:
    """The directory of a machine's saved slots, inside Corral's private directory there
    (created mode 0700 before a server that uses it starts: docs/behaviour.md C43)."""
    return posixpath.join(private_dir, "slots")


def slot_file_name(session_id: int, save_id: int) -> str:
    """The file name of one saved slot, built from ids only (never from a title, a model
    name or a path: docs/behaviour.md C43), and one llama-server's filename check accepts
    (no separators, no leading dot, no spaces)."""
    return f"session-{int(session_id)}-slot-{int(save_id)}.bin"


def server_props(server: Endpoint, *, timeout: float = 10.0) -> dict:
    """llama-server's ``GET /props``: ``build_info`` (the server build, e.g.
    ``"b6123-abc1234"``) and ``default_generation_settings.n_ctx`` (the context size of
    its slot) among others. Raises SlotError when it does not answer with a JSON object."""
    try:
        response = httpx.get(f"{server.url}/props", headers=auth_headers(server.api_key), timeout=timeout)
        body = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise SlotError(f"llama-server did not answer /props: {exc}") from None
    if response.status_code != 200 or not isinstance(body, dict):
        raise SlotError(f"llama-server answered /props with HTTP {response.status_code}")
    return body


def slot_fingerprint(*, binary: str, model_path: str, model_size: int, params: dict, props: dict) -> str:
    """What a saved slot must match to be restored into a server, as 64 hex digits: the
    model file (path and size), the server parameters it was started with (context size,
    GPU layers, KV cache types when set, speculation), the slot's ``n_ctx`` and the server
    build as ``/props`` reports them (``build_info``), and the ``llama-server`` path it was started
    from. A KV cache is only meaningful to the same weights
    laid out the same way by the same code (docs/behaviour.md C44). '' when ``props`` lacks
    ``n_ctx`` or ``build_info``."""
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    if not isinstance(n_ctx, int) or not props.get("build_info"):
        # A server that does not say its context size and build cannot be matched: no key,
        # so nothing is saved from it or restored into it.
        return ""
    key = {
        "binary": binary,  # a build without version info reports "b0-unknown": the binary tells builds apart too
        "model": model_path,
        "size": int(model_size),
        "params": {k: params[k] for k in sorted(params)},
        "n_ctx": n_ctx,
        "build": props.get("build_info"),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def _slot_action(server: Endpoint, action: str, filename: str, timeout: float) -> dict:
    """``POST /slots/0?action=<action>`` with ``{"filename": …}`` (one slot: ``-np 1``)."""
    try:
        response = httpx.post(
            f"{server.url}/slots/0",
            params={"action": action},
            json={"filename": filename},
            headers=auth_headers(server.api_key),
            timeout=timeout,
        )
    except httpx.HTTPError as exc:
        raise SlotError(f"llama-server did not answer the slot {action}: {exc}") from None
    try:
        body = response.json()
    except ValueError:
        body = {}
    if response.status_code != 200 or not isinstance(body, dict):
        error = body.get("error") if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        raise SlotError(message or f"llama-server answered the slot {action} with HTTP {response.status_code}")
    return body


def save_slot(server: Endpoint, filename: str, *, timeout: float = SLOT_IO_TIMEOUT) -> int:
    """Save slot 0's KV cache to ``filename`` in the server's ``--slot-save-path``; the
    number of tokens saved (``n_saved``; 0 for an empty slot). Raises SlotError."""
    body = _slot_action(server, "save", filename, timeout)
    return int(body.get("n_saved") or 0)


def restore_slot(server: Endpoint, filename: str, *, timeout: float = SLOT_IO_TIMEOUT) -> int:
    """Load ``filename`` from the server's ``--slot-save-path`` into slot 0; the number of
    tokens restored (``n_restored``). Raises SlotError for a file llama-server refuses (cut
    short, another model's, not a slot file at all)."""
    body = _slot_action(server, "restore", filename, timeout)
    restored = int(body.get("n_restored") or 0)
    if restored <= 0:
        raise SlotError("llama-server restored no tokens from the saved slot")
    return restored


def wait_until_ready(
    transport: Transport,
    proc: ProcessId,
    base_url: str,
    log_path: str,
    *,
    timeout: float = 300.0,
    api_key: str = "",
    should_stop: Callable[[], bool] | None = None,
) -> None:
    """Poll ``GET /health`` ~4×/s until it answers 200, checking the process each time.

    Only ``/health`` 200 means ready: during a load it answers 503 while other endpoints may
    already answer (docs/behaviour.md C09). A process that exits (bad flag, port taken, model that will
    not load: docs/behaviour.md C08) is reported at once rather than after ``timeout`` seconds.

    Raises ServerStartError with the log tail; TransportError when the machine is lost.
    """
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0, headers=auth_headers(api_key)) as http:
        while True:
            if not transport.process_alive(proc):
                # The log may still be flushing the last lines.
                time.sleep(0.2)
                raise ServerStartError(
                    failure_message("llama-server exited while starting", transport.log_tail(log_path))
                )
            if should_stop is not None and should_stop():
                raise ServerStartError("llama-server start was cancelled.")
            try:
                response = http.get(f"{base_url}/health")
                if response.status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise ServerStartError(
                    failure_message(
                        f"llama-server did not become ready within {int(timeout)} s", transport.log_tail(log_path)
                    )
                )
            time.sleep(HEALTH_INTERVAL)


__all__ = [
    "SERVER_FLAGS",
    "Endpoint",
    "ServerSpec",
    "ServerStartError",
    "SlotError",
    "TransportError",
    "auth_headers",
    "build_argv",
    "failure_message",
    "new_api_key",
    "restore_slot",
    "save_slot",
    "server_props",
    "slot_dir",
    "slot_file_name",
    "slot_fingerprint",
    "wait_until_ready",
]

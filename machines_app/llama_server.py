"""Starting, readying, watching and stopping ``llama-server`` through a Transport (docs/behaviour.md §5).

No Django import: a session's server (:mod:`sessions_app.servers`) wires this to the
database and the transcript.
"""

from __future__ import annotations

import functools
import hashlib
import json
import posixpath
import secrets
import ssl
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


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The one TLS context of the process, for every ``httpx`` client and call (``verify=``).

    httpx builds a fresh context for each client or ``httpx.get`` unless given one, and
    loading the CA bundle costs about 26 ms of CPU each time: once per turn step, per
    ``/props`` poll, per tool call (docs/live-page.md "What it costs"). The context is
    httpx's default (certifi's CAs, verification on); an ``SSLContext`` is safe to share
    between threads."""
    return httpx.create_ssl_context()


@dataclass(frozen=True)
class Endpoint:
    """How this backend reaches one session's llama-server: ``url`` is the server root
    (``http://127.0.0.1:<port>``, no ``/v1``) and ``api_key`` its own key. The key is left
    out of ``repr`` so a log line or a traceback never shows it."""

    url: str
    api_key: str = field(default="", repr=False)


class ServerStartError(Exception):
    """llama-server did not become ready. ``str()`` is the headline with the server's last
    log lines ("It last said: …"); ``sentence`` is what a person reads first (what failed,
    what to try: :func:`explain_start_failure`) and ``log_tail`` the raw lines, shown
    folded below it."""

    def __init__(self, headline: str, log_tail: str = "") -> None:
        super().__init__(failure_message(headline, log_tail))
        self.headline = headline
        self.log_tail = log_tail.strip()

    @property
    def sentence(self) -> str:
        return explain_start_failure(self.headline, self.log_tail)


#: Phrases of llama.cpp's start-up log, and the sentence a person reads for each (the
#: first that matches wins). The log is llama.cpp's (common/arg.cpp, tools/server,
#: src/llama-model-loader.cpp, ggml allocators), so these follow its wording.
START_FAILURES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("invalid argument", "unknown argument", "error while handling argument"),
     "llama-server refused one of its settings ({line}). Check the session's server settings (context size, "
     "GPU layers, threads), then restart."),
    (("couldn't bind", "address already in use"),
     "llama-server could not listen on its port (another program holds it). Restart to try another port."),
    (("out of memory", "failed to allocate", "unable to allocate", "cudamalloc failed", "failed to create context",
      "not enough memory"),
     "llama-server ran out of memory while loading the model. Try a smaller context size or fewer GPU layers, "
     "then restart."),
    (("failed to open gguf", "model loading error", "failed to load model", "error loading model",
      "gguf_init_from_file"),
     "llama-server could not load the model file: it may be incomplete, or not a model this llama.cpp can run. "
     "Pick another model, or copy the file again."),
)


def explain_start_failure(headline: str, log_tail: str) -> str:
    """One plain sentence for a failed start: what failed and what to try, read from the
    server's last log lines (:data:`START_FAILURES`, the first entry with a phrase in any
    line wins; a refused setting is named by its line); the headline's own words when the
    log says nothing known (a timeout, a cancelled start, a silent exit)."""
    lines = log_tail.splitlines()
    for phrases, sentence in START_FAILURES:
        line = next((line.strip() for line in lines if any(phrase in line.lower() for phrase in phrases)), None)
        if line is not None:
            # ``{line}``: the log line that matched, when the sentence names it (cut to a sentence's length).
            return sentence.format(line=line if len(line) <= 160 else line[:159] + "…")
    if "did not become ready" in headline:
        return f"{headline}: a very large model may need longer, or the server is stuck. Look at its log, then restart."
    return f"{headline}. Look at its last words below, then restart, or pick another model."


@dataclass(frozen=True)
class ServerSpec:
    """What to start: the binary, the model's absolute path there, the session's server
    parameters (``contextSize``, ``gpuLayers``, ``threads``, ``speculative``), the path
    of the 0600 file on that machine holding the server's own API key, and the model's
    vision projector there (``""`` for none)."""

    binary: str
    model_path: str
    port: int
    params: dict
    has_mtp: bool = False
    api_key_file: str = ""
    mmproj_path: str = ""
    chat_template: str = ""  # a llama.cpp built-in template name an admin set
    chat_template_file: str = ""  # or a Jinja template file's absolute path on that machine
    slot_dir: str = ""
    alias: str = ""  # the name the server gives its model in replies (--alias); "" for the file's path
    shared: bool = False  # one slot serving several members (the API's): no prompt cache kept in RAM


def build_argv(spec: ServerSpec) -> list[str]:
    """The llama-server command line for one session (docs/behaviour.md §5).

    Loopback only, always, and answering only the holder of its key: ``--api-key-file``
    (never ``--api-key``: a command line is readable by every user through ``ps``);
    ``--tools all`` (the permission gate, not a flag, decides whether
    a call runs); one slot (``-np 1``: extra slots split the context and slow speculative
    decoding); ``--slot-save-path`` when a slot directory is given (docs/behaviour.md §5 warm
    prompts); ``--alias`` when a name is given (:func:`alias_flag`); ``--cache-ram 0`` for a
    server shared by members; ``--spec-type draft-mtp`` only for a file with an MTP head and
    speculation not turned off (asking for it without a head makes llama-server exit).
    """
    argv = [spec.binary, "-m", spec.model_path, "--host", "127.0.0.1", "--port", str(spec.port)]
    if spec.api_key_file:
        argv += ["--api-key-file", spec.api_key_file]
    argv += ["--tools", "all", "-np", "1"]
    if spec.slot_dir:
        # Slot save/restore (docs/behaviour.md §5 "warm prompts"): llama-server only writes
        # and reads files under this directory, by names it validates.
        argv += ["--slot-save-path", spec.slot_dir]
    argv += alias_flag(spec.alias)
    if spec.shared:
        # Its requests never reuse a cached prompt (docs/api.md "One server, many members");
        # with the RAM cache on, swapping a stored prompt into the slot when the next one
        # resembles it would still take longer for a prompt like another member's.
        argv += ["--cache-ram", "0"]
    for param, flag in SERVER_FLAGS.items():
        value = spec.params.get(param)
        if value not in (None, ""):
            argv += [flag, str(int(value))]
    if spec.has_mtp and spec.params.get("speculative") != "off":
        argv += ["--spec-type", "draft-mtp"]
    if spec.mmproj_path:
        # The vision projector found beside the model (docs/behaviour.md §16): with it the
        # server takes image_url content parts; without it, it refuses them.
        argv += ["--mmproj", spec.mmproj_path]
    argv += chat_template_flags(spec)
    return argv


def alias_flag(name: str) -> list[str]:
    """``["--alias", name]``, or [] for a blank name. Without it llama-server names its model
    by the file's absolute path in every reply's ``model`` field (and in ``/props``,
    ``/v1/models``), which the API passes on to members (docs/api.md). llama-server splits
    the value at commas into several names and answers with the first in sorted order, so
    a comma becomes a space, as does a control character (a NUL cannot be in a command line;
    the name comes from inside the file)."""
    name = " ".join("".join(c if c.isprintable() and c != "," else " " for c in name).split())
    return ["--alias", name] if name else []


def chat_template_flags(spec: ServerSpec) -> list[str]:
    """The chat template flags (docs/behaviour.md §17): none for the file's own template.

    A template file is Jinja (``--chat-template-file``). A built-in name needs
    ``--no-jinja`` before it: with Jinja on (llama-server's default) ``--chat-template``
    takes its value as the Jinja text itself, so ``gemma`` would become a template that
    prints "gemma". The legacy engine that reads the name takes no tools; the agent leaves
    them out of such a server's requests.
    """
    if spec.chat_template_file:
        return ["--chat-template-file", spec.chat_template_file]
    if spec.chat_template:
        return ["--no-jinja", "--chat-template", spec.chat_template]
    return []


#: llama.cpp's built-in chat templates, as the bundled ``llama-server --help`` lists them
#: under ``--chat-template`` (tests/test_request.py checks this against the binary).
BUILTIN_CHAT_TEMPLATES = (
    "bailing", "bailing-think", "bailing2", "chatglm3", "chatglm4", "chatml", "command-r", "deepseek",
    "deepseek-ocr", "deepseek2", "deepseek3", "exaone-moe", "exaone3", "exaone4", "falcon3", "gemma",
    "gigachat", "glmedge", "gpt-oss", "granite", "granite-4.0", "granite-4.1", "grok-2", "hunyuan-dense",
    "hunyuan-moe", "hunyuan-vl", "kimi-k2", "llama2", "llama2-sys", "llama2-sys-bos", "llama2-sys-strip",
    "llama3", "llama4", "megrez", "minicpm", "mistral-v1", "mistral-v3", "mistral-v3-tekken", "mistral-v7",
    "mistral-v7-tekken", "monarch", "openchat", "orion", "pangu-embedded", "phi3", "phi4", "rwkv-world",
    "seed_oss", "smolvlm", "solar-open", "vicuna", "vicuna-orca", "yandex", "zephyr",
)

#: The sampling values :func:`parse_props` keeps from /props, by the request's names.
PROPS_SAMPLING = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                  "repeat_penalty": "repeat_penalty"}


@dataclass(frozen=True)
class ServerProps:
    """What ``GET /props`` says about a ready server (docs/behaviour.md §17):
    ``chat_template_caps`` as reported (``supports_tools``, ``supports_system_role``, …;
    {} when the server did not say) and the sampling defaults in force for a request that
    sets none (``default_generation_settings.params``, the file's ``general.sampling.*``
    already applied), by request name. ``n_ctx`` and ``build_info`` also key its saved
    slots (:func:`slot_fingerprint`)."""

    chat_template_caps: dict
    sampling_defaults: dict
    n_ctx: int | None = None  # the slot's context size in tokens (one slot: the whole -c); None unsaid
    build_info: str = ""  # the server build, e.g. "b6123-abc1234"; "" unsaid


def parse_props(body: object) -> ServerProps:
    """The :class:`ServerProps` in a ``GET /props`` answer (its JSON body). An answer of an
    unexpected shape gives empty fields; never raises."""
    body = body if isinstance(body, dict) else {}
    caps = body.get("chat_template_caps")
    caps = {str(k): v for k, v in caps.items() if isinstance(v, bool)} if isinstance(caps, dict) else {}
    settings = body.get("default_generation_settings")
    params = settings.get("params") if isinstance(settings, dict) else None
    params = params if isinstance(params, dict) else {}
    defaults = {
        name: params[key] for name, key in PROPS_SAMPLING.items()
        if isinstance(params.get(key), int | float) and not isinstance(params.get(key), bool)
    }
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    n_ctx = n_ctx if isinstance(n_ctx, int) and not isinstance(n_ctx, bool) and n_ctx > 0 else None
    build_info = body.get("build_info")
    build_info = build_info if isinstance(build_info, str) else ""
    return ServerProps(chat_template_caps=caps, sampling_defaults=defaults, n_ctx=n_ctx, build_info=build_info)


def read_props(server: Endpoint, *, timeout: float = 10.0) -> ServerProps:
    """``GET /props`` of a ready server, with its key: read once per start, it feeds both
    the ``server_ready`` facts and the slot fingerprint. Raises ``httpx.HTTPError`` when
    it does not answer 2xx, ``ValueError`` when the answer is not JSON."""
    response = httpx.get(f"{server.url}/props", headers=auth_headers(server.api_key), timeout=timeout,
                         verify=tls_context())
    response.raise_for_status()
    return parse_props(response.json())


#: The one conversation rendered to learn how the server's template begins a reply.
_PROBE_MESSAGES = [{"role": "user", "content": "Hello"}]


def opens_thinking(prompt: str) -> bool:
    """Whether a rendered generation prompt ends inside an opened ``<think>`` block: its
    last ``<think>`` comes after its last ``</think>`` with only white space after it (the
    templates of R1-style distills, and custom ones, end the prompt so; a template that
    closes the block itself, ``<think>\n\n</think>``, does not)."""
    opened, closed = prompt.rfind("<think>"), prompt.rfind("</think>")
    return opened >= 0 and opened > closed and not prompt[opened + len("<think>"):].strip()


def prompt_opens_thinking(server: Endpoint, *, timeout: float = 10.0) -> bool:
    """Whether the ready server's generation prompt opens a thinking block, so its replies
    carry only the closing ``</think>`` (:func:`opens_thinking`). Learnt once per start by
    rendering one user message with llama-server's ``POST /apply-template`` (the template
    the server really uses, whatever file or flag it came from). Raises ``httpx.HTTPError``
    when it does not answer 2xx, ``ValueError`` when the answer is not JSON."""
    response = httpx.post(f"{server.url}/apply-template", json={"messages": _PROBE_MESSAGES},
                          headers=auth_headers(server.api_key), timeout=timeout, verify=tls_context())
    response.raise_for_status()
    prompt = response.json().get("prompt") if isinstance(response.json(), dict) else None
    return isinstance(prompt, str) and opens_thinking(prompt)


def failure_message(headline: str, log_tail: str) -> str:
    """A start failure in the user's terms, with the server's own last words."""
    tail = log_tail.strip()
    return f"{headline}. It last said:\n{tail}" if tail else f"{headline}."


# --- slot save / restore (docs/behaviour.md §5 "warm prompts") -----------------------------------


class SlotError(Exception):
    """A slot save or restore that llama-server refused or never answered; ``str()`` says
    why in its own words (e.g. "Unable to restore slot, no available space in KV cache or
    invalid slot save file")."""


def slot_dir(private_dir: str, session_id: int) -> str:
    """The directory of one session's saved slots, ``slots/session-<id>`` inside Corral's
    private directory on its machine (created mode 0700 before a server that uses it
    starts: docs/behaviour.md C43). One per session: it is the only part of that private
    directory its sandboxed server sees, so no session's tools can read another's saved
    KV cache (docs/security.md)."""
    return posixpath.join(private_dir, "slots", f"session-{int(session_id)}")


def slot_file_name(session_id: int, save_id: int) -> str:
    """The file name of one saved slot, built from ids only (never from a title, a model
    name or a path: docs/behaviour.md C43), and one llama-server's filename check accepts
    (no separators, no leading dot, no spaces)."""
    return f"session-{int(session_id)}-slot-{int(save_id)}.bin"


def slot_fingerprint(
    *, binary: str, model_path: str, model_size: int, params: dict, props: ServerProps, mmproj_path: str = ""
) -> str:
    """What a saved slot must match to be restored into a server, as 64 hex digits: the
    model file (path and size), the server parameters it was started with (context size,
    GPU layers, KV cache types when set, speculation), the slot's ``n_ctx`` and the server
    build as ``/props`` reports them (``build_info``), and the ``llama-server`` path it was started
    from, and the vision projector it loaded (``--mmproj``: image embeddings in the cache
    come from it). A KV cache is only meaningful to the same weights
    laid out the same way by the same code (docs/behaviour.md C44). '' when ``props`` lacks
    ``n_ctx`` or ``build_info``. The key's JSON is fixed: a slot saved by an earlier Corral
    still matches a server that has not changed (tests/test_warm_slots.py pins it)."""
    if props.n_ctx is None or not props.build_info:
        # A server that does not say its context size and build cannot be matched: no key,
        # so nothing is saved from it or restored into it.
        return ""
    key = {
        "binary": binary,  # a build without version info reports "b0-unknown": the binary tells builds apart too
        "model": model_path,
        "size": int(model_size),
        "params": {k: params[k] for k in sorted(params)},
        "n_ctx": props.n_ctx,
        "build": props.build_info,
        **({"mmproj": mmproj_path} if mmproj_path else {}),  # absent without one: older keys still match
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
            verify=tls_context(),
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


def does_not_answer(endpoint: Endpoint, timeout: float) -> bool:
    """Whether the server at ``endpoint`` took ``GET /health`` and sent no answer within
    ``timeout`` seconds: a process that still has its pid but is frozen (SIGSTOP, a wedged
    driver) — the kernel still accepts its connections, nothing reads them. Any answer
    (200, 503 while loading, 401) is False; so is a refused or broken connection, which is
    the process check's to explain (docs/behaviour.md §5, the health watch)."""
    try:
        with httpx.Client(timeout=timeout, headers=auth_headers(endpoint.api_key), verify=tls_context()) as http:
            http.get(f"{endpoint.url}/health")
    except httpx.TimeoutException:
        return True
    except httpx.HTTPError:
        return False
    return False


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
    with httpx.Client(timeout=2.0, headers=auth_headers(api_key), verify=tls_context()) as http:
        while True:
            if not transport.process_alive(proc):
                # The log may still be flushing the last lines.
                time.sleep(0.2)
                raise ServerStartError("llama-server exited while starting", transport.log_tail(log_path))
            if should_stop is not None and should_stop():
                raise ServerStartError("llama-server start was cancelled")
            try:
                response = http.get(f"{base_url}/health")
                if response.status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"llama-server did not become ready within {int(timeout)} s", transport.log_tail(log_path)
                )
            time.sleep(HEALTH_INTERVAL)


__all__ = [
    "BUILTIN_CHAT_TEMPLATES",
    "SERVER_FLAGS",
    "ServerProps",
    "chat_template_flags",
    "parse_props",
    "read_props",
    "Endpoint",
    "ServerSpec",
    "ServerStartError",
    "SlotError",
    "TransportError",
    "alias_flag",
    "auth_headers",
    "build_argv",
    "explain_start_failure",
    "failure_message",
    "new_api_key",
    "restore_slot",
    "save_slot",
    "slot_dir",
    "slot_file_name",
    "slot_fingerprint",
    "wait_until_ready",
]

"""Starting, readying, watching and stopping ``llama-server`` through a Transport (docs/behaviour.md §5).

No Django import: the session lifecycle (:mod:`sessions_app.lifecycle`) wires this to the
database and the transcript.
"""

from __future__ import annotations

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
    parameters (``contextSize``, ``gpuLayers``, ``threads``, ``speculative``) and the path
    of the 0600 file on that machine holding the server's own API key."""

    binary: str
    model_path: str
    port: int
    params: dict
    has_mtp: bool = False
    api_key_file: str = ""


def build_argv(spec: ServerSpec) -> list[str]:
    """The llama-server command line for one session (docs/behaviour.md §5).

    Loopback only, always, and answering only the holder of its key: ``--api-key-file``
    (never ``--api-key``: a command line is readable by every user through ``ps``);
    ``--tools all`` (the permission gate, not a flag, decides whether
    a call runs); one slot (``-np 1``: extra slots split the context and slow speculative
    decoding); ``--spec-type draft-mtp`` only for a file with an MTP head and speculation not
    turned off (asking for it without a head makes llama-server exit).
    """
    argv = [spec.binary, "-m", spec.model_path, "--host", "127.0.0.1", "--port", str(spec.port)]
    if spec.api_key_file:
        argv += ["--api-key-file", spec.api_key_file]
    argv += ["--tools", "all", "-np", "1"]
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


def read_n_ctx(base_url: str, api_key: str = "") -> int | None:
    """The context size (tokens) of the running server's slot, as ``GET /props`` reports
    it in ``default_generation_settings.n_ctx`` (one slot: ``-np 1``, so the whole ``-c``);
    None when the server does not say (an older build, a stand-in, an error)."""
    try:
        response = httpx.get(f"{base_url}/props", headers=auth_headers(api_key), timeout=5.0)
        response.raise_for_status()
        n_ctx = response.json().get("default_generation_settings", {}).get("n_ctx")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return n_ctx if isinstance(n_ctx, int) and not isinstance(n_ctx, bool) and n_ctx > 0 else None


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
    "SERVER_FLAGS",
    "Endpoint",
    "ServerSpec",
    "ServerStartError",
    "TransportError",
    "auth_headers",
    "build_argv",
    "explain_start_failure",
    "failure_message",
    "new_api_key",
    "read_n_ctx",
    "wait_until_ready",
]

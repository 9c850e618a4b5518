"""The OpenAI-compatible API (``/v1/models``, ``/v1/chat/completions``) and the page where a
member makes and revokes their keys (docs/api.md).

The API views are async: a reply streams from llama-server to the client through
``httpx.AsyncClient`` on daphne's event loop, so a long stream holds no thread. The
database and the lifecycle are reached through ``sync_to_async`` (api_app.serving).
Every refusal is OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import httpx
from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.core.exceptions import RequestDataTooBig
from django.db import close_old_connections, transaction
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods, require_POST

from machines_app.llama_server import Endpoint, auth_headers, tls_context
from machines_app.models import Machine, ModelFile
from usage_app import quota
from usage_app.recording import record_usage

from . import keys, serving
from .models import ApiKey
from .serving import ApiError

log = logging.getLogger(__name__)

#: Request fields that ask the model to call tools: refused (docs/api.md "No tools").
TOOL_FIELDS = ("tools", "functions")
TOOLS_REFUSED = ("Corral's API runs no tools and passes none to the model: send the request without '{field}'. "
                 "Sessions in Corral's web page are where models call tools, each call approved by a person.")
#: The deepest nesting of parentheses a request's ``grammar`` may have. llama-server's
#: grammar parser recurses once per level: 200,000 levels overflowed its stack and ended
#: the server every member's requests share (theirs in flight broken off). Grammars
#: people write nest a few levels.
MAX_GRAMMAR_NESTING = 256
#: Seconds between two polls of a server that is starting.
POLL_SECONDS = 0.25
#: Seconds between two checks, while a request is served, that its key may still use its
#: machine (:class:`_Access`): a revoke or an access change ends a reply within this.
ACCESS_CHECK_SECONDS = 2.0


def _request_finished(user, model_file: ModelFile, usage: dict, seconds: float, timings: dict | None = None,
                      hold: int | None = None) -> None:
    """Called once per finished chat completion (streamed or not, ended by the server or
    broken off), with llama-server's reported ``usage`` (``prompt_tokens``,
    ``completion_tokens``, ``total_tokens``; {} when it reported none), its ``timings`` when
    it sent them, and the request's wall time in seconds from the server being ready. A
    stream whose client did not ask for ``usage`` gets it counted from the ``timings``
    (:func:`usage_from_timings`). Recorded as the key owner's usage (docs/usage.md), like a
    session's reply, in the transaction that drops the request's quota ``hold``
    (usage_app.quota.reserve; None when the owner has no quota)."""
    log.debug("API request of %s on %s/%s: usage %s, timings %s, %.2f s", user.get_username(),
              model_file.machine.name, model_file.key, usage, timings, seconds)
    with transaction.atomic():
        # The machine or the account may be gone (deleted while the request ran, which
        # ended it: serving.access_lost); the row then names them, as usage rows do. Locked,
        # so neither goes between this read and the commit (the foreign keys are checked then).
        machine = Machine.objects.select_for_update(no_key=True).filter(pk=model_file.machine_id).first()
        member = type(user).objects.select_for_update(no_key=True).filter(pk=user.pk).first()
        record_usage(member=member, member_name=user.get_username(), machine=machine,
                     machine_name=model_file.machine.name, model_file=model_file, usage=usage, timings=timings,
                     source="api")
        quota.release(hold)


def _error(exc: ApiError) -> JsonResponse:
    response = JsonResponse(exc.body(), status=exc.status)
    if exc.status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="corral"'
    return response


async def _user(request: HttpRequest):
    """The member whose key the request carries. Raises ApiError 401."""
    return (await _key_of(request)).user


async def _key_of(request: HttpRequest) -> ApiKey:
    """The live key the request carries, its ``user`` loaded. Raises ApiError 401."""
    _owner, key, refusal = await sync_to_async(keys.authenticate)(keys.bearer(request.headers.get("Authorization", "")))
    if refusal is not None or key is None:
        raise ApiError(401, refusal.code if refusal else "invalid_api_key", refusal.message if refusal else "")
    return key


class _Access:
    """A request's right to go on being served, asked again every
    :data:`ACCESS_CHECK_SECONDS` while it is (:func:`_held`; serving.access_lost): a key
    revoked, its account turned off, or its owner no longer allowed on the machine ends
    the request as a new one would be refused (docs/api.md "Keys"). ``lost`` is that
    refusal once it came; ``client``, once the request is sent, is closed then, which breaks
    off what the request waits for from llama-server (httpx raises ReadError there)."""

    def __init__(self, key_id: int, machine_id: int) -> None:
        self.key_id, self.machine_id = key_id, machine_id
        self.lost: ApiError | None = None
        self.client: httpx.AsyncClient | None = None

    async def check(self) -> None:
        # Found lost before the request was sent (the client made after): closed now.
        if self.lost is None:
            self.lost = await sync_to_async(serving.access_lost)(self.key_id, self.machine_id)
        if self.lost is not None and self.client is not None:
            await self.client.aclose()

    def ended(self) -> ApiError:
        """The refusal, worded for a request it ended (``lost`` is set)."""
        assert self.lost is not None
        lost = self.lost
        return ApiError(lost.status, lost.code, f"Corral ended this request: {lost.message}", type=lost.type)


def _entry(model: ModelFile) -> dict:
    return {"id": serving.model_id(model.machine.name, model.key), "object": "model", "created": 0,
            "owned_by": model.machine.name, "name": model.display_name}


@csrf_exempt
@login_not_required
async def model_list(request: HttpRequest) -> HttpResponse:
    """``GET /v1/models``: every model file the key's owner may use, by id (serving.model_id)."""
    if request.method != "GET":
        return _error(ApiError(405, "method_not_allowed", "Use GET for /v1/models."))
    try:
        user = await _user(request)
    except ApiError as exc:
        return _error(exc)
    entries = await sync_to_async(lambda: [_entry(m) for m in serving.listed_models(user)])()
    return JsonResponse({"object": "list", "data": entries})


@csrf_exempt
@login_not_required
async def model_detail(request: HttpRequest, model: str) -> HttpResponse:
    """``GET /v1/models/<id>``: one model file, or 404/403 as a completion would answer."""
    if request.method != "GET":
        return _error(ApiError(405, "method_not_allowed", "Use GET for /v1/models/<id>."))
    try:
        user = await _user(request)
        found = await sync_to_async(serving.resolve)(user, model)
    except ApiError as exc:
        return _error(exc)
    return JsonResponse(_entry(found))


@csrf_exempt
@login_not_required
async def not_served(request: HttpRequest, rest: str) -> HttpResponse:
    """Any other ``/v1/…`` path: 404 in OpenAI's shape, naming what is served."""
    return _error(ApiError(404, "unknown_endpoint", f"Corral's API has no /v1/{rest}: it answers GET /v1/models and "
                           "POST /v1/chat/completions."))


def _check_body(raw: bytes) -> dict:
    """The request's JSON object, checked before any server is started. Raises ApiError 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, "invalid_json", f"The request body is not JSON: {exc}.") from None
    except RecursionError:  # a few hundred kB of '[' is enough to exhaust Python's parser
        raise ApiError(400, "invalid_json", "The request body is not JSON Corral can read: it nests arrays or "
                       "objects too deeply.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_request", "The request body must be a JSON object.")
    for field in TOOL_FIELDS:
        if body.get(field):
            raise ApiError(400, "tools_not_supported", TOOLS_REFUSED.format(field=field), param=field)
    for field in ("tool_choice", "function_call"):
        if body.get(field) not in (None, "none"):
            raise ApiError(400, "tools_not_supported", TOOLS_REFUSED.format(field=field), param=field)
    grammar = body.get("grammar")
    if isinstance(grammar, str) and _nesting(grammar) > MAX_GRAMMAR_NESTING:
        raise ApiError(400, "invalid_request", f"'grammar' nests parentheses more than {MAX_GRAMMAR_NESTING} deep; "
                       "the model's server cannot read it.", param="grammar")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "invalid_request", "'messages' must be a non-empty list of chat messages.",
                       param="messages")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise ApiError(400, "invalid_request", "'stream' must be true or false.", param="stream")
    return body


def _nesting(text: str) -> int:
    """How deep ``(`` nests in ``text`` (one inside a quoted literal counts too: that only
    errs on the safe side; a stray ``)`` never makes it shallower than 0)."""
    depth = deepest = 0
    for c in re.sub(r"[^()]", "", text):
        depth = depth + 1 if c == "(" else max(depth - 1, 0)
        deepest = max(deepest, depth)
    return deepest


def upstream_body(body: dict) -> bytes:
    """What goes to llama-server: the client's request with ``cache_prompt`` false, whatever
    the client sent (docs/api.md "One server, many members"), and for a stream
    ``timings_per_token`` true, so that every frame says how many tokens the server has read
    and written so far: a stream the client cuts counts up to its last frame (docs/usage.md
    "API requests in flight"), not as nothing. Every member's requests share
    one server and its one slot; with the prompt cache on, a request would reuse the part of
    the slot that matches its prompt — another member's previous prompt — and the reply's
    ``cached_tokens`` (``timings.cache_n``), and its speed, would tell how much of it the
    sender guessed. Without it every prompt is read whole, the same for a right guess as
    for a wrong one."""
    counted = {"timings_per_token": True} if body.get("stream") else {}
    return json.dumps({**body, "cache_prompt": False, **counted}).encode()


async def _wait_for_server(session_id: int, after: int, wanted: str, access: _Access) -> Endpoint:
    """The ready server's endpoint, waiting while it starts (and while it waits for
    memory) for up to ``CORRAL_API_WAIT_SECONDS``. Raises ApiError 503 with why, or the
    refusal that ended the request meanwhile (``access``)."""
    deadline = time.monotonic() + settings.CORRAL_API_WAIT_SECONDS
    state = serving.ServerState()
    while time.monotonic() < deadline:
        if access.lost is not None:
            raise access.ended()
        state = await sync_to_async(serving.server_state)(session_id, after)
        if state.endpoint is not None:
            return state.endpoint
        if state.failed:
            raise ApiError(503, "server_unavailable", f"The server for {wanted} could not start: {state.failed}",
                           type="server_error")
        await asyncio.sleep(POLL_SECONDS)
    waited = f"{settings.CORRAL_API_WAIT_SECONDS:g} seconds"
    if state.waiting:
        raise ApiError(503, "no_room", f"{state.waiting} This request waited {waited}; ask again later.",
                       type="server_error")
    raise ApiError(503, "server_starting", f"The server for {wanted} is still starting after {waited}; ask again "
                   "later.", type="server_error")


class Usage:
    """Reads ``usage`` and ``timings`` out of llama-server's SSE frames as they pass,
    without changing a byte of them."""

    LIMIT = 4 * 1024 * 1024

    def __init__(self) -> None:
        self.buffer = b""
        self.usage: dict = {}
        self.timings: dict | None = None
        self.ended = False  # ``data: [DONE]`` seen: the reply is whole

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        *frames, self.buffer = self.buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        if len(self.buffer) > self.LIMIT:
            self.buffer = b""  # a frame this long carries no usage worth the memory
        for frame in frames:
            for line in frame.split(b"\n"):
                if line.startswith(b"data:"):
                    self.take(line[5:].strip())

    def take(self, data: bytes) -> None:
        if data == b"[DONE]":
            self.ended = True
        if not data or data == b"[DONE]":
            return
        try:
            payload = json.loads(data)
        except ValueError:
            return
        if isinstance(payload, dict):
            if isinstance(payload.get("usage"), dict):
                self.usage = payload["usage"]
            if isinstance(payload.get("timings"), dict):
                self.timings = payload["timings"]


def usage_from_timings(timings: dict | None) -> dict:
    """OpenAI's ``usage`` counted from llama-server's ``timings`` (which every reply's last
    frame carries): a stream sends ``usage`` only when the client asked for it
    (``stream_options.include_usage``), and Corral does not change the request to ask.
    The prompt is the tokens read from the cache (``cache_n``) and the ones computed
    (``prompt_n``), as llama-server counts ``prompt_tokens``. {} without timings."""
    if not timings:
        return {}
    try:
        prompt = int(timings.get("cache_n", 0)) + int(timings.get("prompt_n", 0))
        completion = int(timings.get("predicted_n", 0))
    except (TypeError, ValueError):
        return {}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@contextlib.asynccontextmanager
async def _held(session_id: int, hold: int | None, access: _Access):
    """Keep the request's lease on its server (serving.renew) and its quota hold
    (usage_app.quota.renew_hold) for as long as the block runs, whether or not the server
    sends anything meanwhile (a long prompt is read in silence): a task renews them every
    ``RENEW_SECONDS``, and asks every :data:`ACCESS_CHECK_SECONDS` whether the request may
    still be served (``access``)."""

    async def renew() -> None:
        tick = min(ACCESS_CHECK_SECONDS, serving.RENEW_SECONDS)
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            try:
                await access.check()
                # Half a tick early rather than a whole tick late.
                if time.monotonic() - renewed >= serving.RENEW_SECONDS - tick / 2:
                    renewed = time.monotonic()
                    await sync_to_async(serving.renew)(session_id)
                    await sync_to_async(quota.renew_hold)(hold)
            except Exception:
                # The database away or the connection cut: the request goes on, the
                # check and the renewals are tried again next tick on a new connection
                # (one left broken would fail them all, and the request's end with them).
                log.warning("API request on session %s: an access check or renewal failed", session_id,
                            exc_info=True)
                with contextlib.suppress(Exception):
                    await sync_to_async(close_old_connections)()

    task = asyncio.create_task(renew())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _whole_usage(content: bytes) -> tuple[dict, dict | None]:
    """``(usage, timings)`` of a whole (unstreamed) answer; usage counted from the timings
    when the answer has none."""
    try:
        answer = json.loads(content)
    except ValueError:
        return {}, None
    if not isinstance(answer, dict):
        return {}, None
    usage, timings = answer.get("usage"), answer.get("timings")
    timings = timings if isinstance(timings, dict) else None
    return (usage if isinstance(usage, dict) and usage else usage_from_timings(timings)), timings


def _client() -> httpx.AsyncClient:
    timeout = httpx.Timeout(connect=10.0, read=settings.CORRAL_STREAM_IDLE_SECONDS, write=60.0, pool=10.0)
    return httpx.AsyncClient(timeout=timeout, verify=tls_context())


@csrf_exempt
@login_not_required
async def chat_completions(request: HttpRequest) -> HttpResponseBase:
    """``POST /v1/chat/completions``: the request goes, with the prompt cache off
    (:func:`upstream_body`), to the llama-server of the model file it names (started on
    demand, shared by every API request for that file: api_app.serving), and its answer
    comes back unchanged — streamed as llama-server's own SSE frames with ``"stream":
    true``, usage included. Refused with 429 when the owner's quota has no token left to
    hold for it (usage_app.quota.reserve)."""
    if request.method != "POST":
        return _error(ApiError(405, "method_not_allowed", "Use POST for /v1/chat/completions."))
    try:
        key = await _key_of(request)
        user = key.user
        try:
            raw = request.body
        except RequestDataTooBig:
            raise ApiError(413, "request_too_large", "The request is too large: Corral takes at most "
                           f"{settings.DATA_UPLOAD_MAX_MEMORY_SIZE / 1024 / 1024:g} MB in one request.") from None
        # Off daphne's event loop: reading 2.5 MB of JSON, or a grammar's nesting, takes a while.
        body = await sync_to_async(_check_body, thread_sensitive=False)(raw)
        model = await sync_to_async(serving.resolve)(user, body.get("model"))
        # A member whose daily token quota is spent is refused before any server starts
        # (docs/usage.md); OpenAI says the same with 429 insufficient_quota. Checked and
        # held in one step: requests sent at once cannot all pass on the same last token.
        hold, spent = await sync_to_async(quota.reserve)(user)
        if spent is not None:
            raise ApiError(429, "insufficient_quota", spent, type="insufficient_quota")
        wanted = serving.model_id(model.machine.name, model.key)
        access = _Access(key.pk, model.machine_id)
        try:
            session_id, after = await sync_to_async(serving.claim)(user, model)
            try:
                async with _held(session_id, hold, access):
                    endpoint = await _wait_for_server(session_id, after, wanted, access)
                if access.lost is not None:  # found as the server became ready: not sent
                    raise access.ended()
            except ApiError:
                await sync_to_async(serving.finished)(session_id)
                raise
        except BaseException:
            await sync_to_async(quota.release)(hold)
            raise
    except ApiError as exc:
        return _error(exc)
    relay = asyncio.ensure_future(_detached(_relay(user, model, session_id, hold, endpoint, upstream_body(body),
                                                   stream=bool(body.get("stream")), access=access)))
    try:
        return await asyncio.shield(relay)
    except asyncio.CancelledError:
        # The client went away before llama-server answered (a non-streamed reply comes
        # back whole): closing the connection now would stop the server with nothing
        # counted, so the request is finished there and counted (docs/usage.md).
        _abandoned.add(task := asyncio.ensure_future(_finish_abandoned(relay)))
        task.add_done_callback(_abandoned.discard)
        raise


#: Requests whose client went away before llama-server answered, finishing (a reference
#: keeps each task alive until it ends).
_abandoned: set[asyncio.Future] = set()


async def _detached(work):
    """Await ``work`` in a thread-sensitive context of its own: the request's (Django's) ends
    with the request, and a task that outlives it may not call ``sync_to_async`` any more.
    Its database connection is closed at the end, as Django's are after a request."""
    # Given an executor of its own: without one, a context nested in the request's is the
    # request's.
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="api-request")
    try:
        async with ThreadSensitiveContext(executor=executor):
            try:
                return await work
            finally:
                await sync_to_async(close_old_connections)()
    finally:
        executor.shutdown(wait=False)


class _Stream:
    """A relayed stream as Django's StreamingHttpResponse takes it: the async iterator of
    its frames, and a ``close()`` Django calls when the request is over
    (HttpResponseBase.close). A client that leaves after the view returned but before
    Django began to send the stream leaves the frames never iterated, so their own
    clean-up (``finally``: close the upstream, count the usage, drop the hold) would never
    run: ``close()`` then reads the first chunk llama-server has sent (its ``timings``
    say the prompt it read) and closes the frames, as for a stream the client cut."""

    def __init__(self, frames: AsyncGenerator[bytes]) -> None:
        self.frames = frames
        self.began = False  # set by the frames themselves once iterated
        self.loop = asyncio.get_running_loop()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.frames

    def close(self) -> None:
        """Django's: called from a thread (sync_to_async), on every request's end."""
        if not self.began:
            self.loop.call_soon_threadsafe(self._abandon)

    def _abandon(self) -> None:
        _abandoned.add(task := asyncio.ensure_future(_detached(self._cut())))
        task.add_done_callback(_abandoned.discard)

    async def _cut(self) -> None:
        try:
            with contextlib.suppress(StopAsyncIteration):
                await anext(self.frames)
        except Exception:
            log.exception("an API stream whose client went away before it began did not finish")
        finally:
            await self.frames.aclose()


async def _finish_abandoned(relay: asyncio.Future) -> None:
    """Let a request whose client left run to its end, so its usage is recorded and its
    hold dropped as for any other (a stream is read to ``[DONE]`` with nobody to send it to)."""

    async def drain() -> None:
        response = await relay
        if isinstance(response, StreamingHttpResponse):
            frames = response.streaming_content
            assert isinstance(frames, AsyncIterator)  # _relay's frames are an async generator
            async for _ in frames:
                pass

    try:
        await _detached(drain())
    except Exception:
        log.exception("an API request whose client went away did not finish")


async def _broken_off(session_id: int, access: _Access, fallback: str) -> ApiError:
    """Why a request to llama-server broke off: the refusal that ended it (``access``),
    else 503 ``server_unavailable`` with why the server went away (serving.server_went_away),
    or ``fallback`` when nothing is known of it."""
    if access.lost is not None:
        return access.ended()
    why = await sync_to_async(serving.server_went_away)(session_id)
    return ApiError(503, "server_unavailable", why or fallback, type="server_error")


async def _relay(user, model: ModelFile, session_id: int, hold: int | None, endpoint: Endpoint, content: bytes, *,
                 stream: bool, access: _Access) -> HttpResponseBase:
    started = time.monotonic()
    client = access.client = _client()
    upstream_request = client.build_request(
        "POST", f"{endpoint.url}/v1/chat/completions", content=content,
        headers={"Content-Type": "application/json", **auth_headers(endpoint.api_key)},
    )

    async def done(usage: dict, timings: dict | None) -> None:
        await sync_to_async(serving.finished)(session_id)
        await sync_to_async(_request_finished)(user, model, usage, time.monotonic() - started, timings, hold)

    try:
        # llama-server answers a non-streamed request only once the whole reply is written
        # (a stream, once its first result is ready): the request is served all that time,
        # so its lease and its hold are kept through the wait as through a stream.
        async with _held(session_id, hold, access):
            upstream = await client.send(upstream_request, stream=True)
    except httpx.HTTPError as exc:
        await client.aclose()
        await done({}, None)
        return _error(await _broken_off(session_id, access, f"The model's server did not answer: {exc}."))
    content_type = upstream.headers.get("content-type", "application/json")
    if not stream or upstream.status_code != 200:
        failure: httpx.HTTPError | None = None
        try:
            async with _held(session_id, hold, access):
                content = await upstream.aread()
        except httpx.HTTPError as exc:
            content, failure = b"", exc
        finally:
            await upstream.aclose()
            await client.aclose()
        usage, timings = _whole_usage(content) if failure is None and upstream.status_code == 200 else ({}, None)
        await done(usage, timings)
        if failure is not None:
            return _error(await _broken_off(session_id, access, f"The model's server broke off: {failure}."))
        return HttpResponse(content, status=upstream.status_code, content_type=content_type)

    recorded = False

    async def record(seen: Usage) -> None:
        nonlocal recorded
        if not recorded:
            recorded = True
            await done(seen.usage or usage_from_timings(seen.timings), seen.timings)

    async def frames() -> AsyncGenerator[bytes]:
        relayed.began = True
        seen = Usage()
        try:
            async with _held(session_id, hold, access):
                async for chunk in upstream.aiter_raw():
                    seen.feed(chunk)
                    if seen.ended:
                        # Recorded before the client sees the end: a client that closes the
                        # connection right after ``[DONE]`` may cancel this generator before
                        # its ``finally`` can write anything.
                        await record(seen)
                    yield chunk
        except httpx.HTTPError as exc:
            error = await _broken_off(session_id, access, f"The model's server broke off the reply: {exc}.")
            yield b"data: " + json.dumps(error.body()).encode() + b"\n\n"
        finally:
            await upstream.aclose()
            await client.aclose()
            await record(seen)  # a reply broken off: what the server said it used so far

    relayed = _Stream(frames())
    response = StreamingHttpResponse(relayed, status=200, content_type=content_type)
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # a proxy in front must pass each frame on at once
    return response


# --- the member's page: their keys ---------------------------------------------------------------


@require_http_methods(["GET", "POST"])
def api_keys(request: HttpRequest) -> HttpResponse:
    """The member's API keys: name, start of the key, made, last used, revoked; a form to
    make one. A key just made is shown once, on the answer to that POST, and never again."""
    user = request.user
    if not user.is_authenticated:  # the login middleware sends them to log in first
        return redirect("login")
    made, error = None, ""
    if request.method == "POST":
        try:
            key, token = keys.create_key(user, request.POST.get("name", ""))
        except keys.KeyRefused as exc:
            error = str(exc)
        else:
            made = {"key": key, "token": token}
    response = render(request, "api_app/keys.html", {
        "keys": ApiKey.objects.filter(user=user), "made": made, "error": error,
        "base_url": request.build_absolute_uri("/v1"),
        "models": [serving.model_id(m.machine.name, m.key) for m in serving.listed_models(user)],
    }, status=400 if error else 200)
    if made:
        response["Cache-Control"] = "no-store"  # the key must not stay in a cache
    return response


@require_POST
def revoke_key(request: HttpRequest, key_id: int) -> HttpResponse:
    """Revoke one of the member's keys at once (requests with it are refused from now on)."""
    keys.revoke_key(request.user, key_id)
    return redirect("api_keys")

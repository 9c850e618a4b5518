"""Which server answers an API request, and keeping it up (docs/api.md "Servers").

Each model file the API is asked for gets one hidden session (``AgentSession`` with
purpose ``api``, owned by Corral's system account, listed on no page): its llama-server is
started, adopted, watched, put to sleep when idle and placed in its machine's memory by the
same lifecycle as every session's (sessions_app/servers/, room.py). Every API request
for that file, from any member, shares that one server.

While a request is served the session holds a short lease (``api_busy_until``, renewed as
its reply streams), so neither the machine's idle time nor a start making room puts the
server to sleep under it. A request lost with its web process lets go by itself when the
lease lapses.

Everything here is synchronous (database, dispatch); the async views call it through
``sync_to_async``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django.utils import timezone

from machines_app.access import machine_refusal, machines_for
from machines_app.llama_server import Endpoint
from machines_app.models import Machine, MemoryClaim, ModelFile
from sessions_app import dispatch
from sessions_app.actions import by
from sessions_app.events import change_status, locked
from sessions_app.models import AgentSession, TranscriptEvent
from sessions_app.servers import records, watch
from sessions_app.servers.models import ServerRecord
from sessions_app.transcript import Kind

from . import keys
from .models import ApiKey

Status = AgentSession.Status

#: The account that owns the hidden API sessions: inactive, no password, never logs in.
SYSTEM_USERNAME = "corral-api"
#: How long one mark of "serving a request" lasts; renewed every :data:`RENEW_SECONDS`.
BUSY = timedelta(seconds=30)
RENEW_SECONDS = 10.0

_GGUF = re.compile(r"\.gguf$", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class ApiError(Exception):
    """A request the API answers with OpenAI's error body: ``status`` (HTTP), ``code``,
    ``type`` and ``message`` (a sentence); ``param`` names the field at fault, if one is."""

    def __init__(self, status: int, code: str, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.type, self.param = status, code, message, type, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def access_lost(key_id: int, machine_id: int) -> ApiError | None:
    """The refusal a request with the key ``key_id`` on the machine ``machine_id`` would get
    now (401 ``invalid_api_key``: revoked, deleted, its account turned off; 403
    ``machine_not_allowed``: its owner no longer in the machine's groups, or the machine
    turned off or deleted), or None while it may go on. Asked while a request is served
    (docs/api.md "Keys"): what would refuse a new request ends one under way too."""
    key = ApiKey.objects.select_related("user").filter(pk=key_id).first()
    refusal = keys.refusal_of(key)
    if key is None or refusal is not None:
        return ApiError(401, refusal.code if refusal else "invalid_api_key",
                        refusal.message if refusal else "This API key is gone.")
    machine = Machine.objects.filter(pk=machine_id).first()
    if machine is None:
        return ApiError(403, "machine_not_allowed", "The machine this model is on was removed from Corral.",
                        type="permission_error")
    refused = machine_refusal(key.user, machine)
    return ApiError(403, "machine_not_allowed", refused, type="permission_error") if refused else None


def model_id(machine_name: str, key: str) -> str:
    """The id a model file has in the API: its machine's name, ``/``, and its path under the
    machine's models directory without ``.gguf`` — ``gpu1/SmolLM2-135M-Instruct.Q4_1``,
    ``gpu1/qwen/Qwen3-8B-Q4_K_M``. It stays the same as long as the file keeps its name."""
    return f"{machine_name}/{_GGUF.sub('', key)}"


def listed_models(user) -> QuerySet[ModelFile]:
    """The model files ``user`` may use through the API: complete, readable files of the
    machines open to them (machines_app.access.machines_for), by machine and path."""
    return (ModelFile.objects.filter(machine__in=machines_for(user), error="", missing_parts=[])
            .select_related("machine").order_by("machine__name", "key"))


def resolve(user, wanted: object) -> ModelFile:
    """The model file the id ``wanted`` names (:func:`model_id`). Raises ApiError: 400
    without an id, 404 for a machine or file Corral does not know (or one that cannot be
    started, with why), 403 for a machine ``user`` may not use."""
    if not isinstance(wanted, str) or not wanted.strip():
        raise ApiError(400, "missing_model", "Name a model: 'model' is one of the ids GET /v1/models lists, "
                       "e.g. 'gpu1/SmolLM2-135M-Instruct.Q4_1'.", param="model")
    if _CONTROL.search(wanted):
        # No file is named with control characters, and PostgreSQL refuses a NUL in a query.
        raise ApiError(404, "model_not_found", f"No model has the id {wanted!r}: an id holds no control characters. "
                       "GET /v1/models lists the ids you may use.", param="model")
    names = [n for n in Machine.objects.values_list("name", flat=True) if wanted.startswith(n + "/")]
    if not names:
        raise ApiError(404, "model_not_found", f"No machine is named in the model id '{wanted}': an id is "
                       "'<machine>/<model file>', as GET /v1/models lists them.", param="model")
    machine = Machine.objects.get(name=max(names, key=len))
    refusal = machine_refusal(user, machine)
    if refusal:
        raise ApiError(403, "machine_not_allowed", refusal, type="permission_error", param="model")
    rest = wanted[len(machine.name) + 1:]
    found = [m for m in ModelFile.objects.filter(machine=machine, key__startswith=rest).select_related("machine")
             if model_id(machine.name, m.key) == wanted]
    if not found:
        raise ApiError(404, "model_not_found", f"Machine '{machine.name}' has no model file '{rest}'. GET /v1/models "
                       "lists the ids you may use.", param="model")
    model = found[0]
    if model.problem:
        raise ApiError(404, "model_not_found", f"{wanted} cannot be started: {model.problem}.", param="model")
    return model


def system_user():
    """Corral's system account (:data:`SYSTEM_USERNAME`), made once: inactive, with no
    usable password, so nobody logs in as it."""
    users = get_user_model()
    user = users.objects.filter(username=SYSTEM_USERNAME).first()
    if user is None:
        user = users(username=SYSTEM_USERNAME, is_active=False)
        user.set_unusable_password()
        try:
            with transaction.atomic():
                user.save()
        except IntegrityError:  # made by a request racing this one
            user = users.objects.get(username=SYSTEM_USERNAME)
    return user


def api_session(model: ModelFile) -> AgentSession:
    """The hidden session of ``model`` (made ``stopped`` the first time: :func:`claim`
    starts it). One per model file: a unique constraint settles two first requests."""
    session = AgentSession.objects.filter(purpose=AgentSession.Purpose.API, machine=model.machine,
                                          model_key=model.key).first()
    if session is not None:
        return session
    try:
        with transaction.atomic():
            return AgentSession.objects.create(
                purpose=AgentSession.Purpose.API, owner=system_user(), machine=model.machine, model_key=model.key,
                working_dir="", title=f"API · {model.display_name}"[:200], status=Status.STOPPED,
            )
    except IntegrityError:
        return AgentSession.objects.get(purpose=AgentSession.Purpose.API, machine=model.machine, model_key=model.key)


def claim(user, model: ModelFile) -> tuple[int, int]:
    """Mark the model's server as serving a request, and start it when it is not running
    (asleep, stopped, exited, or never started), as a member's message wakes a session.
    ``(session id, last transcript seq before this request)``."""
    session = api_session(model)
    with transaction.atomic():
        current = locked(session.pk)
        now = timezone.now()
        AgentSession.objects.filter(pk=current.pk).update(api_busy_until=now + BUSY, last_activity_at=now)
        if current.status in (Status.SLEEPING, Status.STOPPED, Status.EXITED):
            woke = current.status == Status.SLEEPING
            change_status(current, Status.LOADING, by=dict(by(user)), reason="wake" if woke else "")
            dispatch.enqueue_on_commit(dispatch.START_SERVER, current.pk)
        return current.pk, current.last_seq


@dataclass(frozen=True)
class ServerState:
    """Where a request's server stands: ``endpoint`` once it answers; else ``failed`` with
    why (it exited, was stopped, cannot be reached), or ``waiting`` for memory with the
    machine's line sentence, or neither (still loading)."""

    endpoint: Endpoint | None = None
    failed: str = ""
    waiting: str = ""


def _last_words(session_id: int, after: int, kinds: tuple[str, ...]) -> str:
    event = (TranscriptEvent.objects.filter(session_id=session_id, seq__gt=after, kind__in=kinds)
             .order_by("-seq").first())
    return str(event.payload.get("message", "")) if event is not None else ""


def server_state(session_id: int, after: int) -> ServerState:
    """Where the session's server stands now (read once per poll), the request's lease
    renewed. ``after``: the transcript seq the request began at (its failures come after)."""
    renew(session_id)
    session = AgentSession.objects.filter(pk=session_id).select_related("machine").first()
    if session is None:
        return ServerState(failed="Its machine or model was removed from Corral meanwhile.")
    if session.status == Status.IDLE:
        if ServerRecord.objects.filter(session_id=session_id, ready_at__isnull=False, stopping=False).exists():
            endpoint = records.server_endpoint(session)
            if endpoint is not None:
                return ServerState(endpoint=endpoint)
        return ServerState()
    if session.status in (Status.EXITED, Status.UNKNOWN):
        why = _last_words(session_id, after if session.status == Status.EXITED else 0, (Kind.ERROR,))
        return ServerState(failed=why or "llama-server is not running (its status is "
                           f"{Status.word(session.status)}).")
    if session.status == Status.STOPPED:
        return ServerState(failed="The model's server was stopped (from the machines page or the admin) while "
                           "this request waited for it.")
    if session.status == Status.LOADING and MemoryClaim.objects.filter(session_id=session_id, granted=False).exists():
        return ServerState(waiting=_last_words(session_id, 0, (Kind.NOTICE,)))
    return ServerState()


def renew(session_id: int) -> None:
    """Push the request's lease forward (called at each poll and every few seconds of a stream)."""
    AgentSession.objects.filter(pk=session_id).update(api_busy_until=timezone.now() + BUSY)


def finished(session_id: int) -> None:
    """A request is over: the idle time counts from now. Its lease lapses by itself
    (another request may still be streaming from the same server)."""
    AgentSession.objects.filter(pk=session_id).update(last_activity_at=timezone.now())


def server_went_away(session_id: int) -> str:
    """Why the server broke off a reply, once the watch is asked now ('' when it still runs)."""
    watch.check_session_server(session_id)
    if watch.server_gone(session_id):
        return "The model's server stopped while answering (it exited or was stopped)."
    return ""

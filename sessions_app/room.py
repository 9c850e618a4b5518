"""Starts that fit in a machine's memory (docs/behaviour.md §5 "Room on a machine").

Before a server is spawned (:func:`admit`, called by servers.start) its need —
:func:`machines_app.memory.estimate` of the model file for the session's context size —
is measured against the machine's room: what an admin gave it as a budget, else its GPUs'
free memory (where ``nvidia-smi`` answers and the session offloads layers), else its
available memory (``/proc/meminfo``). Corral's own servers there count with their real
use (resident memory, GPU memory per process), a server still loading at its estimate.

- It fits: it starts.
- It fits once some idle servers sleep: the least recently used idle ones are put to
  sleep first (``servers.stop.sleep_server``: slot saved, woken warm by their next
  message), then it starts.
- It does not fit yet: it waits in the machine's line (a :class:`MemoryClaim` not
  granted) and its transcript says so ("Waiting for memory on gpu1 — 2 ahead"). No worker
  waits: the health watch's :func:`admit_waiting` hands the head of each line back to
  the servers queue every few seconds, and the start measures again.
- It can never fit (more than the budget, or than all the memory or GPU memory there):
  refused before anything starts, naming what it needs and what the machine has.

The line is folded from stored rows: a claim whose session is no longer ``loading``
(stopped, failed, deleted) is out of it.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from machines_app import memory
from machines_app.discovery import read_model_head
from machines_app.gguf import GGUFError
from machines_app.memory import Fit, Need, Room, size
from machines_app.models import Machine, MachineSample, MemoryClaim, ModelFile, reached_by
from machines_app.transports import ProcessId, Transport, TransportError, transport_for

from . import dispatch
from .events import record_event
from .models import AgentSession
from .server_state import idle_sessions, start_live
from .servers.models import ServerRecord
from .transcript import Kind

Status = AgentSession.Status
log = logging.getLogger(__name__)

#: Seconds between two tries of the head of a machine's line (each reads the machine).
RETRY_SECONDS = 4
#: Seconds between two samples of a machine's memory (the machines page's plot); the
#: sampling round comes as often (sessions_app/rounds.py).
SAMPLE_SECONDS = 30
#: A sample taken less than this before a round counts as this round's already: the
#: rounds come every SAMPLE_SECONDS, a little early or late, and a sample found 29.9 s old
#: would have skipped a round (a sample every minute).
SAMPLE_SLACK_SECONDS = 5
#: How long samples are kept.
SAMPLES_KEPT = timedelta(hours=2)


def need_of(model: ModelFile, server_params: dict) -> Need:
    """What a server of ``model`` with ``server_params`` (``contextSize``: ``-c``) needs."""
    shape = model.memory_shape or {}
    context = server_params.get("contextSize")
    try:
        context = int(context) if context not in (None, "") else None
    except (TypeError, ValueError):
        context = None
    projector = shape.get("projector_size", 0) if model.projector_key else 0
    return memory.estimate(model.file_size, shape, context_size=context or None, projector_size=projector)


def shape_of(model: ModelFile, transport: Transport) -> dict:
    """The model file's memory shape (:func:`machines_app.memory.model_shape`), read from
    its head through its machine once when discovery has not (a row from before shapes
    were kept: its next refresh would) and stored. {} when it cannot be read now."""
    if model.memory_shape or model.error:
        return model.memory_shape
    try:
        root = transport.expand_path(model.machine.models_dir)
        path = posixpath.join(root, model.key)
        shape = memory.model_shape(read_model_head(model.key, lambda _key, n, offset=0: transport.read_head(path, n,
                                                                                                          offset)))
        if model.projector_key:
            info = transport.file_info(posixpath.join(root, model.projector_key))
            shape["projector_size"] = info.size if info is not None else 0
    except (TransportError, OSError, GGUFError):
        return {}
    ModelFile.objects.filter(pk=model.pk).update(memory_shape=shape)
    model.memory_shape = shape
    return shape


def uses_gpu(server_params: dict) -> bool:
    """Whether the server offloads layers to the GPUs (``-ngl`` not 0; llama-server's default does)."""
    return str(server_params.get("gpuLayers", "")).strip() not in ("0",)


@dataclass
class Reading:
    """The machine now: memory in bytes, its GPUs, and per session of Corral's servers
    there ``(resident, GPU)`` bytes."""

    ram_total: int | None = None
    ram_available: int | None = None
    gpus: list[memory.Gpu] = field(default_factory=list)
    server_use: dict[int, tuple[int, int]] = field(default_factory=dict)


def read_machine(machine: Machine, transport: Transport | None = None) -> Reading:
    """Read the machine through its transport: ``/proc/meminfo``, ``nvidia-smi`` where it
    answers, and the resident and GPU memory of each recorded server. Raises TransportError."""
    transport = transport or transport_for(machine)
    reading = Reading()
    meminfo = transport.run_probe(["cat", "/proc/meminfo"])
    if meminfo:
        reading.ram_total, reading.ram_available = memory.parse_meminfo(meminfo)
    gpu_text = transport.run_probe(memory.GPU_QUERY)
    reading.gpus = memory.parse_gpus(gpu_text) if gpu_text else []
    per_pid = (transport.gpu_memory() or {}) if reading.gpus else {}
    for record in ServerRecord.objects.filter(machine=machine):
        rss = transport.memory_of(ProcessId(record.pid, record.start_time)) or 0
        reading.server_use[record.session_id] = (rss, per_pid.get(record.pid, 0))
    return reading


def _use(pair: tuple[int, int], where: str) -> int:
    rss, vram = pair
    if where == "GPU memory":
        return vram
    if where == "memory":
        return rss
    return rss + vram


def _where(machine: Machine, reading: Reading, gpu: bool) -> str:
    if machine.memory_budget_mib:
        return "its memory budget"
    if gpu and reading.gpus:
        return "GPU memory"
    return "memory"


def _estimate_for(session_id: int, machine: Machine, model_key: str, params: dict) -> int:
    model = ModelFile.objects.filter(machine=machine, key=model_key).first()
    return need_of(model, params).total if model is not None else 0


def room_of(machine: Machine, reading: Reading, *, gpu: bool = True, leave_out: int | None = None) -> Room:
    """The room a start meets on ``machine`` (:class:`machines_app.memory.Room`), its own
    session ``leave_out`` not counted. Servers that are ready count with their real use;
    one still loading, and a start let through that has not recorded its server yet, with
    their estimate (what they will hold soon)."""
    where = _where(machine, reading, gpu)
    budget = machine.memory_budget_mib * memory.MIB if machine.memory_budget_mib else None
    used = pending = 0
    recorded = set()
    for record in ServerRecord.objects.filter(machine=machine).exclude(session_id=leave_out):
        recorded.add(record.session_id)
        real = _use(reading.server_use.get(record.session_id, (0, 0)), where)
        if record.ready_at is None or not real:
            estimate = _estimate_for(record.session_id, machine, record.model_key, record.server_params)
            used += max(real, estimate)
            pending += max(estimate - real, 0)
        else:
            used += real
    for claim in MemoryClaim.objects.filter(machine=machine, granted=True).exclude(session_id=leave_out):
        if claim.session_id not in recorded:
            used += claim.need
            pending += claim.need
    if budget is not None:
        return Room(where, budget, budget - used)
    if where == "GPU memory":
        return Room(where, sum(g.total for g in reading.gpus), sum(g.free for g in reading.gpus) - pending)
    return Room(where, reading.ram_total or 0, (reading.ram_available or 0) - pending)


def idle_servers(machine: Machine, reading: Reading, where: str, *, leave_out: int | None = None) -> list[tuple[int, int]]:
    """``(session id, bytes its sleep frees)`` of every idle server on the machine, least
    recently used first (``server_state.idle_sessions``)."""
    found = []
    for session_id in idle_sessions(machine):
        if session_id == leave_out:
            continue
        frees = _use(reading.server_use.get(session_id, (0, 0)), where)
        if not frees:
            record = ServerRecord.objects.filter(session_id=session_id).first()
            frees = _estimate_for(session_id, machine, record.model_key, record.server_params) if record else 0
        found.append((session_id, frees))
    return found


def _line(machine: Machine):
    """The machine's line: claims not granted whose session still waits to start."""
    return MemoryClaim.objects.filter(machine=machine, granted=False, session__status=Status.LOADING)


def lock_machine(machine_id: int) -> None:
    """Lock the machine's row until the caller's transaction ends: one admission per
    machine at a time. ``FOR NO KEY UPDATE`` (sessions_app.events.locked says why): rows
    that point at the machine can still be written meanwhile."""
    Machine.objects.select_for_update(no_key=True).filter(pk=machine_id).first()


def admit(session: AgentSession, transport: Transport, *, sleep: Callable[..., bool],
          fail: Callable[[AgentSession, str], object]) -> bool:
    """Let the session's start go ahead (True) or not (False: it waits in line, or it was
    refused and the session says why, status ``exited``). Called by the start, holding
    the session's start claim, before anything is spawned. A model the machine does not
    list, or a machine that cannot be read now, goes ahead: the start itself says what is
    wrong in its own words."""
    machine = session.machine
    model = ModelFile.objects.filter(machine=machine, key=session.model_key).first()
    if model is None or model.problem:
        return True
    shape_of(model, transport)
    need = need_of(model, session.server_params)
    gpu = uses_gpu(session.server_params)
    slept: list[int] = []
    for _attempt in range(3):
        try:
            reading = read_machine(machine, transport)
        except TransportError as exc:
            log.info("session %s: cannot read %s's memory (%s); starting without the check", session.pk,
                     machine.name, exc)
            return True
        with transaction.atomic():
            # One admission per machine at a time (PostgreSQL: the row lock; SQLite takes
            # its write lock for every transaction), so two starts never take one room.
            lock_machine(machine.pk)
            claim = MemoryClaim.objects.filter(session=session).first()
            if claim is not None and (claim.granted or claim.machine_id != machine.pk):
                claim.delete()
                claim = None
            line = _line(machine).exclude(session=session)
            if claim is None:
                ahead = line.count()
            else:
                ahead = line.filter(queued_at__lte=claim.queued_at).exclude(
                    queued_at=claim.queued_at, pk__gt=claim.pk).count()
            room = room_of(machine, reading, gpu=gpu, leave_out=session.pk)
            if not room.total:
                return True  # nothing known of its memory (no /proc/meminfo, no budget): not measured
            idle = idle_servers(machine, reading, room.where, leave_out=session.pk)
            fit = memory.plan(need.total, room, idle, ahead=ahead)
            if fit.kind == Fit.FITS:
                if claim is None:
                    MemoryClaim.objects.create(session=session, machine=machine, need=need.total, granted=True)
                else:
                    MemoryClaim.objects.filter(pk=claim.pk).update(granted=True, need=need.total)
                return True
            if fit.kind == Fit.TOO_BIG:
                if claim is not None:
                    claim.delete()
                break
            if fit.kind == Fit.WAITS:
                if claim is None:
                    claim = MemoryClaim.objects.create(session=session, machine=machine, need=need.total)
                told = claim.told_ahead
                MemoryClaim.objects.filter(pk=claim.pk).update(need=need.total, tried_at=timezone.now(),
                                                               told_ahead=ahead)
                if told != ahead:
                    record_event(session.pk, Kind.NOTICE, {"message": waiting_sentence(session, model, need, fit)})
                return False
        # AFTER_SLEEP: outside the transaction (a sleep saves a slot: seconds).
        slept += _sleep_for(session, machine, fit.to_sleep, sleep)
    else:
        # Sleeping did not free what was counted (a server's memory not given back yet):
        # wait in line; the next try measures again.
        claim, created = MemoryClaim.objects.get_or_create(
            session=session, defaults={"machine": machine, "need": need.total, "told_ahead": 0,
                                       "tried_at": timezone.now()})
        if created:
            waits = Fit(Fit.WAITS, need.total, fit.room)
            record_event(session.pk, Kind.NOTICE, {"message": waiting_sentence(session, model, need, waits)})
        return False
    fail(session, too_big_sentence(model, machine, need, fit.room))  # exited, an open turn ends
    return False


def _sleep_for(session: AgentSession, machine: Machine, session_ids: tuple[int, ...],
               sleep: Callable[..., bool]) -> list[int]:
    """Put those idle servers to sleep for ``session``'s start (``sleep``: servers.stop's
    ``sleep_server``); the ones that slept."""
    slept = []
    for session_id in session_ids:
        if sleep(session_id, by=None):
            slept.append(session_id)
            record_event(session_id, Kind.NOTICE, {"message": (
                f"Put to sleep to make room on {machine.name} for another session; the next message wakes it "
                "with its prompt cache.")})
    if slept:
        names = ", ".join(
            AgentSession.objects.get(pk=s).display_title for s in slept if AgentSession.objects.filter(pk=s).exists()
        )
        n = len(slept)
        record_event(session.pk, Kind.NOTICE, {"message": (
            f"Put {n} idle server{'s' if n != 1 else ''} on {machine.name} to sleep to make room: {names}.")})
    return slept


def waiting_sentence(session: AgentSession, model: ModelFile, need: Need, fit: Fit) -> str:
    """'Waiting for memory on gpu1 — 2 ahead: SmolLM2 needs about 412 MiB (…); 120 MiB of
    2.0 GiB free on gpu1 (its memory budget). …'"""
    ahead = f" — {fit.ahead} ahead" if fit.ahead else ""
    return (
        f"Waiting for memory on {session.machine.name}{ahead}: {model.display_name} needs {need.words()}; "
        f"{fit.room.words(session.machine.name)}. It starts by itself when there is room (a session there "
        "stopped or put to sleep); Stop cancels the wait."
    )


def too_big_sentence(model: ModelFile, machine: Machine, need: Need, room: Room) -> str:
    return (
        f"{model.display_name} cannot start on {machine.name}: it needs {need.words()}, and {machine.name} has "
        f"{size(room.total)} in all ({room.where}). Choose a smaller context size, another model or another machine."
    )


def release(session_id: int) -> None:
    """The start is over (its server ready, failed or stopped): its grant stops counting
    (a ready server counts with its real use)."""
    MemoryClaim.objects.filter(session_id=session_id, granted=True).delete()


def admit_waiting() -> list[int]:
    """The health watch's part: clear claims out of the line (their session no longer
    waits to start), and hand the head of each machine's line back to the servers queue
    (at most every :data:`RETRY_SECONDS`), whose start measures again. The session ids
    handed back."""
    if not MemoryClaim.objects.exists():
        return []  # the usual case, every two seconds: one query, not five
    MemoryClaim.objects.filter(granted=False).exclude(session__status=Status.LOADING).delete()
    # A grant lives only while its start holds the session's start claim: one whose start
    # was lost (its worker died) must not keep counting.
    for claim in MemoryClaim.objects.filter(granted=True).select_related("session"):
        if not start_live(claim.session):
            MemoryClaim.objects.filter(pk=claim.pk, granted=True).delete()
    now = timezone.now()
    handed = []
    for machine_id in MemoryClaim.objects.filter(granted=False).values_list("machine_id", flat=True).distinct():
        line = list(MemoryClaim.objects.filter(machine_id=machine_id, granted=False)
                    .select_related("session", "machine").order_by("queued_at", "pk"))
        if not line:
            continue
        # Those behind the head are told when their place changes (the head hears it from
        # its own try, with the numbers).
        for ahead, claim in enumerate(line[1:], start=1):
            if claim.told_ahead != ahead and MemoryClaim.objects.filter(
                    pk=claim.pk, told_ahead=claim.told_ahead).update(told_ahead=ahead):
                record_event(claim.session_id, Kind.NOTICE, {
                    "message": f"Waiting for memory on {claim.machine.name} — {ahead} ahead."})
        head = line[0]
        if start_live(head.session):
            continue
        if head.tried_at is not None and head.tried_at > now - timedelta(seconds=RETRY_SECONDS):
            continue
        if MemoryClaim.objects.filter(pk=head.pk, tried_at=head.tried_at).update(tried_at=now):
            dispatch.enqueue(dispatch.START_SERVER, head.session_id)
            handed.append(head.session_id)
    return handed


# --- what members see: the picker's fit, the machines page ------------------------------------


def latest_sample(machine: Machine) -> MachineSample | None:
    return machine.samples.order_by("-taken_at").first()


def reading_of(sample: MachineSample | None) -> Reading:
    if sample is None:
        return Reading()
    return Reading(
        ram_total=sample.ram_total, ram_available=sample.ram_available,
        gpus=[memory.Gpu(**g) for g in sample.gpus],
        server_use={int(k): (v[0], v[1]) for k, v in sample.server_use.items()},
    )


def fits(machine: Machine, models: list[ModelFile], server_params: dict | None = None) -> dict[int, Fit]:
    """For the new-session picker: per model file (by pk), whether a start with
    ``server_params`` fits on ``machine`` now, after sleeping idle servers, waits, or is
    too big — from the machine's latest sample (no read of the machine per page). {} when
    no sample was taken yet and no budget is set."""
    sample = latest_sample(machine)
    if (sample is None or sample.error) and not machine.memory_budget_mib:
        return {}
    params = server_params or {}
    reading = reading_of(sample)
    room = room_of(machine, reading, gpu=uses_gpu(params))
    if not room.total:
        return {}
    idle = idle_servers(machine, reading, room.where)
    ahead = _line(machine).count()
    return {m.pk: memory.plan(need_of(m, params).total, room, idle, ahead=ahead)
            for m in models if m.is_complete}


def sample_machines(*, force: bool = False, host: str | None = None) -> list[int]:
    """Read each enabled machine's memory and store it (:class:`MachineSample`), at most
    every :data:`SAMPLE_SECONDS` per machine (less :data:`SAMPLE_SLACK_SECONDS`); drop samples
    older than :data:`SAMPLES_KEPT`.
    A machine that cannot be read gets a sample saying why. The machines sampled: with
    ``host`` None those every host reaches (SSH machines), with a host id that host's own
    local machine (machines_app.models.reached_by)."""
    now = timezone.now()
    done = []
    for machine in Machine.objects.filter(reached_by(host), enabled=True):
        last = latest_sample(machine)
        if not force and last is not None and last.taken_at > now - timedelta(seconds=SAMPLE_SECONDS - SAMPLE_SLACK_SECONDS):
            continue
        sample_machine(machine)
        done.append(machine.pk)
    MachineSample.objects.filter(taken_at__lt=now - SAMPLES_KEPT).delete()
    return done


def sample_machine(machine: Machine) -> MachineSample:
    try:
        reading = read_machine(machine)
    except TransportError as exc:
        return MachineSample.objects.create(machine=machine, error=str(exc)[:2000])
    return MachineSample.objects.create(
        machine=machine, ram_total=reading.ram_total, ram_available=reading.ram_available,
        gpus=[{"index": g.index, "total": g.total, "used": g.used, "free": g.free} for g in reading.gpus],
        corral_used=sum(rss + vram for rss, vram in reading.server_use.values()),
        server_use={str(k): list(v) for k, v in reading.server_use.items()},
    )


def mark_fits(machine: Machine, models: list[ModelFile], server_params: dict | None = None) -> None:
    """Set ``fit`` (a :class:`machines_app.memory.Fit`, or None when the machine's room is
    not known yet) on each model file, for the picker."""
    found = fits(machine, models, server_params)
    for model in models:
        model.fit = found.get(model.pk)


def never_fits(machine: Machine, model_key: str, server_params: dict) -> str:
    """Why a session of that model can never start on ``machine`` (more than its budget,
    or than all its memory or GPU memory, as last read), '' when it may."""
    model = ModelFile.objects.filter(machine=machine, key=model_key).first()
    if model is None or not model.is_complete:
        return ""
    fit = fits(machine, [model], server_params).get(model.pk)
    if fit is None or fit.kind != Fit.TOO_BIG:
        return ""
    return too_big_sentence(model, machine, need_of(model, server_params), fit.room)

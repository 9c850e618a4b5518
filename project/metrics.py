"""``GET /metrics``: Corral's figures for a team's monitoring, in Prometheus' text format
(``prometheus_client``), for staff or for a bearer token (docs/operations.md, "Metrics").

Every figure is read at scrape time from what Corral already stores — the sessions and
their transcript events in the database, the Celery queues in Redis — so all of Corral's
processes, on every host, count once, and nothing is kept in one process's memory (a
worker that restarts loses nothing). Names and units:

- ``corral_sessions{status}``: sessions by status (gauge).
- ``corral_turns_running``: turns under way now (gauge).
- ``corral_turns_ended_total{reason}``: turns ended, by the ``turn_end`` reason
  (``done``, ``error``, ``interrupted``, ``stopped``, ``limit``).
- ``corral_tokens_total{kind}``: tokens the servers reported in their usage, ``prompt``,
  ``completion`` (streamed) and ``cached`` (prompt tokens answered from the prompt cache).
- ``corral_tool_results_total{ok}``: tool calls that ran, by whether they succeeded;
  ``corral_tool_answers_total{answer}``: a person's answers at the gate.
- ``corral_time_to_first_text_seconds{quantile}`` and ``corral_queue_wait_seconds{quantile}``
  over the last hour: from a message taken by its turn to the first stored reply text
  (stored text is batched, so this includes the store window), and from a message queued
  to taken. Absent when the hour had none.
- ``corral_machine_memory_bytes{machine,kind}`` (``total``, ``available``),
  ``corral_machine_servers_memory_bytes{machine}`` and
  ``corral_machine_gpu_memory_bytes{machine,gpu,kind}`` (``total``, ``free``): each
  machine's latest memory sample (the machines page's).
- ``corral_celery_queue_length{queue}``: tasks waiting in each Celery queue.
"""

from __future__ import annotations

import hmac
import statistics
from collections.abc import Iterator
from datetime import timedelta

from amqp.exceptions import ChannelError
from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.db.models import BigIntegerField, Count, Max, Q, Sum
from django.db.models.fields.json import KT
from django.db.models.functions import Cast
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from project import queues

#: The window of the latency quantiles, in seconds.
WINDOW_SECONDS = 3600
QUANTILES = (0.5, 0.95)


class CorralCollector(Collector):
    """The figures listed in the module's docstring, read anew at each ``collect``."""

    def collect(self) -> Iterator:
        from sessions_app.models import AgentSession, TranscriptEvent
        from sessions_app.transcript import ANSWER_ALLOW_ALWAYS, ANSWER_ALLOW_ONCE, ANSWER_REFUSE, Kind, TurnEnd

        sessions = GaugeMetricFamily("corral_sessions", "Sessions by status.", labels=["status"])
        for row in AgentSession.objects.values("status").annotate(n=Count("id")).order_by("status"):
            sessions.add_metric([row["status"]], row["n"])
        yield sessions
        yield GaugeMetricFamily("corral_turns_running", "Turns under way now.",
                                value=AgentSession.objects.filter(turn_active=True).count())

        events = _ran_here(TranscriptEvent.objects.all(), TranscriptEvent, Kind)
        ended = CounterMetricFamily("corral_turns_ended", "Turns ended, by reason.", labels=["reason"])
        for row in (events.filter(kind=Kind.TURN_END).values(reason=KT("payload__reason"))
                    .annotate(n=Count("id")).order_by("reason")):
            ended.add_metric([_known(row["reason"], TurnEnd)], row["n"])
        yield ended

        tokens = CounterMetricFamily("corral_tokens", "Tokens reported by the servers' usage.", labels=["kind"])
        sums = events.filter(kind=Kind.USAGE).aggregate(**{
            kind: Sum(Cast(KT(f"payload__{key}"), BigIntegerField()))
            for kind, key in (("prompt", "prompt_tokens"), ("completion", "completion_tokens"),
                              ("cached", "cached_tokens"))
        })
        for kind, total in sums.items():
            tokens.add_metric([kind], total or 0)
        yield tokens

        results = CounterMetricFamily("corral_tool_results", "Tool calls that ran, by success.", labels=["ok"])
        for row in events.filter(kind=Kind.TOOL_END).values(ok=KT("payload__ok")).annotate(n=Count("id")).order_by("ok"):
            results.add_metric([str(row["ok"]).lower() in ("true", "1") and "true" or "false"], row["n"])
        yield results
        answers = CounterMetricFamily("corral_tool_answers", "Answers given at the gate.", labels=["answer"])
        for row in (events.filter(kind=Kind.ANSWERED).values(answer=KT("payload__answer"))
                    .annotate(n=Count("id")).order_by("answer")):
            answers.add_metric([_known(row["answer"], (ANSWER_ALLOW_ONCE, ANSWER_ALLOW_ALWAYS, ANSWER_REFUSE))],
                               row["n"])
        yield answers

        first_text, queue_wait = _latencies(events, Kind)
        for name, help_text, values in (
            ("corral_time_to_first_text_seconds", "Message taken to first stored reply text, last hour.", first_text),
            ("corral_queue_wait_seconds", "Message queued to taken by its turn, last hour.", queue_wait),
        ):
            if values:
                family = GaugeMetricFamily(name, help_text, labels=["quantile"])
                for q in QUANTILES:
                    family.add_metric([str(q)], _quantile(values, q))
                yield family

        yield from _machine_memory()

        lengths = GaugeMetricFamily("corral_celery_queue_length", "Tasks waiting per Celery queue.",
                                    labels=["queue"])
        from project.celery import app

        try:  # kombu's own count: it knows the broker's key names, priorities and TLS
            with app.connection_for_read() as connection:
                connection.ensure_connection(max_retries=1)
                channel = connection.default_channel
                for queue in (queues.TURNS, queues.SERVERS, queues.HOUSEKEEPING):
                    try:
                        waiting = channel.queue_declare(queue=queue, passive=True).message_count
                    except ChannelError:
                        waiting = 0  # not declared yet (no worker has consumed it): nothing waits there
                    lengths.add_metric([queue], waiting)
        except Exception:  # noqa: BLE001 — Redis down: the other figures still count; its own alert says so
            return
        yield lengths


def _machine_memory() -> Iterator:
    """Per machine, from its latest memory sample (the health watch's, every 30 s; see
    the machines page): RAM total and available, Corral's servers' use, and each GPU's
    total and free memory, in bytes. A machine not sampled yet, or whose last read
    failed, is left out."""
    from machines_app.models import Machine, MachineSample

    ram = GaugeMetricFamily("corral_machine_memory_bytes", "Machine RAM from /proc/meminfo, latest sample.",
                            labels=["machine", "kind"])
    corral = GaugeMetricFamily("corral_machine_servers_memory_bytes",
                               "Memory Corral's llama-servers use there (resident + GPU), latest sample.",
                               labels=["machine"])
    gpu = GaugeMetricFamily("corral_machine_gpu_memory_bytes", "GPU memory from nvidia-smi, latest sample.",
                            labels=["machine", "gpu", "kind"])
    for machine in Machine.objects.order_by("name"):
        sample = MachineSample.objects.filter(machine=machine).order_by("-taken_at").first()
        if sample is None or sample.error:
            continue
        for kind, value in (("total", sample.ram_total), ("available", sample.ram_available)):
            if value is not None:
                ram.add_metric([machine.name, kind], value)
        corral.add_metric([machine.name], sample.corral_used)
        for card in sample.gpus:
            for kind in ("total", "free"):
                gpu.add_metric([machine.name, str(card.get("index")), kind], card.get(kind) or 0)
    yield from (ram, corral, gpu)


def _ran_here(events, model, kind):
    """``events`` less those that came in by import (an imported session's events up to
    its ``imported`` event): a member's import must not count as turns, tokens or tool
    calls of this deployment. One small query for the imported sessions first (a
    correlated subquery per event took a minute over 20,000 events on SQLite)."""
    cut = Q()
    for row in model.objects.filter(kind=kind.IMPORTED).values("session_id").annotate(upto=Max("seq")):
        cut |= Q(session_id=row["session_id"], seq__lte=row["upto"])
    return events.exclude(cut) if cut else events


def _known(value, known) -> str:
    """A label value Corral writes, or ``other``: labels must not be set by stored text."""
    return value if value in {str(v) for v in known} else "other"


def _quantile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def _latencies(events, kind) -> tuple[list[float], list[float]]:
    """Seconds from each message taken (last hour) to the first reply text after it, and
    from each message queued to its taking, from one query over the hour's events."""
    since = timezone.now() - timedelta(seconds=WINDOW_SECONDS)
    rows = (events.filter(created_at__gte=since,
                          kind__in=[kind.MESSAGE_QUEUED, kind.MESSAGE_TAKEN, kind.ASSISTANT_TEXT, kind.REASONING,
                                    kind.TOOL_START])
            .order_by("session_id", "seq")
            # Only the two ids, never the whole payload: a message's text can be 200,000 characters.
            .values_list("session_id", "kind", KT("payload__id"), KT("payload__queued_id"), "created_at"))
    first_text: list[float] = []
    queue_wait: list[float] = []
    queued_at: dict[tuple[int, str], object] = {}
    taken_at = None
    session = None
    for session_id, event_kind, queue_id, queued_id, created_at in rows.iterator():
        if session_id != session:
            session, taken_at = session_id, None
        if event_kind == kind.MESSAGE_QUEUED:
            queued_at[(session_id, queue_id)] = created_at
        elif event_kind == kind.MESSAGE_TAKEN:
            taken_at = created_at
            queued = queued_at.pop((session_id, queued_id), None)
            if queued is not None:
                queue_wait.append((created_at - queued).total_seconds())
        elif taken_at is not None:
            first_text.append((created_at - taken_at).total_seconds())
            taken_at = None
    return first_text, queue_wait


_registry = CollectorRegistry(auto_describe=False)
_registry.register(CorralCollector())


def _allowed(request: HttpRequest) -> bool:
    if request.user.is_authenticated and request.user.is_staff:
        return True
    token = settings.CORRAL_METRICS_TOKEN
    given = request.headers.get("Authorization", "")
    return bool(token) and hmac.compare_digest(given.encode(), f"Bearer {token}".encode())


@login_not_required
@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus' text exposition of :class:`CorralCollector`. 200 for staff (session
    cookie) or ``Authorization: Bearer <CORRAL_METRICS_TOKEN>``; otherwise 401 with
    ``WWW-Authenticate: Bearer`` and no figure."""
    if not _allowed(request):
        response = HttpResponse("Metrics are for staff or a bearer token (CORRAL_METRICS_TOKEN).\n",
                                status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="corral-metrics"'
        return response
    return HttpResponse(generate_latest(_registry), content_type=CONTENT_TYPE_LATEST)

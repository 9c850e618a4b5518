"""``GET /metrics`` (project/metrics.py): Prometheus' text format, for staff or a bearer
token, with figures read from the stored sessions and events."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from machines_app.models import Machine, MachineSample
from sessions_app.events import record_event
from sessions_app.models import AgentSession, TranscriptEvent
from sessions_app.transcript import Kind


def _figures(text: str) -> dict[tuple[str, tuple], float]:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


@pytest.fixture
def sessions(alice, tmp_path):
    machine = Machine.objects.create(name="m1", models_dir=str(tmp_path))
    made = [AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path),
                                        status=status, title=status) for status in ("idle", "idle", "stopped")]
    return made


@pytest.mark.django_db
def test_metrics_are_for_staff_or_the_bearer_token_only(settings, alice, charlie_staff, sessions):
    settings.CORRAL_METRICS_TOKEN = "scrape-token-123"
    assert Client().get("/metrics").status_code == 401
    member = Client()
    member.force_login(alice)
    refused = member.get("/metrics")
    assert refused.status_code == 401 and b"corral_sessions" not in refused.content
    assert refused["WWW-Authenticate"].startswith("Bearer")
    assert Client(headers={"Authorization": "Bearer wrong"}).get("/metrics").status_code == 401
    scraper = Client(headers={"Authorization": "Bearer scrape-token-123"}).get("/metrics")
    assert scraper.status_code == 200 and scraper["Content-Type"].startswith("text/plain")
    staff = Client()
    staff.force_login(charlie_staff)
    assert staff.get("/metrics").status_code == 200
    settings.CORRAL_METRICS_TOKEN = ""
    assert Client(headers={"Authorization": "Bearer "}).get("/metrics").status_code == 401  # no token set: none works


@pytest.mark.django_db
def test_metrics_count_what_the_transcripts_hold(charlie_staff, sessions):
    first, second, _ = sessions
    for session, taken_after, text_after in ((first, 2, 1), (second, 4, 3)):
        queued = record_event(session.pk, Kind.MESSAGE_QUEUED, {"id": "q1", "text": "hi"})
        taken = record_event(session.pk, Kind.MESSAGE_TAKEN, {"text": "hi", "queued_id": "q1"})
        text = record_event(session.pk, Kind.ASSISTANT_TEXT, {"text": "hello"})
        # Timestamps as a real turn would leave them (auto_now_add sets "now").
        TranscriptEvent.objects.filter(pk=taken.pk).update(created_at=queued.created_at + timedelta(seconds=taken_after))
        TranscriptEvent.objects.filter(pk=text.pk).update(
            created_at=queued.created_at + timedelta(seconds=taken_after + text_after))
        record_event(session.pk, Kind.USAGE, {"prompt_tokens": 100, "completion_tokens": 20, "cached_tokens": 60})
        record_event(session.pk, Kind.TURN_END, {"reason": "done"})
    record_event(first.pk, Kind.TOOL_END, {"id": "c1", "output": "ok", "ok": True})
    record_event(first.pk, Kind.TOOL_END, {"id": "c2", "output": "no", "ok": False})
    record_event(second.pk, Kind.ANSWERED, {"id": "c3", "tool": "run_command", "answer": "refuse"})
    record_event(second.pk, Kind.TURN_END, {"reason": "error"})
    MachineSample.objects.create(machine=first.machine, ram_total=8 * 2**30, ram_available=2**30,
                                 corral_used=100, taken_at=timezone.now() - timedelta(seconds=60))
    MachineSample.objects.create(machine=first.machine, ram_total=8 * 2**30, ram_available=3 * 2**30,
                                 corral_used=300 * 2**20,
                                 gpus=[{"index": 0, "total": 8 * 2**30, "used": 7 * 2**30, "free": 2**30}])

    staff = Client()
    staff.force_login(charlie_staff)
    figures = _figures(staff.get("/metrics").content.decode())
    assert figures[("corral_sessions", (("status", "idle"),))] == 2
    assert figures[("corral_sessions", (("status", "stopped"),))] == 1
    assert figures[("corral_turns_ended_total", (("reason", "done"),))] == 2
    assert figures[("corral_turns_ended_total", (("reason", "error"),))] == 1
    assert figures[("corral_tokens_total", (("kind", "completion"),))] == 40
    assert figures[("corral_tokens_total", (("kind", "prompt"),))] == 200
    assert figures[("corral_tokens_total", (("kind", "cached"),))] == 120
    assert figures[("corral_tool_results_total", (("ok", "true"),))] == 1
    assert figures[("corral_tool_results_total", (("ok", "false"),))] == 1
    assert figures[("corral_tool_answers_total", (("answer", "refuse"),))] == 1
    assert figures[("corral_queue_wait_seconds", (("quantile", "0.5"),))] == pytest.approx(3)
    assert figures[("corral_time_to_first_text_seconds", (("quantile", "0.95"),))] == pytest.approx(2.9)
    assert figures[("corral_machine_memory_bytes", (("kind", "available"), ("machine", "m1")))] == 3 * 2**30
    assert figures[("corral_machine_servers_memory_bytes", (("machine", "m1"),))] == 300 * 2**20
    assert figures[("corral_machine_gpu_memory_bytes", (("gpu", "0"), ("kind", "free"), ("machine", "m1")))] == 2**30
    for queue in ("turns", "servers", "housekeeping"):
        assert ("corral_celery_queue_length", (("queue", queue),)) in figures

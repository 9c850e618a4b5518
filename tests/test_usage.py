"""Usage per member, machine, model and UTC day, and daily token quotas (docs/usage.md).

The proof that the figures are the server's own: a real turn on the real llama-server
(SmolLM2), whose final report — read from the stream as the server sent it — must equal
the row recorded for it. The rest runs on rows written through the same
``record_usage`` an API request uses.
"""

from __future__ import annotations

import copy
import csv
import io
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import Group
from django.db import transaction
from django.test import Client
from django.utils import timezone

from machines_app.models import Machine, ModelFile
from sessions_app import actions, agent, completions
from sessions_app.completions import client as completion_client
from sessions_app.events import locked
from sessions_app.export import to_jsonl
from sessions_app.importing import import_into, read_file
from sessions_app.models import AgentSession, TranscriptEvent
from sessions_app.servers.start import start_server
from usage_app import figures, quota
from usage_app.models import Hold, Quota, UsageRecord
from usage_app.recording import record_usage

from .conftest import model_key

#: A final chunk as llama-server sends it (usage and timings), for the rows of these tests.
REPORT = {
    "usage": {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150,
              "prompt_tokens_details": {"cached_tokens": 100}},
    "timings": {"cache_n": 100, "prompt_n": 20, "prompt_ms": 250.0, "predicted_n": 30, "predicted_ms": 1750.0},
}


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def machines(db, tmp_path):
    """Two machines, each with a model file row (no server is started from them)."""
    made = {}
    for name in ("north", "south"):
        machine = Machine.objects.create(name=name, models_dir=str(tmp_path / name))
        ModelFile.objects.create(machine=machine, key=f"{name}.gguf", display_name=f"Model {name}")
        made[name] = machine
    return made


def add(member, machine, *, at=None, source="session", report=REPORT, model=None):
    record_usage(member=member, machine=machine, model_file=model or machine.model_files.get(),
                 usage=report["usage"], timings=report["timings"], source=source)
    row = UsageRecord.objects.order_by("-pk").first()
    if at is not None:
        UsageRecord.objects.filter(pk=row.pk).update(at=at)
    return row


# --------------------------------------------------------------------------- recording


@pytest.mark.django_db
def test_it_records_the_servers_report_as_sent(alice, machines):
    row = add(alice, machines["north"], source="api")
    assert (row.member, row.member_name, row.machine, row.machine_name) == (alice, "alice", machines["north"], "north")
    assert (row.model_key, row.model_name, row.source) == ("north.gguf", "Model north", "api")
    assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (120, 100, 30)
    assert row.seconds == pytest.approx(2.0)
    assert row.counted_tokens == 20 + 30


@pytest.mark.django_db
def test_what_usage_lacks_is_taken_from_the_timings(alice, machines):
    row = add(alice, machines["north"], report={"usage": {}, "timings": REPORT["timings"]})
    assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (120, 100, 30)
    row = add(alice, machines["north"], report={"usage": {"prompt_tokens": "many", "completion_tokens": -1},
                                               "timings": {"prompt_ms": float("nan")}})
    assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens, row.seconds) == (0, 0, 0, 0.0)


@pytest.mark.django_db
def test_a_deleted_model_file_and_member_still_show_by_name(alice, machines):
    record_usage(member=None, member_name="gone", machine=machines["north"], model_file=None, model_key="old.gguf",
                 model_name="Old model", usage=REPORT["usage"], timings=None, source="session")
    row = UsageRecord.objects.get()
    assert (row.member_name, row.model_key, row.model_name, row.seconds) == ("gone", "old.gguf", "Old model", 0.0)
    row = add(alice, machines["south"])
    machines["south"].model_files.all().delete()
    alice.delete()
    row.refresh_from_db()
    assert (row.member, row.member_name, row.model_name) == (None, "alice", "Model south")


@pytest.mark.django_db
def test_an_unknown_source_is_refused(alice, machines):
    with pytest.raises(ValueError, match="unknown usage source"):
        record_usage(member=alice, machine=machines["north"], model_file=None, usage={}, timings={}, source="batch")
    assert not UsageRecord.objects.exists()


# --------------------------------------------------------------------------- aggregation


@pytest.mark.django_db
def test_figures_add_up_by_member_machine_model_and_utc_day(alice, bob, machines):
    now = datetime(2026, 3, 10, 12, 0, tzinfo=UTC)
    add(alice, machines["north"], at=now)
    add(alice, machines["north"], at=now - timedelta(hours=11, minutes=59))  # 00:01 UTC: the same day
    add(alice, machines["south"], at=now - timedelta(hours=12, minutes=1))  # 23:59 UTC the day before
    add(bob, machines["south"], at=now - timedelta(days=2), source="api")
    add(bob, machines["south"], at=now - timedelta(days=7))  # outside a 7-day period

    start = figures.period_start(7, now)
    assert start == datetime(2026, 3, 4, tzinfo=UTC)
    rows = figures.records(start)
    days = figures.by_day(rows, start.date(), 7)
    assert [d["day"].isoformat() for d in days][-3:] == ["2026-03-08", "2026-03-09", "2026-03-10"]
    assert [d["replies"] for d in days] == [0, 0, 0, 0, 1, 1, 2]
    assert days[-1]["prompt"] == 240 and days[-1]["cached"] == 200 and days[-1]["completion"] == 60
    assert days[-1]["seconds"] == pytest.approx(4.0) and days[-1]["fresh"] == 40

    members = {e["name"]: e for e in figures.by(rows, "member")}
    assert members["alice"]["replies"] == 3 and members["bob"]["replies"] == 1
    assert members["alice"]["id"] == alice.pk
    machines_seen = {e["name"]: e["replies"] for e in figures.by(rows, "machine")}
    assert machines_seen == {"north": 2, "south": 2}
    models = {(e["name"], e["machine"]): e["tokens"] for e in figures.by(rows, "model")}
    assert models == {("Model north", "north"): 300, ("Model south", "south"): 300}
    assert figures.totals(rows)["replies"] == 4
    assert figures.totals(figures.records(start, member=bob))["replies"] == 1
    assert figures.totals(figures.records(start, machine_id=machines["north"].pk))["replies"] == 2


def test_the_bars_stack_and_scale_to_the_largest_day():
    days = [{"day": "a", "x": 1, "y": 3}, {"day": "b", "x": 0, "y": 0}, {"day": "c", "x": 2, "y": 0}]
    plot = figures.stacked_bars(days, ("x", "y"), width=300, height=100)
    assert plot["top"] == 4
    first, empty, third = plot["bars"]
    assert [(p["key"], p["y"], p["h"]) for p in first["parts"]] == [("x", 75.0, 25.0), ("y", 0.0, 75.0)]
    assert empty["parts"] == [] and third["parts"] == [{"key": "x", "y": 50.0, "h": 50.0, "value": 2}]
    assert [b["x"] for b in plot["bars"]] == [10.0, 110.0, 210.0] and first["w"] == 80.0
    assert figures.stacked_bars([{"day": "a", "x": 0}], ("x",))["bars"][0]["parts"] == []


# --------------------------------------------------------------------------- the page and the CSV


@pytest.mark.django_db
def test_staff_see_everyone_by_member_machine_and_model(alice, bob, charlie_staff, machines):
    add(alice, machines["north"])
    add(bob, machines["south"])
    response = client_for(charlie_staff).get("/usage/?days=30")
    assert response.status_code == 200
    page = response.content.decode()
    assert 'id="usage-by-member"' in page and ">alice</a>" in page and ">bob</a>" in page
    assert "Model north" in page and "Model south" in page and "Days are UTC" in page
    plot = page.split('id="usage-token-plot"')[1].split("</svg>")[0]
    assert plot.count('class="bar"') == 30 and 'id="usage-csv"' in page  # a bar per day of the period
    assert "style=" not in page.split("<main>")[1]  # the CSP allows no style attribute
    one = client_for(charlie_staff).get(f"/usage/?member={bob.pk}").content.decode()
    assert "Usage of bob" in one and "Model south" in one and "Model north" not in one


@pytest.mark.django_db
def test_a_member_sees_only_their_own_figures(alice, bob, machines):
    add(alice, machines["north"])
    add(bob, machines["south"])
    member = client_for(alice)
    page = member.get("/usage/").content.decode()
    assert "Model north" in page and "Model south" not in page and "bob" not in page
    assert 'id="usage-by-member"' not in page and 'id="usage-csv"' not in page
    refused = member.get(f"/usage/?member={bob.pk}")
    assert refused.status_code == 403 and "Only staff can see other members" in refused.content.decode()
    assert member.get("/usage/?member=x").status_code == 404
    assert member.get(f"/usage/?member={alice.pk}").status_code == 200
    assert 'href="/usage/"' in page  # the top bar's link


@pytest.mark.django_db
def test_the_csv_has_a_row_per_day_member_machine_model_and_source(alice, bob, charlie_staff, machines):
    now = timezone.now()
    add(alice, machines["north"], at=now)
    add(alice, machines["north"], at=now)
    add(alice, machines["north"], at=now - timedelta(days=1))
    add(bob, machines["south"], at=now, source="api")
    evil = ModelFile.objects.create(machine=machines["south"], key="x.gguf", display_name="=HYPERLINK(\"x\")")
    add(bob, machines["south"], at=now, model=evil)
    response = client_for(charlie_staff).get("/usage/usage.csv?days=7")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    assert "attachment" in response["Content-Disposition"]
    rows = list(csv.reader(io.StringIO(response.content.decode())))
    assert rows[0][:3] == ["day (UTC)", "member", "machine"]
    today, yesterday = now.date().isoformat(), (now - timedelta(days=1)).date().isoformat()
    body = {(r[0], r[1], r[3], r[5]): r for r in rows[1:]}
    assert body[(today, "alice", "Model north", "session")][6:10] == ["2", "240", "200", "60"]
    assert body[(yesterday, "alice", "Model north", "session")][6] == "1"
    assert body[(today, "bob", "Model south", "api")][10] == "2.0"
    assert (today, "bob", "'=HYPERLINK(\"x\")", "session") in body  # never a formula in a spreadsheet
    assert client_for(alice).get("/usage/usage.csv").status_code == 403


# --------------------------------------------------------------------------- quotas


@pytest.mark.django_db
def test_a_members_quota_wins_over_groups_and_the_largest_group_holds(alice, bob):
    small, large = Group.objects.create(name="small"), Group.objects.create(name="large")
    alice.groups.add(small, large)
    bob.groups.add(small)
    Quota.objects.create(group=small, tokens_per_day=1_000)
    Quota.objects.create(group=large, tokens_per_day=5_000)
    assert quota.quota_for(alice) == 5_000 and quota.quota_for(bob) == 1_000
    Quota.objects.create(user=alice, tokens_per_day=200)
    assert quota.quota_for(alice) == 200
    bob.groups.clear()
    assert quota.quota_for(bob) is None and quota.refusal(bob) is None


@pytest.mark.django_db
def test_a_quota_names_one_user_or_one_group(alice):
    from django.db import IntegrityError

    with pytest.raises(IntegrityError), transaction.atomic():
        Quota.objects.create(tokens_per_day=10)
    with pytest.raises(IntegrityError), transaction.atomic():
        Quota.objects.create(user=alice, group=Group.objects.create(name="g"), tokens_per_day=10)


@pytest.fixture
def idle_session(alice, machines, tmp_path):
    return AgentSession.objects.create(owner=alice, machine=machines["north"], model_key="north.gguf",
                                       working_dir=str(tmp_path), status="idle")


@pytest.mark.django_db
def test_a_spent_quota_refuses_send_with_a_sentence_and_starts_no_turn(alice, machines, idle_session):
    Quota.objects.create(user=alice, tokens_per_day=50)
    add(alice, machines["north"])  # 20 read + 30 written: 50, all of it
    sentence = quota.refusal(alice)
    assert sentence.startswith("You have used your 50 tokens for today (resets at 00:00 UTC, in ")
    before = TranscriptEvent.objects.filter(session=idle_session).count()
    with pytest.raises(actions.SessionError, match="You have used your 50 tokens for today"):
        actions.do_send_message(idle_session, alice, "hello")
    with pytest.raises(actions.SessionError, match="You have used your 50 tokens for today"):
        actions.do_send_again(idle_session, alice)
    response = client_for(alice).post(f"/sessions/{idle_session.pk}/send/", {"text": "hello"})
    assert "You have used your 50 tokens for today (resets at 00:00 UTC" in response.content.decode()
    assert TranscriptEvent.objects.filter(session=idle_session).count() == before
    assert not AgentSession.objects.get(pk=idle_session.pk).turn_active
    page = client_for(alice).get("/usage/").content.decode()
    assert "50 of" in page and "0 left" in page


@pytest.mark.django_db
def test_the_quota_resets_at_midnight_utc(alice, machines, idle_session):
    Quota.objects.create(user=alice, tokens_per_day=50)
    now = timezone.now()
    add(alice, machines["north"], at=quota.day_start(now) - timedelta(seconds=1))  # yesterday, 23:59:59 UTC
    assert quota.used_today(alice) == 0 and quota.refusal(alice) is None
    actions.do_send_message(idle_session, alice, "hello")  # taken
    assert AgentSession.objects.get(pk=idle_session.pk).turn_active
    yesterday = quota.day_start(now) - timedelta(hours=1)
    assert quota.refusal(alice, now=yesterday) is not None  # that day it was spent


@pytest.mark.django_db
def test_an_api_request_is_checked_and_holds_a_token_in_one_step(alice, bob, machines, idle_session):
    Quota.objects.create(user=alice, tokens_per_day=52)
    add(alice, machines["north"])  # 50 of 52: two left
    first, second = quota.reserve(alice), quota.reserve(alice)
    assert first[0] is not None and second[0] is not None and first[1] is second[1] is None
    hold, sentence = quota.reserve(alice)
    assert hold is None and sentence.startswith("Your requests still running hold the last of your 52 tokens "
                                                "for today (2 in flight)")
    # The held tokens count for a message's Send as well.
    with pytest.raises(actions.SessionError, match="requests still running hold the last"):
        actions.do_send_message(idle_session, alice, "hello")
    quota.release(first[0])
    assert quota.reserve(alice)[0] is not None
    # A hold whose request was lost lapses: a later check no longer counts it.
    later = timezone.now() + quota.HOLD + timedelta(seconds=1)
    assert quota.refusal(alice, now=later) is None and quota.reserve(alice, now=later)[0] is not None
    # No quota, nothing held.
    assert quota.reserve(bob) == (None, None)


@pytest.mark.django_db
def test_a_quota_of_zero_refuses_every_message(alice, machines, idle_session):
    Quota.objects.create(user=alice, tokens_per_day=0)
    with pytest.raises(actions.SessionError, match="quota is 0"):
        actions.do_send_message(idle_session, alice, "hello")


# --------------------------------------------------------------------------- the real server


@pytest.fixture
def real_session(local_machine, alice, tmp_path):
    session = AgentSession.objects.create(
        owner=alice, machine=local_machine, model_key=model_key(local_machine, "llama"), working_dir=str(tmp_path),
        server_params={"contextSize": 1024}, sampling={"max_tokens": 24}, status="loading",
        visibility=AgentSession.Visibility.TEAM_ACT,
    )
    start_server(session.pk)
    assert AgentSession.objects.get(pk=session.pk).status == "idle"
    return session


@pytest.mark.django_db(transaction=True)  # the step's interrupt watcher reads from a thread of its own
@pytest.mark.usefixtures("stop_servers_after", "steps_run_here")
def test_the_figures_equal_the_real_servers_own_reports(real_session, alice, bob, monkeypatch):
    reports: list[dict] = []
    parse = completions.parse_chunk

    def keep_reports(data):
        # What llama-server itself sent, before Corral reads it (the real parser still runs).
        if isinstance(data, Mapping) and isinstance(data.get("usage"), Mapping):
            reports.append(copy.deepcopy(dict(data)))
        return parse(data)

    monkeypatch.setattr(completion_client, "parse_chunk", keep_reports)  # where the client reads it
    model = ModelFile.objects.get(machine=real_session.machine, key=real_session.model_key)
    # alice's session, shared to act: the second message is bob's, and so is its usage.
    for author, text in ((alice, "Say hello."), (bob, "Now say goodbye.")):
        actions.do_send_message(real_session, author, text)
        agent.run_turn_step(real_session.pk)
    assert len(reports) == 2, "one final report per completion"
    rows = list(UsageRecord.objects.order_by("pk"))
    assert len(rows) == 2 == TranscriptEvent.objects.filter(session=real_session, kind="usage").count()
    for row, report, author in zip(rows, reports, (alice, bob), strict=True):
        usage, timings = report["usage"], report["timings"]
        assert row.prompt_tokens == usage["prompt_tokens"] == timings["prompt_n"] + timings["cache_n"]
        assert row.cached_tokens == usage["prompt_tokens_details"]["cached_tokens"] == timings["cache_n"]
        assert row.completion_tokens == usage["completion_tokens"] == timings["predicted_n"]
        assert row.seconds == pytest.approx((timings["prompt_ms"] + timings["predicted_ms"]) / 1000)
        assert (row.member, row.machine, row.model_key, row.model_name, row.source) == (
            author, real_session.machine, model.key, model.display_name, "session")
    assert rows[1].cached_tokens > 0, "the second request reuses the first one's prompt from the cache"
    page = client_for(alice).get("/usage/").content.decode()
    assert f"<strong>{rows[0].prompt_tokens:,}</strong> prompt tokens" in page  # alice's own: the first only

    # An imported session's usage is the other deployment's: importing it counts nothing.
    events = TranscriptEvent.objects.filter(session=real_session).order_by("seq")
    imported_events, stored = read_file("".join(to_jsonl(events)).encode())
    copy_session = AgentSession.objects.create(owner=bob, machine=real_session.machine,
                                               model_key=real_session.model_key, working_dir=real_session.working_dir,
                                               status="stopped")
    with transaction.atomic():
        import_into(locked(copy_session.pk), imported_events, stored, actions.by(bob))
    assert TranscriptEvent.objects.filter(session=copy_session, kind="usage").count() == 2
    assert UsageRecord.objects.count() == 2


@pytest.mark.django_db
def test_the_admin_sets_quotas_and_only_shows_usage_rows(alice, machines, django_user_model):
    root = client_for(django_user_model.objects.create_superuser("root", password="root-password-1"))
    add(alice, machines["north"])
    assert root.get("/admin/usage_app/usagerecord/").status_code == 200
    assert root.get("/admin/usage_app/usagerecord/add/").status_code == 403
    form = root.get("/admin/usage_app/quota/add/")
    assert form.status_code == 200 and "Counted per UTC day" in form.content.decode()
    both = root.post("/admin/usage_app/quota/add/", {"user": alice.pk, "group": Group.objects.create(name="g").pk,
                                                    "tokens_per_day": 10})
    assert "choose exactly one" in both.content.decode() and not Quota.objects.exists()
    root.post("/admin/usage_app/quota/add/", {"user": alice.pk, "tokens_per_day": 10})
    assert quota.quota_for(alice) == 10
    # The requests in flight that hold part of the day are listed (why a member is refused
    # before anything was spent), never added or edited; a stuck one may be deleted.
    hold = Hold.objects.create(member=alice, until=timezone.now() + timedelta(minutes=5))
    listing = root.get("/admin/usage_app/hold/")
    assert listing.status_code == 200 and "alice" in listing.content.decode()
    assert root.get("/admin/usage_app/hold/add/").status_code == 403
    root.post(f"/admin/usage_app/hold/{hold.pk}/delete/", {"post": "yes"})
    assert not Hold.objects.exists()


@pytest.mark.django_db
def test_a_step_that_lost_its_lease_counts_nothing(alice, machines, idle_session):
    from sessions_app import metering, turns

    AgentSession.objects.filter(pk=idle_session.pk).update(lease_owner="another-step")
    usage = completions.Usage(prompt_tokens=10, completion_tokens=2, cached_tokens=0, prompt_ms=5.0, predicted_ms=5.0)
    with pytest.raises(turns.LeaseLost):
        metering.record_completion(idle_session.pk, "this-step", usage.as_payload(), usage, None,
                                   model_key="north.gguf", model_name="Model north")
    assert not UsageRecord.objects.exists()
    AgentSession.objects.filter(pk=idle_session.pk).update(lease_owner="this-step")
    metering.record_completion(idle_session.pk, "this-step", usage.as_payload(), usage, None,
                               model_key="north.gguf", model_name="Model north")
    row = UsageRecord.objects.get()
    assert (row.member, row.prompt_tokens, row.completion_tokens, row.seconds) == (alice, 10, 2, pytest.approx(0.01))


@pytest.mark.django_db(transaction=True)
def test_a_request_finishing_while_another_is_checked_is_counted_once_not_never(alice, machines, monkeypatch):
    """A request that finishes writes its row and drops its hold in one transaction, which
    takes no lock of the member's; a check reads the day's rows and the holds in flight in
    two statements, each seeing what was committed when it began (PostgreSQL's read
    committed). A request finishing between the two reads must still be counted, as its
    hold or as its row: here the first request of a 50-token day finishes, having used
    all 50, just after the second request's check has read one of the two, whichever it
    reads first; the second is refused (docs/usage.md "API requests in flight")."""
    import threading

    from django.db import connections

    Quota.objects.create(user=alice, tokens_per_day=50)
    first, _ = quota.reserve(alice)
    assert first is not None
    finished: list[bool] = []

    def finish() -> None:
        try:
            with transaction.atomic():
                add(alice, machines["north"])  # REPORT counts 50 tokens: the whole day
                quota.release(first)
            finished.append(True)
        finally:
            connections.close_all()

    def then_finish(read):
        def reading(*args, **kwargs):
            value = read(*args, **kwargs)
            if not finished:
                thread = threading.Thread(target=finish)
                thread.start()
                thread.join(30)
            return value
        return reading

    monkeypatch.setattr(quota, "used_today", then_finish(quota.used_today))
    monkeypatch.setattr(quota, "_held", then_finish(quota._held))
    hold, sentence = quota.reserve(alice)
    assert finished and quota.used_today(alice) == 50
    assert hold is None and sentence is not None and "used your 50 tokens" in sentence
    assert quota.refusal(alice) is not None

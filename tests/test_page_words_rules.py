"""Words a new team tripped over (points 1–3 and 10–12 of that round), at the level of the functions that decide the
words (the browser shows them: tests/test_page_words_browser.py): the header's model
details, the notes, the message check, "just now", the first-run checklist, the admin."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from machines_app.models import Machine
from sessions_app import actions, first_run, rules
from sessions_app.live.header import model_details, model_facts, template_info
from sessions_app.live.items import event_item
from sessions_app.live.sentences import settings_text
from sessions_app.models import AgentSession
from sessions_app.templatetags.corral import ago
from sessions_app.transcript import Event, Kind

from .helpers import ALICE

NO_TOOLS = template_info({"chat_template_caps": {"supports_tools": False, "supports_system_role": True}})
TOOLS = template_info({"chat_template_caps": {"supports_tools": True, "supports_system_role": False}})


def test_the_model_details_are_sentences_a_member_would_say():
    facts = {"size_label": "135M", "quantization": "Q4_1", "context_length": 8192, "takes_images": False,
             "own_template": True}
    assert model_details(facts, NO_TOOLS, 1024) == [
        "135M parameters, quantised as Q4_1.",
        "Holds 1,024 tokens of conversation (trained on up to 8,192).",
        "Reads text only: it cannot see images.",
        "This model cannot call tools: its chat template takes none.",
    ]
    said = model_details({**facts, "takes_images": True}, TOOLS, 8192)
    assert said[1:] == ["Holds 8,192 tokens of conversation.", "Takes images as well as text.", "Can call tools.",
                        "Its chat template has no place for a system prompt."]
    # Before a first start nothing is known of the template: it says so, never a guess.
    assert "Whether it can call tools is known once its server has started." in model_details(facts, template_info({}))
    for sentence in said + model_details(facts, NO_TOOLS):
        assert not any(mark in sentence for mark in ("✓", "✗", "supports_", "template:"))


def test_a_file_without_a_chat_template_says_so_as_the_picker_does():
    """Gemma 3 270M's file has none: llama-server uses a generic template and reports a
    system role for it; the header speaks of the file, as the picker does."""
    facts = {"size_label": "270M", "quantization": "Q4_K_M", "takes_images": False, "own_template": False,
             "template_label": "no chat template: replies may be poor"}
    said = model_details(facts, NO_TOOLS)
    assert said[-1] == "Its file has no chat template, so llama-server uses a generic one: replies may be poor."
    assert not any("system" in sentence for sentence in said)


@pytest.mark.django_db
def test_model_facts_read_the_file(local_machine):
    gemma = local_machine.model_files.get(architecture="gemma3")
    facts = model_facts(gemma)
    assert facts["own_template"] is False and "no chat template" in gemma.template_label
    assert (facts["size_label"], facts["quantization"], facts["takes_images"]) == ("270M", "Q4_K_M", False)
    assert model_facts(None) == {}


def test_a_sharing_change_and_a_wake_are_sentences():
    assert settings_text({"visibility": "team_watch", "by": ALICE}) == "alice shared the session with the team, to watch."
    assert settings_text({"visibility": "private", "by": ALICE}) == "alice made the session private."
    wake = event_item(Event(5, Kind.STATUS, {"status": "loading", "by": ALICE, "reason": "wake"}))
    assert wake["text"] == "llama-server woken by a message from alice."
    restart = event_item(Event(6, Kind.STATUS, {"status": "loading", "by": ALICE}))
    assert restart["text"] == "llama-server restarted by alice."


@pytest.mark.parametrize("text", ["\u200b", "\u200b\u200c\u200d", " \ufeff\u2060 \n", "\u3164", "\u2800\u200b"])
def test_a_message_of_only_invisible_characters_is_refused(text):
    with pytest.raises(actions.SessionError, match="only invisible characters"):
        rules.check_message(text)
    assert rules.check_message(text, with_images=True) == ""  # the images are the message


@pytest.mark.parametrize("text", ["a\u200b", "\u200bhello", "👍", "\u0301e"])
def test_a_message_with_something_to_read_is_sent_as_it_is(text):
    assert rules.check_message(text) == text


def test_last_activity_under_a_minute_is_just_now():
    now = timezone.now()
    assert ago(now) == "just now" and ago(now - timedelta(seconds=59)) == "just now"
    assert ago(now - timedelta(minutes=3, seconds=5)) == "3\xa0minutes ago"  # timesince keeps the number with its word


@pytest.mark.django_db
def test_the_first_run_checklist_follows_what_is_done(django_user_model, real_models_dir, llama_server_bin):
    from machines_app import catalog

    staff = django_user_model.objects.create_user("root", password="root-password-1", is_staff=True)
    member = django_user_model.objects.create_user("alice", password="alice-password-1", is_active=False)
    machine = Machine.objects.create(name="local", models_dir=str(real_models_dir), llama_server_path=llama_server_bin)
    done = lambda: {step.key: step.done for step in first_run.checklist_for(staff)}  # noqa: E731
    assert done() == {"member": False, "machine": False, "models": False, "session": False}
    assert first_run.checklist_for(member) is None
    member.is_active = True
    member.save()
    machine.note_containment(True)
    catalog.refresh_models(machine)
    assert done() == {"member": True, "machine": True, "models": True, "session": False}
    AgentSession.objects.create(owner=staff, machine=machine, model_key="x.gguf", working_dir="/tmp")
    assert first_run.checklist_for(staff) is None


@pytest.mark.django_db
def test_the_admin_says_corral_hides_axes_and_keeps_the_local_machine_to_its_fields(django_user_model, local_machine):
    client = Client()
    client.force_login(django_user_model.objects.create_superuser("root", password="root-password-1"))
    index = client.get("/admin/").content.decode()
    assert "Corral administration" in index and "Django administration" not in index
    assert "/admin/axes/" not in index
    session = AgentSession.objects.create(owner=django_user_model.objects.get(username="root"), machine=local_machine,
                                          model_key=local_machine.model_files.first().key, working_dir="/tmp")
    for path in ("/", "/sessions/new/", session.get_absolute_url()):  # no template comment leaks into a page
        page = client.get(path).content.decode()
        assert "{#" not in page and "#}" not in page and "{% comment" not in page, path
    change = client.get(f"/admin/machines_app/machine/{local_machine.pk}/change/").content.decode()
    assert 'name="host"' not in change and 'name="private_key"' not in change and "Link state" not in change
    # Saving it keeps it local and working.
    response = client.post(f"/admin/machines_app/machine/{local_machine.pk}/change/", {
        "name": "local", "models_dir": local_machine.models_dir, "llama_server_path": local_machine.llama_server_path,
        "bwrap_path": "bwrap", "workspace_roots": "", "enabled": "on", "idle_stop_seconds": ""})
    assert response.status_code == 302, response.content.decode()[:2000]
    assert Machine.objects.get(pk=local_machine.pk).transport == "local"

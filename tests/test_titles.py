"""Attacks on a session's title: one rule whichever door it comes through — the new-session
form, the settings form, Rename, the admin (sessions_app.rules.check_title): one line, no
control character, at most 200 characters."""

from __future__ import annotations

import pytest
from django.test import Client

from sessions_app import actions
from sessions_app.forms import NewSessionForm
from sessions_app.models import AgentSession

from .conftest import model_key

pytestmark = pytest.mark.django_db

REFUSED = "The title contains a control character (U+001B at character 6)"


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def session(local_machine, alice, tmp_path):
    return AgentSession.objects.create(owner=alice, machine=local_machine, model_key=model_key(local_machine, "llama"),
                                       working_dir=str(tmp_path), status="idle", title="Flock")


def title_of(session) -> str:
    return AgentSession.objects.get(pk=session.pk).title


def test_the_new_session_form_makes_a_title_one_line_and_refuses_a_control_character(local_machine, alice, tmp_path):
    data = {"machine": local_machine.pk, "model_key": model_key(local_machine, "llama"), "working_dir": str(tmp_path),
            "permission_mode": "manual", "speculative": "auto"}
    form = NewSessionForm({**data, "title": "Flock\n\n# count\r\n\tnorth"}, user=alice)
    assert form.is_valid(), form.errors
    assert form.cleaned_data["title"] == "Flock # count north"
    form = NewSessionForm({**data, "title": "Flock\x1b[31m red"}, user=alice)
    assert not form.is_valid()
    assert form.errors["title"][0].startswith(REFUSED)
    with pytest.raises(actions.SessionError, match="control character"):  # the action holds the rule too
        actions.do_create_session(alice, machine=local_machine, model_key=data["model_key"], working_dir=str(tmp_path),
                                  server_params={}, sampling={}, permission_mode="manual", title="bell\x07")
    assert not AgentSession.objects.exists()


def test_the_settings_form_and_rename_hold_the_same_rule(session, alice):
    client = client_for(alice)
    answer = client.post(f"/sessions/{session.pk}/settings/", {"title": "North\nfield", "speculative": "auto"})
    assert answer.status_code == 200 and title_of(session) == "North field"
    answer = client.post(f"/sessions/{session.pk}/settings/", {"title": "Flock\x1b[31m", "speculative": "auto"})
    assert REFUSED in answer.content.decode() and title_of(session) == "North field"

    answer = client.post(f"/sessions/{session.pk}/rename/", {"title": "Flock\x1b[31m"}, headers={"HX-Request": "true"})
    assert REFUSED in answer.content.decode() and title_of(session) == "North field"
    with pytest.raises(actions.SessionError, match="control character"):
        actions.do_update_settings(session, alice, title="a\x00b", sampling={}, server_params={})
    assert title_of(session) == "North field"


def test_the_admin_may_change_a_title_only_to_one_the_session_forms_take(session, admin_client):
    url = f"/admin/sessions_app/agentsession/{session.pk}/change/"
    answer = admin_client.post(url, {"title": "Flock\x1b[31m"})
    assert answer.status_code == 200 and "The title contains a control character" in answer.content.decode()
    assert title_of(session) == "Flock"
    answer = admin_client.post(url, {"title": "  North\r\nfield  "})
    assert answer.status_code == 302 and title_of(session) == "North field"

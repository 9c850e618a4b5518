"""A machine limited to Django groups is invisible and unusable to everyone else
(docs/access.md), in the picker, the model list and every action that starts a server."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group
from django.test import Client

from machines_app import catalog
from machines_app.access import machine_refusal, machines_for
from machines_app.models import Machine
from sessions_app import actions
from sessions_app.models import AgentSession, TranscriptEvent

from .conftest import model_key

pytestmark = pytest.mark.django_db


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def gpu(local_machine, real_models_dir, llama_server_bin):
    """A second machine, limited to the group "shepherds" (alice is in it, bob is not)."""
    machine = Machine.objects.create(name="gpu-box", models_dir=str(real_models_dir),
                                     llama_server_path=llama_server_bin, workspace_roots="")
    catalog.refresh_models(machine)
    shepherds = Group.objects.create(name="shepherds")
    machine.allowed_groups.add(shepherds)
    return machine


@pytest.fixture
def alice_shepherd(alice):
    alice.groups.add(Group.objects.get(name="shepherds"))
    return alice


def test_the_queryset_opens_a_limited_machine_to_its_groups_and_staff_only(gpu, alice_shepherd, bob, charlie_staff):
    local = Machine.objects.get(name="local")
    assert list(machines_for(alice_shepherd)) == [gpu, local]
    assert list(machines_for(bob)) == [local]
    assert list(machines_for(charlie_staff)) == [gpu, local]
    # in two groups, one of them allowed: listed once
    other = Group.objects.create(name="weavers")
    gpu.allowed_groups.add(other)
    alice_shepherd.groups.add(other)
    assert list(machines_for(alice_shepherd)) == [gpu, local]
    Machine.objects.filter(pk=gpu.pk).update(enabled=False)
    assert list(machines_for(charlie_staff)) == [local]


def test_it_says_why_a_machine_is_refused(gpu, alice_shepherd, bob):
    assert machine_refusal(alice_shepherd, gpu) == ""
    assert machine_refusal(bob, gpu) == (
        "Machine 'gpu-box' is limited to some groups and you are not in them; an admin can add you.")
    Machine.objects.filter(pk=gpu.pk).update(enabled=False)
    gpu.refresh_from_db()
    assert machine_refusal(alice_shepherd, gpu) == "Machine 'gpu-box' is disabled; an admin can enable it."


def test_the_picker_shows_it_only_to_its_groups(gpu, alice_shepherd, bob, charlie_staff):
    for user, sees in ((alice_shepherd, True), (bob, False), (charlie_staff, True)):
        page = logged_in(user).get("/sessions/new/").content.decode()
        assert (f'<option value="{gpu.pk}">gpu-box</option>' in page) is sees, user
        assert "gpu-box" in page if sees else "gpu-box" not in page


def test_the_model_list_and_refresh_of_a_limited_machine_are_closed_to_others(gpu, alice_shepherd, bob):
    smol = model_key(gpu, "llama")
    assert smol in logged_in(alice_shepherd).get(f"/sessions/models/?machine={gpu.pk}").content.decode()
    answer = logged_in(bob).get(f"/sessions/models/?machine={gpu.pk}").content.decode()
    assert smol not in answer and "No models found" in answer
    assert logged_in(bob).post(f"/machines/{gpu.pk}/refresh/").status_code == 404
    assert logged_in(bob).get(f"/machines/{gpu.pk}/refresh/status/").status_code == 404


def test_a_forged_post_cannot_start_a_session_on_it(gpu, alice_shepherd, bob, tmp_path):
    data = {"machine": gpu.pk, "model_key": model_key(gpu, "llama"), "working_dir": str(tmp_path),
            "permission_mode": "manual", "speculative": "auto"}
    response = logged_in(bob).post("/sessions/new/", data)
    assert response.status_code == 200
    assert response.context["form"].errors["machine"] == ["There is no such machine, or it is not open to you."]
    assert not AgentSession.objects.exists()
    assert logged_in(alice_shepherd).post("/sessions/new/", data).status_code == 302
    assert AgentSession.objects.get().machine == gpu


def test_the_action_refuses_too(gpu, bob, tmp_path):
    with pytest.raises(actions.SessionError, match="limited to some groups"):
        actions.do_create_session(bob, machine=gpu, model_key=model_key(gpu, "llama"), working_dir=str(tmp_path),
                                  server_params={}, sampling={}, permission_mode="manual")
    assert not AgentSession.objects.exists()


def test_leaving_the_group_stops_restarts_and_model_changes_on_it(gpu, alice_shepherd, tmp_path):
    session = AgentSession.objects.create(owner=alice_shepherd, machine=gpu, model_key=model_key(gpu, "llama"),
                                          working_dir=str(tmp_path), status="exited")
    alice_shepherd.groups.clear()
    client = logged_in(alice_shepherd)
    assert client.get(f"/sessions/{session.pk}/").status_code == 200  # her transcript stays hers to read
    for path, data in ((f"/sessions/{session.pk}/restart/", {}),
                       (f"/sessions/{session.pk}/model/", {"model_key": model_key(gpu, "gemma3")})):
        response = client.post(path, data, headers={"HX-Request": "true"})
        assert response.status_code == 403  # she may only watch it now (docs/access.md)
        assert "limited to some groups and you are not in them" in response.content.decode()
    session.refresh_from_db()
    assert session.status == "exited" and session.model_key == model_key(gpu, "llama")
    assert not TranscriptEvent.objects.filter(session=session).exists()


@pytest.mark.parametrize("value", ["²", "٣", "99999999999999999999", "-1", "1e3", " 1", "", "0x1"])
def test_an_odd_machine_id_gets_a_form_error_or_the_first_machine_never_a_500(gpu, bob, tmp_path, value):
    client = logged_in(bob)
    page = client.get("/sessions/new/", {"machine": value})
    assert page.status_code == 200 and "gpu-box" not in page.content.decode()
    response = client.post("/sessions/new/", {"machine": value, "model_key": model_key(gpu, "llama"),
                                              "working_dir": str(tmp_path), "permission_mode": "manual",
                                              "speculative": "auto"})
    assert response.status_code in (200, 302)
    if response.status_code == 200:
        assert response.context["form"].errors
    else:
        assert AgentSession.objects.get().machine != gpu  # " 1" is a plain id to Django too

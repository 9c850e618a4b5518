"""The new-session form, the model list, and session settings (docs/behaviour.md §3, §5, §12)."""

from __future__ import annotations

import pytest
from django.test import Client

from machines_app.models import Machine, ModelFile
from sessions_app.models import AgentSession, TranscriptEvent
from sessions_app.servers.models import ServerRecord

from .conftest import model_key, wait_for


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def form_data(machine, tmp_path, **overrides):
    data = {"machine": machine.pk, "model_key": model_key(machine, "llama"), "working_dir": str(tmp_path),
            "permission_mode": "manual", "speculative": "auto"}
    data.update(overrides)
    return data


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("overrides", "field", "message"),
    [
        ({"working_dir": "/no/such/dir"}, "working_dir", "There is no directory /no/such/dir on local"),
        ({"contextSize": -5}, "contextSize", "greater than or equal to 128"),
        ({"temperature": "hot"}, "temperature", "Enter a number"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"model_key": "../etc/passwd"}, "model_key", "Select a valid choice"),
        ({"model_key": ""}, "model_key", "This field is required"),
    ],
)
def test_it_shows_clear_field_errors_and_starts_nothing(local_machine, alice, tmp_path, overrides, field, message):
    response = logged_in(alice).post("/sessions/new/", form_data(local_machine, tmp_path, **overrides))
    assert response.status_code == 200
    assert message in " ".join(response.context["form"].errors[field])
    assert not AgentSession.objects.exists()


@pytest.mark.django_db
def test_it_lists_models_by_their_gguf_name_everywhere(local_machine, alice, django_user_model):
    smol = ModelFile.objects.get(machine=local_machine, architecture="llama")
    assert "smollm2" in smol.display_name.lower() and smol.quantization == "Q4_1"
    page = logged_in(alice).get("/sessions/new/").content.decode()
    picker = logged_in(alice).get(f"/sessions/models/?machine={local_machine.pk}").content.decode()
    for html in (page, picker):
        assert smol.display_name in html and "Gemma 3 270m" in html
    admin_user = django_user_model.objects.create_superuser("root", password="root-password-1")
    admin = logged_in(admin_user).get("/admin/machines_app/modelfile/").content.decode()
    assert smol.display_name in admin and "Q4_1" in admin


@pytest.mark.django_db(transaction=True)
def test_refresh_models_runs_as_a_celery_task_and_the_picker_reloads(stack, alice, real_models_dir, llama_server_bin):
    machine = Machine.objects.create(name="fresh", models_dir=str(real_models_dir), llama_server_path=llama_server_bin)
    client = logged_in(alice)
    response = client.post(f"/machines/{machine.pk}/refresh/", {"model_key": "gemma-3-270m-q4_k_m.gguf"})
    assert "Reading model files" in response.content.decode()
    assert "selected=gemma-3-270m-q4_k_m.gguf" in response.content.decode()  # the choice survives the refresh
    wait_for(lambda: ModelFile.objects.filter(machine=machine).count() == 2, 30, what="the worker's discovery")
    status = client.get(f"/machines/{machine.pk}/refresh/status/?since=&selected=gemma-3-270m-q4_k_m.gguf")
    html = status.content.decode()
    assert "Gemma 3 270m" in html and "<select" in html
    assert 'value="gemma-3-270m-q4_k_m.gguf" selected' in html


@pytest.mark.django_db
def test_sampling_applies_next_request_and_server_params_ask_for_a_restart(alice, tmp_path):
    machine = Machine.objects.create(name="m", models_dir=str(tmp_path))
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path),
                                          status="idle", server_params={"contextSize": 2048})
    ServerRecord.objects.create(session=session, machine=machine, model_key="m.gguf", pid=1, start_time="0", port=1,
                                log_path="/dev/null", server_params={"contextSize": 2048})
    client = logged_in(alice)
    response = client.post(f"/sessions/{session.pk}/settings/",
                           {"title": "Shearing plan", "temperature": 0.3, "speculative": "auto", "contextSize": 2048})
    assert "Sampling changes apply to the next request" in response.content.decode()
    session.refresh_from_db()
    assert session.title == "Shearing plan" and session.sampling == {"temperature": 0.3}
    response = client.post(f"/sessions/{session.pk}/settings/",
                           {"title": "Shearing plan", "temperature": 0.3, "speculative": "auto", "contextSize": 4096})
    assert "restart the server to apply them" in response.content.decode()
    assert TranscriptEvent.objects.filter(session=session, kind="settings").last().payload["server_params"] == {
        "contextSize": 4096}

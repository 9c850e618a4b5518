"""The request — system prompt, the model
file's sampling defaults, chat templates and their capabilities — and export
(docs/behaviour.md §17, §18).

Real llama-server where it matters (prompt_tokens, /props, a reply with a built-in
template, the browser); the stand-in only to read back the exact request bodies Corral
sent (it records them) for a GGUF written here, which the real server could not load.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
from django.test import Client
from gguf import GGUFValueType, GGUFWriter

from machines_app import catalog
from machines_app.llama_server import BUILTIN_CHAT_TEMPLATES, ServerSpec, build_argv
from machines_app.models import Machine, ModelFile
from sessions_app import actions, agent, export
from sessions_app.live import sentences
from sessions_app.models import AgentSession, DeploymentSettings, TranscriptEvent
from sessions_app.servers.models import ServerRecord
from sessions_app.servers.start import start_server
from sessions_app.transcript import Event

from .conftest import fake_server, model_key, wait_for

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("stop_servers_after")]


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def events_of(session, *kinds):
    return [e for e in TranscriptEvent.objects.filter(session=session).order_by("seq") if e.kind in kinds]


def requests_seen(session) -> list[dict]:
    """The request bodies the stand-in received, in order (it records them)."""
    record = ServerRecord.objects.get(session=session)
    return httpx.get(f"http://127.0.0.1:{record.port}/requests",
                     headers={"Authorization": f"Bearer {record.api_key}"}).json()


def turn(session, user, text: str) -> None:
    """Send ``text`` and run the turn in this process, against the session's server (or let
    the suite's worker run it, when a stack is up and takes the step first)."""
    ended = len(events_of(session, "turn_end"))
    actions.do_send_message(AgentSession.objects.get(pk=session.pk), user, text)
    agent.run_turn_step(session.pk)
    wait_for(lambda: len(events_of(session, "turn_end")) == ended + 1, 180, what="the turn to end")


def write_sampled_gguf(path: Path) -> None:
    """A small GGUF carrying the model's own sampling defaults (general.sampling.*)."""
    writer = GGUFWriter(path, "llama")
    writer.add_key_value("general.name", "Sampled", GGUFValueType.STRING)
    writer.add_key_value("general.sampling.temp", 0.25, GGUFValueType.FLOAT32)
    writer.add_key_value("general.sampling.top_k", 20, GGUFValueType.INT32)
    writer.add_key_value("general.sampling.min_p", 0.05, GGUFValueType.FLOAT32)
    writer.add_tensor("w", np.zeros(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def sampled_machine(db, tmp_path):
    """A machine whose only model is a written GGUF with sampling defaults, served by the stand-in."""
    models = tmp_path / "models"
    models.mkdir()
    write_sampled_gguf(models / "sampled.gguf")
    machine = Machine.objects.create(name="sampled", models_dir=str(models), llama_server_path=fake_server(tmp_path),
                                     workspace_roots="")
    catalog.refresh_models(machine)
    return machine


def input_tag(html: str, name: str) -> str:
    match = re.search(rf'<(?:input|textarea)[^>]*name="{name}"[^>]*>', html)
    assert match, f"no field {name}"
    return match.group(0)


# --- system prompt ----------------------------------------------------------------------------


def test_the_system_prompt_in_force_is_the_sessions_then_the_model_files_then_the_deployments(alice, tmp_path):
    machine = Machine.objects.create(name="m", models_dir=str(tmp_path))
    ModelFile.objects.create(machine=machine, key="m.gguf", display_name="M")
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir="/")
    assert session.system_prompt_in_force() is None  # nothing set anywhere: no system message

    DeploymentSettings.objects.update_or_create(pk=1, defaults={"system_prompt": "Deployment says hi."})
    assert session.system_prompt_in_force() == "Deployment says hi."
    ModelFile.objects.filter(key="m.gguf").update(system_prompt="The model file's own.")
    assert session.system_prompt_in_force() == "The model file's own."
    session.system_prompt = "The session's own."
    assert session.system_prompt_in_force() == "The session's own."


def test_an_admin_sets_the_deployments_default_system_prompt(admin_client, alice, tmp_path):
    response = admin_client.get("/admin/sessions_app/deploymentsettings/")
    assert response.status_code == 302 and response.url == "/admin/sessions_app/deploymentsettings/1/change/"
    response = admin_client.post(response.url, {"system_prompt": "You answer for the farm."})
    assert response.status_code == 302
    machine = Machine.objects.create(name="m", models_dir=str(tmp_path))
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir="/")
    assert session.system_prompt_in_force() == "You answer for the farm."


def test_the_system_prompt_goes_first_keeps_the_prefix_and_a_change_applies_next_request(sampled_machine, alice, tmp_path):
    client = logged_in(alice)
    response = client.post("/sessions/new/", {
        "machine": sampled_machine.pk, "model_key": "sampled.gguf", "working_dir": str(tmp_path),
        "permission_mode": "manual", "speculative": "auto", "system_prompt": "  You herd sheep.  ",
    })
    assert response.status_code == 302, response.content.decode()[:2000]
    session = AgentSession.objects.get(owner=alice)
    assert session.system_prompt == "You herd sheep."
    assert events_of(session, "settings")[0].payload["system_prompt"] == "You herd sheep."
    start_server(session.pk)

    turn(session, alice, "How many sheep?")
    turn(session, alice, "And goats?")
    first, second = requests_seen(session)
    assert first["messages"][0] == {"role": "system", "content": "You herd sheep."}
    # Earlier turns fold byte-identically while the prompt stays (the prompt cache).
    assert json.dumps(second["messages"][:2]) == json.dumps(first["messages"])
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "user"]

    response = client.post(f"/sessions/{session.pk}/settings/",
                           {"title": "", "speculative": "auto", "system_prompt": "You herd goats."})
    assert response.status_code == 200
    assert events_of(session, "settings")[-1].payload["system_prompt"] == "You herd goats."
    turn(session, alice, "Now?")
    third = requests_seen(session)[-1]
    assert third["messages"][0] == {"role": "system", "content": "You herd goats."}
    assert json.dumps(third["messages"][1:4]) == json.dumps(second["messages"][1:])


def test_a_system_prompt_with_a_control_character_is_refused_in_the_form(sampled_machine, alice, tmp_path):
    response = logged_in(alice).post("/sessions/new/", {
        "machine": sampled_machine.pk, "model_key": "sampled.gguf", "working_dir": str(tmp_path),
        "permission_mode": "manual", "speculative": "auto", "system_prompt": "be\x1bgood",
    })
    assert response.status_code == 200
    assert "The system prompt contains a control character (U+001B at character 3" in response.content.decode()
    assert not AgentSession.objects.exists()


@pytest.mark.django_db(transaction=True)  # the step's interrupt watcher reads the session from its own connection
def test_the_real_server_counts_the_system_prompt_in_prompt_tokens(local_machine, alice, tmp_path):
    session = AgentSession.objects.create(
        owner=alice, machine=local_machine, model_key=model_key(local_machine, "llama"), working_dir=str(tmp_path),
        server_params={"contextSize": 2048}, sampling={"max_tokens": 8, "temperature": 0}, status="loading",
        system_prompt="Be brief.",
    )
    start_server(session.pk)
    assert AgentSession.objects.get(pk=session.pk).status == "idle"
    turn(session, alice, "Name one colour.")
    assert events_of(session, "usage"), [(e.kind, e.payload) for e in TranscriptEvent.objects.filter(session=session)]
    short = events_of(session, "usage")[-1].payload["prompt_tokens"]

    longer = "Be brief. You look after a flock of sheep on a hill farm in the north, and you answer farmers."
    actions.do_clear(session, alice)
    actions.do_update_settings(session, alice, title="", sampling=session.sampling, server_params=session.server_params,
                               system_prompt=longer)
    turn(session, alice, "Name one colour.")
    long = events_of(session, "usage")[-1].payload["prompt_tokens"]

    record = ServerRecord.objects.get(session=session)
    headers = {"Authorization": f"Bearer {record.api_key}"}

    def tokens(text: str) -> int:
        url = f"http://127.0.0.1:{record.port}/tokenize"
        return len(httpx.post(url, json={"content": text}, headers=headers).json()["tokens"])

    grown = tokens(longer) - tokens("Be brief.")
    assert grown > 10
    assert abs((long - short) - grown) <= 2, (short, long, grown)  # ± a token where the texts join


# --- the model file's sampling defaults --------------------------------------------------------


def test_discovery_reads_the_sampling_defaults_and_the_forms_show_them_as_placeholders(sampled_machine, alice):
    model = ModelFile.objects.get(machine=sampled_machine)
    assert model.sampling_defaults == {"temperature": 0.25, "top_k": 20, "min_p": 0.05}
    html = logged_in(alice).get(f"/sessions/new/?machine={sampled_machine.pk}").content.decode()
    assert 'placeholder="model default: 0.25"' in input_tag(html, "temperature")
    assert 'placeholder="model default: 20"' in input_tag(html, "top_k")
    assert "placeholder" not in input_tag(html, "top_p")  # the file has no default for it

    # Choosing a model in the picker redraws these fields for it, keeping what was typed.
    html = logged_in(alice).get("/sessions/models/defaults/", {
        "machine": sampled_machine.pk, "model_key": "sampled.gguf", "top_p": "0.5"}).content.decode()
    assert 'placeholder="model default: 0.25"' in input_tag(html, "temperature")
    assert 'value="0.5"' in input_tag(html, "top_p")


@pytest.mark.django_db(transaction=True)
def test_the_placeholders_follow_the_machine_and_model_chosen_in_the_browser(
    stack, page, local_machine, sampled_machine, alice
):
    from .helpers import log_in

    log_in(page, stack, "alice", "alice-password-1")
    page.goto(stack.base_url + "/sessions/new/")
    assert page.get_attribute("#id_temperature", "placeholder") is None  # the local machine's models have none
    page.fill("#id_top_p", "0.5")
    page.select_option("#id_machine", value=str(sampled_machine.pk))
    page.wait_for_selector('#id_temperature[placeholder="model default: 0.25"]')
    assert page.input_value("#id_top_p") == "0.5"  # what was typed stays
    page.select_option("#id_machine", value=str(local_machine.pk))
    page.wait_for_selector("#id_temperature:not([placeholder])")


def test_an_empty_field_sends_nothing_and_a_set_field_wins(sampled_machine, alice, tmp_path):
    client = logged_in(alice)
    response = client.post("/sessions/new/", {
        "machine": sampled_machine.pk, "model_key": "sampled.gguf", "working_dir": str(tmp_path),
        "permission_mode": "manual", "speculative": "auto", "temperature": "", "top_k": "",
    })
    assert response.status_code == 302, response.content.decode()[:2000]
    session = AgentSession.objects.get(owner=alice)
    start_server(session.pk)
    turn(session, alice, "Hello")
    body = requests_seen(session)[-1]
    assert "temperature" not in body and "top_k" not in body  # llama-server applies the file's own
    usage = events_of(session, "usage")[-1].payload
    assert usage["sampling"]["temperature"] == 0.25 and usage["sampling_from"]["temperature"] == "model"
    assert "temperature 0.25 (model)" in sentences.usage_line(usage)
    assert f"seed {usage['seed']}" in sentences.usage_line(usage)

    html = client.get(f"/sessions/{session.pk}/").content.decode()
    assert 'placeholder="model default: 0.25"' in input_tag(html, "temperature")  # settings form too
    client.post(f"/sessions/{session.pk}/settings/", {"title": "", "speculative": "auto", "temperature": 0.7})
    turn(session, alice, "Again")
    assert requests_seen(session)[-1]["temperature"] == 0.7
    usage = events_of(session, "usage")[-1].payload
    assert usage["sampling"]["temperature"] == 0.7 and usage["sampling_from"]["temperature"] == "session"
    assert usage["sampling_from"]["top_k"] == "model"


@pytest.mark.django_db(transaction=True)  # the step's interrupt watcher reads the session from its own connection
def test_the_real_server_applies_the_files_own_default_to_a_session_that_sets_none(
    real_models_dir, llama_server_bin, alice, tmp_path
):
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    # The real SmolLM2, copied with sampling defaults of its own.
    reader = gguf.GGUFReader(real_models_dir / "SmolLM2-135M-Instruct.Q4_1.gguf")
    models = tmp_path / "models"
    models.mkdir()
    writer = gguf.GGUFWriter(models / "smol-sampled.gguf", arch=reader.get_field("general.architecture").contents(),
                             endianess=reader.endianess)
    alignment = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = alignment.contents()
    copy_with_new_metadata(reader, writer, {
        "general.sampling.temp": MetadataDetails(GGUFValueType.FLOAT32, 0.25),
        "general.sampling.top_k": MetadataDetails(GGUFValueType.INT32, 20),
    }, [])
    machine = Machine.objects.create(name="local", models_dir=str(models), llama_server_path=llama_server_bin,
                                     workspace_roots="")
    catalog.refresh_models(machine)
    session = AgentSession.objects.create(
        owner=alice, machine=machine, model_key="smol-sampled.gguf", working_dir=str(tmp_path),
        server_params={"contextSize": 1024}, sampling={"max_tokens": 8}, status="loading",
    )
    start_server(session.pk)
    ready = events_of(session, "server_ready")[-1].payload
    assert ready["sampling_defaults"]["temperature"] == 0.25 and ready["sampling_defaults"]["top_k"] == 20

    turn(session, alice, "Name one colour.")
    usage = events_of(session, "usage")[-1].payload
    assert usage["sampling"]["temperature"] == 0.25 and usage["sampling_from"]["temperature"] == "model"
    assert usage["sampling_from"]["top_p"] == "server"  # the file says nothing of it: llama-server's own


def test_case_c13_odd_sampling_keys_are_left_out():
    from machines_app.gguf import GGUFHead

    head = GGUFHead(version=3, tensor_count=0, metadata={
        "general.sampling.temp": float("nan"), "general.sampling.top_k": "forty", "general.sampling.top_p": True,
        "general.sampling.min_p": float("inf"), "general.sampling.penalty_repeat": 1.100000023841858,
        "general.sampling.sequence": "top_k;top_p",
    })
    assert head.sampling_defaults == {"repeat_penalty": 1.1}  # float32 read back as the number written


def test_sampling_in_force_takes_the_session_then_the_model_then_the_server():
    values, sources = agent.sampling_in_force(
        {"temperature": 0.9, "seed": 3}, {"temperature": 0.25, "top_k": 20}, {"temperature": 0.8, "top_k": 40, "top_p": 0.95}
    )
    assert values == {"temperature": 0.9, "top_k": 20, "top_p": 0.95}
    assert sources == {"temperature": "session", "top_k": "model", "top_p": "server"}


# --- chat templates and their capabilities -----------------------------------------------------


def test_the_argv_carries_the_admins_chat_template():
    spec = dict(binary="llama-server", model_path="/m.gguf", port=1, params={})
    assert "--chat-template" not in build_argv(ServerSpec(**spec))
    argv = build_argv(ServerSpec(**spec, chat_template="gemma"))
    assert argv[-3:] == ["--no-jinja", "--chat-template", "gemma"]
    argv = build_argv(ServerSpec(**spec, chat_template_file="/t/x.jinja"))
    assert argv[-2:] == ["--chat-template-file", "/t/x.jinja"] and "--no-jinja" not in argv


def test_the_built_in_template_names_are_the_ones_the_binary_lists(llama_server_bin):
    help_text = subprocess.run([llama_server_bin, "--help"], capture_output=True, text=True, timeout=60).stdout
    lines = help_text.splitlines()
    start = next(i for i, line in enumerate(lines) if "list of built-in templates:" in line) + 1
    listed = []
    for line in lines[start:]:  # the list wraps over lines, each but the last ending with a comma
        listed += [name.strip() for name in line.split(",") if name.strip()]
        if not line.rstrip().endswith(","):
            break
    assert sorted(listed) == sorted(BUILTIN_CHAT_TEMPLATES)


def test_the_admin_sets_a_template_checked_on_the_machine(local_machine, admin_client, tmp_path):
    model = ModelFile.objects.get(machine=local_machine, architecture="gemma3")
    model.chat_template_caps = {"supports_tools": False}
    model.save()
    client = admin_client
    url = f"/admin/machines_app/modelfile/{model.pk}/change/"
    response = client.post(url, {"system_prompt": "", "chat_template": "", "chat_template_file": str(tmp_path / "no.jinja")})
    assert f"There is no file {tmp_path / 'no.jinja'} on local." in response.content.decode()
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    response = client.post(url, {"system_prompt": "", "chat_template": "gemma", "chat_template_file": str(template)})
    assert "Choose a built-in template or a template file, not both." in response.content.decode()
    response = client.post(url, {"system_prompt": "Be kind.", "chat_template": "gemma", "chat_template_file": ""})
    assert response.status_code == 302, response.content.decode()[:3000]
    model.refresh_from_db()
    assert (model.chat_template, model.system_prompt, model.chat_template_caps) == ("gemma", "Be kind.", {})
    html = client.get(f"/sessions/new/?machine={local_machine.pk}").content.decode()
    assert "Gemma 3 270m — 270M Q4_K_M (built-in chat template &#x27;gemma&#x27;)" in html  # the picker says which


def test_a_missing_template_file_stops_the_start_with_a_clear_error(local_machine, alice, tmp_path):
    key = model_key(local_machine, "llama")
    ModelFile.objects.filter(machine=local_machine, key=key).update(chat_template_file=str(tmp_path / "gone.jinja"))
    session = AgentSession.objects.create(owner=alice, machine=local_machine, model_key=key, working_dir=str(tmp_path),
                                          status="loading")
    start_server(session.pk)
    error = events_of(session, "error")[-1].payload["message"]
    assert f"has no chat template file {tmp_path / 'gone.jinja'}" in error
    assert AgentSession.objects.get(pk=session.pk).status == "exited"


@pytest.mark.django_db(transaction=True)  # the step's interrupt watcher reads the session from its own connection
def test_gemma_with_the_built_in_gemma_template_replies(local_machine, alice, tmp_path):
    key = model_key(local_machine, "gemma3")
    ModelFile.objects.filter(machine=local_machine, key=key).update(chat_template="gemma")
    session = AgentSession.objects.create(
        owner=alice, machine=local_machine, model_key=key, working_dir=str(tmp_path),
        server_params={"contextSize": 1024}, sampling={"max_tokens": 24, "temperature": 0}, status="loading",
    )
    start_server(session.pk)
    assert AgentSession.objects.get(pk=session.pk).status == "idle", events_of(session, "error")
    ready = events_of(session, "server_ready")[-1].payload
    assert ready["chat_template"] == "gemma" and ready["jinja"] is False

    record = ServerRecord.objects.get(session=session)
    props = httpx.get(f"http://127.0.0.1:{record.port}/props",
                      headers={"Authorization": f"Bearer {record.api_key}"}).json()
    assert props["chat_template"] == "gemma"  # llama-server reports the template it was given
    assert "gemma" in " ".join(record_argv(record))

    turn(session, alice, "What is the capital of France?")
    assert not events_of(session, "error"), [e.payload for e in events_of(session, "error")]
    reply = "".join(e.payload["text"] for e in events_of(session, "assistant_text"))
    assert reply.strip(), [(e.kind, e.payload) for e in TranscriptEvent.objects.filter(session=session)]
    assert events_of(session, "usage")[-1].payload["prompt_tokens"] > 5


GEMMA_JINJA = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else 'user' }}\n"
    "{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.mark.django_db(transaction=True)  # the step's interrupt watcher reads the session from its own connection
def test_a_template_file_is_checked_and_used_on_the_ssh_machine(ssh_machine, admin_client, alice, tmp_path):
    model = ModelFile.objects.get(machine=ssh_machine, architecture="gemma3")
    url = f"/admin/machines_app/modelfile/{model.pk}/change/"
    path = tmp_path / "gemma.jinja"
    response = admin_client.post(url, {"system_prompt": "", "chat_template": "", "chat_template_file": str(path)})
    assert f"There is no file {path} on {ssh_machine.name}." in response.content.decode()  # asked over SFTP
    path.write_text(GEMMA_JINJA)
    response = admin_client.post(url, {"system_prompt": "", "chat_template": "", "chat_template_file": str(path)})
    assert response.status_code == 302, response.content.decode()[:3000]

    html = logged_in(alice).get(f"/sessions/new/?machine={ssh_machine.pk}").content.decode()
    assert f"Gemma 3 270m — 270M Q4_K_M (chat template file {path})" in html  # the picker says which template

    session = AgentSession.objects.create(
        owner=alice, machine=ssh_machine, model_key=model.key, working_dir=str(tmp_path),
        server_params={"contextSize": 1024}, sampling={"max_tokens": 16, "temperature": 0}, status="loading",
    )
    start_server(session.pk)
    assert AgentSession.objects.get(pk=session.pk).status == "idle", events_of(session, "error")
    ready = events_of(session, "server_ready")[-1].payload
    assert ready["chat_template"] == str(path) and ready["jinja"] is True
    assert ready["chat_template_caps"]["supports_tools"] is False  # this template takes no tools
    record = ServerRecord.objects.get(session=session)
    assert "--chat-template-file" in record_argv(record)
    turn(session, alice, "What is the capital of France?")
    assert not events_of(session, "error"), [e.payload for e in events_of(session, "error")]
    assert "".join(e.payload["text"] for e in events_of(session, "assistant_text")).strip()


def record_argv(record: ServerRecord) -> list[str]:
    return Path(f"/proc/{record.pid}/cmdline").read_bytes().decode().split("\x00")


def test_a_start_remembers_what_the_template_can_do_on_the_model_file(local_machine, alice, tmp_path):
    key = model_key(local_machine, "llama")
    session = AgentSession.objects.create(owner=alice, machine=local_machine, model_key=key, working_dir=str(tmp_path),
                                          server_params={"contextSize": 1024}, status="loading")
    start_server(session.pk)
    ready = events_of(session, "server_ready")[-1].payload
    # What the real binary says of SmolLM2's own template (both demo models).
    assert ready["chat_template_caps"]["supports_tools"] is False
    assert ready["jinja"] is True and set(ready["sampling_defaults"]) >= {"temperature", "top_k", "top_p"}
    model = ModelFile.objects.get(machine=local_machine, key=key)
    assert model.chat_template_caps == ready["chat_template_caps"] and model.cannot_call_tools


@pytest.mark.django_db(transaction=True)
def test_the_browser_says_the_model_cannot_call_tools(stack, page, local_machine, alice, tmp_path):
    from .helpers import log_in

    log_in(page, stack, "alice", "alice-password-1")
    page.goto(stack.base_url + "/sessions/new/")
    option = page.locator("#id_model_key option", has_text="SmolLM2").first
    assert "cannot call tools" not in option.inner_text()  # not known before a first start
    page.select_option("#id_model_key", value=option.get_attribute("value"))
    page.fill("#id_working_dir", str(tmp_path))
    page.fill("#id_contextSize", "1024")
    page.click("#new-session button[type=submit]")
    page.wait_for_url("**/sessions/*/")
    page.wait_for_selector("#status-badge[data-status=idle]", timeout=120_000)

    # Live, as the server became ready: the header's model details and the tool list say so.
    page.locator("#model-details li", has_text="This model cannot call tools").wait_for(state="attached")
    page.click("#model-details summary")
    assert "✗" not in page.inner_text("#model-details")
    summary = page.inner_text("#tool-list summary")
    assert "cannot call tools" in summary and "may call" not in summary
    page.reload()
    page.locator("#model-details li", has_text="This model cannot call tools").wait_for(state="attached")
    page.click("#tool-list summary")
    assert "This model cannot call tools" in page.inner_text("#no-tools-note")

    # The picker remembers it per model file, for the next session.
    page.goto(stack.base_url + "/sessions/new/")
    option = page.locator("#id_model_key option", has_text="SmolLM2").first
    assert "this model cannot call tools" in option.inner_text()


# --- export ------------------------------------------------------------------------------------


def conversation(session, alice) -> None:
    """Text, reasoning, a tool call with its output and a usage line, as a turn stores them."""
    from sessions_app.events import record_event

    by = {"id": alice.pk, "username": "alice"}
    for kind, payload in [
        ("message_taken", {"text": "What is in notes.txt?", "queued_id": None, "by": by}),
        ("reasoning", {"text": "I should read "}),
        ("reasoning", {"text": "the file."}),
        ("tool_start", {"id": "call_1", "tool": "read_file", "arguments": '{"path": "notes.txt"}',
                        "input": {"path": "notes.txt"}, "display_name": "Read file"}),
        ("tool_end", {"id": "call_1", "output": "sheep ``` north field", "ok": True}),
        ("assistant_text", {"text": "The sheep are "}),
        ("assistant_text", {"text": "in the **north** field."}),
        ("usage", {"prompt_tokens": 120, "completion_tokens": 9, "seed": 7}),
        ("turn_end", {"reason": "done"}),
    ]:
        record_event(session.pk, kind, payload)


def test_both_exports_of_a_session(alice, bob, tmp_path):
    machine = Machine.objects.create(name="m", models_dir=str(tmp_path))
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir="/",
                                          title="Flock", status="idle")
    conversation(session, alice)
    client = logged_in(alice)

    response = client.get(f"/sessions/{session.pk}/export.jsonl")
    assert response.status_code == 200
    assert response["Content-Disposition"] == f'attachment; filename="session-{session.pk}.jsonl"'
    again = export.read_jsonl(response.content.decode())
    stored = TranscriptEvent.objects.filter(session=session).order_by("seq")
    assert [(e.seq, e.kind, e.payload) for e in again] == [(e.seq, e.kind, e.payload) for e in stored]

    page = client.get(f"/sessions/{session.pk}/").content.decode()
    assert f'href="/sessions/{session.pk}/export.md"' in page and f'href="/sessions/{session.pk}/export.jsonl"' in page
    markdown = client.get(f"/sessions/{session.pk}/export.md").content.decode()
    assert markdown.startswith("# Flock\n")
    assert "**alice:**\n\nWhat is in notes.txt?" in markdown
    assert "<details><summary>Reasoning</summary>\n\n```\nI should read the file.\n```\n\n</details>" in markdown
    assert "**Tool call** `read_file` (Read file):\n\n*path*\n\n```\nnotes.txt\n```" in markdown  # the card's fields
    assert "````\nsheep ``` north field\n````" in markdown  # a fence the output cannot close
    assert "**Model:**\n\nThe sheep are in the **north** field." in markdown
    assert "*context 120 tokens · reply 9 tokens · seed 7*" in markdown

    assert logged_in(bob).get(f"/sessions/{session.pk}/export.md").status_code == 404  # private: not his to see
    AgentSession.objects.filter(pk=session.pk).update(visibility="team_watch")
    assert logged_in(bob).get(f"/sessions/{session.pk}/export.md").status_code == 200  # whoever may watch
    assert client.get(f"/sessions/{session.pk}/export.html").status_code == 404


def test_the_markdown_export_links_images_of_a_user_message():
    events = [Event(1, "message_taken", {"text": "Look", "queued_id": None,
                                         "images": ["/media/a.png", {"url": "https://x/b c.jpg", "name": "b"},
                                                    "data:image/png;base64,AAAA"]})]
    markdown = export.to_markdown(events)
    assert "Look\n\n![image](</media/a.png>)\n\n![b](<https://x/b c.jpg>)" in markdown
    assert "base64" not in markdown  # a reference, never the data

    # A stored image (its reference: sha256, media type, size) links through the page's address for it.
    stored = {"sha256": "ab" * 32, "media_type": "image/png", "size": 68}
    events = [Event(1, "message_taken", {"text": "See", "queued_id": None, "images": [stored]})]
    linked = export.to_markdown(events, image_url=lambda ref: f"https://corral/sessions/1/images/{ref['sha256']}.png")
    assert f"See\n\n![image](<https://corral/sessions/1/images/{'ab' * 32}.png>)" in linked
    assert f"*[an image, image/png {'ab' * 6}]*" in export.to_markdown(events)  # no address: named in words


def test_read_jsonl_names_the_line_of_a_bad_event():
    with pytest.raises(export.InvalidEvent, match="line 2: notice payload: missing"):
        export.read_jsonl('{"seq": 1, "kind": "turn_end", "payload": {"reason": "done"}}\n'
                          '{"seq": 2, "kind": "notice", "payload": {}}\n')

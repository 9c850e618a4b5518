"""Bad input never gives a 500, and the answer names the real reason.

Query parameters, path pieces and form fields of the HTTP views; the message a person
sends; GGUF files llama-server could not load. The websocket's paths and frames are in
test_live_connection.py.
"""

from __future__ import annotations

import struct

import pytest
from django.test import Client

from machines_app import catalog
from machines_app.discovery import discover
from machines_app.models import Machine, ModelFile
from sessions_app import actions, rules
from sessions_app.models import AgentSession, TranscriptEvent

HUGE = "9" * 30  # beyond any database integer


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def machine(tmp_path, db):
    return Machine.objects.create(name="m1", models_dir=str(tmp_path))


@pytest.fixture
def session(alice, machine, tmp_path):
    return AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path),
                                       status="idle")


# --- query parameters and path pieces -------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("query", "reason"),
    [
        ("", "Choose a machine first."),
        ("?machine=", "Choose a machine first."),
        ("?machine=abc", "There is no such machine"),
        ("?machine=%C2%B2", "There is no such machine"),  # '²' is a digit to str.isdigit, not to int()
        ("?machine=1.5", "There is no such machine"),
        ("?machine=-1", "There is no such machine"),
        (f"?machine={HUGE}", "There is no such machine"),
        ("?machine=%00", "Null characters are not allowed."),
    ],
)
def test_it_refuses_a_bad_machine_in_the_model_picker_with_a_reason(alice, machine, query, reason):
    response = logged_in(alice).get("/sessions/models/" + query)
    assert response.status_code == 400
    assert reason in response.content.decode()


@pytest.mark.django_db
def test_it_lists_the_models_of_a_good_machine_and_refuses_a_turned_off_one(alice, machine):
    ModelFile.objects.create(machine=machine, key="a.gguf", display_name="Model A", architecture="llama")
    assert "Model A" in logged_in(alice).get(f"/sessions/models/?machine={machine.pk}").content.decode()
    Machine.objects.filter(pk=machine.pk).update(enabled=False)
    response = logged_in(alice).get(f"/sessions/models/?machine={machine.pk}")
    assert response.status_code == 400 and "turned off" in response.content.decode()


@pytest.mark.django_db
@pytest.mark.parametrize("value", ["abc", "%C2%B2", HUGE, "-3", "%00"])
def test_it_shows_the_new_session_form_whatever_machine_the_link_names(alice, machine, value):
    response = logged_in(alice).get(f"/sessions/new/?machine={value}")
    assert response.status_code == 200 and response.context["form"].chosen_machine == machine


@pytest.mark.django_db
@pytest.mark.parametrize("value", ["²", HUGE, "1.5"])
def test_it_answers_a_bad_machine_in_the_new_session_form_with_a_form_error(alice, machine, value, tmp_path):
    response = logged_in(alice).post("/sessions/new/", {"machine": value, "model_key": "a.gguf",
                                                        "working_dir": str(tmp_path), "permission_mode": "manual",
                                                        "speculative": "auto"})
    assert response.status_code == 200 and "machine" in response.context["form"].errors
    assert not AgentSession.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", f"/sessions/{HUGE}/"),
        ("post", f"/sessions/{HUGE}/send/"),
        ("post", f"/sessions/{HUGE}/delete/"),
        ("post", f"/machines/{HUGE}/refresh/"),
        ("get", f"/machines/{HUGE}/refresh/status/"),
        ("get", "/sessions/abc/"),
    ],
)
def test_it_answers_404_for_an_id_no_database_can_hold(alice, method, path):
    assert getattr(logged_in(alice), method)(path).status_code == 404


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("path", "data", "reason"),
    [
        ("calls/%00/answer/", {"answer": "allow_once"}, "already been answered"),
        ("calls/x/answer/", {"answer": "\x00"}, "Choose Allow once"),
        ("queue/%00/drop/", {}, "already been taken or withdrawn"),
        ("mode/", {"permission_mode": "root\x00"}, "Unknown permission mode"),
        ("model/", {"model_key": "a\x00b.gguf"}, "may not contain NUL"),
        ("model/", {"model_key": "../../etc/passwd"}, "is not allowed"),
    ],
)
def test_it_refuses_odd_action_values_with_a_sentence(alice, session, path, data, reason):
    response = logged_in(alice).post(f"/sessions/{session.pk}/{path}", data, HTTP_HX_REQUEST="true")
    assert response.status_code == 200
    assert reason in response.content.decode()


@pytest.mark.django_db
@pytest.mark.parametrize("field", ["title", "temperature", "contextSize", "seed"])
@pytest.mark.parametrize("value", ["\x00", "1e999", HUGE, "nan"])
def test_it_answers_odd_settings_with_form_errors(alice, session, field, value):
    response = logged_in(alice).post(f"/sessions/{session.pk}/settings/", {field: value})
    assert response.status_code == 200
    if field != "title" or value == "\x00":
        assert field in response.context["settings_form"].errors


# --- the message a person sends --------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "Type a message first."),
        (" \n\t ", "Type a message first."),
        ("x" * (rules.MAX_MESSAGE_CHARS + 1), "This message is 200,001 characters long; a message can be at most 200,000."),
        ("hello\x00world", "This message contains a control character (U+0000 at character 6)"),
        ("colour \x1b[31mred", "control character (U+001B at character 8)"),
        ("bell\x07", "control character (U+0007"),
        ("del\x7f", "control character (U+007F"),
        ("c1\x85c", "control character (U+0085 at character 3)"),
        ("/compact now", "/compact: compact and slash commands are not supported"),
    ],
)
def test_check_message_gives_each_reason_its_own_sentence(text, reason):
    with pytest.raises(actions.SessionError) as refused:
        rules.check_message(text)
    assert reason in str(refused.value)


@pytest.mark.parametrize("text", ["tab\tand\nnew line\r\n", "x" * rules.MAX_MESSAGE_CHARS, "zero\u200bwidth é 日本 🐑"])
def test_check_message_accepts_text(text):
    assert rules.check_message(f"  {text}  ") == text.strip()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "Type a message first."),
        ("x" * 250_000, "This message is 250,000 characters long; a message can be at most 200,000."),
        ("a\x00b", "control character (U+0000 at character 2)"),
    ],
)
def test_the_composer_says_what_is_wrong_with_a_message(alice, session, text, reason):
    response = logged_in(alice).post(f"/sessions/{session.pk}/send/", {"text": text})
    assert response.status_code == 200
    assert reason in response.content.decode()
    assert "Type a message first." not in response.content.decode() or not text
    assert not TranscriptEvent.objects.filter(session=session).exists()


@pytest.mark.django_db
def test_the_composer_sends_a_message_with_tabs_and_new_lines(alice, session):
    response = logged_in(alice).post(f"/sessions/{session.pk}/send/", {"text": "line one\n\tline two"})
    assert response.status_code == 200 and '<p class="error feedback" id="composer-error" hidden></p>' in response.content.decode()
    taken = TranscriptEvent.objects.get(session=session, kind="message_taken")
    assert taken.payload["text"] == "line one\n\tline two"


@pytest.mark.django_db
@pytest.mark.parametrize("multipart", [False, True])
def test_a_body_larger_than_the_server_takes_gets_a_sentence_not_a_bare_400(alice, session, settings, multipart):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1024 * 1024
    text = "é" * 600_000  # 1.2 MB of UTF-8, more once form-encoded
    client = logged_in(alice)
    if multipart:
        response = client.post(f"/sessions/{session.pk}/send/", {"text": text})
    else:
        response = client.post(f"/sessions/{session.pk}/send/", f"text={text}".encode(),
                               content_type="application/x-www-form-urlencoded")
    assert response.status_code == 413
    assert response.content.decode() == (
        "This is too large to send: the server takes at most 1 MB in one request, "
        "and a message can be at most 200,000 characters with at most 8 images of 10 MB."
    )
    assert not TranscriptEvent.objects.filter(session=session).exists()


@pytest.mark.django_db
def test_a_body_with_too_many_fields_gets_a_sentence(alice, session):
    body = "&".join(f"f{i}=x" for i in range(1500)).encode()
    response = logged_in(alice).post(f"/sessions/{session.pk}/send/", body,
                                     content_type="application/x-www-form-urlencoded")
    assert response.status_code == 400
    assert response.content.decode().startswith("This request has too many fields: The number of GET/POST parameters")


# --- GGUF files llama-server cannot load --------------------------------------------------------

# GGUF value types (gguf.GGUFValueType): raw files, because GGUFWriter always writes an architecture.
UINT32, BOOL, STRING, ARRAY = 4, 7, 8, 9


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def raw_gguf(architecture: tuple[int, bytes] | None) -> bytes:
    """A metadata-only GGUF v3 with a name and, when given, general.architecture as (type, payload)."""
    kvs = [_string("general.name") + struct.pack("<I", STRING) + _string("No Arch")]
    if architecture is not None:
        vtype, payload = architecture
        kvs.append(_string("general.architecture") + struct.pack("<I", vtype) + payload)
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs)


ARCHITECTURES = {
    "missing": (None, "does not say which model architecture it is (no general.architecture)"),
    "empty": ((STRING, _string("")), "(general.architecture) is empty"),
    "blank": ((STRING, _string("  ")), "(general.architecture) is empty"),
    "number": ((UINT32, struct.pack("<I", 7)), "(general.architecture) is the number 7 instead of a name"),
    "flag": ((BOOL, b"\x01"), "is a true/false flag instead of a name"),
    "list": ((ARRAY, struct.pack("<IQ", STRING, 1) + _string("llama")), "is a list instead of a name"),
}


@pytest.mark.parametrize("case", ARCHITECTURES)
def test_discovery_marks_a_file_without_a_usable_architecture_as_not_startable(case):
    architecture, reason = ARCHITECTURES[case]
    data = raw_gguf(architecture)
    [info] = discover([("noarch.gguf", len(data))], lambda key, n: data[:n])
    assert not info.is_complete
    assert reason in info.error and info.error.endswith("so llama-server cannot load it")


@pytest.mark.django_db
def test_a_file_without_an_architecture_is_listed_with_its_reason_and_cannot_be_started(alice, tmp_path):
    (tmp_path / "noarch.gguf").write_bytes(raw_gguf(None))
    (tmp_path / "empty.gguf").write_bytes(raw_gguf((STRING, _string(""))))
    machine = Machine.objects.create(name="odd", models_dir=str(tmp_path))
    found = {m.key: m for m in catalog.refresh_models(machine)}
    assert "no general.architecture" in found["noarch.gguf"].problem
    assert "is empty" in found["empty.gguf"].problem
    with pytest.raises(catalog.ModelUnavailable, match="cannot be started: the file does not say which model"):
        catalog.model_for_session(machine, "noarch.gguf")
    client = logged_in(alice)
    picker = client.get(f"/sessions/models/?machine={machine.pk}").content.decode()
    assert "disabled" in picker and "no general.architecture" in picker
    response = client.post("/sessions/new/", {"machine": machine.pk, "model_key": "noarch.gguf",
                                              "working_dir": str(tmp_path), "permission_mode": "manual",
                                              "speculative": "auto"})
    assert "cannot be started" in str(response.context["form"].errors["model_key"])
    assert not AgentSession.objects.exists()

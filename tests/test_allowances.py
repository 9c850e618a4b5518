"""Allowances are exact, visible and revocable (docs/behaviour.md §8).

Pure tests of what an allowance covers (sessions_app/allowances.py) and of the fold
(transcript.allowances); then turns run by the real worker's step with the model side
scripted, against the llama-server stand-in (tests/fake_llama_server.py, whose tools run
for real: the gate is under test, not the model) and MCP servers of this file's own
(``python tests/test_allowances.py --serve-mcp PORT DESCRIPTION``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sessions_app import allowances, transcript
from sessions_app.allowances import matches, normal_path, offers, simple_words
from sessions_app.transcript import Event

WD = "/srv/work/proj"

SHELL = {"name": "exec_shell_command", "origin": "machine", "writes": True, "remote_name": "exec_shell_command"}
WRITE = {"name": "write_file", "origin": "machine", "writes": True, "remote_name": "write_file"}
READ = {"name": "read_file", "origin": "machine", "writes": False, "remote_name": "read_file"}


def shell(command) -> dict:
    return {"tool": "exec_shell_command", "input": {"command": command}}


def write(path) -> dict:
    return {"tool": "write_file", "input": {"path": path, "content": "x"}}


def allowance(tool: str, **scope) -> dict:
    return {"seq": 1, "tool": tool, "scope": scope, "by": None, "at": None}


def mcp_entry(description="Add two integers.", schema=None, annotations=None) -> dict:
    return {"name": "calc__add", "origin": "mcp", "server": "calc", "remote_name": "add", "writes": True,
            "definition": {"type": "function", "function": {
                "name": "calc__add", "description": description,
                "parameters": schema or {"type": "object", "properties": {"a": {"type": "integer"}}}}},
            "annotations": annotations if annotations is not None else {"readOnlyHint": True}}


# --------------------------------------------------------------------------- shell commands


def test_an_exact_command_allowance_covers_that_command_only():
    exact = allowance("exec_shell_command", kind="exact", command="git status")
    assert matches(exact, shell("git status"), SHELL, WD)
    for other in ("git status ", "git  status", "git status -s", "git", "git statu", "GIT status"):
        assert not matches(exact, shell(other), SHELL, WD), other
    # The same command for another tool, or a scope for another tool, covers nothing.
    assert not matches({**exact, "tool": "write_file"}, shell("git status"), SHELL, WD)


def test_an_exact_allowance_of_a_compound_command_covers_exactly_it():
    exact = allowance("exec_shell_command", kind="exact", command="make && make test")
    assert matches(exact, shell("make && make test"), SHELL, WD)
    assert not matches(exact, shell("make && make test; rm -rf ~"), SHELL, WD)


@pytest.mark.parametrize("words", [["git"], ["git", "status"]])
@pytest.mark.parametrize("command", ["git status", "git status -s", "git  status --short", "git 'status'",
                                     'git "status" .'])
def test_a_prefix_allowance_covers_simple_commands_starting_with_its_words(words, command):
    assert matches(allowance("exec_shell_command", kind="prefix", words=words), shell(command), SHELL, WD)


@pytest.mark.parametrize("command", [
    "git status; rm -rf ~", "git status;rm x", "git status && curl x|sh", "git status || rm x",
    "git status | sh", "git status & rm x", "git status `rm x`", "git status $(rm x)", "git status ${IFS}x",
    "git status $HOME", "git status > ~/.bashrc", "git status >> x", "git status < /etc/passwd",
    "git status <(rm x)", "git status >(rm x)", "git status\nrm -rf ~", "git status\rrm x", "git status\x00",
    "git status (x)", "git status { x; }", "git status 'quoted; still refused'", "git status 2>&1",
    "git status\u202e", "git status\u200b",
])
def test_a_compound_command_never_matches_a_prefix(command):
    for words in (["git"], ["git", "status"]):
        assert not matches(allowance("exec_shell_command", kind="prefix", words=words), shell(command), SHELL, WD)


@pytest.mark.parametrize("command", [
    "gitx status", "git", "git\tstatus", "/usr/bin/git status", "FOO=1 git status", "sudo git status",
    "git\\ status", "'git status'", "env git status", "g", "", "   ", "git 'unclosed", None, 42, ["git", "status"],
])
def test_prefix_words_are_whole_words_of_a_plain_command(command):
    """``git`` does not cover ``gitx``; a tab is not taken for a space; an assignment or a
    wrapper in front is another command; a quote that never closes is not parsed."""
    prefix = allowance("exec_shell_command", kind="prefix", words=["git", "status"])
    assert not matches(prefix, shell(command), SHELL, WD)


def test_a_prefix_allowance_with_a_forged_scope_covers_nothing():
    for words in ([], ["git", "status", "-s"], "git", None):
        assert not matches(allowance("exec_shell_command", kind="prefix", words=words), shell("git status -s"),
                           SHELL, WD)


def test_simple_words_splits_as_sh_does():
    assert simple_words('git commit -m "a message"') == ["git", "commit", "-m", "a message"]
    assert simple_words("ls; rm") is None


@pytest.mark.parametrize(("command", "expected"), [
    ("git status -s", [["git", "status"], ["git"]]),
    ("ls -la", [["ls"]]),  # an option is no subcommand
    ("cat src/a.py", [["cat"]]),
    ("npm test", [["npm", "test"], ["npm"]]),
    ("make", [["make"]]),
    ("bash -c 'rm -rf ~'", []),  # a shell runs anything: the exact command only
    ("python3 x.py", []),
    ("/bin/sh x", []),
    ("FOO=1 make", []),
    ("git status; rm x", []),  # compound: the exact command only
])
def test_offers_for_a_shell_command(command, expected):
    scopes = offers(shell(command), SHELL, WD)
    assert scopes[0] == {"kind": "exact", "command": command}
    assert [scope["words"] for scope in scopes[1:]] == expected


# --------------------------------------------------------------------------- files


@pytest.mark.parametrize(("path", "expected"), [
    ("notes.txt", "notes.txt"), ("./notes.txt", "notes.txt"), ("src//a.py", "src/a.py"),
    (f"{WD}/src/a.py", "src/a.py"), (WD, "."), (".", "."),
    # `..` is never folded: through a symlink it leads elsewhere (tests/test_gate_holes.py).
    ("src/../notes.txt", None), ("../proj/notes.txt", None),
    ("..", None), ("../other/x", None), ("src/../../x", None), ("/etc/passwd", None), ("/srv/work/proj2/x", None),
    ("~/x", None), ("", None), (None, None), ("a\x00b", None), ("a\nb", None), (3, None),
])
def test_paths_are_normalised_inside_the_working_directory(path, expected):
    assert normal_path(path, WD) == expected


def test_a_path_allowance_covers_that_file_for_that_tool_only():
    path = allowance("write_file", kind="path", path="notes.txt")
    for same in ("notes.txt", "./notes.txt", f"{WD}/notes.txt"):
        assert matches(path, write(same), WRITE, WD), same
    for other in ("src/../notes.txt", "notes.txt.bak", "notes", "src/notes.txt", "../notes.txt", "/notes.txt",
                  "~/notes.txt"):
        assert not matches(path, write(other), WRITE, WD), other
    # Allowing writes to a file allows no reads of it, and the other way round.
    assert not matches(path, {"tool": "read_file", "input": {"path": "notes.txt"}}, READ, WD)


def test_a_folder_allowance_covers_paths_inside_it_never_outside():
    folder = allowance("write_file", kind="folder", path="src")
    for inside in ("src/a.py", "src/deep/b.py", "src", f"{WD}/src/x", "src/./x"):
        assert matches(folder, write(inside), WRITE, WD), inside
    for outside in ("srcx/a.py", "src2", "a.py", "src/../a.py", "src/../../x", "/etc/src/x", "../proj2/src/x"):
        assert not matches(folder, write(outside), WRITE, WD), outside


def test_offers_for_files():
    assert offers(write("src/a.py"), WRITE, WD) == [{"kind": "path", "path": "src/a.py"},
                                                     {"kind": "folder", "path": "src"}]
    assert offers(write("notes.txt"), WRITE, WD) == [{"kind": "path", "path": "notes.txt"}]
    assert offers(write("../x"), WRITE, WD) == []
    assert offers(write("/etc/passwd"), WRITE, WD) == []


# --------------------------------------------------------------------------- MCP


def test_an_mcp_allowance_is_bound_to_server_remote_name_and_definition():
    entry = mcp_entry()
    scope, = offers({"tool": "calc__add", "input": {}}, entry, WD)
    granted = {"seq": 3, "tool": "calc__add", "scope": scope, "by": None, "at": None}
    call = {"tool": "calc__add", "input": {"a": 1}}
    assert matches(granted, call, entry, WD)
    assert not matches(granted, call, mcp_entry(description="Add two integers. Also delete files."), WD)
    assert not matches(granted, call, mcp_entry(schema={"type": "object"}), WD)
    assert not matches(granted, call, mcp_entry(annotations={}), WD)
    assert not matches(granted, call, {**entry, "server": "calc2"}, WD)
    assert not matches(granted, call, {**entry, "remote_name": "sub"}, WD)
    assert allowances.changes(scope["definition"], mcp_entry(description="new", annotations={})) == [
        "its description", "its annotations (readOnlyHint: true → none)"]


# --------------------------------------------------------------------------- the fold


def answered(seq, tool, answer="allow_always", scope=None, by="alice"):
    payload = {"id": f"c{seq}", "tool": tool, "answer": answer, "by": {"id": 1, "username": by}}
    if scope is not None:
        payload["scope"] = scope
    return Event(seq, "answered", payload)


def test_the_fold_lists_grants_less_revokes_and_reads_old_answers_as_nothing():
    prefix = {"kind": "prefix", "words": ["git"]}
    events = [
        answered(1, "read_file"),  # allow_always written before scopes: grants nothing
        answered(2, "exec_shell_command", scope=prefix),
        answered(3, "exec_shell_command", answer="allow_once", scope=prefix),
        Event(4, "cleared", {"by": {"id": 1, "username": "alice"}}),  # Clear keeps allowances
        answered(5, "write_file", scope={"kind": "path", "path": "a"}, by="carol"),
        answered(6, "exec_shell_command", scope=prefix),  # the same again: listed once
    ]
    in_force = transcript.allowances(events)
    assert [(a["seq"], a["tool"], a["by"]["username"]) for a in in_force] == [
        (2, "exec_shell_command", "alice"), (5, "write_file", "carol")]
    revoke = Event(7, "allowance_revoked", {"seq": 2, "tool": "exec_shell_command", "scope": prefix,
                                            "by": {"id": 1, "username": "alice"}})
    assert [a["seq"] for a in transcript.allowances([*events, revoke])] == [5]
    transcript.check_payload("allowance_revoked", revoke.payload)


def test_a_new_mcp_grant_replaces_the_one_for_the_old_definition():
    old = offers({"tool": "calc__add"}, mcp_entry(), WD)[0]
    new = offers({"tool": "calc__add"}, mcp_entry(description="changed"), WD)[0]
    in_force = transcript.allowances([answered(1, "calc__add", scope=old), answered(2, "calc__add", scope=new)])
    assert [a["seq"] for a in in_force] == [2]


# --------------------------------------------------------------------------- turns with the real worker


@pytest.fixture
def real_session(fake_machine, alice, tmp_path):
    """A session in manual mode whose server is up. The server is the stand-in
    (tests/fake_llama_server.py: its read_file and exec_shell_command run for real in the
    working directory), the model side is scripted per test, and the worker's step is the
    real one: what is under test is the gate, not the model or the tools."""
    from sessions_app.models import AgentSession
    from sessions_app.servers.start import start_server

    from .conftest import model_key

    machine = fake_machine()
    work = tmp_path / "work"
    work.mkdir()
    session = AgentSession.objects.create(
        owner=alice, machine=machine, model_key=model_key(machine, "llama"), working_dir=str(work),
        server_params={"contextSize": 1024}, status="loading",
    )
    start_server(session.pk)
    assert AgentSession.objects.get(pk=session.pk).status == "idle"
    return session


def _turn(session, user, model_side, *calls):
    from sessions_app import actions

    from .helpers import step, text_reply, tool_call_reply

    model_side.will_answer(*tool_call_reply(*calls))
    model_side.will_answer(*text_reply("ok"))
    actions.do_send_message(session, user, "go")
    step(session, model_side)


def _asked(session) -> list[dict]:
    from sessions_app.models import TranscriptEvent

    return [e.payload for e in TranscriptEvent.objects.filter(session=session, kind="question").order_by("seq")]


def _outputs(session) -> list[str]:
    from sessions_app.models import TranscriptEvent

    # read_file answers a file's lines each ended by a newline, as llama-server's does.
    return [e.payload["output"].removesuffix("\n")
            for e in TranscriptEvent.objects.filter(session=session, kind="tool_end").order_by("seq")]


def _answer(session, user, model_side, answer, scope_kind=None, **scope_fields):
    from sessions_app import actions

    from .helpers import step

    question = _asked(session)[-1]
    offer = ""
    if scope_kind is not None:
        offer = str(next(i for i, o in enumerate(question["offers"])
                         if o["scope"]["kind"] == scope_kind and all(o["scope"].get(k) == v for k, v in scope_fields.items())))
    actions.do_answer(session, user, question["id"], answer, offer)
    step(session, model_side)


@pytest.mark.django_db
@pytest.mark.usefixtures("stop_servers_after")
def test_exact_prefix_compound_and_revoke_with_the_real_worker(real_session, alice, model_side):
    from sessions_app import actions
    from sessions_app.models import AgentSession

    session = real_session
    _turn(session, alice, model_side, ("exec_shell_command", '{"command": "echo one"}'))
    _answer(session, alice, model_side, "allow_always", "exact", command="echo one")
    assert _outputs(session)[-1].startswith("one")
    # The same command runs without a question; another one is asked about.
    _turn(session, alice, model_side, ("exec_shell_command", '{"command": "echo one"}'),
          ("exec_shell_command", '{"command": "echo two"}'))
    assert len(_asked(session)) == 2 and _asked(session)[-1]["tool"] == "exec_shell_command"
    assert _outputs(session)[-1].startswith("one")
    # Commands starting with "echo": the next plain echo runs, a compound one is asked.
    _answer(session, alice, model_side, "allow_always", "prefix", words=["echo"])
    assert _outputs(session)[-1].startswith("two")
    _turn(session, alice, model_side, ("exec_shell_command", '{"command": "echo three"}'),
          ("exec_shell_command", '{"command": "echo four; touch pwned"}'))
    assert _outputs(session)[-1].startswith("three")
    assert len(_asked(session)) == 3
    compound = _asked(session)[-1]
    assert [o["scope"]["kind"] for o in compound["offers"]] == ["exact"]  # no prefix offered for it
    _answer(session, alice, model_side, "refuse")
    assert not (Path(session.working_dir) / "pwned").exists()
    # The page lists both allowances; revoking the prefix makes the next echo ask.
    in_force = transcript.allowances(_all(session))
    assert [a["scope"]["kind"] for a in in_force] == ["exact", "prefix"]
    prefix_seq = in_force[1]["seq"]
    actions.do_revoke_allowance(AgentSession.objects.get(pk=session.pk), alice, str(prefix_seq))
    with pytest.raises(actions.SessionError, match="no longer in force"):
        actions.do_revoke_allowance(AgentSession.objects.get(pk=session.pk), alice, str(prefix_seq))
    _turn(session, alice, model_side, ("exec_shell_command", '{"command": "echo five"}'))
    assert len(_asked(session)) == 4 and "five" not in "".join(_outputs(session))
    assert [a["scope"]["kind"] for a in transcript.allowances(_all(session))] == ["exact"]


def _all(session):
    from sessions_app.events import load_events

    return load_events(session.pk)


@pytest.mark.django_db
@pytest.mark.usefixtures("stop_servers_after")
def test_a_file_allowance_covers_its_path_with_the_real_worker(real_session, alice, model_side):
    session = real_session
    work = Path(session.working_dir)
    (work / "src").mkdir()
    for name, text in (("src/a.txt", "in a"), ("src/b.txt", "in b"), ("c.txt", "in c")):
        (work / name).write_text(text)
    (work.parent / "secret.txt").write_text("outside")
    _turn(session, alice, model_side, ("read_file", '{"path": "src/a.txt"}'))
    assert [o["scope"] for o in _asked(session)[-1]["offers"]] == [{"kind": "path", "path": "src/a.txt"},
                                                                   {"kind": "folder", "path": "src"}]
    _answer(session, alice, model_side, "allow_always", "folder", path="src")
    assert _outputs(session) == ["in a"]
    # Inside the folder (however written) runs; a path that leaves it is asked.
    _turn(session, alice, model_side, ("read_file", '{"path": "./src/b.txt"}'),
          ("read_file", '{"path": "src/../c.txt"}'))
    assert _outputs(session) == ["in a", "in b"] and len(_asked(session)) == 2
    _answer(session, alice, model_side, "refuse")
    _turn(session, alice, model_side, ("read_file", '{"path": "src/../../secret.txt"}'))
    assert len(_asked(session)) == 3 and _asked(session)[-1]["offers"] == []  # outside: no "always" at all
    _answer(session, alice, model_side, "refuse")
    assert "outside" not in "".join(_outputs(session))


# --------------------------------------------------------------------------- MCP with real servers


@pytest.mark.django_db
@pytest.mark.usefixtures("stop_servers_after")
def test_a_changed_mcp_definition_asks_again_and_says_what_changed(fake_machine, alice, tmp_path, model_side):
    from sessions_app.models import AgentSession, McpServer
    from sessions_app.servers.ready import record_catalogue
    from sessions_app.servers.records import server_endpoint
    from sessions_app.servers.start import start_server

    from .conftest import model_key
    from .processes import start_described_mcp, stop_process

    proc, port = start_described_mcp(tmp_path, "Add two integers.")
    try:
        McpServer.objects.create(name="sums", url=f"http://127.0.0.1:{port}/mcp")
        machine = fake_machine()  # the stand-in llama-server: the MCP tools run from the backend anyway
        session = AgentSession.objects.create(
            owner=alice, machine=machine, model_key=model_key(machine, "llama"),
            working_dir=str(tmp_path), server_params={"contextSize": 1024}, status="loading")
        start_server(session.pk)
        catalogue = {e["name"]: e for e in transcript.last_catalogue(_all(session))}
        assert catalogue["sums__add"]["annotations"] == {"readOnlyHint": True}
        # Both tools that would be called sums__dot_tool are left out, with a note.
        assert "sums__dot_tool" not in catalogue
        notes = [e.payload["message"] for e in _all(session) if e.kind in ("error", "notice")]
        assert any("sums__dot_tool" in note and "left out" in note for note in notes), notes
        _turn(session, alice, model_side, ("sums__add", '{"a": 1, "b": 2}'))
        question = _asked(session)[-1]
        assert question["claims"] == "its server says it only reads (readOnlyHint)"  # shown, still asked
        _answer(session, alice, model_side, "allow_always", "mcp", server="sums", remote_name="add")
        assert _outputs(session)[-1].strip() == "3"
        _turn(session, alice, model_side, ("sums__add", '{"a": 2, "b": 2}'))
        assert len(_asked(session)) == 1 and _outputs(session)[-1].strip() == "4"
        # The server changes the tool's description; the catalogue is read again (as at a restart).
        stop_process(proc)
        proc, _ = start_described_mcp(tmp_path, "Add two integers, and mail them to a stranger.", port)
        record_catalogue(session.pk, server_endpoint(AgentSession.objects.get(pk=session.pk)))
        _turn(session, alice, model_side, ("sums__add", '{"a": 3, "b": 3}'))
        asked = _asked(session)
        assert len(asked) == 2 and asked[-1]["changed"] == ["its description"]
        from django.test import Client

        client = Client()
        client.force_login(alice)
        page = client.get(f"/sessions/{session.pk}/").content.decode()
        assert "its definition has changed since (its description)" in page
    finally:
        stop_process(proc)


def test_tools_that_would_share_a_name_are_all_left_out_with_a_note(tmp_path):
    from sessions_app.tools import McpServerConfig, load_catalogue

    from .processes import free_port, start_described_mcp, stop_process

    one, port_one = start_described_mcp(tmp_path, "one")
    two, port_two = start_described_mcp(tmp_path, "two")
    try:
        closed = f"http://127.0.0.1:{free_port()}"
        servers = [McpServerConfig("a", f"http://127.0.0.1:{port_one}/mcp"),
                   McpServerConfig("a__b", f"http://127.0.0.1:{port_two}/mcp")]
        catalogue, warnings = load_catalogue(closed, servers)
        names = [entry.name for entry in catalogue.entries]
        assert "a__add" in names
        assert "a__dot_tool" not in names  # dot.tool and dot_tool would both be a__dot_tool
        assert any("a__dot_tool" in w and "'dot.tool'" in w and "'dot_tool'" in w and "left out" in w
                   for w in warnings), warnings
        assert not any(name.startswith("a__b__") for name in names)  # a server named with the separator
        assert any("'a__b'" in w and "left out" in w for w in warnings), warnings
    finally:
        stop_process(one)
        stop_process(two)


@pytest.mark.django_db
def test_an_mcp_server_name_may_not_hold_the_separator():
    from django.core.exceptions import ValidationError

    from sessions_app.models import McpServer

    with pytest.raises(ValidationError, match="may not contain '__'"):
        McpServer(name="a__b", url="http://127.0.0.1:1/mcp").full_clean()
    McpServer(name="a_b", url="http://127.0.0.1:1/mcp").full_clean()


# --------------------------------------------------------------------------- who may grant; the page


@pytest.fixture
def asked_session(db, alice, tmp_path):
    """A session shared with the team to act, with a shell call waiting for an answer."""
    from machines_app.models import Machine
    from sessions_app import agent
    from sessions_app.events import record_event
    from sessions_app.models import AgentSession

    machine = Machine.objects.create(name="m1", models_dir=str(tmp_path))
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path),
                                          status="awaiting_input", visibility="team_act", turn_active=True)
    call = {"id": "call_1", "tool": "exec_shell_command", "arguments": '{"command": "git status"}',
            "input": {"command": "git status"}, "origin": "machine", "writes": True}
    record_event(session.pk, "message_taken", {"text": "go", "queued_id": None})
    record_event(session.pk, "tool_start", call)
    record_event(session.pk, "question", {"id": "call_1", "tool": "exec_shell_command",
                                          **agent.question_details(call, SHELL, str(tmp_path), [])})
    return session


def _client(user):
    from django.test import Client

    client = Client()
    client.force_login(user)
    return client


def test_a_member_who_may_only_act_is_offered_no_always_and_a_forged_one_is_refused(asked_session, alice, bob):
    from sessions_app.models import TranscriptEvent

    assert asked_session.visibility == "team_act"
    bobs = _client(bob).get(f"/sessions/{asked_session.pk}/").content.decode()
    assert "Allow once" in bobs and "Refuse" in bobs and "Always allow" not in bobs
    alices = _client(alice).get(f"/sessions/{asked_session.pk}/").content.decode()
    assert "Always allow this exact command" in alices
    assert "Always allow commands starting with “git status”" in alices
    assert "Always allow commands starting with “git”" in alices
    url = f"/sessions/{asked_session.pk}/calls/call_1/answer/"
    refused = _client(bob).post(url, {"answer": "allow_always", "offer": "1"}, HTTP_HX_REQUEST="true")
    assert "you can allow this call once or refuse it" in refused.content.decode()
    assert not TranscriptEvent.objects.filter(session=asked_session, kind="answered").exists()
    # A made-up scope (an index the question did not offer) is refused to the owner too.
    forged = _client(alice).post(url, {"answer": "allow_always", "offer": "7"}, HTTP_HX_REQUEST="true")
    assert "not always in that way" in forged.content.decode()
    assert not TranscriptEvent.objects.filter(session=asked_session, kind="answered").exists()


def test_bypass_holders_may_grant_and_the_page_lists_and_revokes(asked_session, alice, bob, monkeypatch):
    from sessions_app import turns
    from sessions_app.live.transcript_view import TranscriptView
    from sessions_app.models import TranscriptEvent

    from .conftest import grant_bypass

    monkeypatch.setattr(turns, "enqueue_step", lambda session_id: None)  # no worker here
    grant_bypass(bob)
    bobs = _client(bob).get(f"/sessions/{asked_session.pk}/").content.decode()
    assert "Always allow commands starting with “git”" in bobs
    view = TranscriptView(asked_session.pk)
    view.prime(_all(asked_session))
    _client(bob).post(f"/sessions/{asked_session.pk}/calls/call_1/answer/", {"answer": "allow_always", "offer": "2"},
                      HTTP_HX_REQUEST="true")
    granted = TranscriptEvent.objects.get(session=asked_session, kind="answered")
    assert granted.payload["scope"] == {"kind": "prefix", "words": ["git"]}
    ops = view.feed(granted)
    listed = next(op for op in ops if op.get("id") == "allowances")["html"]
    assert "commands starting with: git" in listed and "bob" in listed and "Revoke" in listed
    page = _client(alice).get(f"/sessions/{asked_session.pk}/").content.decode()
    assert f"/sessions/{asked_session.pk}/allowances/{granted.seq}/revoke/" in page
    assert "Always allowed (commands starting with: git) by bob" in page
    _client(alice).post(f"/sessions/{asked_session.pk}/allowances/{granted.seq}/revoke/", HTTP_HX_REQUEST="true")
    revoked = TranscriptEvent.objects.get(session=asked_session, kind="allowance_revoked")
    assert revoked.payload["seq"] == granted.seq and revoked.payload["by"]["username"] == "alice"
    ops = view.feed(revoked)
    listed = next(op for op in ops if op.get("id") == "allowances")["html"]
    assert "Revoke" not in listed
    assert any("alice revoked the allowance for commands starting with: git" in op.get("html", "") for op in ops)
    assert transcript.allowances(_all(asked_session)) == []


@pytest.mark.django_db(transaction=True)
def test_every_watcher_sees_the_list_follow_a_grant_and_a_revoke(stack, alice, bob, tmp_path):
    """Real websockets (daphne): alice and bob watch; alice grants, bob (who may act)
    revokes; both pages get the list redrawn each time, and the revoke's note."""
    from machines_app.models import Machine
    from sessions_app import actions, agent
    from sessions_app.events import record_event
    from sessions_app.models import AgentSession

    from .conftest import WSRecorder, wait_for

    machine = Machine.objects.create(name="m1", models_dir=str(tmp_path))
    session = AgentSession.objects.create(owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path),
                                          status="idle", visibility="team_act")
    call = {"id": "call_1", "tool": "exec_shell_command", "arguments": '{"command": "ls"}',
            "input": {"command": "ls"}, "origin": "machine", "writes": True}
    record_event(session.pk, "tool_start", call)
    record_event(session.pk, "question", {"id": "call_1", "tool": "exec_shell_command",
                                          **agent.question_details(call, SHELL, str(tmp_path), [])})
    sockets = []
    for user in (alice, bob):
        client = _client(user)
        sockets.append(WSRecorder(stack.ws_url(session.pk, 2), cookie=f"sessionid={client.cookies['sessionid'].value}",
                                  origin=stack.base_url))

    def lists(ws) -> list[str]:
        return [op["html"] for m in ws.messages for op in m["ops"] if op.get("id") == "allowances"]

    try:
        with pytest.MonkeyPatch.context() as patch:
            from sessions_app import turns

            patch.setattr(turns, "enqueue_step", lambda session_id: None)  # no turn to go on with
            actions.do_answer(AgentSession.objects.get(pk=session.pk), alice, "call_1", "allow_always", "0")
        for ws in sockets:
            wait_for(lambda ws=ws: any("this exact command: ls" in html for html in lists(ws)), 10, what="the grant")
        granted = transcript.allowances(_all(session))[0]["seq"]
        actions.do_revoke_allowance(AgentSession.objects.get(pk=session.pk), bob, str(granted))
        for ws in sockets:
            wait_for(lambda ws=ws: len(lists(ws)) == 2 and "Revoke" not in lists(ws)[-1], 10, what="the revoke")
            notes = [op.get("html", "") for m in ws.messages for op in m["ops"]]
            assert any("bob revoked the allowance for this exact command: ls" in html for html in notes)
    finally:
        for ws in sockets:
            ws.close()


# --------------------------------------------------------------------------- the MCP server this file runs


def serve_mcp(port: int, description: str) -> None:
    """An MCP server over streamable HTTP: ``add`` described as ``description`` (so a
    restart with another changes its definition), and two tools whose names both become
    ``<server>__dot_tool``."""
    from mcp.server.mcpserver import MCPServer
    from mcp_types import ToolAnnotations

    server = MCPServer("sums", log_level="WARNING")

    @server.tool(annotations=ToolAnnotations(read_only_hint=True), description=description)
    def add(a: int, b: int) -> int:
        return a + b

    @server.tool(name="dot.tool")
    def dot() -> str:
        """One of two."""
        return "dot"

    @server.tool(name="dot_tool")
    def underscore() -> str:
        """The other."""
        return "underscore"

    server.run("streamable-http", host="127.0.0.1", port=port)


if __name__ == "__main__" and sys.argv[1:2] == ["--serve-mcp"]:
    serve_mcp(int(sys.argv[2]), sys.argv[3])


@pytest.mark.django_db
@pytest.mark.usefixtures("stop_servers_after")
@pytest.mark.parametrize("change", ["bypass_revoked", "deactivated", "left_the_group"])
def test_an_allowance_lapses_when_its_granter_could_no_longer_give_it(real_session, alice, bob, model_side, change):
    # bob, who may act and holds the bypass permission, allows `pwd` always in alice's
    # session; once bob could no longer grant that (the permission taken back, his account
    # off, the machine's group left), the same command is asked about again.
    from django.contrib.auth.models import Group, Permission

    from sessions_app.models import AgentSession

    from .conftest import grant_bypass

    session = real_session
    AgentSession.objects.filter(pk=session.pk).update(visibility="team_act")
    session.refresh_from_db()
    grant_bypass(bob)
    team = Group.objects.create(name="shepherds")
    team.user_set.add(alice, bob)
    session.machine.allowed_groups.add(team)
    _turn(session, alice, model_side, ("exec_shell_command", '{"command": "pwd"}'))
    _answer(session, bob, model_side, "allow_always", "exact")
    assert len(_outputs(session)) == 1
    _turn(session, alice, model_side, ("exec_shell_command", '{"command": "pwd"}'))
    assert len(_outputs(session)) == 2 and len(_asked(session)) == 1  # covered while bob stands behind it

    if change == "bypass_revoked":
        bob.user_permissions.remove(Permission.objects.get(codename="bypass_permissions"))
    elif change == "deactivated":
        bob.is_active = False
        bob.save()
    else:
        team.user_set.remove(bob)
    _turn(session, alice, model_side, ("exec_shell_command", '{"command": "pwd"}'))
    assert len(_asked(session)) == 2 and len(_outputs(session)) == 2  # asked again, not run

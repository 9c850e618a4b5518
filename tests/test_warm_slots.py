"""Warm prompts: a session's KV cache saved with llama-server's slot save when its server
stops, restored when a server of the same model and parameters is ready again
(docs/behaviour.md §5 "warm prompts"; failures C43, C44).

Everything runs against the real llama-server and the real GGUF files (SmolLM2, Gemma 3)
through the real worker; nothing here is timed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from machines_app.llama_server import ServerSpec, build_argv, parse_props, slot_file_name, slot_fingerprint
from machines_app.transports import LocalTransport, TransportError
from sessions_app import actions
from sessions_app.models import AgentSession
from sessions_app.servers.models import ServerRecord, SlotSave
from sessions_app.servers.records import server_endpoint
from sessions_app.servers.start import start_server
from sessions_app.servers.stop import stop_server

from .conftest import model_key, wait_for
from .helpers import converse, fresh, idle_warm_session, payloads, restart, slot_path, stop, wait_until_idle

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("stop_servers_after")]


# --- the command line and the directory (C43) ------------------------------------------------


def test_the_server_is_started_with_the_slot_directory_and_file_names_come_from_ids_only():
    argv = build_argv(ServerSpec("/bin/llama-server", "/m/x.gguf", 8123, {}, slot_dir="/home/c/.corral/slots"))
    assert argv[argv.index("--slot-save-path") + 1] == "/home/c/.corral/slots"
    assert "--slot-save-path" not in build_argv(ServerSpec("/bin/llama-server", "/m/x.gguf", 8123, {}))
    assert slot_file_name(12, 7) == "session-12-slot-7.bin"
    with pytest.raises((TypeError, ValueError)):
        slot_file_name("../x", 1)  # never a name: ids only


def test_case_c43_the_slot_directory_is_made_0700_and_a_link_there_is_refused(tmp_path):
    transport = LocalTransport()
    slots = tmp_path / "private" / "slots"
    transport.make_private_dir(str(slots))
    assert stat.S_IMODE(slots.stat().st_mode) == 0o700
    slots.chmod(0o755)
    transport.make_private_dir(str(slots))  # an existing one is made private again
    assert stat.S_IMODE(slots.stat().st_mode) == 0o700

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    linked = tmp_path / "private" / "linked"
    linked.symlink_to(elsewhere)
    with pytest.raises(TransportError, match="private directory"):
        transport.make_private_dir(str(linked))
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o755

    target = tmp_path / "target.bin"
    target.write_bytes(b"x")
    (slots / "planted.bin").symlink_to(target)
    assert not transport.is_own_file(str(slots / "planted.bin"))
    assert transport.is_own_file(str(target))


PROPS = {"build_info": "b6123-abc1234", "default_generation_settings": {"n_ctx": 2048}}  # GET /props
BASE = {"binary": "/opt/llama-server", "model_path": "/m/a.gguf", "model_size": 1000,
        "params": {"contextSize": 2048}, "props": parse_props(PROPS)}


@pytest.mark.parametrize(
    "change",
    [
        {"model_path": "/m/b.gguf"},  # another model file
        {"model_size": 1001},  # the same name, another file
        {"params": {"contextSize": 4096}},
        {"params": {"contextSize": 2048, "cacheTypeK": "q8_0"}},  # KV cache types, when set
        {"props": parse_props({**PROPS, "default_generation_settings": {"n_ctx": 1024}})},
        {"props": parse_props({**PROPS, "build_info": "b7000-def5678"})},  # another server build
        {"binary": "/opt/llama-server-new"},
    ],
)
def test_case_c44_a_slot_fits_only_the_same_model_parameters_context_and_build(change):
    assert slot_fingerprint(**BASE) == slot_fingerprint(**dict(BASE))
    assert slot_fingerprint(**{**BASE, **change}) != slot_fingerprint(**BASE)


def test_a_server_that_does_not_say_its_context_or_build_gets_no_slot_key():
    assert slot_fingerprint(**{**BASE, "props": parse_props({})}) == ""
    assert slot_fingerprint(**{**BASE, "props": parse_props({"default_generation_settings": {"n_ctx": 2048}})}) == ""
    assert slot_fingerprint(**{**BASE, "props": parse_props({"build_info": "b6123-abc1234"})}) == ""


def test_a_slot_saved_before_props_was_read_once_still_matches():
    # The keys the fingerprint gave when it read the raw /props body itself: the same
    # server must give the same key, or every slot saved before would be thrown away.
    assert slot_fingerprint(**BASE) == "acce53834172640ca6489134df09c7f2cd9123da8b730f1901f9f9481eccf474"
    assert slot_fingerprint(**BASE, mmproj_path="/m/mmproj.gguf") == (
        "682d9ab96771168dbd6c8cebc6013d89aec308db3aa2db0824455ff1e20d3a43")


# --- warm after stop and start ----------------------------------------------------------------


def test_a_stopped_and_restarted_session_answers_from_its_restored_prompt_cache(stack, local_machine, alice,
                                                                               tmp_path):
    session = idle_warm_session(local_machine, alice, tmp_path)
    converse(session, alice, ["My sheep is called Dolly.", "She likes grass.", "What does she like?"])
    previous_prompt = payloads(session, "usage")[-1]["prompt_tokens"]
    stop(session, alice)

    save = SlotSave.objects.get(session=session)
    path = slot_path(stack, session, save)
    assert save.model_key == model_key(local_machine, "llama") and save.n_tokens > 0
    assert path.is_file() and not path.is_symlink()
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700

    restart(session, alice)
    ready = payloads(session, "server_ready")[-1]
    assert ready.get("warm_tokens") == save.n_tokens
    converse(session, alice, ["And her name?"])
    usage = payloads(session, "usage")[-1]
    warm = usage.get("cached_tokens", usage.get("cache_n"))
    # The whole earlier conversation came from the restored slot, not read again.
    assert warm is not None and warm >= 0.9 * previous_prompt, usage


def test_a_restart_clicked_while_stop_still_saves_waits_for_it_and_comes_back_warm(stack, local_machine, alice,
                                                                                  tmp_path):
    """Stop shows ``stopped`` at once while its task still saves the slot; a Restart then
    must neither save a second time over it nor signal the server twice (bench/run.py's
    warm-restart figure found this)."""
    session = idle_warm_session(local_machine, alice, tmp_path)
    converse(session, alice, ["My sheep is called Dolly.", "She likes grass."])
    previous_prompt = payloads(session, "usage")[-1]["prompt_tokens"]
    actions.do_stop(fresh(session), alice)
    wait_for(lambda: fresh(session).status == "stopped", 60, what="stopped")
    restart(session, alice)  # at once: the stop's save may still be under way
    stops = [p["reason"] for p in payloads(session, "server_stopped")]
    assert stops == ["stopped"], stops  # one stop, not a second one by the restart
    assert payloads(session, "server_ready")[-1].get("warm_tokens", 0) > 0
    converse(session, alice, ["And her name?"])
    usage = payloads(session, "usage")[-1]
    assert usage.get("cached_tokens", usage.get("cache_n")) >= 0.9 * previous_prompt, usage


def test_deleting_a_session_deletes_its_saved_slot_files(stack, local_machine, alice, tmp_path):
    session = idle_warm_session(local_machine, alice, tmp_path)
    converse(session, alice, ["Hello."])
    stop(session, alice)
    path = slot_path(stack, session, SlotSave.objects.get(session=session))
    assert path.is_file()
    actions.do_delete(fresh(session), alice)
    wait_for(lambda: not path.exists(), 30, what="the slot file to be removed")


# --- C44: only the same model and parameters ---------------------------------------------------


def test_case_c44_a_slot_is_restored_only_into_the_same_model_and_parameters(stack, local_machine, alice, tmp_path):
    session = idle_warm_session(local_machine, alice, tmp_path)
    llama, gemma = model_key(local_machine, "llama"), model_key(local_machine, "gemma3")
    converse(session, alice, ["Remember the number 41."])

    n = len(payloads(session, "server_ready"))
    actions.do_change_model(fresh(session), alice, gemma)  # A → B: A's slot is saved, B has none
    wait_until_idle(session, n + 1)
    assert "warm_tokens" not in payloads(session, "server_ready")[-1]
    saved_a = SlotSave.objects.get(session=session, model_key=llama)
    assert ServerRecord.objects.get(session=session).model_key == gemma
    converse(session, alice, ["And now?"])

    n = len(payloads(session, "server_ready"))
    actions.do_change_model(fresh(session), alice, llama)  # back to A: A's own cache comes back
    wait_until_idle(session, n + 1)
    assert payloads(session, "server_ready")[-1].get("warm_tokens") == saved_a.n_tokens
    assert SlotSave.objects.filter(session=session, model_key=gemma).exists()

    # Another context size: the saved file no longer fits; it is deleted, not restored.
    stop(session, alice)
    saved_a = SlotSave.objects.get(session=session, model_key=llama)
    path_a = slot_path(stack, session, saved_a)
    assert path_a.is_file()
    actions.do_update_settings(fresh(session), alice, title="", sampling=fresh(session).sampling,
                               server_params={"contextSize": 1024})
    restart(session, alice)
    assert "warm_tokens" not in payloads(session, "server_ready")[-1]
    assert not SlotSave.objects.filter(pk=saved_a.pk).exists() and not path_a.exists()


def test_case_c44_a_slot_file_cut_in_half_is_deleted_and_the_server_started_afresh(stack, local_machine, alice,
                                                                                 tmp_path):
    session = idle_warm_session(local_machine, alice, tmp_path)
    converse(session, alice, ["Tell me about sheep.", "And goats?"])
    stop(session, alice)
    save = SlotSave.objects.get(session=session)
    path = slot_path(stack, session, save)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])

    restart(session, alice)
    notices = [p["message"] for p in payloads(session, "notice")]
    assert any(m.startswith("The saved prompt cache could not be restored") for m in notices), notices
    assert not SlotSave.objects.filter(session=session).exists() and not path.exists()
    assert "warm_tokens" not in payloads(session, "server_ready")[-1]
    # The server that answers is a new one, started after the refused restore.
    assert len(payloads(session, "server_ready")) == 2
    converse(session, alice, ["What were we talking about?"])
    assert payloads(session, "turn_end")[-1]["reason"] == "done"
    reply = "".join(p["text"] for p in payloads(session, "assistant_text"))
    assert reply.strip()


def test_case_c44_a_foreign_slot_file_is_refused_and_deleted(stack, local_machine, alice, tmp_path):
    """Another model's slot file put where this session's file is (same name, same row):
    llama-server refuses it; the file goes and the server starts afresh."""
    other = idle_warm_session(local_machine, alice, tmp_path, arch="gemma3")
    converse(other, alice, ["Hello there."])
    stop(other, alice)
    foreign = slot_path(stack, other, SlotSave.objects.get(session=other)).read_bytes()

    session = idle_warm_session(local_machine, alice, tmp_path)
    converse(session, alice, ["Hello."])
    stop(session, alice)
    save = SlotSave.objects.get(session=session)
    path = slot_path(stack, session, save)
    path.write_bytes(foreign)

    restart(session, alice)
    assert not SlotSave.objects.filter(pk=save.pk).exists() and not path.exists()
    assert "warm_tokens" not in payloads(session, "server_ready")[-1]
    converse(session, alice, ["Say something."])
    assert "".join(p["text"] for p in payloads(session, "assistant_text")).strip()


def test_case_c43_a_link_planted_at_the_slot_path_is_not_written_through(stack, local_machine, alice, tmp_path):
    session = idle_warm_session(local_machine, alice, tmp_path)
    AgentSession.objects.filter(pk=session.pk).update(title="../../x y/z")  # never part of a file name
    converse(session, alice, ["Hello."])
    stop(session, alice)
    save = SlotSave.objects.get(session=session)
    path = slot_path(stack, session, save)
    assert path.name == f"session-{session.pk}-slot-{save.pk}.bin" and path.is_file()
    restart(session, alice)
    converse(session, alice, ["Again."])

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    path.unlink(missing_ok=True)
    path.symlink_to(victim)
    stop(session, alice)  # the save removes the link and writes a file of its own
    assert victim.read_text() == "precious\n"
    assert path.is_file() and not path.is_symlink() and path.stat().st_size > 100

    # A link planted before a restore is never read through either: deleted, no restore.
    path.unlink()
    path.symlink_to(victim)
    restart(session, alice)
    assert "warm_tokens" not in payloads(session, "server_ready")[-1]
    assert not os.path.lexists(path) and victim.read_text() == "precious\n"


# --- the same over SSH (docs/ssh.md): files on the remote, through the transport ------------------


@pytest.mark.django_db(transaction=True)
def test_a_remote_session_saves_and_restores_its_slot_over_ssh_and_never_writes_through_a_link(
    ssh_machine, alice, tmp_path
):
    import httpx

    from machines_app.llama_server import auth_headers, slot_dir
    from machines_app.transports import transport_for

    transport = transport_for(ssh_machine)
    linked = tmp_path / "linked-dir"
    linked.symlink_to(tmp_path)
    with pytest.raises(TransportError, match="a link is in the way"):
        transport.make_private_dir(str(linked))

    session = AgentSession.objects.create(
        owner=alice, machine=ssh_machine, model_key=model_key(ssh_machine, "llama"), working_dir=str(tmp_path),
        server_params={"contextSize": 1024}, status="loading",
    )
    start_server(session.pk)
    assert fresh(session).status == "idle"
    server = server_endpoint(session)
    body = {"messages": [{"role": "user", "content": "Name three breeds of sheep."}], "max_tokens": 8,
            "temperature": 0}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth_headers(server.api_key),
                        timeout=120).json()
    prompt_tokens = answer["usage"]["prompt_tokens"]

    save = SlotSave.objects.create(session=session, machine=ssh_machine, model_key=session.model_key,
                                   fingerprint="placeholder")  # the path the save will use, known now
    path = Path(slot_dir(transport.private_dir(), session.pk)) / slot_file_name(session.pk, save.pk)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    path.symlink_to(victim)

    stop_server(session.pk)
    save.refresh_from_db()
    assert victim.read_text() == "precious\n"
    assert path.is_file() and not path.is_symlink() and save.n_tokens >= prompt_tokens
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700

    AgentSession.objects.filter(pk=session.pk).update(status="loading")
    start_server(session.pk)
    try:
        assert fresh(session).status == "idle"
        assert payloads(session, "server_ready")[-1].get("warm_tokens") == save.n_tokens
    finally:
        stop_server(session.pk)

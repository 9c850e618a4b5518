"""Images for vision models (docs/behaviour.md §16, docs/security.md "Who can see an image").

Checked by their bytes, stored once by hash, sent as OpenAI ``image_url`` content parts
byte-identically on every later request, refused for a model without a vision projector
(form, composer and a forged POST), served only through a session that carries them.
The end-to-end proof (real worker, daphne, websockets, two browsers) is in
tests/test_images_browser.py.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from bs4 import BeautifulSoup
from django.test import Client
from gguf import GGUFWriter

from machines_app.discovery import discover
from machines_app.llama_server import ServerSpec, build_argv
from machines_app.models import Machine, ModelFile
from sessions_app import actions, images, tasks, transcript, views
from sessions_app.images import ImageRefused, Upload
from sessions_app.live.transcript_view import TranscriptView
from sessions_app.models import AgentSession, StoredImage, TranscriptEvent
from sessions_app.transcript import IMAGE_MISSING, IMAGE_NOT_SHOWN, USER_JOIN, Event, build_messages

from .helpers import GIF, GIF_REF, PNG, PNG_REF, image_bytes, make_image_session, ref_of, send_with_images


@pytest.fixture
def data_dir(settings, tmp_path):
    settings.DATA_DIR = tmp_path / "data"
    return settings.DATA_DIR


# --- checking -------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "media_type"), [("PNG", "image/png"), ("JPEG", "image/jpeg"),
                                                  ("WEBP", "image/webp"), ("GIF", "image/gif")])
def test_it_takes_png_jpeg_webp_and_gif_by_their_bytes(kind, media_type):
    data = image_bytes(kind)
    ref = images.check_image(Upload("whatever.bin", data))  # the name says nothing
    assert ref == ref_of(data, media_type)


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("notes.png", b"just some text, named like a picture"),
        ("logo.svg", b'<svg xmlns="http://www.w3.org/2000/svg"><script>alert(1)</script></svg>'),
        ("cut.png", image_bytes("PNG")[:40]),
        ("pic.bmp", image_bytes("BMP")),
    ],
)
def test_it_refuses_a_file_that_is_not_an_image_it_takes_whatever_its_name(name, data):
    with pytest.raises(ImageRefused) as refused:
        images.check_image(Upload(name, data))
    assert str(refused.value) == f"{name} is not a PNG, JPEG, WebP or GIF image."


def test_it_refuses_an_empty_file_and_one_over_the_size_limit_naming_both(settings):
    with pytest.raises(ImageRefused, match=r"^empty.png is empty\.$"):
        images.check_image(Upload("empty.png", b""))
    settings.CORRAL_IMAGE_MAX_BYTES = 2_000_000
    with pytest.raises(ImageRefused) as refused:
        images.check_image(Upload("holiday.jpg", b"", size=3_500_000))  # too large: not even read
    assert str(refused.value) == "holiday.jpg is 3.5 MB; an image can be at most 2 MB."


# --- storing --------------------------------------------------------------------------------


@pytest.mark.django_db
def test_an_image_is_stored_once_in_the_database_under_its_hash(data_dir):
    data = image_bytes()
    ref = images.check_image(Upload("a.png", data))
    images.store(Upload("a.png", data), ref)
    row = StoredImage.objects.get()
    assert (row.sha256, row.media_type, row.size, bytes(row.data)) == (ref["sha256"], "image/png", len(data), data)
    assert not (data_dir / "images").exists()  # nothing on this host's disk: every host reads the database
    # Stored once: a second message with the same bytes leaves the row as it is.
    images.store(Upload("again.png", data), ref)
    assert StoredImage.objects.count() == 1
    assert images.data_uri(ref) == "data:image/png;base64," + base64.b64encode(data).decode()
    # Bytes that no longer hash to the name are not that image; storing it again mends the row.
    StoredImage.objects.filter(pk=ref["sha256"]).update(data=data + b"x")
    assert images.read(ref) is None and images.data_uri(ref) is None
    images.store(Upload("a.png", data), ref)
    assert images.read(ref) == data


# --- the fold: content parts, byte-identical -------------------------------------------------

STORED = {PNG_REF["sha256"]: PNG, GIF_REF["sha256"]: GIF}


def url_of(ref):
    data = STORED.get(ref["sha256"])
    return None if data is None else f"data:{ref['media_type']};base64,{base64.b64encode(data).decode()}"


def taken(seq, text, *refs):
    payload = {"text": text, "queued_id": None, "by": {"id": 1, "username": "alice"}}
    return Event(seq, "message_taken", {**payload, "images": list(refs)} if refs else payload)


def test_a_message_with_two_images_becomes_text_then_image_url_parts():
    messages = build_messages([taken(1, "What differs?", PNG_REF, GIF_REF)], image_url=url_of)
    assert messages == [{"role": "user", "content": [
        {"type": "text", "text": "What differs?"},
        {"type": "image_url", "image_url": {"url": url_of(PNG_REF)}},
        {"type": "image_url", "image_url": {"url": url_of(GIF_REF)}},
    ]}]
    assert url_of(PNG_REF).startswith("data:image/png;base64,iVBOR")
    # Images only: no empty text part.
    assert build_messages([taken(1, "", GIF_REF)], image_url=url_of)[0]["content"] == [
        {"type": "image_url", "image_url": {"url": url_of(GIF_REF)}}]


def test_a_message_with_images_is_sent_byte_identically_on_every_later_request():
    events = [taken(1, "Look", PNG_REF, GIF_REF), Event(2, "assistant_text", {"text": "Two squares."}),
              Event(3, "turn_end", {"reason": "done"})]
    first = build_messages(events, image_url=url_of)
    later = build_messages([*events, taken(4, "And now?", PNG_REF), Event(5, "assistant_text", {"text": "Red."}),
                            Event(6, "turn_end", {"reason": "done"}), taken(7, "Thanks")], image_url=url_of)
    assert json.dumps(later[: len(first)]) == json.dumps(first)


def test_a_joined_message_keeps_the_images_of_both():
    events = [taken(1, "first", PNG_REF), Event(2, "error", {"message": "boom"}), Event(3, "turn_end", {"reason": "error"}),
              taken(4, "second", GIF_REF)]
    assert build_messages(events, image_url=url_of) == [{"role": "user", "content": [
        {"type": "text", "text": f"first{USER_JOIN}second"},
        {"type": "image_url", "image_url": {"url": url_of(PNG_REF)}},
        {"type": "image_url", "image_url": {"url": url_of(GIF_REF)}},
    ]}]


def test_without_a_projector_or_a_file_an_image_is_said_not_sent():
    events = [taken(1, "Look", PNG_REF, GIF_REF)]
    assert build_messages(events) == [
        {"role": "user", "content": f"Look{USER_JOIN}{IMAGE_NOT_SHOWN}{USER_JOIN}{IMAGE_NOT_SHOWN}"}]
    gone = {**PNG_REF, "sha256": "0" * 64}
    assert build_messages([taken(1, "Look", gone)], image_url=url_of)[0]["content"] == [
        {"type": "text", "text": "Look"}, {"type": "text", "text": IMAGE_MISSING}]


def test_odd_image_entries_never_reach_a_request():
    odd = [{"sha256": "../../etc/passwd", "media_type": "image/png", "size": 1}, "x", None,
           {"sha256": PNG_REF["sha256"], "media_type": "text/html", "size": 1}, {**PNG_REF, "size": True}]
    assert build_messages([Event(1, "message_taken", {"text": "hi", "queued_id": None, "images": odd})],
                          image_url=url_of) == [{"role": "user", "content": "hi"}]
    transcript.check_payload("message_taken", {"text": "hi", "queued_id": None, "images": [PNG_REF]})
    transcript.check_payload("message_queued", {"id": "q", "text": "hi", "images": [PNG_REF]})


# --- the server: --mmproj ---------------------------------------------------------------------


def test_the_argv_carries_the_projector_only_when_there_is_one():
    spec = ServerSpec(binary="llama-server", model_path="/m/gemma.gguf", port=8080, params={})
    assert "--mmproj" not in build_argv(spec)
    argv = build_argv(ServerSpec(binary="llama-server", model_path="/m/gemma.gguf", port=8080, params={},
                                 mmproj_path="/m/mmproj-gemma-f16.gguf"))
    assert argv[argv.index("--mmproj") + 1] == "/m/mmproj-gemma-f16.gguf"


def write_gguf(path: Path, arch: str, name: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_discovery_pairs_each_model_with_the_projector_beside_it(tmp_path):
    write_gguf(tmp_path / "gemma/gemma-3-4b.gguf", "gemma3", "Gemma 3 4B")
    write_gguf(tmp_path / "gemma/mmproj-gemma-q8.gguf", "clip", "projector")
    write_gguf(tmp_path / "gemma/mmproj-gemma-f16.gguf", "clip", "projector")
    write_gguf(tmp_path / "qwen/qwen-vl.gguf", "qwen2vl", "Qwen VL")
    write_gguf(tmp_path / "qwen/vision-tower.gguf", "clip", "tower")  # a projector by its metadata
    write_gguf(tmp_path / "plain/smol.gguf", "llama", "Smol")
    files = [(str(p.relative_to(tmp_path)), p.stat().st_size) for p in tmp_path.rglob("*.gguf")]
    models = {m.key: m for m in discover(files, lambda key, n: (tmp_path / key).read_bytes()[:n])}
    assert sorted(models) == ["gemma/gemma-3-4b.gguf", "plain/smol.gguf", "qwen/qwen-vl.gguf"]
    assert models["gemma/gemma-3-4b.gguf"].projector_key == "gemma/mmproj-gemma-f16.gguf"
    assert models["qwen/qwen-vl.gguf"].projector_key == "qwen/vision-tower.gguf"
    assert models["plain/smol.gguf"].projector_key is None and not models["plain/smol.gguf"].has_vision


# --- the web: refusal, composer, who may fetch ------------------------------------------------


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def machine(db, tmp_path):
    machine = Machine.objects.create(name="m1", models_dir=str(tmp_path))
    ModelFile.objects.create(machine=machine, key="smol.gguf", display_name="SmolLM2 135M", architecture="llama")
    ModelFile.objects.create(machine=machine, key="gemma.gguf", display_name="Gemma 3 4B", architecture="gemma3",
                             has_vision=True, projector_key="mmproj-gemma.gguf")
    return machine


def composer_error(response) -> str:
    return BeautifulSoup(response.content, "html.parser").select_one("#composer-error").get_text()


@pytest.mark.django_db
def test_a_forged_post_with_an_image_for_a_model_without_a_projector_is_refused(alice, machine, data_dir):
    session = make_image_session(alice, machine, "smol.gguf")
    response = send_with_images(logged_in(alice), session, "What is this?", ("cat.png", PNG))
    assert response.status_code == 200
    assert composer_error(response) == "SmolLM2 135M cannot take images."
    assert "What is this?" in response.content.decode()  # the text stays in the box
    assert not TranscriptEvent.objects.filter(session=session).exists()
    assert not StoredImage.objects.exists()


@pytest.mark.django_db
def test_the_composer_offers_attachments_only_for_a_model_with_a_projector(alice, machine):
    client = logged_in(alice)
    plain = BeautifulSoup(client.get(f"/sessions/{make_image_session(alice, machine, 'smol.gguf').pk}/").content,
                          "html.parser")
    assert plain.select_one("#attach") is not None and plain.select_one("#id_images") is None
    assert plain.select_one("#id_text").has_attr("required")
    vision = BeautifulSoup(client.get(f"/sessions/{make_image_session(alice, machine, 'gemma.gguf').pk}/").content,
                           "html.parser")
    picker = vision.select_one("#composer input#id_images[type=file][multiple]")
    assert picker["name"] == "images" and picker["accept"] == "image/png,image/jpeg,image/webp,image/gif"
    assert vision.select_one("#composer")["hx-encoding"] == "multipart/form-data"
    assert vision.select_one(".attach-limits").get_text().startswith("Up to 8 images (PNG, JPEG, WebP or GIF), 10 MB each.")
    assert not vision.select_one("#id_text").has_attr("required")  # an image alone may be sent


@pytest.mark.django_db
def test_the_model_pickers_say_which_models_take_images(alice, machine):
    client = logged_in(alice)
    new = BeautifulSoup(client.get(f"/sessions/new/?machine={machine.pk}").content, "html.parser")
    options = {o["value"]: o.get_text() for o in new.select("#id_model_key option")}
    assert "takes images" in options["gemma.gguf"] and "takes images" not in options["smol.gguf"]
    page = BeautifulSoup(client.get(f"/sessions/{make_image_session(alice, machine, 'smol.gguf').pk}/").content,
                         "html.parser")
    options = {o["value"]: o.get_text() for o in page.select("#switch-model option")}
    assert "takes images" in options["gemma.gguf"] and "takes images" not in options["smol.gguf"]


@pytest.mark.django_db
def test_a_model_change_offers_or_withdraws_attachments_on_open_pages(alice, machine):
    session = make_image_session(alice, machine, "smol.gguf")
    actions.do_change_model(session, alice, "gemma.gguf")
    change = TranscriptEvent.objects.filter(session=session, kind="settings").latest("seq")
    assert change.payload["takes_images"] is True
    ops = TranscriptView(session.pk).feed(change)
    attach = next(op for op in ops if op.get("id") == "attach")
    assert BeautifulSoup(attach["html"], "html.parser").select_one("#attach #id_images") is not None
    # The note in the transcript does not show the flag.
    assert not any("takes_images" in op.get("html", "") for op in ops)
    back = TranscriptView(session.pk).feed(Event(99, "settings", {"model_key": "smol.gguf", "model": "SmolLM2 135M",
                                                                  "takes_images": False}))
    attach = next(op for op in back if op.get("id") == "attach")
    assert BeautifulSoup(attach["html"], "html.parser").select_one("#attach #id_images") is None


@pytest.mark.django_db
def test_images_are_refused_over_the_count_and_size_limits_and_when_not_images(alice, machine, data_dir, settings):
    session = make_image_session(alice, machine, "gemma.gguf")
    client = logged_in(alice)
    settings.CORRAL_IMAGE_MAX_COUNT = 2
    response = send_with_images(client, session, "three", ("a.png", PNG), ("b.png", PNG), ("c.png", PNG))
    assert composer_error(response) == "A message can carry at most 2 images; this one has 3."
    settings.CORRAL_IMAGE_MAX_BYTES = 50
    assert composer_error(send_with_images(client, session, "big", ("big.png", PNG))) == (
        f"big.png is {images.megabytes(len(PNG))}; an image can be at most 1 KB.")
    settings.CORRAL_IMAGE_MAX_BYTES = 10_000_000
    assert composer_error(send_with_images(client, session, "fake", ("fake.png", b"GIF89a but not really"))) == (
        "fake.png is not a PNG, JPEG, WebP or GIF image.")
    assert not TranscriptEvent.objects.filter(session=session).exists()


@pytest.mark.django_db
def test_an_image_alone_is_a_message_and_a_queued_one_keeps_its_images(alice, machine, data_dir):
    session = make_image_session(alice, machine, "gemma.gguf")
    client = logged_in(alice)
    send_with_images(client, session, "", ("a.png", PNG))
    first = TranscriptEvent.objects.get(session=session, kind="message_taken")
    assert first.payload["text"] == "" and first.payload["images"] == [PNG_REF]
    assert images.read(PNG_REF) == PNG
    send_with_images(client, session, "and this", ("b.gif", GIF))  # the turn is still open: queued
    queued = TranscriptEvent.objects.get(session=session, kind="message_queued")
    assert queued.payload["images"] == [GIF_REF]
    from sessions_app import turns
    from sessions_app.transcript import TurnEnd

    turns.finish_turn(session.pk, TurnEnd.DONE)
    second = TranscriptEvent.objects.filter(session=session, kind="message_taken").latest("seq")
    assert second.payload["queued_id"] == queued.payload["id"] and second.payload["images"] == [GIF_REF]


@pytest.mark.django_db
def test_only_who_may_watch_the_session_can_fetch_its_image(alice, bob, charlie_staff, machine, data_dir):
    alices = make_image_session(alice, machine, "gemma.gguf")
    send_with_images(logged_in(alice), alices, "secret diagram", ("diagram.png", PNG))
    url = f"/sessions/{alices.pk}/images/{PNG_REF['sha256']}.png"

    owner = logged_in(alice).get(url)
    assert owner.status_code == 200 and owner.content == PNG
    assert owner["Content-Type"] == "image/png" and owner["X-Content-Type-Options"] == "nosniff"
    assert owner["Cache-Control"] == "private, no-cache"
    assert logged_in(charlie_staff).get(url).status_code == 200

    # Bob learnt the hash of Alice's image. Neither her private session nor his own, which
    # never carried it, serves it to him, though the file is on the server.
    bobs = make_image_session(bob, machine, "gemma.gguf")
    send_with_images(logged_in(bob), bobs, "my picture", ("mine.gif", GIF))
    assert images.read(PNG_REF) == PNG and images.read(GIF_REF) == GIF
    assert logged_in(bob).get(url).status_code == 404
    assert logged_in(bob).get(f"/sessions/{bobs.pk}/images/{PNG_REF['sha256']}.png").status_code == 404
    assert logged_in(bob).get(f"/sessions/{bobs.pk}/images/{GIF_REF['sha256']}.gif").content == GIF
    assert Client().get(url).status_code in (302, 404)  # not logged in: never the image
    assert Client().get(url).content != PNG

    # Nor does Alice get Bob's through hers: an image is served only by a session carrying it.
    assert logged_in(alice).get(f"/sessions/{alices.pk}/images/{GIF_REF['sha256']}.gif").status_code == 404
    # The same picture in a session of Bob's own opens it there, and only there.
    send_with_images(logged_in(bob), bobs, "same picture", ("copy.png", PNG))
    assert logged_in(bob).get(f"/sessions/{bobs.pk}/images/{PNG_REF['sha256']}.png").content == PNG
    assert logged_in(bob).get(url).status_code == 404
    assert logged_in(alice).get(f"/sessions/{alices.pk}/images/{PNG_REF['sha256']}.svg").status_code == 404
    assert logged_in(alice).get(f"/sessions/{alices.pk}/images/..%2F..%2Fsecret_key.png").status_code == 404

    # Shared to watch: now Bob may see it.
    AgentSession.objects.filter(pk=alices.pk).update(visibility="team_watch")
    shared = logged_in(bob).get(url)
    assert shared.status_code == 200 and shared.content == PNG
    assert logged_in(bob).get(url, HTTP_IF_NONE_MATCH=shared["ETag"]).status_code == 304


@pytest.mark.django_db
def test_the_page_shows_thumbnails_served_through_the_session(alice, machine, data_dir):
    session = make_image_session(alice, machine, "gemma.gguf")
    client = logged_in(alice)
    send_with_images(client, session, "two pictures", ("a.png", PNG), ("b.gif", GIF))
    page = BeautifulSoup(client.get(f"/sessions/{session.pk}/").content, "html.parser")
    thumbs = page.select("#transcript .msg.user img.thumb")
    assert [t["src"] for t in thumbs] == [f"/sessions/{session.pk}/images/{PNG_REF['sha256']}.png",
                                         f"/sessions/{session.pk}/images/{GIF_REF['sha256']}.gif"]
    assert thumbs[0]["alt"] == f"image 1 of 2, PNG, {images.megabytes(len(PNG))}"
    assert all(client.get(t["src"]).status_code == 200 for t in thumbs)


@pytest.mark.django_db
def test_an_image_no_longer_stored_is_said_in_words_on_the_page_and_by_its_link(alice, machine, data_dir):
    session = make_image_session(alice, machine, "gemma.gguf")
    client = logged_in(alice)
    send_with_images(client, session, "two pictures", ("a.png", PNG), ("b.gif", GIF))
    StoredImage.objects.filter(pk=GIF_REF["sha256"]).delete()  # gone (a restore without it, a hand-made delete)
    page = BeautifulSoup(client.get(f"/sessions/{session.pk}/").content, "html.parser")
    assert [t["src"] for t in page.select("#transcript .msg.user img.thumb")] == [
        f"/sessions/{session.pk}/images/{PNG_REF['sha256']}.png"]
    missing = page.select_one("#transcript .msg.user .thumb.missing")
    assert missing.get_text() == "Image 2 is no longer stored in Corral: the model does not see it."
    gone = client.get(f"/sessions/{session.pk}/images/{GIF_REF['sha256']}.gif")
    assert gone.status_code == 404 and gone.content.decode() == views.IMAGE_GONE
    # A browser holding it in its cache is not told "not modified" about an image that is gone.
    again = client.get(f"/sessions/{session.pk}/images/{GIF_REF['sha256']}.gif", HTTP_IF_NONE_MATCH=f'"{GIF_REF["sha256"]}"')
    assert again.status_code == 404


@pytest.mark.django_db
def test_an_image_is_deleted_with_the_last_session_that_carries_it(alice, bob, machine, data_dir,
                                                                   django_capture_on_commit_callbacks):
    """Retention (docs/behaviour.md §16): sessions share an image by its bytes; it goes when
    no event refers to it any more — with its last session, whichever way that goes — and
    the hourly sweep deletes leftovers no event names."""
    first, second = make_image_session(alice, machine, "gemma.gguf"), make_image_session(bob, machine, "gemma.gguf")
    send_with_images(logged_in(alice), first, "a picture", ("a.png", PNG), ("b.gif", GIF))
    send_with_images(logged_in(bob), second, "the same picture", ("copy.png", PNG))
    assert set(StoredImage.objects.values_list("sha256", flat=True)) == {PNG_REF["sha256"], GIF_REF["sha256"]}

    with django_capture_on_commit_callbacks(execute=True):
        AgentSession.objects.get(pk=first.pk).delete()
    # The GIF only the first session carried is gone; the PNG the second carries too stays.
    assert set(StoredImage.objects.values_list("sha256", flat=True)) == {PNG_REF["sha256"]}
    assert logged_in(bob).get(f"/sessions/{second.pk}/images/{PNG_REF['sha256']}.png").content == PNG

    with django_capture_on_commit_callbacks(execute=True):
        bob.delete()  # the second session goes with its owner (a cascade)
    assert not StoredImage.objects.exists()

    # The sweep: a row no event names (its session's deletion did not clean up) goes; one a
    # message names stays.
    third = make_image_session(alice, machine, "gemma.gguf")
    send_with_images(logged_in(alice), third, "kept", ("a.png", PNG))
    leftover = image_bytes("PNG", (1, 2, 3))
    images.store(Upload("left.png", leftover), ref_of(leftover))
    assert tasks.forget_images.apply().successful()
    assert list(StoredImage.objects.values_list("sha256", flat=True)) == [PNG_REF["sha256"]]


def test_an_image_of_a_withdrawn_queued_message_is_served_no_more(alice, machine, data_dir):
    """A queued message's bubble shows its image to the session's watchers; once it is
    withdrawn, it is no longer the session's to show (only sent and waiting messages count)."""
    session = make_image_session(alice, machine, "gemma.gguf")
    AgentSession.objects.filter(pk=session.pk).update(turn_active=True)  # a turn runs: the message queues
    send_with_images(logged_in(alice), session, "later, with a picture", ("later.png", PNG))
    queued = TranscriptEvent.objects.get(session=session, kind="message_queued").payload
    url = f"/sessions/{session.pk}/images/{PNG_REF['sha256']}.png"
    assert logged_in(alice).get(url).content == PNG  # waiting: its bubble shows it

    actions.do_drop_queued(AgentSession.objects.get(pk=session.pk), alice, queued["id"])
    assert logged_in(alice).get(url).status_code == 404


def test_a_message_of_images_only_may_be_edited_to_no_text_and_a_text_one_may_not(alice, machine, data_dir):
    from sessions_app.actions import SessionError, do_send_again

    session = make_image_session(alice, machine, "gemma.gguf")
    send_with_images(logged_in(alice), session, "", ("only.png", PNG))
    AgentSession.objects.filter(pk=session.pk).update(turn_active=False)
    do_send_again(AgentSession.objects.get(pk=session.pk), alice, "")
    again = TranscriptEvent.objects.filter(session=session, kind="message_taken").last().payload
    assert again["text"] == "" and again["replaces"] and [r["sha256"] for r in again["images"]] == [PNG_REF["sha256"]]

    texted = make_image_session(alice, machine, "gemma.gguf")
    send_with_images(logged_in(alice), texted, "words")
    AgentSession.objects.filter(pk=texted.pk).update(turn_active=False)
    with pytest.raises(SessionError, match="Type a message first"):
        do_send_again(AgentSession.objects.get(pk=texted.pk), alice, "  ")

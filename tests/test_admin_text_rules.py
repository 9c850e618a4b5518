"""Attacks on what an admin sets (docs/behaviour.md §17): chat template file paths with
tricks in them, and control characters in the system prompts an admin writes — the same
rule as a session's own prompt, whichever door the text comes through."""

from __future__ import annotations

import os
import re

import pytest

from machines_app.llama_server import ServerSpec, build_argv
from machines_app.models import ModelFile
from sessions_app.models import DeploymentSettings

from .conftest import model_key

pytestmark = pytest.mark.django_db


def change(admin_client, model, **fields):
    data = {"system_prompt": "", "chat_template": "", "chat_template_file": "", **fields}
    return admin_client.post(f"/admin/machines_app/modelfile/{model.pk}/change/", data)


def test_a_template_path_that_is_not_an_absolute_path_to_a_file_is_refused_in_words(local_machine, admin_client,
                                                                                      tmp_path):
    model = ModelFile.objects.get(machine=local_machine, key=model_key(local_machine, "llama"))
    (tmp_path / "dir").mkdir()
    os.symlink(tmp_path / "dir", tmp_path / "link-to-dir")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    refusals = {
        "t.jinja": "Give an absolute path on the machine",
        "../../etc/passwd": "Give an absolute path on the machine",
        "~root/t.jinja": "Give an absolute path on the machine",
        str(tmp_path / "dir"): "There is no file",
        str(tmp_path / "link-to-dir"): "There is no file",
        str(tmp_path / "dangling"): "There is no file",
        str(tmp_path / "dir" / ".." / "none.jinja"): "There is no file",
    }
    for path, words in refusals.items():
        response = change(admin_client, model, chat_template_file=path)
        assert response.status_code == 200 and words in response.content.decode(), path
        model.refresh_from_db()
        assert model.chat_template_file == ""


def test_a_template_path_with_spaces_quotes_and_a_link_is_one_argument(local_machine, admin_client, tmp_path):
    model = ModelFile.objects.get(machine=local_machine, key=model_key(local_machine, "llama"))
    folder = tmp_path / "it's a \"dir\" $(touch pwned)"
    folder.mkdir()
    template = folder / "t;rm -rf x.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    os.symlink(template, tmp_path / "link.jinja")
    for path in (str(template), str(tmp_path / "link.jinja")):
        response = change(admin_client, model, chat_template_file=path)
        assert response.status_code == 302, response.content.decode()[:2000]
        model.refresh_from_db()
        assert model.chat_template_file == path
        argv = build_argv(ServerSpec(binary="llama-server", model_path="/m.gguf", port=1, params={},
                                     chat_template_file=model.chat_template_file))
        assert argv[argv.index("--chat-template-file") + 1] == path
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("control", ["\x1b[31m", "\x07", "\x7f", "\x85"])
def test_an_admins_system_prompt_with_a_control_character_is_refused_like_a_sessions(local_machine, admin_client,
                                                                                     control):
    model = ModelFile.objects.get(machine=local_machine, key=model_key(local_machine, "llama"))
    response = change(admin_client, model, system_prompt=f"Be {control}kind.")
    assert response.status_code == 200
    assert "The system prompt contains a control character" in response.content.decode()
    model.refresh_from_db()
    assert model.system_prompt == ""

    url = admin_client.get("/admin/sessions_app/deploymentsettings/").url
    response = admin_client.post(url, {"system_prompt": f"You answer {control}for the farm."})
    assert response.status_code == 200
    assert "The system prompt contains a control character" in response.content.decode()
    assert DeploymentSettings.load().system_prompt == ""

    # Tabs and line breaks are text, and surrounding white space goes, as for a session.
    assert change(admin_client, model, system_prompt="  Be kind.\n\tAlways.  ").status_code == 302
    model.refresh_from_db()
    assert model.system_prompt == "Be kind.\n\tAlways."


def test_a_model_files_admin_page_shows_each_field_once(local_machine, admin_client):
    model = ModelFile.objects.get(machine=local_machine, key=model_key(local_machine, "llama"))
    page = admin_client.get(f"/admin/machines_app/modelfile/{model.pk}/change/").content.decode()
    rows = re.findall(r'class="form-row field-(\w+)', page)
    assert "chat_template_caps" in rows
    assert sorted(name for name in set(rows) if rows.count(name) > 1) == []

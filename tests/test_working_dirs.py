"""Working directories are resolved on the session's machine and kept inside its
workspace roots for members (docs/access.md)."""

from __future__ import annotations

import os

import pytest
from django.core.exceptions import ValidationError
from django.test import Client

from machines_app.models import Machine
from machines_app.transports import LocalTransport
from machines_app.workspaces import inside, is_machine_path, parse_roots, validate_workspace_roots
from sessions_app.models import AgentSession

from .conftest import model_key

# --- the pure shape rules ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/srv/work", True),
        ("/", True),
        ("~", True),
        ("~/project", True),
        (".", False),
        ("..", False),
        ("../../etc", False),
        ("work", False),
        ("./work", False),
        ("~bob/work", False),
        ("~bob", False),
        ("", False),
    ],
)
def test_it_accepts_only_absolute_or_home_paths(path, expected):
    assert is_machine_path(path) is expected


@pytest.mark.parametrize(
    ("path", "root", "expected"),
    [
        ("/srv/work", "/srv/work", True),
        ("/srv/work/a/b", "/srv/work", True),
        ("/srv/work/a", "/srv/work/", True),
        ("/srv/work2", "/srv/work", False),
        ("/srv", "/srv/work", False),
        ("/etc", "/", True),
        ("/srv/work/../etc", "/srv/work", False),  # normalised before comparing
    ],
)
def test_it_compares_by_whole_path_parts(path, root, expected):
    assert inside(path, root) is expected


def test_it_reads_one_root_per_line():
    assert parse_roots("  /srv/work \n\n~\r\n~/projects\n") == ["/srv/work", "~", "~/projects"]
    assert parse_roots("") == [] and parse_roots(" \n ") == []


def test_it_refuses_relative_roots_naming_them():
    validate_workspace_roots("/srv/work\n~\n~/x")
    with pytest.raises(ValidationError) as raised:
        validate_workspace_roots("/srv/work\nwork\n..\n~bob")
    assert "work, .., ~bob" in raised.value.messages[0]


# --- the one check, through the form --------------------------------------------------------


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def tree(tmp_path):
    """root/ (a workspace root) with a project, a symlink out of it, and a sibling outside."""
    tmp_path = tmp_path.resolve()  # messages show real paths
    root = tmp_path / "root"
    (root / "project").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "escape").symlink_to(tmp_path / "outside")
    (root / "inner").symlink_to(root / "project")
    (tmp_path / "root2").mkdir()
    return tmp_path


def post_new(user, machine, working_dir, **extra):
    data = {"machine": machine.pk, "model_key": model_key(machine, "llama"), "working_dir": working_dir,
            "permission_mode": "manual", "speculative": "auto", **extra}
    return logged_in(user).post("/sessions/new/", data)


def field_error(response, field="working_dir") -> str:
    assert response.status_code == 200, response.status_code
    return " ".join(response.context["form"].errors.get(field, []))


@pytest.mark.django_db
@pytest.mark.parametrize("working_dir", [".", "..", "../../etc", "work", "./", "~bob", "~root/x"])
def test_it_refuses_relative_paths_for_everyone(local_machine, alice, charlie_staff, working_dir):
    for user in (alice, charlie_staff):
        error = field_error(post_new(user, local_machine, working_dir))
        assert f"'{working_dir}' is not an absolute path" in error
        assert "(like /srv/work/project)" in error and "(like ~/project)" in error
    assert not AgentSession.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("relative", "shown"),
    [
        ("outside", "{tmp}/outside is not."),
        ("root2", "{tmp}/root2 is not."),  # a sibling sharing the root's name as a prefix
        ("root/escape", "{tmp}/root/escape leads to {tmp}/outside, which is not."),
        ("root/project/../../outside", "{tmp}/root/project/../../outside leads to {tmp}/outside, which is not."),
        ("root/inner/../escape", "leads to {tmp}/outside, which is not."),  # a symlink, then .. from where it led
    ],
)
def test_a_member_is_kept_inside_the_roots_and_told_which_they_are(local_machine, alice, tree, relative, shown):
    Machine.objects.filter(pk=local_machine.pk).update(workspace_roots=f"{tree}/root\n~")
    local_machine.refresh_from_db()
    home = os.path.realpath(os.path.expanduser("~"))
    error = field_error(post_new(alice, local_machine, f"{tree}/{relative}"))
    assert f"On local your working directory must be inside {tree}/root, ~ ({home});" in error
    assert shown.format(tmp=tree) in error
    assert not AgentSession.objects.exists()


@pytest.mark.django_db
def test_a_root_that_is_a_symlink_is_compared_by_where_it_leads(local_machine, alice, tree):
    (tree / "via").symlink_to(tree / "root")
    Machine.objects.filter(pk=local_machine.pk).update(workspace_roots=f"{tree}/via")
    local_machine.refresh_from_db()
    response = post_new(alice, local_machine, f"{tree}/root/project")
    assert response.status_code == 302, field_error(response)
    error = field_error(post_new(alice, local_machine, f"{tree}/via/escape"))
    assert f"inside {tree}/via ({tree}/root);" in error


@pytest.mark.django_db
@pytest.mark.parametrize("relative", ["root", "root/project", "root/inner", "root/project/../project"])
def test_a_member_may_use_a_root_and_below_and_the_real_path_is_stored(local_machine, alice, tree, relative):
    Machine.objects.filter(pk=local_machine.pk).update(workspace_roots=f"{tree}/root")
    local_machine.refresh_from_db()
    response = post_new(alice, local_machine, f"{tree}/{relative}")
    assert response.status_code == 302, field_error(response)
    assert AgentSession.objects.get().working_dir == os.path.realpath(tree / relative)


@pytest.mark.django_db
def test_staff_are_not_limited_by_the_roots(local_machine, charlie_staff, tree):
    Machine.objects.filter(pk=local_machine.pk).update(workspace_roots=f"{tree}/root")
    local_machine.refresh_from_db()
    response = post_new(charlie_staff, local_machine, f"{tree}/root/escape")
    assert response.status_code == 302, field_error(response)
    assert AgentSession.objects.get().working_dir == str(tree / "outside")


@pytest.mark.django_db
def test_no_roots_means_any_directory_and_a_missing_one_is_still_refused(local_machine, alice, tree):
    assert local_machine.workspace_roots == ""
    assert "There is no directory /no/such/dir on local" in field_error(post_new(alice, local_machine, "/no/such/dir"))
    assert post_new(alice, local_machine, f"{tree}/outside").status_code == 302


@pytest.mark.django_db
def test_outside_the_roots_is_said_before_whether_it_exists(local_machine, alice, tree):
    """A member cannot probe which directories exist outside the roots."""
    Machine.objects.filter(pk=local_machine.pk).update(workspace_roots=f"{tree}/root")
    local_machine.refresh_from_db()
    error = field_error(post_new(alice, local_machine, "/no/such/dir"))
    assert "must be inside" in error and "There is no directory" not in error


@pytest.mark.django_db
def test_a_new_machine_keeps_members_in_their_home_there(alice, real_models_dir, llama_server_bin, tmp_path):
    from machines_app import catalog

    machine = Machine.objects.create(name="fresh", models_dir=str(real_models_dir), llama_server_path=llama_server_bin)
    catalog.refresh_models(machine)
    assert machine.workspace_roots == "~"
    home = LocalTransport().real_path("~")
    for hostile in (str(tmp_path), "~/..", "~/../../etc", "//etc", "/", f"{home}/../etc", "~/./../etc"):
        error = field_error(post_new(alice, machine, hostile))
        assert f"must be inside ~ ({home})" in error, hostile
    assert post_new(alice, machine, "~").status_code == 302  # the form's initial value works out of the box
    assert AgentSession.objects.get().working_dir == home


@pytest.mark.django_db
def test_the_admin_refuses_a_relative_root(local_machine, django_user_model):
    admin_user = django_user_model.objects.create_superuser("root", password="root-password-1")
    client = logged_in(admin_user)
    page = client.get(f"/admin/machines_app/machine/{local_machine.pk}/change/")
    assert page.status_code == 200 and 'name="workspace_roots"' in page.content.decode()
    data = {"name": "local", "transport": "local", "port": 22, "models_dir": local_machine.models_dir,
            "llama_server_path": local_machine.llama_server_path, "enabled": "on", "workspace_roots": "/srv/work\n..\n"}
    response = client.post(f"/admin/machines_app/machine/{local_machine.pk}/change/", data)
    assert response.status_code == 200
    assert "not: .." in response.content.decode()
    local_machine.refresh_from_db()
    assert local_machine.workspace_roots == ""
    data["workspace_roots"] = "/srv/work\n~\n"
    assert client.post(f"/admin/machines_app/machine/{local_machine.pk}/change/", data).status_code == 302
    local_machine.refresh_from_db()
    assert parse_roots(local_machine.workspace_roots) == ["/srv/work", "~"]


@pytest.mark.django_db
def test_the_admin_cannot_set_a_working_directory_around_the_check(local_machine, alice, django_user_model, tmp_path):
    session = AgentSession.objects.create(owner=alice, machine=local_machine, model_key=model_key(local_machine, "llama"),
                                          working_dir=str(tmp_path), status="exited")
    client = logged_in(django_user_model.objects.create_superuser("root", password="root-password-1"))
    assert client.get("/admin/sessions_app/agentsession/add/").status_code == 403
    url = f"/admin/sessions_app/agentsession/{session.pk}/change/"
    page = client.get(url).content.decode()
    assert 'name="working_dir"' not in page and 'name="permission_mode"' not in page and str(tmp_path) in page
    forged = {"owner": alice.pk, "machine": local_machine.pk, "model_key": session.model_key, "working_dir": ".",
              "permission_mode": "bypassPermissions", "status": "exited", "title": "renamed",
              "server_params": "{}", "sampling": "{}", "interrupt_requested": ""}
    assert client.post(url, forged).status_code == 302
    session.refresh_from_db()
    assert session.title == "renamed"  # the form was taken…
    assert session.working_dir == str(tmp_path) and session.permission_mode == "manual"  # …but not those fields


@pytest.mark.django_db
def test_the_form_tells_a_member_where_they_may_work(local_machine, alice, charlie_staff, tree):
    Machine.objects.filter(pk=local_machine.pk).update(workspace_roots=f"{tree}/root\n~")
    said = f"On local you may work inside {tree}/root, ~."
    assert said in logged_in(alice).get("/sessions/new/").content.decode()
    picker = logged_in(alice).get(f"/sessions/models/?machine={local_machine.pk}").content.decode()
    assert said in picker and 'id="workspace-roots" hx-swap-oob="true"' in picker  # follows a change of machine
    assert "you may work inside" not in logged_in(charlie_staff).get("/sessions/new/").content.decode()
    Machine.objects.filter(pk=local_machine.pk).update(workspace_roots="/srv/<b>x</b>")
    page = logged_in(alice).get("/sessions/new/").content.decode()
    assert "you may work inside /srv/&lt;b&gt;x&lt;/b&gt;." in page and "<b>x" not in page
    error = field_error(post_new(alice, local_machine, "/etc"))
    assert "inside /srv/<b>x</b>;" in error  # the message is text; the page escapes it
    assert "<b>x" not in post_new(alice, local_machine, "/etc").content.decode()
    Machine.objects.filter(pk=local_machine.pk).update(workspace_roots="")
    assert "you may work inside" not in logged_in(alice).get("/sessions/new/").content.decode()

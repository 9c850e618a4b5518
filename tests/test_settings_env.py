"""Settings are declarations and production mode is one switch (docs/deployment.md).

Importing settings writes nothing; the launcher prepares the data directory and the
secret key; every variable is read strictly. Settings are module-level, so what depends
on the environment is proven in a fresh interpreter (``_settings_in``).
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from project import data_dir, launcher
from project.env import env_bool, env_choice, env_db, env_float, env_int, env_list, env_str, env_url

ROOT = Path(__file__).resolve().parent.parent

# Variables a test process may carry in from the launcher or the shell; each child below
# starts from a known environment instead.
_CLEARED = ("DEBUG", "CORRAL_HTTPS", "SECRET_KEY", "DATABASE_URL", "CORRAL_DATA_DIR", "CORRAL_HSTS_SECONDS", "PORT")


def _child_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env.update({"CORRAL_DATA_DIR": str(tmp_path / "data"), "DJANGO_SETTINGS_MODULE": "project.settings", **extra})
    return env


def _settings_in(tmp_path: Path, names: list[str], **extra: str) -> subprocess.CompletedProcess:
    """Import settings in a fresh interpreter with ``extra`` in its environment; prints
    the named settings as JSON (``repr`` for values JSON cannot hold)."""
    code = (
        "import json; from django.conf import settings; "
        f"print(json.dumps({{n: getattr(settings, n, None) for n in {names!r}}}, default=repr))"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_child_env(tmp_path, **extra), capture_output=True, text=True,
        timeout=60,
    )


# --- the strict helpers -----------------------------------------------------------------

@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("true", True), ("Yes", True), ("ON", True), (" on ", True),
     ("0", False), ("false", False), ("No", False), ("off", False)],
)
def test_it_reads_booleans_in_the_usual_spellings(monkeypatch, raw, expected):
    monkeypatch.setenv("CORRAL_X", raw)
    assert env_bool("CORRAL_X", not expected) is expected


@pytest.mark.parametrize(
    ("helper", "raw", "words"),
    [
        (lambda: env_bool("CORRAL_X", False), "ture", "use 1/true/yes/on or 0/false/no/off"),
        (lambda: env_bool("CORRAL_X", False), "2", "use 1/true/yes/on"),
        (lambda: env_int("CORRAL_X", 1), "5s", "expected a whole number"),
        (lambda: env_int("CORRAL_X", 1), "1.5", "expected a whole number"),
        (lambda: env_int("CORRAL_X", 1, minimum=1, maximum=65535), "0", "at least 1"),
        (lambda: env_int("CORRAL_X", 1, minimum=1, maximum=65535), "70000", "at most 65535"),
        (lambda: env_float("CORRAL_X", 1.0), "five", "expected a number"),
        (lambda: env_float("CORRAL_X", 1.0), "nan", "finite"),
        (lambda: env_float("CORRAL_X", 1.0), "inf", "finite"),
        (lambda: env_float("CORRAL_X", 1.0, minimum=0.0), "-3", "at least 0.0"),
        (lambda: env_list("CORRAL_X", []), "a,,b", "none empty"),
        (lambda: env_list("CORRAL_X", []), "a,", "none empty"),
        (lambda: env_choice("CORRAL_X", "INFO", {"INFO", "DEBUG"}), "LOUD", "one of DEBUG, INFO"),
        (lambda: env_url("CORRAL_X", "", {"redis", "rediss"}), "localhost:6379", "redis or rediss://"),
        (lambda: env_db("CORRAL_X", "sqlite:///x"), "mysqlx://db/x", "database URL"),
        (lambda: env_db("CORRAL_X", "sqlite:///x"), "corral.sqlite3", "database URL"),
        (lambda: env_db("CORRAL_X", "sqlite:///x"), "postgres://u@host:port/db", "could not read"),
        (lambda: env_db("CORRAL_X", "sqlite:///x"), "postgres://u@host:5432/", "names no database"),
    ],
)
def test_it_refuses_a_value_that_cannot_mean_anything_and_says_which(monkeypatch, helper, raw, words):
    monkeypatch.setenv("CORRAL_X", raw)
    with pytest.raises(ImproperlyConfigured) as caught:
        helper()
    assert f"CORRAL_X={raw.strip()!r} is not valid" in str(caught.value)
    assert words in str(caught.value)


def test_it_gives_the_default_for_unset_or_blank_and_never_echoes_a_password(monkeypatch):
    monkeypatch.delenv("CORRAL_X", raising=False)
    assert env_int("CORRAL_X", 7) == 7 and env_list("CORRAL_X", ["a"]) == ["a"] and env_str("CORRAL_X", "d") == "d"
    monkeypatch.setenv("CORRAL_X", "   ")
    assert env_bool("CORRAL_X", True) is True and env_float("CORRAL_X", 2.5) == 2.5
    monkeypatch.setenv("CORRAL_X", " a , b ")
    assert env_list("CORRAL_X", []) == ["a", "b"]
    monkeypatch.setenv("CORRAL_X", "postgres://corral:hunter2@db:5432/corral")
    assert env_db("CORRAL_X", "sqlite:///x")["NAME"] == "corral"
    for bad in ("postgres://corral:hunter2@db:notaport/corral", "postgres://corral:hunter2@db:5432/"):
        monkeypatch.setenv("CORRAL_X", bad)
        with pytest.raises(ImproperlyConfigured) as caught:
            env_db("CORRAL_X", "sqlite:///x")
        assert "hunter2" not in str(caught.value) and "corral:***@db" in str(caught.value)
    monkeypatch.setenv("CORRAL_X", "http://:hunter2@redis:6379/0")
    with pytest.raises(ImproperlyConfigured) as caught:
        env_url("CORRAL_X", "", {"redis"})
    assert "hunter2" not in str(caught.value)


# --- the data directory: prepared by the launcher, only read by settings ------------------

def test_it_prepares_a_fresh_data_dir_once_with_an_owner_only_key(tmp_path):
    target = tmp_path / "fresh" / "data"
    data_dir.prepare(target)
    key_file = target / data_dir.SECRET_KEY_FILE
    key = key_file.read_text()
    assert len(key) >= 50 and not key.startswith("django-insecure-")
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert (target / "logs").is_dir() and (target / "static").is_dir()
    data_dir.prepare(target)
    assert key_file.read_text() == key  # kept: logged-in sessions stay valid
    key_file.write_text("")  # e.g. a disk that filled up mid-write
    data_dir.prepare(target)
    assert data_dir.read_secret_key(target) and data_dir.read_secret_key(target) != key
    # The VAPID key of Web Push, owner-only too (docs/attention.md); no partial file left.
    assert stat.S_IMODE((target / data_dir.VAPID_KEY_FILE).stat().st_mode) == 0o600
    assert sorted(p.name for p in target.iterdir()) == ["host_id", "logs", "secret_key", "static", "vapid_private.pem"]


def test_importing_settings_writes_nothing_and_a_missing_key_is_a_clear_error(tmp_path):
    result = _settings_in(tmp_path, ["DEBUG"])
    assert result.returncode != 0
    assert "ImproperlyConfigured: No secret key: set SECRET_KEY, or start Corral once with ./corral run" in result.stderr
    assert not (tmp_path / "data").exists()

    result = _settings_in(tmp_path, ["DEBUG", "STATIC_ROOT"], SECRET_KEY="k" * 60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["DEBUG"] is False  # off unless asked for
    assert not (tmp_path / "data").exists()  # no folder, no key file, no static root

    data_dir.prepare(tmp_path / "data")
    result = _settings_in(tmp_path, ["SECRET_KEY"])
    assert json.loads(result.stdout)["SECRET_KEY"] == (tmp_path / "data" / "secret_key").read_text()


@pytest.mark.parametrize(
    ("name", "value"),
    [("DEBUG", "ture"), ("CORRAL_HTTPS", "maybe"), ("CORRAL_STOP_GRACE", "5s"), ("CORRAL_LEASE_SECONDS", "0"),
     ("ALLOWED_HOSTS", "corral.example,"), ("REDIS_URL", "127.0.0.1:6379"), ("LOG_LEVEL", "LOUD"),
     ("CORRAL_LOGIN_FAILURE_LIMIT", "0"), ("CORRAL_TURN_WORKERS", "0"), ("REDIS_URL", "redis://127.0.0.1:6379/abc?db=x")],
)
def test_a_bad_setting_stops_the_process_naming_the_variable(tmp_path, name, value):
    result = _settings_in(tmp_path, ["DEBUG"], SECRET_KEY="k" * 60, **{name: value})
    assert result.returncode != 0
    assert f"ImproperlyConfigured: {name}={value!r} is not valid" in result.stderr


# --- production mode -----------------------------------------------------------------------

HTTPS_SETTINGS = ["SECURE_SSL_REDIRECT", "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE", "SECURE_HSTS_SECONDS",
                  "SECURE_PROXY_SSL_HEADER", "DEBUG"]


def test_corral_https_turns_on_secure_cookies_hsts_ssl_redirect_and_the_proxy_header(tmp_path):
    on = json.loads(_settings_in(tmp_path, HTTPS_SETTINGS, SECRET_KEY="k" * 60, CORRAL_HTTPS="1").stdout)
    assert on == {"SECURE_SSL_REDIRECT": True, "SESSION_COOKIE_SECURE": True, "CSRF_COOKIE_SECURE": True,
                  "SECURE_HSTS_SECONDS": 31_536_000, "SECURE_PROXY_SSL_HEADER": ["HTTP_X_FORWARDED_PROTO", "https"],
                  "DEBUG": False}
    off = json.loads(_settings_in(tmp_path, HTTPS_SETTINGS, SECRET_KEY="k" * 60).stdout)
    assert off["SECURE_SSL_REDIRECT"] is False and off["SESSION_COOKIE_SECURE"] is False
    assert off["SECURE_HSTS_SECONDS"] == 0 and off["SECURE_PROXY_SSL_HEADER"] is None


def _check_deploy(tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    data_dir.prepare(tmp_path / "data")  # a real generated key, as the launcher makes it
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT, env=_child_env(tmp_path, **extra), capture_output=True, text=True, timeout=120,
    )


def test_check_deploy_is_clean_in_production_mode(tmp_path):
    result = _check_deploy(tmp_path, CORRAL_HTTPS="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout


def test_check_deploy_names_what_is_missing_without_the_switch(tmp_path):
    result = _check_deploy(tmp_path)
    assert result.returncode != 0
    for warning in ("security.W004", "security.W008", "security.W012", "security.W016"):
        assert warning in result.stderr
    result = _check_deploy(tmp_path, CORRAL_HTTPS="1", DEBUG="1")
    assert "security.W018" in result.stderr  # DEBUG asked for explicitly still shows up


# --- the launcher --------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("https", "debug", "flag", "expected_debug", "daphne_args"),
    [(None, None, False, "0", []), (None, None, True, "1", []), ("1", None, False, "0", ["--proxy-headers"]),
     (None, "0", False, "0", []), (None, "1", False, "1", []), ("1", "true", False, "1", ["--proxy-headers"])],
)
def test_corral_run_has_debug_only_when_asked_for(monkeypatch, https, debug, flag, expected_debug, daphne_args):
    """The run the README gives a team has DEBUG off: a member must never meet Django's
    debug 404 that lists every URL pattern. ``--debug`` or ``DEBUG=1`` turns it on."""
    for name, value in (("CORRAL_HTTPS", https), ("DEBUG", debug)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert launcher.run_environment(flag) == daphne_args
    assert os.environ["DEBUG"] == expected_debug


@pytest.mark.parametrize(
    ("argv", "env", "words"),
    [(["run", "--port", "eighty"], {}, "PORT='eighty' is not valid"),
     (["run", "--port=0"], {}, "PORT='0' is not valid"),
     (["run"], {"PORT": "99999"}, "at most 65535"), (["run"], {"CORRAL_HTTPS": "sure"}, "CORRAL_HTTPS='sure'"),
     (["test"], {"CORRAL_DATA_DIR": "/proc/corral-data"}, "cannot prepare the data directory /proc/corral-data"),
     (["run"], {"CORRAL_TURN_WORKERS": "many"}, "CORRAL_TURN_WORKERS='many'"),
     (["setup"], {"REDIS_URL": ""}, "set REDIS_URL")],
)
def test_the_launcher_refuses_bad_input_with_a_message_not_a_traceback(tmp_path, argv, env, words):
    result = subprocess.run(
        [sys.executable, "-m", "project.launcher", *argv], cwd=ROOT, env={**_child_env(tmp_path), **env},
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("corral: ") and words in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "port"),
    [(["--port", "8765"], 8765), (["--port=8765"], 8765), ([], 8000), (["--port", "1", "--port=2"], 2),
     (["--debug", "--port", "8765"], 8765)],
)
def test_corral_run_takes_its_port_in_either_spelling(monkeypatch, args, port):
    monkeypatch.delenv("PORT", raising=False)
    assert launcher.run_port(args) == port


@pytest.mark.parametrize(
    ("args", "named"),
    [(["--prot", "8765"], "'--prot'"), (["8765"], "'8765'"), (["--port", "8765", "-v"], "'-v'"),
     (["--port"], "'--port' needs a port number"), (["--port="], "'--port=' needs a port number")],
)
def test_corral_run_refuses_an_argument_it_does_not_know_naming_it(monkeypatch, args, named):
    """A misspelt ``--prot 8765`` used to be ignored: Corral started on 8000 as if
    nothing had been asked."""
    monkeypatch.setenv("PORT", "8000")
    with pytest.raises(launcher.UsageError, match=re.escape(named)):
        launcher.run_port(args)


@pytest.mark.parametrize(
    ("argv", "words"),
    [(["run", "--prot", "1"], "unknown argument '--prot' for run"), (["setup", "now"], "setup takes no arguments"),
     (["serve"], "unknown command 'serve'")],
)
def test_a_usage_mistake_is_one_line_and_exit_status_2(tmp_path, argv, words):
    for command in ([sys.executable, "-m", "project.launcher", *argv], [str(ROOT / "corral"), *argv]):
        result = subprocess.run(command, cwd=ROOT, env=_child_env(tmp_path), capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 2, command
        assert result.stderr.startswith(f"corral: {words}") and result.stderr.count("\n") == 1, command
        # ./corral checks its arguments before it installs, builds or imports anything.
        assert result.stdout == "", command
    assert not (tmp_path / "data").exists()


def test_the_run_workers_leave_out_celerys_worker_to_worker_chatter(tmp_path):
    # Heartbeat events every 2 s from every worker, received by every other (gossip), cost an
    # idle stack CPU and Corral reads none of them (liveness is keys in Redis: docs/operations.md).
    from project import data_dir, launcher

    data_dir.prepare(tmp_path)
    config = launcher.supervisor_config(data=tmp_path, port=8000, daphne_args=[], turn_workers=2)
    workers = [line for line in config.splitlines() if line.startswith("command=") and " worker " in line]
    assert len(workers) == 3
    for line in workers:
        assert {"--without-gossip", "--without-mingle", "--without-heartbeat"} <= set(line.split())


def test_the_stack_runs_no_beat_process(tmp_path):
    # Celery beat sent each periodic check as a task through Redis, a process of its own
    # and 0.7 messages a second on an idle stack; the rounds run in the housekeeping
    # worker now (sessions_app/rounds.py): nothing schedules through beat any more.
    from django.conf import settings

    from project import data_dir, launcher

    data_dir.prepare(tmp_path)
    config = launcher.supervisor_config(data=tmp_path, port=8000, daphne_args=[], turn_workers=2)
    programs = [line.removeprefix("[program:").removesuffix("]") for line in config.splitlines()
                if line.startswith("[program:")]
    assert sorted(programs) == ["web", "worker-housekeeping", "worker-servers", "worker-turns"]
    commands = [line for line in config.splitlines() if line.startswith("command=")]
    assert not any(" beat" in line or " -B" in line for line in commands), commands
    assert not hasattr(settings, "CELERY_BEAT_SCHEDULE")


def test_each_worker_is_named_after_its_hosts_id_and_reads_its_hosts_own_queue(tmp_path, monkeypatch):
    # Two hosts with the same host name (a cloned VM) gave two workers the same turns@%h
    # name; the host id is drawn once per data directory (or set: CORRAL_HOST_ID).
    from project import data_dir, launcher

    monkeypatch.delenv("CORRAL_HOST_ID", raising=False)
    first, second = tmp_path / "one", tmp_path / "two"
    data_dir.prepare(first)
    data_dir.prepare(second)
    host = data_dir.read_host_id(first)
    assert host and host != data_dir.read_host_id(second)
    data_dir.prepare(first)
    assert data_dir.read_host_id(first) == host  # kept
    config = launcher.supervisor_config(data=first, port=8000, daphne_args=[], turn_workers=2)
    for kind in ("turns", "servers", "housekeeping"):
        line = next(line for line in config.splitlines() if f" -n {kind}@" in line)
        assert f" -Q {kind},{kind}.{host} -n {kind}@{host} " in line
    monkeypatch.setenv("CORRAL_HOST_ID", "rack-7")
    assert data_dir.read_host_id(first) == "rack-7"
    monkeypatch.setenv("CORRAL_HOST_ID", "rack 7")
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match="CORRAL_HOST_ID"):
        data_dir.read_host_id(first)


def test_supervisord_starts_without_alarming_lines_for_a_root_run(tmp_path):
    """A newcomer's find: as root, every ``./corral run`` opened with two CRIT lines from
    supervisord (privileges not dropped; a control socket without authentication). Root is
    said on purpose and the socket asks for a password drawn per run, which supervisorctl
    reads from the same owner-only file."""
    import configparser

    from project import data_dir, launcher

    data_dir.prepare(tmp_path)
    config = configparser.ConfigParser(interpolation=None)
    config.read_string(launcher.supervisor_config(data=tmp_path, port=8000, daphne_args=[], turn_workers=2))
    if os.geteuid() == 0:
        assert config["supervisord"]["user"] == "root"
    server, client = config["unix_http_server"], config["supervisorctl"]
    assert len(server["password"]) >= 24 and (server["username"], server["password"]) == (
        client["username"], client["password"])
    again = configparser.ConfigParser(interpolation=None)
    again.read_string(launcher.supervisor_config(data=tmp_path, port=8000, daphne_args=[], turn_workers=2))
    assert again["unix_http_server"]["password"] != server["password"]  # drawn afresh


@pytest.mark.parametrize("word", ["--help", "-h", "help"])
def test_asking_corral_for_help_is_not_a_mistake(tmp_path, word):
    """A newcomer's find: ``./corral --help`` answered "unknown command" with exit status 2."""
    result = subprocess.run([str(ROOT / "corral"), word], cwd=ROOT, env=_child_env(tmp_path), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == ""
    assert all(f"./corral {command}" in result.stdout for command in ("run", "test", "check", "setup", "worker"))
    assert not (tmp_path / "data").exists()  # nothing installed or prepared for it

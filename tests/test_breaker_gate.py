"""Breaking the gate built for issues 20 and 21 (docs/behaviour.md §8, §9; docs/security.md).

Each test here is a hole found by trying to get past the gate, the card or the bounds:
it failed before its fix.
"""

from __future__ import annotations

import pytest

from sessions_app.allowances import matches, offers

WD = "/srv/work/proj"
SHELL = {"name": "exec_shell_command", "origin": "machine", "writes": True, "remote_name": "exec_shell_command"}


def shell(command) -> dict:
    return {"tool": "exec_shell_command", "input": {"command": command}}


def prefix(*words) -> dict:
    return {"seq": 1, "tool": "exec_shell_command", "scope": {"kind": "prefix", "words": list(words)},
            "by": None, "at": None}


# --------------------------------------------------------------------------- shell prefixes


@pytest.mark.parametrize("command", [
    # sh's reserved word `!` runs the rest as a command: "commands starting with !" is the gate off.
    "! rm -rf ~", "coproc rm -rf ~",
    # `trap` runs its first argument when the shell exits.
    "trap 'rm -rf ~' EXIT",
    # An interpreter under its versioned name is still an interpreter.
    "python3.12 -c 'import os'", "/usr/bin/python3.11 x.py", "perl5.36 -e 1", "ruby3.1 -e 1", "node18 -e 1",
    "lua5.4 -e 1", "pypy3 -c 1", "php8.2 -r 1", "bash5 -c x",
    # Wrappers that run their arguments as a command.
    "setsid rm -rf ~", "stdbuf -o0 rm -rf ~", "chroot / rm -rf ~", "unshare rm -rf ~", "flock /tmp/l rm -rf ~",
    "ionice -c3 rm -rf ~", "taskset 1 rm -rf ~", "script -c 'rm -rf ~'", "runuser -u x rm", "pkexec rm",
    "parallel rm ::: a", "fakeroot rm -rf ~", "chrt 1 rm -rf ~", "nsenter -t 1 rm",
    # A glob in the command's name runs whatever file it matches (/usr/bin/python).
    "/usr/bin/pytho? -c 'import os'", "/usr/bin/pytho[n] -c 1", "/usr/bin/*sh -c x",
])
def test_no_prefix_is_offered_for_a_command_that_runs_anything(command):
    scopes = offers(shell(command), SHELL, WD)
    assert scopes == [{"kind": "exact", "command": command}], scopes


@pytest.mark.parametrize(("words", "command"), [
    (["!"], "! rm -rf ~"),
    (["python3.12"], "python3.12 -c 'import os'"),
    (["setsid"], "setsid rm -rf ~"),
    (["/usr/bin/pytho?"], "/usr/bin/pytho? -c 'import os'"),
    (["cat", "*.txt"], "cat *.txt"),
])
def test_a_stored_prefix_that_would_not_be_offered_now_covers_nothing(words, command):
    """An allowance granted before the offer was refused (or forged into the transcript)
    is no way around it."""
    assert not matches(prefix(*words), shell(command), SHELL, WD)


def test_a_glob_is_never_part_of_an_offered_prefix():
    """``cat *.txt``'s second word is whatever files the shell finds: only ``cat`` is offered."""
    scopes = offers(shell("cat *.txt"), SHELL, WD)
    assert [scope.get("words") for scope in scopes[1:]] == [["cat"]]
    assert matches(prefix("cat"), shell("cat *.txt"), SHELL, WD)  # the one-word prefix still covers it

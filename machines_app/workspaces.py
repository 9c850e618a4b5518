"""Where a session's tools may act: working directories and a machine's workspace roots.

A working directory names a place on the session's machine, so it is resolved there, by
that machine's Transport — never by the backend's own file system (a relative ``..``
resolved here would be the backend's checkout). It must be absolute or under the home
directory (``~`` or ``~/…``); ``~`` and every symlink and ``..`` are resolved on the
machine (``realpath``), and the resolved path is what is checked and stored. A member
(not staff) must stay inside the machine's workspace roots, compared after resolving both
sides, so a symlink that leaves a root counts as leaving it. The rules, and why the
default is ``~``, are written up in ``docs/access.md``.

The shape helpers here are plain string functions (table-tested without a database);
:func:`check_working_dir` is the one check every form and action calls.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable

from django.core.exceptions import ValidationError

from .transports import Transport, reader_for


class WorkingDirRefused(Exception):
    """A working directory that cannot be used; the message says why in the user's terms."""


def is_machine_path(path: str) -> bool:
    """True for a path that means the same wherever it is resolved: absolute (``/…``),
    ``~`` or ``~/…``. False for relative paths (``.``, ``..``, ``work``) and for
    ``~user`` forms, which name another account's home."""
    return path.startswith("/") or path == "~" or path.startswith("~/")


def parse_roots(text: str) -> list[str]:
    """The workspace roots field → its roots, one per non-blank line, surrounding space
    removed, in the order written."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def inside(path: str, root: str) -> bool:
    """Whether the absolute, already-resolved ``path`` is ``root`` or lies below it.

    Compared by whole path components (``/srv/work2`` is not inside ``/srv/work``).
    """
    root = posixpath.normpath(root)
    path = posixpath.normpath(path)
    if root == "/":
        return path.startswith("/")
    return path == root or path.startswith(root + "/")


def validate_workspace_roots(text: str) -> None:
    """Model-field validator: every root is absolute or ``~``/``~/…`` and has no NUL.

    Raises ValidationError naming the lines that are not.
    """
    bad = [root for root in parse_roots(text) if not is_machine_path(root) or "\x00" in root]
    if bad:
        raise ValidationError(
            "Each root must be an absolute path (/srv/work) or in the home directory (~, ~/projects); "
            "not: %(roots)s.",
            params={"roots": ", ".join(bad)},
            code="relative_root",
        )


def check_working_dir(user, machine, path: str, reach: Callable[..., Transport] = reader_for) -> str:
    """The working directory ``path`` as ``user`` may use it on ``machine``: its real
    path on that machine (``~``, symlinks and ``..`` resolved there).

    Raises WorkingDirRefused for a relative path, a NUL, a path outside the machine's
    workspace roots (members only; the message names the roots) or one that is not a
    directory there. Raises TransportError when the machine cannot be asked (for another
    Corral host's local machine: when that host does not answer, machines_app/transports/relay.py).

    A page's check: another host's local machine is asked through that host (``reach``,
    :func:`reader_for` by default; a form that asks more passes one ``one_reader()``).
    """
    machine_name = machine.name
    if "\x00" in path:
        raise WorkingDirRefused("A path cannot contain a NUL character.")
    if not is_machine_path(path):
        raise WorkingDirRefused(
            f"'{path}' is not an absolute path. Give the working directory as an absolute path on {machine_name} "
            "(like /srv/work/project) or one in the home directory there (like ~/project)."
        )
    transport = reach(machine)
    real = transport.real_path(path)
    roots = machine.workspace_root_list
    if roots and not user.is_staff:
        real_roots = [transport.real_path(root) for root in roots]
        if not any(inside(real, root) for root in real_roots):
            named = ", ".join(root if root == real_root else f"{root} ({real_root})"
                              for root, real_root in zip(roots, real_roots, strict=True))
            # Say where a path led when it is not what was typed (~, a symlink, a ".."), so the
            # refusal of a path that looks inside a root makes sense.
            where = path if path.rstrip("/") in (real, "") else f"{path} leads to {real}, which"
            raise WorkingDirRefused(f"On {machine_name} your working directory must be inside {named}; {where} is not.")
    if not transport.is_dir(real):
        raise WorkingDirRefused(f"There is no directory {path} on {machine_name}.")
    return real

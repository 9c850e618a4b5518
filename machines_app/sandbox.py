"""Keeping a session's tools away from Corral: the bubblewrap sandbox a llama-server runs in
(docs/security.md, "What a tool can reach").

llama-server runs its built-in tools (``exec_shell_command``, ``read_file``, …) itself, as
its own children. So whatever the server may touch, an approved tool may touch too. On the
machine Corral runs on that would be Corral's data directory (the secret key, the SQLite
database with every server's key, the SSH private keys of the remote machines, attached
images), its code, and its processes. On an SSH machine it would be Corral's private
directory there (``~/.corral``: other sessions' saved slots, key files, logs).

Each server is therefore started inside Debian's ``bwrap`` (bubblewrap):

- the file system is the machine's own (``--bind / /``: the working directory, the
  workspace roots and the rest stay as the account sees them), except that Corral's
  private directories are replaced by an empty ``tmpfs`` (``hide``), Corral's code is
  read-only (``read_only``) and single secret files elsewhere are replaced by an empty file
  (``mask``);
- the few things the server needs from a hidden directory are bound back at the same path:
  the model file, its projector and template, its key file (read-only: ``read``) and its
  own slot directory (writable: ``write``);
- it gets a PID namespace of its own (``--unshare-pid``, with a fresh ``/proc``): a tool
  cannot see, signal or read ``/proc/<pid>/environ`` of any process outside its own server;
  and an IPC namespace of its own (``--unshare-ipc``).

The network stays shared: Corral reaches the server on 127.0.0.1, so anything else on
loopback (Redis, a database) must ask for a password (docs/security.md).

Plain functions, no Django import: the transports build the command line with them.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

#: Environment variables never handed to a llama-server (and so to its tools): Corral's
#: own secrets and addresses, and the doors to the account's other sessions (an agent
#: socket, the user's D-Bus through which ``systemd-run --user`` would start a command
#: outside the sandbox).
SECRET_NAMES = frozenset({
    "SECRET_KEY", "DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE", "SSH_AUTH_SOCK", "SSH_AGENT_PID",
    "DBUS_SESSION_BUS_ADDRESS", "XDG_RUNTIME_DIR", "PGPASSWORD", "PGPASSFILE", "PGSERVICEFILE",
    "SUPERVISOR_SERVER_URL", "SUPERVISOR_PROCESS_NAME", "SUPERVISOR_GROUP_NAME", "SUPERVISOR_ENABLED",
})
#: Prefixes of Corral's own settings (``CORRAL_*``), Celery's, Django's; and names that
#: say what they hold (``…_PASSWORD``, ``…_TOKEN``, ``…_SECRET``, ``…_API_KEY``).
SECRET_PATTERN = re.compile(r"^(CORRAL_|CELERY_|DJANGO_)|(PASSWORD|PASSWD|TOKEN|SECRET|API_KEY|PRIVATE_KEY)",
                            re.IGNORECASE)


def server_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without :data:`SECRET_NAMES` and the names :data:`SECRET_PATTERN`
    matches: what a llama-server started from a Corral process is given. The rest (PATH,
    HOME, locale, the GPU's ``CUDA_*`` and ``GGML_*`` settings) is kept."""
    return {name: value for name, value in environ.items()
            if name not in SECRET_NAMES and not SECRET_PATTERN.search(name)}


@dataclass(frozen=True)
class Sandbox:
    """What one server's sandbox hides and lets through; every path absolute, on the
    machine that runs the server.

    ``hide``: directories replaced by an empty tmpfs (Corral's private directories);
    ``read_only``: directories left visible but not writable (Corral's code);
    ``mask``: files replaced by an empty one (secrets outside the hidden directories; each
    must exist, or bubblewrap cannot mount over it);
    ``read``: files bound back read-only at their own path (the model, the key file);
    ``write``: directories bound back writable (the server's own slot directory).
    """

    hide: tuple[str, ...] = ()
    read_only: tuple[str, ...] = ()
    mask: tuple[str, ...] = ()
    read: tuple[str, ...] = ()
    write: tuple[str, ...] = field(default=())

    def with_hidden(self, *dirs: str, read_only: tuple[str, ...] = (), mask: tuple[str, ...] = ()) -> Sandbox:
        """This sandbox with more to hide (what the transport knows of its own machine)."""
        return Sandbox(self.hide + tuple(dirs), self.read_only + read_only, self.mask + mask, self.read, self.write)


def _inside(path: str, root: str) -> bool:
    root = posixpath.normpath(root)
    path = posixpath.normpath(path)
    return path == root or path.startswith(root.rstrip("/") + "/")


def bwrap_argv(bwrap: str, sandbox: Sandbox, argv: list[str]) -> list[str]:
    """The command line that runs ``argv`` inside ``sandbox`` with the bubblewrap at
    ``bwrap``. bubblewrap applies its options in order, so: the whole file system, then
    read-only code, then the hidden directories, then what is bound back into them.

    A path to bind back that lies outside every hidden directory is visible anyway and is
    left alone; a masked file inside a hidden one is gone already. No
    ``--die-with-parent``: a server outlives Corral on purpose (docs/behaviour.md §5), and
    no ``--new-session``: the server keeps the process group Corral made for it, so a stop
    reaches everything in the sandbox (the server has no terminal to be fed keystrokes)."""
    out = [bwrap, "--bind", "/", "/", "--unshare-pid", "--unshare-ipc", "--proc", "/proc"]
    for path in dict.fromkeys(sandbox.read_only):
        out += ["--ro-bind", path, path]
    hidden = list(dict.fromkeys(sandbox.hide))
    for path in hidden:
        out += ["--tmpfs", path]
    for path in dict.fromkeys(sandbox.mask):
        if not any(_inside(path, root) for root in hidden):
            out += ["--ro-bind", "/dev/null", path]
    for path in dict.fromkeys(p for p in sandbox.read if p):
        if any(_inside(path, root) for root in hidden):
            out += ["--ro-bind", path, path]
    for path in dict.fromkeys(p for p in sandbox.write if p):
        if any(_inside(path, root) for root in hidden):
            out += ["--bind", path, path]
    return [*out, *argv]


#: A sandbox that must start for bubblewrap to count as working on a machine: installed is
#: not enough where the kernel forbids the namespaces it needs.
PROBE_OPTIONS = ["--bind", "/", "/", "--unshare-pid", "--unshare-ipc", "--proc", "/proc", "true"]


def probe_argv(bwrap: str) -> list[str]:
    """The command that tells whether ``bwrap`` can make a sandbox on a machine (exit 0)."""
    return [bwrap, *PROBE_OPTIONS]


def local_secrets(data_dir: str, code_dirs: list[str], secret_files: list[str]) -> Sandbox:
    """What a server on the machine Corral runs on must not reach: ``data_dir`` hidden,
    ``code_dirs`` read-only (a tool that rewrote Corral's code would run as Corral at its
    next start), the existing ``secret_files`` outside it masked, and the account's runtime
    directory (``/run/user/<uid>``: its D-Bus and systemd, which start commands outside any
    sandbox) hidden when there is one."""
    hide = [data_dir]
    runtime = f"/run/user/{os.getuid()}"
    if os.path.isdir(runtime):
        hide.append(runtime)
    code = [path for path in dict.fromkeys(code_dirs) if path and os.path.isdir(path)]
    masked = [path for path in dict.fromkeys(secret_files) if path and os.path.isfile(path)]
    return Sandbox(hide=tuple(hide), read_only=tuple(code), mask=tuple(masked))

"""A model file's chat template file (docs/behaviour.md §17): which files may be one, and
keeping its text from the people who watch a session.

llama-server reads the whole file as the template, renders every prompt with it and, when
it cannot parse it, quotes it in its log. So a file that holds a secret — ``/etc/shadow``,
``/proc/self/environ``, an SSH key, Corral's own data directory — would reach the model
and, through a failed start's log lines, every watcher of the session and its export.
:func:`check_template_file` refuses such a file by where it lies (after following every
link on the machine), and anything that is not a readable regular file of a template's
size; :func:`without_template_lines` takes the file's lines out of a log tail.
"""

from __future__ import annotations

import posixpath

from django.conf import settings

from .transports import Transport
from .workspaces import inside

#: The largest template file taken, in bytes: real ones are a few KB (Qwen's 4 KB, a long
#: tool-calling one 20 KB).
MAX_TEMPLATE_BYTES = 256 * 1024

#: Directories of the system whose files are secrets or not files at all.
SYSTEM_DIRS = ("/etc", "/proc", "/sys", "/dev", "/run", "/boot")

#: Directories, anywhere, that hold an account's keys and credentials.
SECRET_DIR_NAMES = frozenset({".ssh", ".gnupg", ".aws", ".kube", ".docker", ".password-store", ".corral"})

#: File names that hold keys, by their usual spelling (``id_ed25519``, ``server.pem``…).
SECRET_SUFFIXES = (".pem", ".key", ".p12", ".pfx", ".kdbx", ".keystore", ".jks")
SECRET_NAMES = frozenset({".env", ".netrc", ".pgpass", "secret_key", "shadow"})

#: A log line is left out when it holds this many characters of the file in a row (a Jinja
#: error quotes a window of the template around the fault, cut anywhere), or is one of the
#: file's lines, however short.
QUOTED_RUN = 12

#: llama-server's phrases that the template's text follows on the same line: the line is
#: kept up to the phrase (its own words), the rest is not shown.
TEMPLATE_FOLLOWS = ("chat template is not supported:", "chat_template:")

#: What stands in a log tail for the lines left out.
LEFT_OUT = "(lines quoting the chat template file are not shown)"


class TemplateFileRefused(Exception):
    """A chat template file that cannot be used; the message says why, in the admin's terms."""


def secret_location(real: str, *, private_dirs: tuple[str, ...] = ()) -> str | None:
    """Why the resolved path ``real`` is a secret by where it lies, or None.

    Refused: the system's directories (:data:`SYSTEM_DIRS`), any directory of keys or
    credentials (:data:`SECRET_DIR_NAMES`: ``~/.ssh`` of any account…), key files by name
    (``id_*``, :data:`SECRET_SUFFIXES`, :data:`SECRET_NAMES`), and ``private_dirs``
    (Corral's own directories on that machine). A pure function of the strings."""
    for root in SYSTEM_DIRS:
        if inside(real, root):
            return f"it is under {root}, where the system keeps its secrets and devices"
    for directory in private_dirs:
        if directory and inside(real, directory):
            return f"it is in {directory}, Corral's own directory (its database, keys and secrets)"
    parts = real.split("/")
    for part in parts[:-1]:
        if part in SECRET_DIR_NAMES:
            return f"it is in a {part} directory, where keys and credentials are kept"
    name = parts[-1]
    lowered = name.lower()
    if lowered.startswith("id_") or lowered.endswith(SECRET_SUFFIXES) or lowered in SECRET_NAMES:
        return f"{name} is named like a key or a credentials file"
    return None


def corral_dirs(transport: Transport, *, local: bool) -> tuple[str, ...]:
    """Corral's own directories on the machine behind ``transport``: its private directory
    there (slots, logs, keys while a server starts) and, on a machine a Corral host runs on
    (``local``), that host's data directory (database, secret key, SSH keys of the other
    machines, images) as its own transport says it (``own_secrets``: another host's, asked
    of that host through machines_app/transports/relay.py, is its own, not this one's)."""
    found = [transport.real_path(transport.private_dir())]
    if local:
        found += [transport.real_path(directory) for directory in transport.own_secrets().hide]
        found.append(transport.real_path(str(settings.DATA_DIR)))
        database = settings.DATABASES["default"]
        if "sqlite" in database.get("ENGINE", "") and str(database.get("NAME", "")).startswith("/"):
            found.append(transport.real_path(str(database["NAME"])))
    return tuple(found)


def check_template_file(transport: Transport, path: str, machine_name: str, *, local: bool) -> tuple[str, str]:
    """The chat template file ``path`` (absolute, or ``~``/``~/…``) as it may be used on
    the machine behind ``transport``: ``(its real path there, its text)``.

    Raises TemplateFileRefused, naming the file, for a relative path or one with a
    control character, a secret by location (:func:`secret_location`, checked on the path
    with every link followed on the machine, so a link to ``/etc/shadow`` is refused too),
    anything but a regular file, a file Corral cannot read there, and one larger than
    :data:`MAX_TEMPLATE_BYTES`. Raises TransportError when the machine cannot be asked.
    ``local``: the machine is the one Corral runs on (its data directory is refused too).
    """
    if not (path.startswith("/") or path == "~" or path.startswith("~/")):
        raise TemplateFileRefused("Give an absolute path on the machine, or one under ~ (~/x.jinja).")
    if any(ord(c) < 32 for c in path):
        raise TemplateFileRefused("A template file's path cannot hold a control character.")
    real = transport.real_path(path)
    shown = path if posixpath.normpath(path) == real else f"{path} (which leads to {real})"
    why = secret_location(real, private_dirs=corral_dirs(transport, local=local))
    if why is not None:
        raise TemplateFileRefused(f"{shown} cannot be a chat template: {why}.")
    if not transport.is_own_file(real):
        if transport.is_dir(real):
            raise TemplateFileRefused(f"There is no file {shown} on {machine_name}: it is a directory.")
        if transport.is_file(real):
            raise TemplateFileRefused(f"There is no file {shown} on {machine_name}: it is not a regular file.")
        raise TemplateFileRefused(f"There is no file {shown} on {machine_name}.")
    try:
        data = transport.read_head(real, MAX_TEMPLATE_BYTES + 1)
    except OSError as exc:
        raise TemplateFileRefused(f"{shown} on {machine_name} cannot be read by Corral ({exc.strerror or exc}).") from None
    if len(data) > MAX_TEMPLATE_BYTES:
        raise TemplateFileRefused(
            f"{shown} is larger than {MAX_TEMPLATE_BYTES // 1024} KB: that is not a chat template."
        )
    return real, data.decode("utf-8", "replace")


def without_template_lines(log_tail: str, template_text: str | None) -> str:
    """``log_tail`` without what quotes the template file whose text is ``template_text``.

    llama-server prints the template as it starts and after "the supplied chat template
    is not supported:", and a Jinja error quotes a window of it around the fault, its
    line breaks written ``↵``. So a log line is left out when it is one of the file's
    lines, holds :data:`QUOTED_RUN` characters of the file in a row (``↵`` read as a line
    break), or is such an error's excerpt (``↵`` in it) or caret line; a line with one of
    :data:`TEMPLATE_FOLLOWS` is kept up to that phrase. The lines left out are said by one
    :data:`LEFT_OUT` line where the first of them stood. ``template_text`` None (the
    file could not be read back): nothing can be told apart, so the whole tail is
    :data:`LEFT_OUT`.
    """
    if template_text is None:
        return LEFT_OUT if log_tail.strip() else log_tail
    lines = {line.strip() for line in template_text.splitlines() if line.strip()}
    runs = {template_text[i:i + QUOTED_RUN] for i in range(max(0, len(template_text) - QUOTED_RUN + 1))}
    kept: list[str] = []
    said = False
    for line in log_tail.splitlines():
        for phrase in TEMPLATE_FOLLOWS:
            at = line.find(phrase)
            if at >= 0:
                line = line[:at + len(phrase)] + " (the file's text is not shown)"
                break
        plain = line.replace("\u21b5", "\n")
        quoted = (
            line.strip() in lines or "\u21b5" in line or (line.strip() and not line.strip("^ ~"))
            or any(plain[i:i + QUOTED_RUN] in runs for i in range(len(plain) - QUOTED_RUN + 1))
        )
        if quoted:
            if not said:
                kept.append(LEFT_OUT)
                said = True
            continue
        kept.append(line)
    return "\n".join(kept)

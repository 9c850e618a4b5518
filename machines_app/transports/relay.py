"""Another host's local machine as a page reads it: its read-only answers asked of the host
that owns it (docs/operations.md, "More hosts").

Only the owner host reaches a local machine's files and processes, and often only one host
runs the web; a page that must check a working directory, a model directory, a template
file or bubblewrap on another host's local machine asks that host. :func:`reader_for` is
the transport a page reads a machine through: :func:`transport_for`'s, or for another
host's local machine a :class:`RelayTransport`. A task and a worker keep
:func:`transport_for`, so one on the wrong host still meets ElsewhereError (the health
watch relies on it: a host never judges another's server).

One call: :meth:`RelayTransport._ask` sends ``machines_app.tasks.machine_call`` (place,
method, JSON arguments, reply key) to the owner host's ``housekeeping.<host id>`` queue
(project/queues.py) and waits on the reply key with BLPOP, at most :data:`ANSWER_SECONDS`.
There :func:`answer` runs the method on that host's LocalTransport and :func:`reply`
pushes one JSON object to the key: ``{"ok": value}``, ``{"error": sentence, "permanent":
bool}`` (a TransportError, raised here with its own sentence; ``"elsewhere": true``
for an ElsewhereError) or ``{"oserror": [errno,
strerror, filename]}`` (a file that could not be read, raised here as that OSError).
Celery keeps no task results in this project (``CELERY_RESULT_BACKEND`` is None), and a
list read with BLPOP wakes the page the moment the answer is pushed. The call's message
expires after the bound too, so a host that comes back later never runs questions nobody
waits for; the reply key expires by itself.

Only the methods of :data:`READ_ONLY` travel, each with its arguments' types checked there;
``run_probe`` only with the memory probes of :data:`PROBES` and ``read_proc`` only for the
files of :data:`PROC_FILES`. Everything that acts — start, signal, write, remove, run a
tool — raises ElsewhereError here, as :func:`transport_for` does.
"""

from __future__ import annotations

import base64
import json
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import redis
from celery import current_app
from django.conf import settings

from project import queues
from project.channel_layer import channel_prefix

from ..memory import GPU_QUERY
from ..sandbox import Sandbox
from .base import CommandResult, ElsewhereError, FileInfo, ProcessId, Transport, TransportError
from .places import is_here, machine_place, transport_at, transport_for

#: Seconds a page waits for the owner host's answer to one call.
ANSWER_SECONDS = 10.0
#: The task that answers, on the owner host's housekeeping queue.
MACHINE_CALL = "machines_app.tasks.machine_call"
#: The most bytes one call's file reads may answer (a chat template is at most 256 KB; a
#: page reads no model heads: discovery runs on the owner host).
MAX_READ_BYTES = 4 * 1024 * 1024
#: The probes ``run_probe`` may run through the relay: memory and the GPUs (machines_app.memory).
PROBES = (
    ("cat", "/proc/meminfo"),
    tuple(GPU_QUERY),
    ("nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"),
)
#: The ``/proc/<pid>/`` files ``read_proc`` may read through the relay.
PROC_FILES = re.compile(r"(stat|status|task/\d+/children)")


def _bytes(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unbytes(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def _oserror(exc: OSError) -> dict:
    return {"oserror": [exc.errno, exc.strerror or str(exc), exc.filename]}


def _path(value: object) -> str:
    if not isinstance(value, str):
        raise TransportError(f"a path must be text, not {type(value).__name__}")
    return value


def _count(value: object, most: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TransportError(f"{value!r} is not a count")
    if most is not None and value > most:
        raise TransportError(f"a page may read at most {most} bytes of another host's machine in one call")
    return value


def _probe(argv: object) -> list[str]:
    if not isinstance(argv, list) or tuple(argv) not in PROBES:
        raise TransportError(f"the probe {argv!r} is not one a page may run on another host's machine")
    return list(argv)


def _proc_file(name: object) -> str:
    if not isinstance(name, str) or not PROC_FILES.fullmatch(name):
        raise TransportError(f"/proc/<pid>/{name} is not a file a page may read on another host's machine")
    return name


def _ranges(transport: Transport, ranges: object) -> list[str | dict]:
    if not isinstance(ranges, list):
        raise TransportError("the ranges must be a list")
    checked = [(_path(path), _count(offset), _count(nbytes)) for path, offset, nbytes in ranges]
    _count(sum(nbytes for _path_, _offset, nbytes in checked), MAX_READ_BYTES)
    return [_bytes(part) if isinstance(part, bytes) else _oserror(part) for part in transport.read_ranges(checked)]


def _file_info(info: FileInfo | None) -> list | None:
    return [info.kind, info.size] if info is not None else None


#: The read-only methods a page may ask of another host's local machine: name → what runs
#: there with the JSON arguments, answering JSON.
READ_ONLY: dict[str, Callable[..., Any]] = {
    "expand_path": lambda t, path: t.expand_path(_path(path)),
    "real_path": lambda t, path: t.real_path(_path(path)),
    "is_dir": lambda t, path: t.is_dir(_path(path)),
    "is_file": lambda t, path: t.is_file(_path(path)),
    "is_own_file": lambda t, path: t.is_own_file(_path(path)),
    "file_info": lambda t, path: _file_info(t.file_info(_path(path))),
    "read_head": lambda t, path, nbytes, offset=0: _bytes(t.read_head(_path(path), _count(nbytes, MAX_READ_BYTES),
                                                                      _count(offset))),
    "read_ranges": _ranges,
    "list_gguf_stamped": lambda t, models_dir: t.list_gguf_stamped(_path(models_dir)),
    "list_files": lambda t, directory: t.list_files(_path(directory)),
    "find_bwrap": lambda t, name: list(t.find_bwrap(_path(name))),
    "own_secrets": lambda t: asdict(t.own_secrets()),
    "private_dir": lambda t: t.private_dir(),
    "process_alive": lambda t, pid, start_time: t.process_alive(ProcessId(_count(pid), _path(start_time))),
    "read_proc": lambda t, pid, name: t.read_proc(_count(pid), _proc_file(name)),
    "run_probe": lambda t, argv: t.run_probe(_probe(argv)),
}


def answer(place: dict, method: str, args: list) -> dict:
    """What the owner host answers to one call (see the module's text): ``method`` of
    :data:`READ_ONLY` run with ``args`` on the machine at ``place`` (a
    :func:`machine_place`), which must be this host's own (else the ElsewhereError's
    sentence comes back)."""
    call = READ_ONLY.get(method)
    try:
        if call is None:
            raise TransportError(f"{method!r} is not a read-only operation a page may ask of another host")
        if not isinstance(args, list):
            raise TransportError("the arguments must be a list")
        return {"ok": call(transport_at(place), *args)}
    except ElsewhereError as exc:
        return {"error": str(exc), "permanent": exc.permanent, "elsewhere": True}
    except TransportError as exc:
        return {"error": str(exc), "permanent": exc.permanent}
    except OSError as exc:
        return _oserror(exc)
    except (TypeError, ValueError) as exc:  # arguments of the wrong number or shape
        return {"error": f"{method} could not be asked that way: {exc}", "permanent": True}


def _redis(timeout: float) -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=5, socket_timeout=timeout)


def _reply_prefix() -> str:
    return channel_prefix(settings.REDIS_URL) + "machine-call:"


def reply(key: str, answer_: dict, ttl: float = ANSWER_SECONDS) -> None:
    """Push ``answer_`` (JSON) to the reply list ``key``, which lapses after ``2 × ttl``
    seconds when nobody reads it (the page stopped waiting)."""
    client = _redis(10)
    with client.pipeline() as pipe:
        pipe.rpush(key, json.dumps(answer_))
        pipe.expire(key, max(1, int(2 * ttl)))
        pipe.execute()


def owner_refusal(name: object, corral_host: str) -> str:
    return (f"Machine '{name}' is the local machine of the Corral host {corral_host}; a page reads it through that "
            "host, and only that host's workers act on it")


class RelayTransport(Transport):
    """Another host's local machine, read through that host (see the module's text).

    ``place``: its :func:`machine_place`. After one call the host did not answer, the
    others on this object say so at once (an admin page asks several things in a row)."""

    def __init__(self, place: dict) -> None:
        self.place = place
        self.name = str(place.get("name"))
        self.host = str(place.get("corral_host") or "")
        self._silent: TransportError | None = None
        self._lock = threading.Lock()

    def _ask(self, method: str, *args: object) -> Any:
        """Run ``method`` there; its JSON answer. Raises TransportError (the owner's
        sentence, or "did not answer within N s") or the OSError a file read met."""
        if self._silent is not None:
            raise self._silent
        bound = ANSWER_SECONDS
        key = _reply_prefix() + uuid.uuid4().hex
        client = _redis(bound + 5)
        try:
            current_app.send_task(MACHINE_CALL, args=(self.place, method, list(args), key),
                                  queue=queues.on_host(queues.HOUSEKEEPING, self.host), expires=bound)
            got = client.blpop([key], timeout=bound)
        except Exception as exc:  # kombu and redis raise many kinds: the page says why, never a 500
            raise TransportError(f"could not ask the Corral host {self.host} about machine '{self.name}': {exc}",
                                 permanent=False) from None
        finally:
            client.close()
        if got is None:
            with self._lock:
                self._silent = TransportError(
                    f"the Corral host {self.host} that runs machine '{self.name}' did not answer within {bound:g} s; "
                    "is its housekeeping worker running?", permanent=False)
            raise self._silent
        answered = json.loads(got[1])
        if "oserror" in answered:
            errno, strerror, filename = answered["oserror"]
            raise OSError(errno, strerror, filename) if filename is not None else OSError(errno, strerror)
        if answered.get("elsewhere"):  # the call reached a host that is not the machine's
            raise ElsewhereError(answered["error"], permanent=bool(answered.get("permanent", True)))
        if "error" in answered:
            raise TransportError(answered["error"], permanent=bool(answered.get("permanent", True)))
        return answered["ok"]

    def _refuse(self, what: str) -> ElsewhereError:
        return ElsewhereError(f"{owner_refusal(self.name, self.host)}: it cannot {what} from here.")

    # --- read-only: asked of the owner host ------------------------------------------------

    def expand_path(self, path: str) -> str:
        return self._ask("expand_path", path)

    def real_path(self, path: str) -> str:
        return self._ask("real_path", path)

    def is_dir(self, path: str) -> bool:
        return bool(self._ask("is_dir", path))

    def is_file(self, path: str) -> bool:
        return bool(self._ask("is_file", path))

    def is_own_file(self, path: str) -> bool:
        return bool(self._ask("is_own_file", path))

    def file_info(self, path: str) -> FileInfo | None:
        found = self._ask("file_info", path)
        return FileInfo(found[0], int(found[1])) if found is not None else None

    def read_head(self, path: str, nbytes: int, offset: int = 0) -> bytes:
        return _unbytes(self._ask("read_head", path, nbytes, offset))

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes | OSError]:
        answers: list[bytes | OSError] = []
        for part in self._ask("read_ranges", [list(r) for r in ranges]):
            if isinstance(part, dict):
                errno, strerror, filename = part["oserror"]
                answers.append(OSError(errno, strerror, filename))
            else:
                answers.append(_unbytes(part))
        return answers

    def list_gguf_stamped(self, models_dir: str) -> list[tuple[str, int, int]]:
        return [(str(key), int(size), int(mtime)) for key, size, mtime in self._ask("list_gguf_stamped", models_dir)]

    def list_files(self, directory: str) -> list[tuple[str, float]]:
        return [(str(name), float(mtime)) for name, mtime in self._ask("list_files", directory)]

    def find_bwrap(self, name: str) -> tuple[str, str]:
        path, reason = self._ask("find_bwrap", name)
        return str(path), str(reason)

    def own_secrets(self) -> Sandbox:
        found = self._ask("own_secrets")
        return Sandbox(**{field: tuple(value) for field, value in found.items()})

    def private_dir(self) -> str:
        return self._ask("private_dir")

    def process_alive(self, proc: ProcessId) -> bool:
        return bool(self._ask("process_alive", proc.pid, proc.start_time))

    def read_proc(self, pid: int, name: str) -> str:
        return self._ask("read_proc", pid, name)

    def run_probe(self, argv: list[str]) -> str | None:
        return self._ask("run_probe", list(argv))

    # --- what acts: only the owner host's workers ------------------------------------------

    def spawn(
        self, argv: list[str], log_path: str, cwd: str | None = None, *, bwrap: str = "", sandbox: Sandbox | None = None
    ) -> ProcessId:
        raise self._refuse("start a process there")

    def write_private(self, path: str, text: str) -> None:
        raise self._refuse("write a file there")

    def remove(self, path: str) -> None:
        raise self._refuse("remove a file there")

    def make_private_dir(self, path: str) -> None:
        raise self._refuse("make a directory there")

    def send_signal(self, proc: ProcessId, sig: int) -> None:
        raise self._refuse("signal a process there")

    def log_tail(self, log_path: str, lines: int = 15) -> str:
        raise self._refuse("read a server's log there")

    def base_url(self, port: int) -> str:
        raise self._refuse("reach a port there")

    def free_port(self) -> int:
        raise self._refuse("reach a port there")

    def _run_command(self, argv: list[str], *, cwd: str, timeout: float, max_output: int, stdin: bytes,
                     cancel: threading.Event | None) -> CommandResult:
        raise self._refuse("run a command there")


def reader_for(machine) -> Transport:
    """The transport a page reads ``machine`` through, for a read-only answer it needs
    now: :func:`transport_for`'s, or for another Corral host's local machine a
    :class:`RelayTransport` to that host. Never for a task or a worker: those must meet
    ElsewhereError on another host's local machine. Raises TransportError as
    :func:`transport_for` does."""
    if machine.transport == "local" and not is_here("local", machine.corral_host):
        return RelayTransport(machine_place(machine))
    return transport_for(machine)


def one_reader() -> Callable[[Any], Transport]:
    """:func:`reader_for` keeping one transport per machine: for a page that asks several
    questions (the new-session form: the model's directory, then the working directory),
    so a host that did not answer the first is not waited for again by the next."""
    made: dict[int, Transport] = {}

    def reach(machine) -> Transport:
        if machine.pk not in made:
            made[machine.pk] = reader_for(machine)
        return made[machine.pk]

    return reach

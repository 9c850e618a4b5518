"""Sampling profiles of a bench stack's processes with py-spy (``--profile DIR`` of
bench/many_sessions.py and bench/many_watchers.py).

py-spy (PyPI ``py-spy``, not in requirements.txt: ``.venv/bin/python -m pip install
py-spy``) samples a running process from outside, 100 times a second, without stopping it
(``--nonblocking``); each profile is written as collapsed stacks (``<name>.txt``) and
summed up by :func:`summary`: the functions most often on top of a stack (own time) and
most often anywhere in it (own time plus what they called), in percent of the samples
that found the process busy (idle threads are left out).
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

LINE_NUMBER = re.compile(r":\d+\)$")


def py_spy() -> str | None:
    """The py-spy beside this Python, or on PATH; None when neither exists."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


class Profiles:
    """py-spy recording each of ``pids`` (name → pid) for ``seconds`` into ``directory``,
    ``rate`` samples a second."""

    def __init__(self, pids: dict[str, int], directory: Path, seconds: float, rate: int = 100) -> None:
        exe = py_spy()
        if exe is None:
            raise SystemExit("--profile needs py-spy: .venv/bin/python -m pip install py-spy")
        directory.mkdir(parents=True, exist_ok=True)
        self.paths = {name: directory / f"{name}.txt" for name in pids}
        self.procs = [
            subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
                              "--rate", str(rate), "--nonblocking", "--format", "raw", "--output", str(self.paths[name])],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in pids.items()
        ]

    def wait(self) -> None:
        for proc in self.procs:
            proc.wait()

    def stop(self) -> None:
        """End the recordings now (before their ``seconds``): py-spy writes what it has on SIGINT."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        self.wait()

    def summaries(self, top: int = 15) -> list[str]:
        self.wait()
        return [line for name, path in self.paths.items() for line in summary(name, path, top)]


def summary(name: str, path: Path, top: int = 15) -> list[str]:
    """The top ``top`` functions of one profile by own samples and by samples anywhere in
    the stack, as printable lines."""
    own: Counter = Counter()
    anywhere: Counter = Counter()
    total = 0
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return [f"profile of {name}: none written ({path})"]
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [LINE_NUMBER.sub(")", frame) for frame in stack.split(";")
                  if not frame.startswith(("process ", "thread ("))]
        if not frames:
            continue
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            anywhere[frame] += n
    out = [f"profile of {name}: {total} busy samples ({path})"]
    out += ["  own time:"] + [f"    {c / total * 100:5.1f}%  {f}" for f, c in own.most_common(top)]
    out += ["  with callees:"] + [f"    {c / total * 100:5.1f}%  {f}" for f, c in anywhere.most_common(top)]
    return out

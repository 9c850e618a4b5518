"""Item 6 of bench/run.py: the live page at scale, each figure printed beside its goal.

- bench/many_sessions.py with 64 sessions of 50 tokens/s, two watchers each: delivered /
  sent (goal 1.000, in order), p95 delay from the stand-in writing a token to a watcher
  showing it (goal <= 100 ms), and the Redis commands and database writes per 100 tokens;
- bench/many_watchers.py with 50 and 200 watchers joining one streaming session: the
  largest live-token delay while they join (goal <= 100 ms), who-is-watching messages per
  watcher (goal: the same at 50 and 200, O(watchers) in all), and the Redis commands and
  database writes per join.

Each runs as a script of its own, on a stack of its own (a data directory and, unless
REDIS_URL names one, an embedded Redis of its own), one after the other, so none shares
the CPU with another's stack.
"""

from __future__ import annotations

import os
import subprocess
import sys

import _setup
from _setup import ROOT

RUNS = (
    ("many_sessions.py", ["--sessions", "64", "--watchers", "2", "--rate", "50", "--seconds", "10"], ("N=",)),
    ("many_watchers.py", ["--watchers", "50,200", "--rate", "50"], ("W=",)),
)


def lines() -> list[str]:
    """Run both benches; the lines to print under "6."."""
    env = {k: v for k, v in os.environ.items() if k != "CORRAL_DATA_DIR"}
    if _setup.REDIS is not None:  # the caller's embedded Redis: each bench starts its own
        env.pop("REDIS_URL", None)
    out = ["6. the live page at scale (bench/live_scale.py):"]
    for script, args, prefixes in RUNS:
        run = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                             env=env)
        out.append(f"   {script} {' '.join(args)}:")
        found = [f"     {line}" for line in run.stdout.splitlines() if line.startswith(prefixes)]
        out += found
        if run.returncode != 0 or not found:
            out.append(f"     {script} failed (exit {run.returncode}): {run.stderr.strip()[-2000:]}")
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print("\n".join(lines()))

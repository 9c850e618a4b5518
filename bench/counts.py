"""What a bench stack asks of Redis and the database, counted (not timed), so a change
that adds round trips shows as a number (bench/many_sessions.py, bench/many_watchers.py).

- Redis: the server's own ``INFO commandstats`` (every command any client sent: daphne,
  the workers, the bench itself), read before and after; a pipeline's commands
  count one each, a ``PUBLISH`` one however many subscribers it reaches.
- Database: the statements of every process of the stack, counted by
  bench/counting/sitecustomize.py (loaded into each process through ``PYTHONPATH`` when
  :data:`SQL_COUNTS_ENV` names a directory) by first word; writes are ``INSERT``,
  ``UPDATE`` and ``DELETE``.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

#: The environment variable naming the directory the stack's processes write counts to.
SQL_COUNTS_ENV = "CORRAL_BENCH_SQL_COUNTS"
COUNTING_PATH = Path(__file__).resolve().parent / "counting"
WRITES = ("INSERT", "UPDATE", "DELETE")


def redis_commands() -> Counter:
    """Calls per Redis command so far (``INFO commandstats``), e.g. ``{"publish": 120}``."""
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return Counter({name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()})


def sql_statements(directory: Path) -> Counter:
    """Statements per first word so far, summed over the stack's processes."""
    total: Counter = Counter()
    for path in directory.glob("*.json"):
        try:
            total.update(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # being replaced this instant: the next read has it
    return total


class Tally:
    """Redis commands and SQL statements between :meth:`start` and :meth:`stop`."""

    def __init__(self, sql_dir: Path) -> None:
        self.sql_dir = sql_dir
        self.redis: Counter = Counter()
        self.sql: Counter = Counter()

    def start(self) -> None:
        time.sleep(1)  # the processes' last counts written (every 0.5 s)
        self._redis, self._sql = redis_commands(), sql_statements(self.sql_dir)

    def stop(self) -> None:
        time.sleep(1)
        self.redis = redis_commands() - self._redis
        self.redis["info"] -= 1  # the bench's own read
        self.redis = +self.redis
        self.sql = sql_statements(self.sql_dir) - self._sql

    def line(self, per: float, unit: str) -> str:
        """``Redis N commands (publish a, …), database W writes (…) of S statements`` per ``unit``."""
        redis_total = sum(self.redis.values())
        top = ", ".join(f"{name} {calls / per:.1f}" for name, calls in self.redis.most_common(5))
        writes = sum(self.sql[w] for w in WRITES)
        statements = sum(v for k, v in self.sql.items() if k not in ("COMMIT", "CONNECT"))
        by_kind = ", ".join(f"{w.lower()} {self.sql[w] / per:.1f}" for w in WRITES)
        return (f"Redis {redis_total / per:.1f} commands ({top}); database {writes / per:.1f} writes "
                f"({by_kind}; {self.sql['COMMIT'] / per:.1f} commits) of {statements / per:.1f} statements "
                f"({self.sql['CONNECT'] / per:.2f} connections opened), "
                f"per {unit}")

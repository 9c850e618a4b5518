"""Counts the SQL statements of a bench stack's process (bench/counts.py), loaded at
interpreter start through ``PYTHONPATH`` by bench/_setup.py's Stack when
``CORRAL_BENCH_SQL_COUNTS`` names a directory; never loaded by ``./corral run``.

Every Django database connection the process opens gets an execute wrapper that counts
its statements by their first word (``INSERT``, ``UPDATE``, ``DELETE``, ``SELECT``, …)
and the transactions it commits; a daemon thread writes the counts to
``<dir>/<pid>.json`` every 0.5 s when they changed, so the bench reads them while the
process runs (it waits a second before reading).
"""

from __future__ import annotations

import os

DIRECTORY = os.environ.get("CORRAL_BENCH_SQL_COUNTS")

if DIRECTORY:
    import collections
    import json
    import threading
    import time

    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()

    def count(execute, sql, params, many, context):
        word = sql.lstrip().split(None, 1)[0].upper() if sql and sql.strip() else "?"
        with lock:
            counts[word] += len(params) if many and params is not None else 1
        return execute(sql, params, many, context)

    def watch(sender, connection, **kwargs):
        # connection_created is sent at every (re)connect of the same DatabaseWrapper, whose
        # execute_wrappers and commit outlive the connection: wrap them once, or every
        # statement counts once per reconnect so far (daphne's database thread reconnects).
        with lock:
            counts["CONNECT"] += 1
        if count in connection.execute_wrappers:
            return
        connection.execute_wrappers.append(count)
        commit = connection.commit

        def counted_commit():
            with lock:
                counts["COMMIT"] += 1
            return commit()

        connection.commit = counted_commit

    def dump():
        path = os.path.join(DIRECTORY, f"{os.getpid()}.json")
        written = None
        while True:
            time.sleep(0.5)
            with lock:
                text = json.dumps(counts)
            if text == written:
                continue
            written = text
            with open(path + ".tmp", "w") as out:
                out.write(text)
            os.replace(path + ".tmp", path)

    from django.db.backends.signals import connection_created

    connection_created.connect(watch, weak=False)
    threading.Thread(target=dump, name="bench-sql-counts", daemon=True).start()

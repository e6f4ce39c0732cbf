"""The handler of the queue-limit race tests, run by real worker processes:

    python -m sqla_proletarian worker flow_tasks:sleep --handler-mode advanced ...

with this folder on PYTHONPATH and ``FLOW_EVENTS`` naming the events file. Each run appends
``start <job_id> <key> <time> <pid>`` when it starts, sleeps ``payload["seconds"]``, and
appends ``end <job_id> <key> <time> <pid>`` (``time.time()``, one line per write, the file
opened in append mode), so a test can rebuild every run's interval from the handlers' own
clock. ``key`` is ``payload["key"]``, ``-`` without one.
"""

from __future__ import annotations

import os
import time
from typing import Any


def note(what: str, job: Any, at: float) -> None:
    key = job.payload.get("key") or "-"
    with open(os.environ["FLOW_EVENTS"], "a", encoding="utf-8") as events:
        events.write(f"{what} {job.job_id} {key} {at!r} {os.getpid()}\n")


def sleep(job: Any) -> None:
    note("start", job, time.time())
    time.sleep(job.payload["seconds"])
    note("end", job, time.time())

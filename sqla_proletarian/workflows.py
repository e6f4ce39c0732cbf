"""Workflows: jobs that run after other jobs, and the end of a job told to whoever waits.

A job enqueued with ``depends_on`` is written with one ``proletarian_dependency`` row per
dependency and ``waiting_on``, the number of them not yet ended. While ``waiting_on`` is above
0 its ``process_at`` is ``WAITING_AT`` (no poll reaches it) and ``due_at`` holds its own due
time. Whatever ends a job (success, failure, cancel) settles its dependents in the same
transaction (``settle``).
"""

from __future__ import annotations

from typing import Literal

#: What a dependent does when one of its dependencies fails or is cancelled.
OnDependencyFailure = Literal["cancel", "run"]

#: PostgreSQL: the channel a job's end is announced on (payload: the job id) when someone
#: waits for it (``wait_for_result``).
DONE_CHANNEL = "sqla_proletarian_done"

#: ``proletarian_dependency.kind`` of a ``wait_for_result`` caller's row.
WAIT_KIND = "wait"

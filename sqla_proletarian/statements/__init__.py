"""Every statement the worker runs, each built by a named function.

Statements are SQLAlchemy Core, built once and cached, so they stay portable and no
identifier is ever formatted into SQL text. Where servers differ, the function takes the
fact from ``dialects`` that decides the form. One module per part of the queue's life, each
the one named place of its queries:

- ``base``: the tables, the columns a claimed job is read with, shared delete helpers;
- ``claim``: the polls that lock due jobs, in claim order;
- ``enqueue``: inserting jobs (one, keyed, many);
- ``finish``: a claim's outcomes (archive, delete, retry);
- ``leases``: lease mode's claims, renewals and fenced ends;
- ``runs`` and ``owners``: the crash ledger's run records and their owners' locks;
- ``periodic``, ``pausing``, ``housekeeping``: schedules, paused queues, pruning;
- ``leased``, ``inspection``, ``dashboard``: reads of the queue from outside a worker;
- ``results``: jobs' results and the rows of those waiting for them;
- ``hot_path``: the registry of the statements a worker sends per claim and per job, each
  with when it runs and the index it reads (their plans are checked by a test).
"""

from sqla_proletarian.statements.base import (
    ARCHIVE,
    HISTORY,
    JOB,
    JOB_COLUMNS,
    PAUSED,
    PERIODIC,
    RUN,
    Statement,
)
from sqla_proletarian.statements.claim import (
    due_run_orders,
    first_entry,
    next_due,
    poll,
    poll_first,
    queue_ends,
    reclaim,
    relock,
)
from sqla_proletarian.statements.dashboard import (
    archived_job,
    archived_jobs,
    finished_by_minute,
    held_jobs,
    jobs_by_id,
    next_queue,
    queued_job,
    queued_jobs,
)
from sqla_proletarian.statements.enqueue import (
    ENQUEUED_COLUMNS,
    insert_job,
    insert_job_or_nothing,
    insert_jobs,
    key_holder,
)
from sqla_proletarian.statements.finish import (
    archive,
    archive_leased_succeeded,
    archive_succeeded,
    delete_job,
    delete_job_and_runs,
    end_claim_runs,
    end_runs,
    retry,
    set_results,
    snooze,
)
from sqla_proletarian.statements.housekeeping import (
    archived_batch,
    delete_archived,
    delete_history,
    history_of,
    keep_failures,
)
from sqla_proletarian.statements.inspection import (
    claimed_runs,
    data_version,
    delete_failure,
    due_job,
    failed_jobs,
    failures_to_retry,
    finished_counts,
    in_recovery,
    oldest_unclaimed,
    paused_names,
    probe_tables,
    queue_counts,
    queued_of_type,
    replica_status,
    requeue_failed,
    requeue_keyed,
    standby_lag,
    type_ends,
    wsrep_on,
    wsrep_recv_queue,
)
from sqla_proletarian.statements.leased import DUE_AT, leased_jobs, lock_to_cancel, request_cancel
from sqla_proletarian.statements.leases import (
    archive_lease,
    cancel_requested,
    complete_leases,
    end_lease,
    end_leases,
    expire_lease,
    lease,
    leases_held,
    leasing_poll,
    lock_leases,
    release_leases,
    renew_leases,
    retry_lease,
    snooze_lease,
)
from sqla_proletarian.statements.owners import (
    advisory_lock_tag,
    advisory_locks_held,
    hold_owner,
    owner_gone,
    release_owner,
    used_locks,
)
from sqla_proletarian.statements.pausing import (
    notify_queue,
    pause_queue,
    paused_queues,
    resume_queue,
)
from sqla_proletarian.statements.periodic import advance_schedule, schedules, start_schedule
from sqla_proletarian.statements.runs import end_run, end_runs_by_id, lose_runs, runs_of, start_runs

__all__ = [
    "ARCHIVE",
    "DUE_AT",
    "ENQUEUED_COLUMNS",
    "HISTORY",
    "JOB",
    "JOB_COLUMNS",
    "PAUSED",
    "PERIODIC",
    "RUN",
    "Statement",
    "advance_schedule",
    "advisory_lock_tag",
    "advisory_locks_held",
    "archive",
    "archive_lease",
    "archive_leased_succeeded",
    "archive_succeeded",
    "archived_batch",
    "archived_job",
    "archived_jobs",
    "cancel_requested",
    "claimed_runs",
    "complete_leases",
    "data_version",
    "delete_archived",
    "delete_failure",
    "delete_history",
    "delete_job",
    "delete_job_and_runs",
    "due_job",
    "due_run_orders",
    "end_claim_runs",
    "end_lease",
    "end_leases",
    "end_run",
    "end_runs",
    "end_runs_by_id",
    "expire_lease",
    "failed_jobs",
    "failures_to_retry",
    "finished_by_minute",
    "finished_counts",
    "first_entry",
    "held_jobs",
    "history_of",
    "hold_owner",
    "in_recovery",
    "insert_job",
    "insert_job_or_nothing",
    "insert_jobs",
    "jobs_by_id",
    "keep_failures",
    "key_holder",
    "lease",
    "leased_jobs",
    "leases_held",
    "leasing_poll",
    "lock_leases",
    "lock_to_cancel",
    "lose_runs",
    "next_due",
    "next_queue",
    "notify_queue",
    "oldest_unclaimed",
    "owner_gone",
    "pause_queue",
    "paused_names",
    "paused_queues",
    "poll",
    "poll_first",
    "probe_tables",
    "queue_counts",
    "queue_ends",
    "queued_job",
    "queued_jobs",
    "queued_of_type",
    "reclaim",
    "release_leases",
    "release_owner",
    "relock",
    "renew_leases",
    "replica_status",
    "request_cancel",
    "requeue_failed",
    "requeue_keyed",
    "resume_queue",
    "retry",
    "retry_lease",
    "runs_of",
    "schedules",
    "set_results",
    "snooze",
    "snooze_lease",
    "standby_lag",
    "start_runs",
    "start_schedule",
    "type_ends",
    "used_locks",
    "wsrep_on",
    "wsrep_recv_queue",
]

"""The hot path: every statement a worker sends per claim and per job, by name, in one place.

``HOT_PATH`` names each statement the worker executes while it claims, runs and finishes jobs,
in transaction mode and lease mode, one job a claim or a batch, with the crash ledger on or
off, on a queue with limits, with dependencies: name -> ``HotStatement``, whose ``build``
gives the statement and example parameters for a server (``dialects.Dialect``), whose
docstring says when it runs, and whose ``reads`` names the index through which it must read
each table. The statements themselves stay where they are built (``claim``, ``finish``,
``runs``, ``owners``, ``leases``, ``flow``, ``workflows``...): this module only refers to them.

``tests/integration/test_hot_path_plans.py`` EXPLAINs every entry on PostgreSQL and MariaDB in
tables whose statistics were never refreshed and checks the indexes named here; it also
drains queues in each mode and fails on a statement the worker sent that no entry names, so
a new statement on the hot path comes with its plan check. Importable without a database.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import Executable, text
from sqlalchemy.engine import Dialect as SQLDialect
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement

from sqla_proletarian.dialects import IDLE_LIMITS, WSREP_SETTINGS, Dialect
from sqla_proletarian.statements import (
    claim,
    finish,
    flow,
    inspection,
    leases,
    owners,
    progress,
    results,
    runs,
    workflows,
)
from sqla_proletarian.statements.base import ARCHIVE, JOB, LIMITS, PAUSED, RUN, SLOTS, STARTS
from sqla_proletarian.statements.workflows import DEPENDENCY

#: The indexes the hot path reads (MySQL and MariaDB call a primary key ``PRIMARY``).
POLL_INDEX = "ix_proletarian_job_poll"
JOB_ID_INDEX = "uq_proletarian_job_job_id"
RUN_JOB_INDEX = "ix_proletarian_job_run_job_id"
RUN_KEY = "pk_proletarian_job_run"
ARCHIVE_KEY = "pk_proletarian_archived_job"
DEPENDS_ON_INDEX = "ix_proletarian_dependency_depends_on"
PENDING_INDEX = "ix_proletarian_dependency_pending"
DEPENDENCY_KEY = "pk_proletarian_dependency"
PAUSED_KEY = "pk_proletarian_paused_queue"
LIMITS_KEY = "pk_proletarian_queue_limit"
SLOT_KEY = "pk_proletarian_slot"
START_KEY = "pk_proletarian_start"
START_WINDOW_INDEX = "ix_proletarian_start_window"

#: The tables that grow with the queue, the archive, the crash ledger and the job graphs:
#: no statement of the hot path may read one of them whole.
LARGE_TABLES = (JOB.name, ARCHIVE.name, RUN.name, DEPENDENCY.name)

Statement = tuple[Executable, Any]


@dataclass(frozen=True)
class HotStatement:
    """One statement of the hot path: how to build it, which servers send it, and the index
    it reads each table through (table name -> the indexes any of which will do)."""

    name: str
    build: Callable[[Dialect], Statement]
    reads: Mapping[str, frozenset[str]]
    sent_by: Callable[[Dialect], bool]

    @property
    def when(self) -> str:
        """When the worker sends it (the builder's docstring)."""
        return " ".join((self.build.__doc__ or "").split())

    def text(self, dialect: Dialect, sql_dialect: SQLDialect) -> str:
        """The SQL text the worker sends for it on ``sql_dialect`` (before an expanding IN
        list is rendered for its values)."""
        return compiled_text(*self.build(dialect), sql_dialect)


HOT_PATH: dict[str, HotStatement] = {}


def _everywhere(dialect: Dialect) -> bool:
    return True


def _hot(
    reads: Mapping[Any, str | tuple[str, ...]] | None = None,
    sent_by: Callable[[Dialect], bool] = _everywhere,
    name: str | None = None,
) -> Callable[[Callable[[Dialect], Statement]], Callable[[Dialect], Statement]]:
    """Register a builder in ``HOT_PATH`` under its own name (or ``name``)."""

    def register(build: Callable[[Dialect], Statement]) -> Callable[[Dialect], Statement]:
        key = name or build.__name__
        assert key not in HOT_PATH, key
        indexes = {
            getattr(table, "name", table): frozenset((index,) if isinstance(index, str) else index)
            for table, index in (reads or {}).items()
        }
        HOT_PATH[key] = HotStatement(key, build, indexes, sent_by)
        return build

    return register


def hot_path(dialect: Dialect) -> list[HotStatement]:
    """The entries of the statements ``dialect``'s server is sent."""
    return [entry for entry in HOT_PATH.values() if entry.sent_by(dialect)]


def compiled_text(statement: Executable, params: Any, sql_dialect: SQLDialect) -> str:
    """A statement's SQL text on a dialect, compiled as the worker's direct path compiles it:
    an INSERT or UPDATE names the columns of its parameters (the first row of many)."""
    row = params[0] if isinstance(params, list) else params
    keys = list(row) if getattr(statement, "is_dml", False) and isinstance(row, dict) else None
    compiled = cast(ClauseElement, statement).compile(dialect=sql_dialect, column_keys=keys)
    return cast(SQLCompiler, compiled).string


_PLACEHOLDER = re.compile(
    r"%\(\w+\)[sb]|%s|\$\d+|__\[POSTCOMPILE_\w+\]"
    # An empty expanding IN (or NOT IN) list, as SQLAlchemy renders it.
    r"|\(SELECT CAST\(NULL AS [\w ()\[\]]+?\) WHERE 1!=1\)"
    r"|\(NULL\) (?:AND \(1 != 1\)|OR \(1 = 1\))"
)
_CAST = re.compile(r"\?::(?:TIMESTAMP WITH(?:OUT)? TIME ZONE|[A-Z]+)(?:\(\d+\))?(?:\[\])?")
_GROUP = re.compile(r"\(\?(, \?)*\)")
_LIST = re.compile(r"\?(, \?)+")
_CASES = re.compile(r"(WHEN (?:\?|\([\w.]+ = \?\)) THEN \? )+")


def shape(sql_text: str) -> str:
    """A statement's text with its parameters left out: every placeholder, list of them
    (an expanding IN, an executemany's rows, a CASE per row) and cast of one read as one
    ``?``, so that the text the worker sent and the text an entry compiles to compare equal
    whatever the parameters' names and numbers."""
    shaped = _PLACEHOLDER.sub("?", " ".join(sql_text.split()))
    shaped = _CAST.sub("?", shaped)
    while True:
        folded = _LIST.sub("?", _GROUP.sub("?", shaped))
        folded = _CASES.sub("WHEN ? THEN ? ", folded)
        if folded == shaped:
            return shaped
        shaped = folded


# --- example values ---------------------------------------------------------------------------

QUEUE = "hot-path"
NOW = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
IDS = [uuid.UUID(int=n, version=4) for n in (1, 2, 3)]
TOKEN = uuid.UUID(int=7, version=4)
OWNER = "0123456789abcdef0123456789abcdef"
_JOB = {
    "job_id": IDS[0],
    "queue": QUEUE,
    "job_type": "work",
    "payload": "{}",
    "attempts": 0,
    "enqueued_at": NOW,
    "process_at": NOW,
    "due_at": None,
    "run_order": 0,
    "unique_key": None,
    "concurrency_key": None,
    "snoozes": 0,
}
_RUN_ROW = {
    "run_id": IDS[2],
    "job_id": IDS[0],
    "worker_id": "worker",
    "started_at": NOW,
    "owner": OWNER,
    "batched": False,
}


def _one_row(statement: Statement) -> Statement:
    """An executemany with its first row of parameters: the statement each row runs."""
    executable, rows = statement
    return executable, rows[0]


def _finds_priority(dialect: Dialect) -> bool:
    return dialect.poll_finds_priority


def _recursive(dialect: Dialect) -> bool:
    return dialect.priority_scan == "recursive"


def _hops(dialect: Dialect) -> bool:
    return dialect.priority_scan == "hops"


def _deletes_with_job(dialect: Dialect) -> bool:
    return dialect.deletes_runs_with_job


def _copies_to_archive(dialect: Dialect) -> bool:
    return not dialect.deletes_runs_with_job


def _notifies(dialect: Dialect) -> bool:
    return dialect.notifies


# --- claims: the polls ------------------------------------------------------------------------

#: The claim's forms: (name suffix, with_runs, excluding) for the crash ledger on, on with
#: jobs held back (their earlier run may still be going), and off (``max_unclean_ends=None``).
_LEDGER_FORMS = (("", True, False), ("_excluding", True, True), ("_untracked", False, False))


def _register_polls() -> None:
    for first in (True, False):
        for limited in (False, True):
            for suffix, with_runs, excluding in _LEDGER_FORMS:
                name = ("poll_first" if first else "poll") + ("_limited" if limited else "")
                reads: dict[Any, str | tuple[str, ...]] = {
                    JOB: POLL_INDEX,
                    PAUSED: PAUSED_KEY,
                }
                if not limited:
                    reads[LIMITS] = LIMITS_KEY
                if with_runs:
                    reads[RUN] = RUN_JOB_INDEX
                build = _poll_builder(first, limited, with_runs, excluding)
                _hot(reads, _finds_priority if first else _everywhere, name + suffix)(build)


def _poll_builder(
    first: bool, limited: bool, with_runs: bool, excluding: bool
) -> Callable[[Dialect], Statement]:
    held = IDS[1:] if excluding else None

    def build(dialect: Dialect) -> Statement:
        if first:
            return claim.poll_first(
                QUEUE, NOW, 10, with_runs=with_runs, excluding=held, limited=limited
            )
        return claim.poll(
            QUEUE, NOW, 10, run_order=0, with_runs=with_runs, excluding=held, limited=limited
        )

    build.__doc__ = (
        (
            "Every claim's first poll where the server finds the first due priority itself; "
            if first
            else "A claim's poll of one priority that has due jobs; "
        )
        + ("of a queue with limits (``flow``); " if limited else "")
        + {
            (True, False): "the crash ledger on: with the jobs' run counts.",
            (True, True): "the crash ledger on, jobs whose earlier run may still be going "
            "left out.",
            (False, False): "the crash ledger off (``max_unclean_ends=None``).",
        }[with_runs, excluding]
    )
    return build


_register_polls()


@_hot({JOB: POLL_INDEX, PAUSED: PAUSED_KEY}, _recursive)
def due_run_orders(dialect: Dialect) -> Statement:
    """A claim whose first poll took fewer jobs than it wants (or every claim, where the
    server cannot find the priority in the poll): the queue's priorities that have due jobs."""
    return claim.due_run_orders(QUEUE, NOW)


#: The read of the queues' ends is one statement whose text grows with the queues: its
#: forms for a worker of up to this many queues are entries (the plans of more are alike).
QUEUE_ENDS_FORMS = 4


def _queue_ends(queues: int) -> Callable[[Dialect], Statement]:
    def build(dialect: Dialect) -> Statement:
        """A claim after one that took nothing (and SQLite's first): both ends of each of
        the worker's queues' ranges of the poll index, in one statement; the queues it
        names are polled, none when it names none."""
        return claim.queue_ends(tuple(f"{QUEUE}-{n}" for n in range(queues)))

    return build


for _queues in range(1, QUEUE_ENDS_FORMS + 1):
    _hot({JOB: POLL_INDEX, PAUSED: PAUSED_KEY}, name=f"queue_ends_{_queues}")(_queue_ends(_queues))


@_hot({JOB: POLL_INDEX, PAUSED: PAUSED_KEY}, _recursive)
def next_due(dialect: Dialect) -> Statement:
    """An idle worker, after a poll that found nothing: when the queue's next job is due."""
    return claim.next_due(QUEUE)


@_hot({JOB: POLL_INDEX, PAUSED: PAUSED_KEY}, _recursive)
def due_job(dialect: Dialect) -> Statement:
    """A ``burst`` worker's wait for due jobs (and SQLite's claims, before they take the write
    lock): whether a job of its queues is due."""
    return inspection.due_job(QUEUE, NOW)


@_hot({JOB: POLL_INDEX, PAUSED: PAUSED_KEY}, _hops)
def first_entry(dialect: Dialect) -> Statement:
    """MySQL and MariaDB, every claim and idle poll: the queue's first priority and its
    earliest job (one entry of the poll index)."""
    return claim.first_entry(QUEUE)


@_hot({JOB: POLL_INDEX}, _hops)
def first_entry_after(dialect: Dialect) -> Statement:
    """MySQL and MariaDB, after ``first_entry``: the next priority, one hop each."""
    return claim.first_entry(QUEUE, after=0)


@_hot({JOB: JOB_ID_INDEX})
def relock(dialect: Dialect) -> Statement:
    """A job whose outcome could not be written: claimed again by id, to write it."""
    return claim.relock(IDS[0])


# --- a job's run: what its handler asks for ---------------------------------------------------


@_hot({DEPENDENCY: DEPENDENCY_KEY, ARCHIVE: ARCHIVE_KEY})
def dependency_results(dialect: Dialect) -> Statement:
    """A handler that reads ``job.dependency_results``: its dependencies' archive rows."""
    return results.dependency_results(IDS[0])


@_hot()
def write_progress(dialect: Dialect) -> Statement:
    """A handler that reports progress: at most once per ``progress_interval``, and when it
    returns, its progress row replaced."""
    (statement,) = progress.write_progress(dialect.archive_upsert, IDS[0], 0.5, "half", NOW)
    return statement


# --- the crash ledger -------------------------------------------------------------------------


@_hot()
def start_runs(dialect: Dialect) -> Statement:
    """The crash ledger on, every claim before its first handler: its run record (a batch's,
    one per job, in one executemany on MySQL and MariaDB)."""
    return runs.start_runs([dict(_RUN_ROW)])


@_hot({}, lambda dialect: dialect.bulk_insert_unnest)
def start_runs_batch(dialect: Dialect) -> Statement:
    """The crash ledger on, a claim of several jobs on PostgreSQL: their run records in one
    ``INSERT ... SELECT unnest(...)``."""
    run_ids = dict(zip(IDS[::-1], IDS, strict=True))
    return runs.start_batch_runs(run_ids, "worker", "owner", NOW)


@_hot({RUN: RUN_JOB_INDEX})
def runs_of(dialect: Dialect) -> Statement:
    """A claim of a job that has run records (an earlier run crashed, or may still be going)."""
    return runs.runs_of(IDS[0])


@_hot({RUN: RUN_JOB_INDEX})
def end_claim_runs(dialect: Dialect) -> Statement:
    """The end of a claim on MySQL and MariaDB (elsewhere, of a claim whose jobs all failed
    or were retried): the run records of the jobs it ended."""
    (statement,) = finish.end_claim_runs(IDS, {}, force_index=dialect.force_index)
    return statement


@_hot({RUN: (RUN_JOB_INDEX, RUN_KEY)})
def end_runs_by_id(dialect: Dialect) -> Statement:
    """The end of a claim: its own run records of the jobs it did not end (retried, not
    started); a claim given up: all of them."""
    return runs.end_runs_by_id(zip(IDS, IDS[::-1], strict=True), force_index=dialect.force_index)


@_hot({RUN: RUN_JOB_INDEX})
def end_runs(dialect: Dialect) -> Statement:
    """A job archived on its own (failed, cancelled, a lease's end) where its run records
    do not go in the same statement."""
    return finish.end_runs(IDS[0])


@_hot({RUN: RUN_KEY})
def lose_runs(dialect: Dialect) -> Statement:
    """A claim that lost its connection while a handler ran: its run records lose their owner."""
    return runs.lose_runs(IDS[:2], "lost")


@_hot(sent_by=lambda dialect: dialect.owner_lock in ("advisory", "named"))
def hold_owner(dialect: Dialect) -> Statement:
    """A worker's start (and its keeper, after a lost session): the lock that shows its run
    records' owner alive."""
    return owners.hold_owner(cast(Any, dialect.owner_lock), OWNER)


@_hot(sent_by=lambda dialect: dialect.owner_lock in ("advisory", "named"))
def release_owner(dialect: Dialect) -> Statement:
    """A worker's stop: the owner lock given back."""
    return owners.release_owner(cast(Any, dialect.owner_lock), OWNER)


@_hot(sent_by=lambda dialect: dialect.owner_lock in ("advisory", "named"))
def owner_gone(dialect: Dialect) -> Statement:
    """A claim that found a job's run records: whether their owner's session has ended."""
    return owners.owner_gone(cast(Any, dialect.owner_lock), OWNER)


@_hot(sent_by=lambda dialect: bool(dialect.ledger_setup))
def ledger_setup(dialect: Dialect) -> Statement:
    """A run-record connection taken from the pool: its session settings."""
    return text(dialect.ledger_setup[0]), {}


@_hot(sent_by=lambda dialect: bool(dialect.ledger_reset))
def ledger_reset(dialect: Dialect) -> Statement:
    """A run-record connection given back to the pool: its settings undone."""
    return text(dialect.ledger_reset[0]), {}


@_hot()
def keeper_check(dialect: Dialect) -> Statement:
    """The owner lock's keeper, every few seconds: whether its session is still there."""
    return text("SELECT 1"), {}


@_hot(sent_by=lambda dialect: dialect.name in ("mysql", "mariadb"))
def idle_limits(dialect: Dialect) -> Statement:
    """A worker's first claim connection on MariaDB: the session's idle-transaction limits."""
    return text(IDLE_LIMITS), {}


@_hot(sent_by=lambda dialect: dialect.name in ("mysql", "mariadb"), name="galera_check")
def wsrep_settings(dialect: Dialect) -> Statement:
    """A worker's creation (once per engine) on MySQL and MariaDB: whether the server is a
    node of a Galera cluster, where transaction mode is refused."""
    return text(WSREP_SETTINGS), {}


# --- a claim's end: transaction mode ----------------------------------------------------------


def _archive_succeeded(dialect: Dialect) -> list[Statement]:
    return finish.archive_succeeded(
        IDS,
        IDS,
        {IDS[0]: IDS[2]},
        NOW,
        upsert=dialect.archive_upsert,
        returning=dialect.deletes_runs_with_job,
        force_index=dialect.force_index,
    )


@_hot(
    {
        JOB: JOB_ID_INDEX,
        RUN: (RUN_JOB_INDEX, RUN_KEY),
        DEPENDENCY: (DEPENDS_ON_INDEX, PENDING_INDEX),
    },
    _deletes_with_job,
)
def archive_succeeded(dialect: Dialect) -> Statement:
    """The end of a claim with succeeded jobs on PostgreSQL: one statement deletes them,
    archives them, removes the claim's run records and counts the rows waiting for them."""
    (statement,) = _archive_succeeded(dialect)
    return statement


@_hot({JOB: JOB_ID_INDEX}, _copies_to_archive)
def archive_succeeded_copy(dialect: Dialect) -> Statement:
    """The end of a claim with succeeded jobs on MySQL and MariaDB: their archive rows,
    copied from their queue rows."""
    return _archive_succeeded(dialect)[0]


@_hot({JOB: JOB_ID_INDEX})
def delete_jobs(dialect: Dialect) -> Statement:
    """The end of a claim with succeeded jobs on MySQL and MariaDB, after their copy (in lease
    mode too, its grouped ends): the jobs' rows."""
    _, delete = leases.end_leases(IDS, [TOKEN], force_index=dialect.force_index)
    return delete, {"ids": IDS}


@_hot({ARCHIVE: ARCHIVE_KEY})
def set_results(dialect: Dialect) -> Statement:
    """The end of a claim whose handlers returned results: each stored in its archive row."""
    return finish.set_results({IDS[0]: "1"})


@_hot({JOB: JOB_ID_INDEX})
def retry(dialect: Dialect) -> Statement:
    """A transaction-mode job that raised and has retries left: its next run scheduled."""
    return finish.retry(IDS[0], NOW)


@_hot({JOB: JOB_ID_INDEX})
def snooze(dialect: Dialect) -> Statement:
    """A transaction-mode job that snoozed: put back, due later."""
    return finish.snooze(IDS[0], NOW)


@_hot()
def archive(dialect: Dialect) -> Statement:
    """A job archived on its own (failed, cancelled, crashed too often), and lease mode's
    grouped ends (one executemany): its archive row."""
    return finish.archive(
        _JOB,
        status="failure",
        attempts=1,
        finished_at=NOW,
        error="error",
        upsert=dialect.archive_upsert,
    )


@_hot({JOB: JOB_ID_INDEX})
def delete_job(dialect: Dialect) -> Statement:
    """A job archived on its own: its queue row."""
    return finish.delete_job(IDS[0])


@_hot({JOB: JOB_ID_INDEX, RUN: RUN_JOB_INDEX}, _deletes_with_job)
def delete_job_and_runs(dialect: Dialect) -> Statement:
    """A job archived on its own on PostgreSQL: its queue row and its run records at once."""
    return finish.delete_job_and_runs(IDS[0])


# --- dependencies: the settle at a job's end, and the sweep -----------------------------------


def _settles_in_one(dialect: Dialect) -> bool:
    return dialect.settles_in_one


@_hot({DEPENDENCY: (DEPENDS_ON_INDEX, PENDING_INDEX)}, lambda dialect: not dialect.settles_in_one)
def pending_on(dialect: Dialect) -> Statement:
    """The end of jobs something waits for (elsewhere than PostgreSQL, of any job): the rows
    waiting for them, locked."""
    return workflows.pending_on(IDS)


@_hot({DEPENDENCY: (DEPENDS_ON_INDEX, PENDING_INDEX, DEPENDENCY_KEY)}, _settles_in_one)
def settle_pending_on(dialect: Dialect) -> Statement:
    """PostgreSQL, the end of jobs something waits for: the rows waiting for them, locked
    and (but for waiters' rows) marked counted, in one statement."""
    return workflows.settle_pending_on(IDS)


@_hot({JOB: JOB_ID_INDEX})
def lock_dependents(dialect: Dialect) -> Statement:
    """The end of jobs with dependents: the dependents' rows, locked in id order."""
    return workflows.lock_dependents(IDS)


#: A row of the dependency table by its key: MariaDB reads it through the depends_on index
#: on a small table, as good (a few entries).
_EDGE: dict[Any, str | tuple[str, ...]] = {DEPENDENCY: (DEPENDENCY_KEY, DEPENDS_ON_INDEX)}


@_hot(_EDGE, lambda dialect: not dialect.settles_in_one)
def settle_edges(dialect: Dialect) -> Statement:
    """The end of jobs with dependents: their rows marked settled."""
    return _one_row(workflows.settle_edges([(IDS[1], IDS[0])]))


@_hot(_EDGE)
def drop_waits(dialect: Dialect) -> Statement:
    """The end of a job that ``wait_for_result`` callers wait for: their rows."""
    return _one_row(workflows.drop_waits([(IDS[1], IDS[0])]))


@_hot({DEPENDENCY: DEPENDENCY_KEY})
def unlocked_pending_after(dialect: Dialect) -> Statement:
    """The end of a job with dependents: for each dependent, one of its rows still pending
    that no end is counting right now, share-locked, read from the ended job's row on."""
    return workflows.unlocked_pending_of(IDS[1], IDS[0], after=True)


@_hot({DEPENDENCY: DEPENDENCY_KEY})
def unlocked_pending_before(dialect: Dialect) -> Statement:
    """The end of a job with dependents, for a dependent that has no such row after the
    ended job's: one before it (none either: maybe this end is the last)."""
    return workflows.unlocked_pending_of(IDS[1], IDS[0], after=False)


@_hot({DEPENDENCY: DEPENDENCY_KEY})
def any_pending_of(dialect: Dialect) -> Statement:
    """The end of a job whose dependent has no row left pending that no end is counting:
    whether any is pending (none: this end is the last, and releases the dependent)."""
    return workflows.any_pending_of(IDS[1])


@_hot(_EDGE)
def unsettle_edges(dialect: Dialect) -> Statement:
    """The end of a job whose dependent's other pending rows are all being counted by ends
    not committed yet: its row pending again, for a count after its commit."""
    return _one_row(workflows.unsettle_edges([(IDS[1], IDS[0])]))


@_hot({JOB: JOB_ID_INDEX})
def release_dependents(dialect: Dialect) -> Statement:
    """The end of a dependent's last dependency: the dependent made due."""
    return _one_row(workflows.release([IDS[1]]))


@_hot(sent_by=_notifies)
def notify(dialect: Dialect) -> Statement:
    """PostgreSQL, at a job's end: the ``wait_for_result`` callers of the job woken, and the
    workers of the queues where dependents became due (``notify_done``, ``notify_queue``:
    one statement, its channel a parameter)."""
    return workflows.notify_done(IDS[0])


@_hot({DEPENDENCY: PENDING_INDEX, JOB: JOB_ID_INDEX})
def stranded(dialect: Dialect) -> Statement:
    """A worker's sweep, at its polls every few seconds: ended jobs whose dependents no settle
    counted."""
    return workflows.stranded()


@_hot({ARCHIVE: ARCHIVE_KEY})
def ended_jobs(dialect: Dialect) -> Statement:
    """A sweep that found ended jobs, or a count of ends after their commit: their archive
    status."""
    return workflows.ended_jobs(IDS)


@_hot({JOB: JOB_ID_INDEX})
def live_jobs(dialect: Dialect) -> Statement:
    """A sweep that found ended jobs, or a count of ends after their commit: those still
    (or back) in the queue."""
    return workflows.live_jobs(IDS)


@_hot({DEPENDENCY: (DEPENDS_ON_INDEX, PENDING_INDEX)})
def waiting_on(dialect: Dialect) -> Statement:
    """A sweep that found ended jobs, or a count of ends after their commit: the rows
    waiting for them, read without a lock."""
    return workflows.waiting_on(IDS)


@_hot({DEPENDENCY: DEPENDENCY_KEY})
def lock_pending_of(dialect: Dialect) -> Statement:
    """A sweep that found ended jobs, or a count of ends after their commit: each
    dependent's rows still pending, locked in key order."""
    return workflows.lock_pending_of(IDS[1])


# --- lease mode -------------------------------------------------------------------------------


@_hot({JOB: JOB_ID_INDEX})
def lease(dialect: Dialect) -> Statement:
    """Lease mode, every claim elsewhere than PostgreSQL (there, of a queue with limits, or of
    jobs its poll did not lease): the jobs it locked leased under one token (their ids as an
    array where the dialect takes arrays)."""
    return leases.lease(IDS, TOKEN, "owner", NOW, NOW, arrays=dialect.id_arrays)


def _register_leasing_polls() -> None:
    for first in (True, False):
        for with_runs in (True, False):
            name = ("leasing_poll_first" if first else "leasing_poll") + (
                "" if with_runs else "_untracked"
            )
            reads: dict[Any, str | tuple[str, ...]] = {
                # The poll reads its range of the poll index; the lease, the rows it locked.
                JOB: (POLL_INDEX, JOB_ID_INDEX),
                PAUSED: PAUSED_KEY,
                LIMITS: LIMITS_KEY,
            }
            if with_runs:
                reads[RUN] = RUN_JOB_INDEX
            build = _leasing_poll_builder(first, with_runs)
            _hot(reads, _deletes_with_job, name)(build)


def _leasing_poll_builder(first: bool, with_runs: bool) -> Callable[[Dialect], Statement]:
    def build(dialect: Dialect) -> Statement:
        poll = _poll_builder(first, False, with_runs, False)(dialect)
        limit = 3 if with_runs else None
        return leases.leasing_poll(
            poll, TOKEN, "owner", NOW, NOW, with_runs=with_runs, unclean_limit=limit
        )

    build.__doc__ = (
        "Lease mode on PostgreSQL, a claim's "
        + ("first poll" if first else "poll of one priority that has due jobs")
        + " of a queue without limits, that leases the jobs it locks in the same statement "
        + (
            "(but those with a cancel request, run records or too many unclean ends); the "
            "crash ledger on."
            if with_runs
            else "(but those with a cancel request); the crash ledger off."
        )
    )
    return build


_register_leasing_polls()


def _complete_leases(results: list[str | None], doc: str) -> Callable[[Dialect], Statement]:
    def build(dialect: Dialect) -> Statement:
        runs = [(job_id, TOKEN, result) for job_id, result in zip(IDS, results, strict=False)]
        return leases.complete_leases(runs, NOW, upsert=dialect.archive_upsert)

    build.__doc__ = doc
    return build


_COMPLETE_LEASES_READS: dict[Any, str | tuple[str, ...]] = {
    JOB: JOB_ID_INDEX,
    DEPENDENCY: (DEPENDS_ON_INDEX, PENDING_INDEX),
}
_hot(_COMPLETE_LEASES_READS, _deletes_with_job, "complete_leases")(
    _complete_leases(
        [None, None],
        "Lease mode's grouped ends on PostgreSQL: one statement deletes the succeeded jobs "
        "that still carry their runs' tokens, archives them (as cancelled where a cancel was "
        "requested) and counts the rows waiting for them.",
    )
)
_hot(_COMPLETE_LEASES_READS, _deletes_with_job, "complete_leases_results")(
    _complete_leases(
        ["1", None],
        "Lease mode's grouped ends on PostgreSQL where a handler returned a result: as "
        "``complete_leases``, the results archived with their jobs.",
    )
)


@_hot({JOB: JOB_ID_INDEX}, _copies_to_archive)
def end_leases(dialect: Dialect) -> Statement:
    """Lease mode's grouped ends on MySQL and MariaDB: the succeeded jobs still carrying
    their tokens, locked (then ``archive_leased_succeeded_copy``)."""
    locking, _ = leases.end_leases(
        IDS, [TOKEN], force_index=dialect.force_index, arrays=dialect.id_arrays
    )
    return locking


@_hot({JOB: JOB_ID_INDEX}, _copies_to_archive)
def archive_leased_succeeded_copy(dialect: Dialect) -> Statement:
    """Lease mode's grouped ends on MySQL and MariaDB: the succeeded jobs' archive rows,
    copied from their queue rows (then ``delete_jobs``)."""
    return finish.archive_leased_succeeded(
        IDS, NOW, upsert=dialect.archive_upsert, force_index=dialect.force_index
    )[0]


def _archive_lease(status: str, doc: str) -> Callable[[Dialect], Statement]:
    def build(dialect: Dialect) -> Statement:
        return leases.archive_lease(
            IDS[0],
            TOKEN,
            status=status,
            attempts=1,
            finished_at=NOW,
            error=None,
            upsert=dialect.archive_upsert,
        )

    build.__doc__ = doc
    return build


_ARCHIVE_LEASE_READS: dict[Any, str | tuple[str, ...]] = {
    JOB: JOB_ID_INDEX,
    DEPENDENCY: (DEPENDS_ON_INDEX, PENDING_INDEX),
}
_hot(_ARCHIVE_LEASE_READS, _deletes_with_job, "archive_lease")(
    _archive_lease(
        "failure",
        "Lease mode on PostgreSQL, a job ended on its own (failed, or succeeded alone): "
        "removed where it still carries its token and no cancel was requested, and archived, "
        "in one statement.",
    )
)
_hot(_ARCHIVE_LEASE_READS, _deletes_with_job, "archive_lease_cancelled")(
    _archive_lease(
        "cancelled",
        "Lease mode on PostgreSQL, a job whose cancel was requested: removed where it still "
        "carries its token, and archived as cancelled.",
    )
)


@_hot({JOB: JOB_ID_INDEX})
def end_lease(dialect: Dialect) -> Statement:
    """Lease mode, a job ended on its own elsewhere than PostgreSQL (or with run records):
    removed where it still carries its token and no cancel was requested."""
    return leases.end_lease(IDS[0], TOKEN)


@_hot({JOB: JOB_ID_INDEX})
def end_lease_cancelled(dialect: Dialect) -> Statement:
    """Lease mode, a job whose cancel was requested: removed where it still carries its token."""
    return leases.end_lease(IDS[0], TOKEN, cancelling=True)


@_hot({JOB: JOB_ID_INDEX})
def cancel_requested(dialect: Dialect) -> Statement:
    """Lease mode, an outcome that found no row to write: whether a cancel was requested."""
    return leases.cancel_requested(IDS[0], TOKEN)


@_hot({JOB: JOB_ID_INDEX})
def retry_lease(dialect: Dialect) -> Statement:
    """Lease mode, a job that raised and has retries left: its next run scheduled."""
    return leases.retry_lease(IDS[0], TOKEN, NOW)


@_hot({JOB: JOB_ID_INDEX})
def snooze_lease(dialect: Dialect) -> Statement:
    """Lease mode, a job that snoozed: its lease given back, due later."""
    return leases.snooze_lease(IDS[0], TOKEN, NOW)


@_hot({JOB: JOB_ID_INDEX})
def lock_leases(dialect: Dialect) -> Statement:
    """Lease mode, every heartbeat: the worker's leases it can renew, locked."""
    return leases.lock_leases(IDS, [TOKEN])


@_hot({JOB: JOB_ID_INDEX})
def renew_leases(dialect: Dialect) -> Statement:
    """Lease mode, every heartbeat: the locked leases' expiry moved."""
    return leases.renew_leases(IDS, [TOKEN], NOW, NOW)


@_hot({JOB: JOB_ID_INDEX})
def leases_held(dialect: Dialect) -> Statement:
    """Lease mode, every heartbeat: which leases the worker still holds, and cancel requests."""
    return leases.leases_held(IDS, [TOKEN])


@_hot({JOB: JOB_ID_INDEX})
def release_leases(dialect: Dialect) -> Statement:
    """Lease mode, a stop before the handlers started: the leases given back, unrun."""
    return leases.release_leases(IDS, [TOKEN], ran=False)


@_hot({JOB: JOB_ID_INDEX})
def release_leases_ran(dialect: Dialect) -> Statement:
    """Lease mode, a lost connection or a stop that gave up on the handlers: the leases given
    back, their runs counted and not charged."""
    return leases.release_leases(IDS, [TOKEN], ran=True)


@_hot({JOB: JOB_ID_INDEX})
def expire_lease(dialect: Dialect) -> Statement:
    """Lease mode, a run whose session was lost: its lease ended now, for an unclean end."""
    return leases.expire_lease(IDS[0], TOKEN, NOW)


# --- limits -----------------------------------------------------------------------------------


@_hot({LIMITS: LIMITS_KEY})
def limits_of(dialect: Dialect) -> Statement:
    """A worker's first claim, and a claim that came back short (``limits.read_versions``):
    the limits of its queues."""
    return flow.limits_of([QUEUE])


@_hot({LIMITS: LIMITS_KEY})
def lock_limits(dialect: Dialect) -> Statement:
    """A queue with rate limits, a reservation of starts: its limit row, locked."""
    return flow.lock_limits(QUEUE)


@_hot({JOB: POLL_INDEX, PAUSED: PAUSED_KEY})
def candidates(dialect: Dialect) -> Statement:
    """A claim of a queue with per-key limits: due jobs in claim order, with their keys (first
    with no key full and no job seen)."""
    return flow.candidates(QUEUE, NOW, 50, full=[], seen=[])


@_hot({JOB: JOB_ID_INDEX, PAUSED: PAUSED_KEY, RUN: RUN_JOB_INDEX})
def lock_job(dialect: Dialect) -> Statement:
    """A claim of a queue with per-key limits, the crash ledger on: each candidate taken."""
    return flow.lock_job(IDS[0], QUEUE, NOW, with_runs=True)


@_hot({JOB: JOB_ID_INDEX, PAUSED: PAUSED_KEY})
def lock_job_untracked(dialect: Dialect) -> Statement:
    """A claim of a queue with per-key limits, the crash ledger off: each candidate taken."""
    return flow.lock_job(IDS[0], QUEUE, NOW, with_runs=False)


@_hot({SLOTS: SLOT_KEY, LIMITS: LIMITS_KEY, JOB: JOB_ID_INDEX})
def free_slots(dialect: Dialect) -> Statement:
    """A claim of a queue with a running limit: its free slots, locked."""
    return flow.free_slots(QUEUE, "", 5, 1, NOW, [2], NOW)


@_hot({JOB: JOB_ID_INDEX})
def live_leases(dialect: Dialect) -> Statement:
    """A claim that locked slots naming jobs: which of those leases are live."""
    return flow.live_leases(IDS, NOW)


@_hot({SLOTS: SLOT_KEY})
def slot_numbers(dialect: Dialect) -> Statement:
    """A claim that found no free slot: the slots that exist."""
    return flow.slot_numbers(QUEUE, [""])


@_hot()
def insert_slots(dialect: Dialect) -> Statement:
    """A claim that found fewer slots than the limit: the missing ones made."""
    return _one_row(flow.insert_slots([{"queue": QUEUE, "slot_key": "", "n": 1}], dialect.name))


@_hot({SLOTS: SLOT_KEY})
def name_holders(dialect: Dialect) -> Statement:
    """Lease mode, a claim that took slots: the slots name their jobs and the claim's token."""
    return flow.name_holders(QUEUE, "", {1: IDS[0], 2: IDS[1]}, TOKEN, dialect.name)


@_hot({STARTS: START_WINDOW_INDEX})
def starts_since(dialect: Dialect) -> Statement:
    """A reservation of starts under a rate limit: the starts in the window."""
    return flow.starts_since(QUEUE, [""], NOW)


@_hot()
def insert_starts(dialect: Dialect) -> Statement:
    """A reservation of starts under a rate limit: the starts reserved."""
    row = {"id": IDS[0], "queue": QUEUE, "slot_key": "", "started_at": NOW, "starts": 3}
    return _one_row(flow.insert_starts([row]))


@_hot({STARTS: START_KEY})
def unuse_starts(dialect: Dialect) -> Statement:
    """A reservation that gives back starts no claim used: each row counts fewer."""
    unuse, _ = flow.give_back_starts({IDS[0]: 1})
    return _one_row(unuse)


@_hot({STARTS: START_KEY})
def delete_spent_starts(dialect: Dialect) -> Statement:
    """A reservation that gives back starts no claim used: rows that count none deleted."""
    _, spent = flow.give_back_starts({IDS[0]: 1})
    return spent


@_hot()
def prune_starts(dialect: Dialect) -> Statement:
    """A reservation of starts, at most every few seconds: starts no window counts deleted
    (a table of a few rows a queue: not held to an index)."""
    return flow.prune_starts(QUEUE, NOW)


__all__ = [
    "HOT_PATH",
    "LARGE_TABLES",
    "HotStatement",
    "compiled_text",
    "hot_path",
    "shape",
]

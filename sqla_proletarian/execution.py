"""Transaction mode: claim a job, run its handler and record the outcome, all in one
transaction (the shared parts are in ``running``; lease mode is in ``leases``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, cast

from sqlalchemy import Connection
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from sqla_proletarian import direct, ledger, telemetry, workflows
from sqla_proletarian import statements as sql
from sqla_proletarian.dialects import dialect_of
from sqla_proletarian.errors import (
    JobCrashedError,
    JobTransactionLostError,
    ProletarianError,
    Snooze,
    connection_loss_hint,
    driver_error,
    is_lock_conflict,
    is_transient,
)
from sqla_proletarian.flow import COUNTED, FlowClaim, Reserved, too_late
from sqla_proletarian.handlers import JobContext, JobSession, SessionOnFirstUse, StopSignal
from sqla_proletarian.ledger import ClaimRecords
from sqla_proletarian.logs import log_event, logger
from sqla_proletarian.running import (
    Failure,
    Outcome,
    RunnerBase,
    describe,
    due_run_orders,
    rollback_quietly,
)

#: Seconds a worker whose claim lost its connection waits before it looks whether its
#: owner's session lives too.
LOSS_SETTLE = 0.5


@dataclass
class WorkerConnections:
    """A thread's claim connection and run-record connection, released together.

    ``record`` holds the thread's run records (see ``ledger``); ``owner`` vouches for them while
    the ledger connection lives.
    """

    conn: Connection
    ledger: Connection | None
    record: ClaimRecords | None
    _stack: ExitStack
    #: The server's idle-transaction limit where its errors do not name it (for log hints).
    idle_timeout: float | None = None
    #: The owner keeper's epoch when the claim's records were written.
    owner_epoch: int = 0
    #: Whether the thread's last claim took a job: the next one then polls every queue with
    #: no read first of which may have a due job. A thread's first claim does too, but on
    #: SQLite, where that read keeps an idle claim from taking the write lock.
    claimed_last: bool = False
    #: Whether a job was announced since (a NOTIFY, an enqueue in this process, another
    #: thread's claim that may have left jobs due): a worker of one queue then polls at once
    #: too, with no read first, which would cost its own transaction before the job's.
    announced: bool = False

    @property
    def records_on(self) -> Connection:
        """The connection run records are written on."""
        return self.ledger if self.ledger is not None else self.conn

    def close(self) -> None:
        try:
            self._stack.close()
        except Exception as exc:
            log_event(logging.DEBUG, "connection-close-error", error=repr(exc))

    def __enter__(self) -> WorkerConnections:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass
class _Claim:
    """A claimed job and what is known of its earlier runs."""

    job: dict[str, Any]
    past: ledger.Past
    #: "claimed" until the handler starts, "running" until the claim commits its outcomes.
    phase: Literal["claimed", "running", "committing"] = "claimed"
    #: Succeeded, and archived with the claim's other successes when it finishes.
    deferred: bool = False
    #: The handler's serialized result (None: it returned None).
    result: str | None = None
    #: When the claim was made, then when its handler started (time.monotonic()).
    started: float = field(default_factory=time.monotonic)
    #: The worker's clock when the job was claimed (for its queue lag).
    claimed_at: datetime | None = None


def poll_due_jobs(
    conn: Connection,
    queue: str,
    now: datetime,
    limit: int,
    *,
    with_runs: bool,
    excluding: list[uuid.UUID] | None = None,
    limited: bool = False,
    leasing: Callable[[sql.Statement], sql.Statement] | None = None,
) -> list[dict[str, Any]]:
    """Lock up to ``limit`` due jobs of a queue in claim order: its priorities that have a
    due job (hops through the poll index, one or two entries a priority, so jobs scheduled
    for later are never read), then each in turn, highest first, until ``limit`` are locked
    (``excluding`` some). ``leasing`` makes each poll one that leases what it locks too (see
    ``sql.leasing_poll``).

    Where the server allows, the first poll finds the first due priority itself; the
    priorities are read only when it locks fewer than ``limit``: then the polls go on past
    the priority it claimed from (all of them when it found none, or found it all locked).
    """
    jobs: list[dict[str, Any]] = []
    dialect = dialect_of(conn)
    after = None
    if dialect.poll_finds_priority:
        first = sql.poll_first(
            queue, now, limit, with_runs=with_runs, excluding=excluding, limited=limited
        )
        if leasing is not None:
            first = leasing(first)
        jobs.extend(direct.execute(conn, *first).mappings())
        if len(jobs) == limit:
            return jobs
        if jobs:
            after = jobs[0]["run_order"]
    for run_order in due_run_orders(conn, queue, now, dialect.priority_scan):
        if after is not None and run_order <= after:
            continue
        poll = sql.poll(
            queue,
            now,
            limit - len(jobs),
            run_order=run_order,
            with_runs=with_runs,
            excluding=excluding,
            limited=limited,
        )
        if leasing is not None:
            poll = leasing(poll)
        jobs.extend(direct.execute(conn, *poll).mappings())
        if len(jobs) == limit:
            break
    return jobs


def poll_queues(
    conn: Connection,
    queues: tuple[str, ...],
    now: datetime,
    limit: int,
    *,
    with_runs: bool,
    excluding: list[uuid.UUID] | None = None,
    flow: FlowClaim | None = None,
    leasing: Callable[[sql.Statement], sql.Statement] | None = None,
) -> list[dict[str, Any]]:
    """Lock up to ``limit`` due jobs of several queues in the order given: the first queue's
    (``poll_due_jobs``), then, while fewer than ``limit`` are locked, the next queue's. Each
    queue is polled on its own range of the poll index. A queue with limits is claimed as
    they allow (``flow``); a claim that comes back short looks for limits it did not know.
    ``leasing``: the polls of queues without limits lease what they lock (lease mode)."""
    jobs: list[dict[str, Any]] = []
    for queue in queues:
        left = limit - len(jobs)
        if flow is not None and flow.limits(queue) is not None:

            def limited_poll(n: int, queue: str = queue) -> list[dict[str, Any]]:
                return poll_due_jobs(
                    conn, queue, now, n, with_runs=with_runs, excluding=excluding, limited=True
                )

            found = flow.claim(
                queue, now, left, limited_poll, with_runs=with_runs, excluding=excluding
            )
        else:
            found = None
        if found is None:  # no limits (any more)
            found = poll_due_jobs(
                conn, queue, now, left, with_runs=with_runs, excluding=excluding, leasing=leasing
            )
        jobs.extend(found)
        if len(jobs) == limit:
            break
    if flow is not None and len(jobs) < limit:
        flow.came_back_short()
    return jobs


class JobRunner(RunnerBase):
    """Claims and runs jobs one transaction at a time. Thread-safe; shared by worker threads.

    See ``RunnerBase`` for ``stopping``, ``new_lock``, ``unit_name`` and ``sleep``.
    """

    def _set_up(self) -> None:
        self._connect_lock = self._new_lock()
        #: Whether runs are recorded (the crash ledger), and on a connection of their own.
        self._tracked = self.settings.max_unclean_ends is not None
        self._separate_ledger = self._tracked and self.dialect.separate_ledger
        #: Where run records this process gave up but could not remove are kept for later.
        self._database = self.engine.url.render_as_string(hide_password=True)
        #: The connections of threads (or tasks) whose handler is running, by their id.
        self._in_flight: dict[int, WorkerConnections] = {}
        #: Holds the runner's owner lock where owners are session locks (see ``ledger``).
        self._keeper = (
            ledger.OwnerKeeper(self.engine, self.dialect, self._new_lock)
            if self._separate_ledger and self.dialect.owner_lock in ("advisory", "named")
            else None
        )

    #: Seconds between calls of keep_owner().
    upkeep_interval = ledger.KEEPER_INTERVAL

    @property
    def connections_per_thread(self) -> int:
        """Connections a claiming thread holds: its claim's, plus the run ledger's."""
        return 2 if self._separate_ledger else 1

    @property
    def shared_connections(self) -> int:
        """Connections the runner holds besides its threads': the owner keeper's."""
        return 1 if self._keeper is not None else 0

    def keep_owner(self) -> None:
        """Check that the runner's owner lock is held, taking it back if its session ended
        (call every ``ledger.KEEPER_INTERVAL`` while the runner works); idle, it costs
        nothing (see ``_owner_needed``)."""
        if self._keeper is not None and self._owner_needed():
            self._keeper.check()

    def start_keeping_owner(self) -> None:
        """Check the owner lock from a thread of its own until ``close()``."""
        if self._keeper is not None:
            self._keeper.start_checking(self._owner_needed)

    def _owner_needed(self) -> bool:
        """Whether run records may be under the owner: a claim's, from before its records
        are written until they are removed, or records given up and not removed yet. A
        session lost while idle is found by the first check after the next claim, within
        ``KEEPER_INTERVAL`` as always, long before the records could count as gone."""
        return bool(self._in_flight) or ledger.has_orphans(self._database)

    def close(self) -> None:
        """Give the runner's owner lock up (after its last claim)."""
        if self._keeper is not None:
            self._keeper.close()

    def open_connections(self) -> WorkerConnections:
        """The connections a thread claims with; hold them across jobs, close on errors."""
        stack = ExitStack()
        # Take both connections together, one thread at a time, so that threads sharing a
        # small pool wait for it instead of each holding one and waiting forever.
        with self._connect_lock, stack:
            owner = None
            if self._keeper is not None:
                self._keeper.ensure()
                owner = self._keeper.owner
            elif self._tracked:
                owner = ledger.new_owner(self.dialect.owner_lock)
            conn = stack.enter_context(self.dialect.claim_connection(self.engine))
            ledger_conn = None
            if self._separate_ledger:
                ledger_conn = stack.enter_context(self.dialect.ledger_connection(self.engine))
            idle_timeout = self.dialect.idle_timeout(conn)
            record = None
            if self._tracked:
                record = ClaimRecords(self.dialect, owner, self._owner(), self.now)
            first = not self.dialect.claim_takes_write_lock  # see claimed_last
            return WorkerConnections(
                conn, ledger_conn, record, stack.pop_all(), idle_timeout, claimed_last=first
            )
        raise AssertionError("unreachable")  # pragma: no cover

    def process_one(self, connections: WorkerConnections | None = None) -> bool:
        """Claim and run at most one job; True if a job was claimed."""
        if connections is not None:
            return self._claim_one(connections)
        try:
            self.start_keeping_owner()
            with self.open_connections() as opened:
                return self._claim_one(opened)
        finally:
            self.close()

    def _claim_one(self, connections: WorkerConnections) -> bool:
        self._clear_orphans(connections)
        queues = self.settings.queues
        if not connections.claimed_last and not (connections.announced and len(queues) == 1):
            # After a claim that took nothing, one read of all the queues first: the claim
            # polls only those that may have a due job, and is not made when none may. A
            # worker of one queue woken for a job polls it at once (of several queues, the
            # read costs less than a poll of each).
            queues = self._queue_ends(connections.conn).to_poll(self.now())
            if not queues:
                return False
        connections.claimed_last = connections.announced = False
        if not self.dialect.claim_takes_write_lock:
            connections.claimed_last = self._process(connections, queues)
            return connections.claimed_last
        # SQLite: the write lock keeps every other writer waiting, so it is taken only for a
        # due job (the read above looks first, unless the thread's last claim took one). One
        # job runs at a time per file anyway; taking turns inside the process
        # also keeps a thread from claiming a job between another's run record and its
        # re-claim, and lets the turns pause for the application's writers.
        with self._claim_turn.taken(lambda: self._commits(connections.conn), self._sleep):
            connections.claimed_last = self._process(connections, queues)
        return connections.claimed_last

    def abandon_in_flight(self) -> int:
        """Remove the run records of handlers still running when the worker gives up on them
        (shutdown timeout), so the process's exit is not charged to their jobs; how many
        claims were still running.

        The jobs' transactions are untouched: they roll back when the process exits, and the
        jobs run again. SQLite cannot do this while the running job holds its write lock.
        """
        in_flight = list(self._in_flight.values())
        if self._separate_ledger:
            self._end_abandoned_runs(in_flight)
        return len(in_flight)

    def _end_abandoned_runs(self, in_flight: list[WorkerConnections]) -> None:
        """Remove the run records of the abandoned claims, on a ledger connection."""
        records = [c.record for c in in_flight if c.record is not None]
        run_ids = [pair for r in records for pair in r.run_ids.items()]
        if not run_ids:
            return
        try:
            with self.dialect.ledger_connection(self.engine) as conn:
                conn.execute(*sql.end_runs_by_id(run_ids, force_index=self.dialect.force_index))
        except Exception as exc:
            log_event(logging.WARNING, "run-record-cleanup-error", error=repr(exc))
            return
        log_event(
            logging.INFO,
            "runs-abandoned",
            worker_id=self.settings.worker_id,
            runs=len(run_ids),
            hint="their jobs roll back when the process exits and run again, without an "
            "unclean end",
        )

    # --- one claim ------------------------------------------------------------------------

    def _process(self, connections: WorkerConnections, queues: tuple[str, ...]) -> bool:
        """Claim due jobs of ``queues`` (in claim order) and run them; True if a job was
        claimed (or ended at the claim)."""
        if self._stopping():
            return False
        conn = connections.conn
        in_flight = id(connections)
        claim: _Claim | None = None
        done: list[tuple[_Claim, Outcome, Failure | None]] = []
        #: Set while a claim of several jobs writes their outcomes together.
        batch_finishing = False
        reserved = self._flow.prepare(conn, self.now, self._batch_size, self.dialect.begin_claim)
        self.dialect.begin_claim(conn)
        try:
            claims, cancelled = self._claim(connections, reserved, queues)
            if not claims:
                conn.commit()
                self._cancelled_at_claim(cancelled)
                return bool(cancelled)
            self._in_flight[in_flight] = connections
            if self.on_claim is not None:
                self.on_claim()
            claim = claims[0]
            claims = self._record_claim(connections, claims)
            for index, claim in enumerate(claims):
                if self._stopping():
                    # No handler starts after stop(): the jobs not yet run are released at
                    # the commit.
                    break
                if too_late(claim.job, self.now()):
                    # It and the batch's jobs after it go back unrun, with their starts.
                    self._started_late(claim.job)
                    for later in claims[index + 1 :]:
                        self._flow.give_back(later.job.pop(COUNTED, []))
                    break
                claim.phase = "running"
                claim.started = time.monotonic()
                with telemetry.run_span(claim.job, claim.claimed_at) as run:
                    outcome, failure = self._run(conn, claim)
                    run.ended(outcome, failure[1] if failure else None)
                done.append((claim, outcome, failure))
            if not done:
                assert claim is not None
                claim.phase = "claimed"
                self._give_up(connections)
                return False
            batch_finishing = len(claims) > 1
            self._finish_claim(conn, connections, done)
            claim.phase = "committing"
            conn.commit()
            if connections.record is not None:
                connections.record.ended()
        except BaseException as exc:
            if claim is None:
                rollback_quietly(conn)
                raise
            if claim.phase == "claimed":
                # Nothing ran yet: give the job back and report the error as a polling error.
                self._give_up(connections)
                raise
            if self._interrupted(connections, claim, exc, batch_finishing=batch_finishing):
                return True
            raise
        finally:
            self._in_flight.pop(in_flight, None)
        self._cancelled_at_claim(cancelled)
        for finished, outcome, failure in done:
            self._finished(finished.job, outcome, failure, finished.started)
        return True

    def _finish_claim(
        self,
        conn: Connection,
        connections: WorkerConnections,
        done: list[tuple[_Claim, Outcome, Failure | None]],
    ) -> None:
        """Archive the claim's succeeded jobs together and remove the claim's run record, in
        its transaction; a job row that is gone means the transaction lost its locks."""
        succeeded = [c.job["job_id"] for c, _, _ in done if c.deferred]
        ended = [c.job["job_id"] for c, outcome, _ in done if outcome != "retried"]
        record = connections.record
        # The records of the ended jobs go by job id, the claim's own with them.
        runs = record.run_ids if record is not None else {}
        ended_ids = set(ended)
        own = {job_id: run_id for job_id, run_id in runs.items() if job_id not in ended_ids}
        force_index = self.dialect.force_index
        if not succeeded:
            for statement in sql.end_claim_runs(ended, own, force_index=force_index):
                direct.execute(conn, *statement)
            return
        statements = sql.archive_succeeded(
            succeeded,
            ended,
            own,
            self.now(),
            upsert=self.dialect.archive_upsert,
            returning=self.dialect.deletes_runs_with_job,
            force_index=force_index,
        )
        results = [direct.execute(conn, *statement) for statement in statements]
        # The job rows the archive insert read (PostgreSQL) or the job delete removed.
        removed = results[0 if len(results) == 1 else 1].rowcount
        if removed != len(succeeded):
            raise JobTransactionLostError(
                f"{len(succeeded) - removed} of the claim's {len(succeeded)} job rows were "
                "gone when their success was recorded: the claim lost its row locks"
            )
        # PostgreSQL's one statement tells whether any row waits for these ends.
        if len(results) > 1 or any(row[0] for row in results[0]):
            workflows.settle(conn, dict.fromkeys(succeeded, "success"), self.dialect, self.now())
        stored = {
            c.job["job_id"]: c.result for c, _, _ in done if c.deferred and c.result is not None
        }
        if stored:
            direct.execute(conn, *sql.set_results(stored))

    def _claim(
        self,
        connections: WorkerConnections,
        reserved: dict[str, Reserved],
        queues: tuple[str, ...],
    ) -> tuple[list[_Claim], list[dict[str, Any]]]:
        """Lock the next due jobs, if any, and count their runs that ended with their worker.
        A job whose cancel was requested while it was leased (its lease has expired since)
        is archived as cancelled in the claim's transaction instead: the claims, and those
        jobs."""
        conn = connections.conn
        log_event(
            logging.DEBUG,
            "polling-for-jobs",
            worker_id=self.settings.worker_id,
            queue=self.settings.queue_names,
        )
        now = self.now()
        held = ledger.held_jobs(self._database) if self._tracked else []
        claims: list[_Claim] = []
        cancelled: list[dict[str, Any]] = []
        flow = self._flow.begin(conn, reserved)
        # A job whose earlier run may still be going is left alone, and the poll looks past it.
        for _ in range(3):
            found_held = []
            for job in poll_queues(
                conn,
                queues,
                now,
                self._batch_size,
                with_runs=self._tracked,
                excluding=held,
                flow=flow,
            ):
                records = job.pop("runs", 0)
                past = ledger.past_runs(
                    self.dialect, conn, job["job_id"], records, self.settings.reconnect_grace
                )
                if past.held:
                    found_held.append(job["job_id"])
                elif job["cancel_requested_at"] is not None:
                    attempts = job["attempts"] + past.unclean_ends
                    self._archive(conn, job, "cancelled", attempts, None)
                    cancelled.append(job)
                else:
                    claims.append(_Claim(job, past, claimed_at=now))
            if not found_held:
                break
            log_event(
                logging.DEBUG,
                "jobs-held",
                worker_id=self.settings.worker_id,
                queue=self.settings.queue_names,
                jobs=len(found_held),
                hint="an earlier run of these jobs may still be going (its worker lives, or "
                "lost its session for less than the grace): they run once it has ended",
            )
            ledger.hold_jobs(self._database, found_held)
            held = [*held, *found_held]
            if claims:
                break
        flow.finish()
        # A job whose batch died with its worker runs alone, so that a crash is charged to it.
        suspects = [claim for claim in claims if claim.past.suspect]
        return (suspects[:1] if suspects and len(claims) > 1 else claims), cancelled

    def _cancelled_at_claim(self, cancelled: list[dict[str, Any]]) -> None:
        """After the claim's commit: log the jobs it archived as cancelled."""
        for job in cancelled:
            log_event(
                logging.INFO,
                "job-cancelled",
                **self._fields(job),
                hint="its cancel was requested while it was leased, and the lease expired",
            )

    def _record_claim(self, connections: WorkerConnections, claims: list[_Claim]) -> list[_Claim]:
        """Record the claim's runs before its first handler starts; the claims still held
        (SQLite commits the records, then takes the job again: none if it was lost)."""
        record = connections.record
        if record is None:
            return claims
        job_ids = [claim.job["job_id"] for claim in claims]
        if connections.ledger is not None:
            if self._keeper is not None:
                connections.owner_epoch = self._keeper.epoch
            record.begin(connections.ledger, job_ids)
            return claims
        # One connection (SQLite, one job per claim): commit the record, then claim the job
        # again as the poll would, since another process may have run it in between.
        conn = connections.conn
        record.begin(conn, job_ids)
        conn.commit()
        self.dialect.begin_claim(conn)
        reclaim = sql.reclaim(job_ids[0], claims[0].job["queue"], self.now())
        again = conn.execute(*reclaim).mappings().first()
        if again is None:
            return []
        claims[0].job.update(again)
        return claims[:1]

    def _give_up(self, connections: WorkerConnections) -> None:
        """End a claim without an outcome: roll it back, then remove its run record (the
        rollback first, since the claim may hold the record's row lock). In between, the
        record's live owner keeps any other claim from counting it as an unclean end."""
        rollback_quietly(connections.conn)
        self._forget(connections)

    def _forget(self, connections: WorkerConnections, *, lost: bool = False) -> None:
        """Remove the thread's run record (``lost``: take its owner off, so that it counts
        as an unclean end): on its own connection, else on a fresh one, else later (until
        then its live owner keeps it from counting)."""
        record = connections.record
        if record is None or not record.run_ids:
            return
        settle = record.lose if lost else record.forget
        on = connections.records_on
        if not on.invalidated and settle(on):
            return
        if self._separate_ledger:
            try:
                with self.dialect.ledger_connection(self.engine) as fresh:
                    if settle(fresh):
                        return
            except Exception as exc:
                log_event(logging.DEBUG, "run-record-cleanup-error", error=repr(exc))
        for job_id, run_id in record.run_ids.items():
            ledger.add_orphan(self._database, job_id, run_id)
        record.ended()

    def _lost_while_running(self, connections: WorkerConnections, claim: _Claim) -> bool:
        """Whether the claim's connection was lost while a handler ran (not while polling
        or committing) and the server ended that session alone: the runner's owner session
        lived on all along, as it does not through a restart, failover or killed sessions."""
        if claim.phase != "running" or self._keeper is None or connections.ledger is None:
            return False
        # Servers end sessions one at a time (a restart, a kill of all of them): let the
        # owner's session go too before looking whether it lives.
        self._sleep(LOSS_SETTLE)
        epoch = connections.owner_epoch
        return self._keeper.check() and self._keeper.epoch == epoch

    def _clear_orphans(self, connections: WorkerConnections) -> None:
        orphans = ledger.take_orphans(self._database)
        if not orphans:
            return
        conn = connections.records_on
        try:
            conn.execute(*sql.end_runs_by_id(orphans, force_index=self.dialect.force_index))
            if conn.in_transaction():
                conn.commit()
        except Exception:
            rollback_quietly(conn)
            for job_id, run_id in orphans:
                ledger.add_orphan(self._database, job_id, run_id)
            raise

    def _interrupted(
        self,
        connections: WorkerConnections,
        claim: _Claim,
        exc: BaseException,
        *,
        batch_finishing: bool = False,
    ) -> bool:
        """A running job's transaction ended without its outcome: say why, clean up, and
        whether the worker goes on (True) or the exception propagates (False).

        ``batch_finishing``: the error came while a claim of several jobs wrote their
        outcomes together, so it is no one job's: the whole claim ends without outcomes."""
        conn = connections.conn
        fields = self._fields(claim.job)
        if isinstance(exc, KeyboardInterrupt | asyncio.CancelledError):
            # Interrupted by the operator (or the asyncio worker's task cancelled by a stop
            # past its timeout): the job is left untouched, and its run is not an unclean end.
            self._give_up(connections)
            return False
        if not isinstance(exc, Exception):
            # SystemExit or another BaseException from the handler ends the worker as a
            # dying process would: the run counts as an unclean end, so a job that always
            # exits cannot loop.
            rollback_quietly(conn)
            if connections.record is not None and not connections.records_on.invalidated:
                connections.record.disown(connections.records_on, claim.job["job_id"])
            return False
        lost_lock = isinstance(exc, JobTransactionLostError) or is_lock_conflict(exc)
        if lost_lock and not conn.invalidated:
            log_event(
                logging.WARNING,
                "job-transaction-lost",
                **fields,
                error=repr(exc),
                hint="a deadlock or lock wait timeout rolled back the job's transaction, or "
                "its row lock was lost; nothing was recorded and the job will run again",
            )
            self._give_up(connections)
            return True
        if conn.invalidated or is_transient(exc):
            counted = self._lost_while_running(connections, claim)
            hint = connection_loss_hint(
                exc, time.monotonic() - claim.started, connections.idle_timeout
            )
            if counted:
                hint += (
                    "; the server ended only this job's session while its handler ran, so "
                    "the run counts as an unclean end (max_unclean_ends)"
                )
            log_event(logging.ERROR, "job-connection-lost", **fields, error=repr(exc), hint=hint)
            rollback_quietly(conn)
            self._forget(connections, lost=counted)
            return False
        if driver_error(exc) is not None and not isinstance(exc, sa_exc.DataError):
            # The database refused the worker itself (a missing grant or table): not the
            # job's fault. The job goes back; the error is the worker's polling error.
            self._give_up(connections)
            return False
        if batch_finishing:
            # Not this job's outcome alone: archiving it as failed would drop the others'.
            log_event(
                logging.ERROR,
                "batch-outcome-error",
                **fields,
                error=repr(exc),
                hint="the batch's outcomes could not be written; none was recorded and "
                "every job of the batch will run again",
            )
            self._give_up(connections)
            return False
        # The outcome itself could not be written (a retry time no column can hold...):
        # record that as the job's failure in a transaction of its own, and go on.
        log_event(logging.ERROR, "outcome-recording-error", **fields, error=repr(exc))
        rollback_quietly(conn)
        self._fail_again(connections, claim, exc)
        return True

    def _fail_again(self, connections: WorkerConnections, claim: _Claim, exc: Exception) -> None:
        """Archive a job as failed because its outcome could not be written, and remove the
        claim's other run records; if another worker holds it by now, leave it to run again."""
        conn = connections.conn
        error = ProletarianError(f"the job's outcome could not be recorded: {exc!r}")
        session = JobSession(conn)
        try:
            self.dialect.begin_claim(conn)
            again = conn.execute(*sql.relock(claim.job["job_id"])).mappings().first()
            if again is None:
                conn.rollback()
                self._forget(connections)
                return
            claim.job.update(again)
            attempts = claim.job["attempts"] + claim.past.unclean_ends + 1
            self._archive(conn, claim.job, "failure", attempts, describe(error))
            conn.commit()
        except Exception:
            rollback_quietly(conn)
            self._forget(connections)
            raise
        finally:
            _close_quietly(session)
        # The job's archive removed its own record; its batch mates' go too (they run again).
        self._forget(connections)
        self._finished(claim.job, "failed", (self._context(claim.job, None, session), error))

    # --- the handler and its outcome --------------------------------------------------------

    def _run(self, conn: Connection, claim: _Claim) -> tuple[Outcome, Failure | None]:
        """Run the handler and write the outcome into the claim's transaction."""
        job = claim.job
        # The job's Session is made when first read: by an advanced handler (job.session),
        # current_job().session, a retry strategy or a failed-job handler. A handler of
        # (job_type, payload) gets its context only from current_job(), made on first use.
        plain = self.settings.handler_mode != "advanced"
        session = _LazySession(conn)
        try:
            payload, decode_error = self._payload(job)
            signal = StopSignal()
            made: list[JobContext] = []

            def context_of() -> JobContext:
                """The job's context, made on first use."""
                if not made:
                    on_first_use = SessionOnFirstUse(session.made)
                    made.append(
                        self._context(job, payload, cast(Session, on_first_use), signal, conn)
                    )
                return made[0]

            context = None if plain else context_of()
            limit = self.settings.max_unclean_ends
            # Leases that expired (lease mode's unclean ends) count too; their runs are in
            # attempts already.
            leased = job.get("unclean_ends", 0) + (job.get("lease_token") is not None)
            unclean = claim.past.unclean_ends + leased
            # The archive's attempts count every run, those that ended uncleanly included.
            runs = job["attempts"] + claim.past.unclean_ends + 1
            if limit is not None and unclean >= limit:
                crashed = JobCrashedError(
                    job["job_id"],
                    unclean,
                    claim.past.connection_losses,
                    expired_leases=leased,
                )
                log_event(logging.ERROR, "job-crashed", **self._fields(job), unclean_ends=unclean)
                return self._fail(conn, claim, context or context_of(), crashed, runs - 1)
            if unclean:
                log_event(
                    logging.WARNING, "job-interrupted", **self._fields(job), unclean_ends=unclean
                )
            if logger.isEnabledFor(logging.DEBUG):
                log_event(logging.DEBUG, "handling-job", **self._fields(job))
            try:
                if decode_error is not None:
                    raise decode_error
                with session.handling():
                    if context is None:
                        call = (job["job_type"], payload, signal, context_of, job["job_id"])
                        claim.result = self._call_plain(*call)
                    else:
                        claim.result = self._call_handler(context)
                session.finish()
            except JobTransactionLostError:
                raise
            except Exception as exc:
                if not conn.invalidated:
                    session.discard()
                if conn.invalidated:
                    # The job's transaction is gone with its connection: nothing can be
                    # recorded; the job runs again.
                    raise
                if isinstance(exc, Snooze):
                    return self._snooze(conn, claim, exc)
                log_event(
                    logging.WARNING,
                    "handle-job-exception",
                    **self._fields(job),
                    error=repr(exc),
                    traceback=describe(exc),
                )
                telemetry.job_error(exc)
                return self._after_exception(conn, claim, context or context_of(), exc, runs)
            if claim.past.unclean_ends:
                self._archive(
                    conn, job, "success", runs, None, with_runs=False, result=claim.result
                )
            else:
                claim.deferred = True
            return "succeeded", None
        finally:
            session.close()

    def _after_exception(
        self, conn: Connection, claim: _Claim, context: JobContext, exc: Exception, runs: int
    ) -> tuple[Outcome, Failure | None]:
        job = claim.job
        retry_at, left = self._retry_at(job, context, exc)
        if retry_at is None:
            return self._fail(conn, claim, context, exc, runs)
        _expect_one(direct.execute(conn, *sql.retry(job["job_id"], retry_at)), "retry")
        log_event(
            logging.INFO,
            "retrying",
            **self._fields(job),
            retry_at=retry_at.isoformat(),
            retries_left=left,
        )
        return "retried", None

    def _snooze(
        self, conn: Connection, claim: _Claim, snooze: Snooze
    ) -> tuple[Outcome, Failure | None]:
        """Put the job back, due in the snooze's seconds, in the claim's transaction (the
        handler's writes rolled back already): no attempt counted, one more snooze. The
        worker's summary counts it as retried."""
        job_id = claim.job["job_id"]

        def write(until: datetime) -> bool:
            _expect_one(direct.execute(conn, *sql.snooze(job_id, until)), "snooze")
            return True

        self._snoozed(claim.job, snooze, write)
        return "retried", None

    def _fail(
        self,
        conn: Connection,
        claim: _Claim,
        context: JobContext,
        exc: Exception,
        attempts: int,
    ) -> tuple[Outcome, Failure | None]:
        self._archive(conn, claim.job, "failure", attempts, describe(exc), with_runs=False)
        return "failed", (context, exc)

    def _archive(
        self,
        conn: Connection,
        job: dict[str, Any],
        status: str,
        attempts: int,
        error: str | None,
        *,
        with_runs: bool = True,
        result: str | None = None,
    ) -> None:
        """Archive the job with its outcome (and its handler's serialized ``result``) and
        remove it from the queue, with its run records (also leftovers of runs recorded while
        crash accounting was on) unless the claim removes them when it finishes
        (``with_runs=False``); settle its dependents."""
        now = self.now()
        direct.execute(
            conn,
            *sql.archive(
                job,
                status=status,
                attempts=attempts,
                finished_at=now,
                error=error,
                upsert=self.dialect.archive_upsert,
                result=result,
            ),
        )
        if with_runs and self.dialect.deletes_runs_with_job:
            _expect_one(direct.execute(conn, *sql.delete_job_and_runs(job["job_id"])), "delete")
        else:
            _expect_one(direct.execute(conn, *sql.delete_job(job["job_id"])), "delete")
            if with_runs:
                direct.execute(conn, *sql.end_runs(job["job_id"]))
        workflows.settle(conn, {job["job_id"]: status}, self.dialect, now)


class _LazySession:
    """The job's Session, made on first need (a run whose handler never reads it needs
    none). Made while the handler runs, it starts handling at once (see
    ``JobSession.handling``); made after the run ended, it is closed, as the run's is."""

    __slots__ = ("_conn", "_ended", "_handling", "_session")

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._session: JobSession | None = None
        self._handling = False
        self._ended = False

    def made(self) -> JobSession:
        if self._session is None:
            self._session = JobSession(self._conn)
            if self._handling:
                self._session.start_handling()
            elif self._ended:
                _close_quietly(self._session)
        return self._session

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """Around the handler's call."""
        self._handling = True
        if self._session is not None:
            self._session.start_handling()
        try:
            yield
        finally:
            self._handling = False
            if self._session is not None:
                self._session.stop_handling()

    def finish(self) -> None:
        if self._session is not None:
            self._session.finish()

    def discard(self) -> None:
        """Undo the handler's writes; a session first read after this is closed already."""
        if self._session is not None:
            self._session.discard()
        self._ended = True

    def close(self) -> None:
        self._ended = True
        if self._session is not None:
            _close_quietly(self._session)


def _expect_one(result: Any, what: str) -> None:
    """The job's own row must be there: a claim whose row is gone lost its transaction."""
    if result.rowcount == 0:
        raise JobTransactionLostError(
            f"the job's {what} touched no row: its row lock was lost and another worker ran it"
        )


def _close_quietly(session: JobSession) -> None:
    """Close a handler's session for good."""
    try:
        session.close()
    except Exception as exc:
        log_event(logging.DEBUG, "session-close-error", error=repr(exc))

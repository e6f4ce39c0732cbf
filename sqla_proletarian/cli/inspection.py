"""``status``, ``failed``, ``retry-failed`` and ``prune``: what the queues and the archive hold,
and putting failures back."""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from dataclasses import asdict
from datetime import datetime
from typing import Any, TextIO

from sqla_proletarian.cli.common import (
    PROG,
    READ_URL,
    Command,
    UsageError,
    _cell,
    _database,
    _iso,
    _reading_database,
    _table,
    _uuids,
    arg,
    limits_table,
    parse_duration,
    read_lag,
    warn_if_unknown_queue,
)
from sqla_proletarian.errors import ConfigurationError
from sqla_proletarian.inspection import (
    DEFAULT_FAILED_LIMIT,
    DEFAULT_PAGE_SIZE,
    JOB_STATES,
    MAX_PAGE_SIZE,
    failed_jobs,
    list_jobs,
    queue_status,
)
from sqla_proletarian.maintenance import prune_archive, retry_failed_report
from sqla_proletarian.replicas import ReplicaLag
from sqla_proletarian.supervisor import EXIT_OK


def status(args: argparse.Namespace) -> int:
    with _reading_database(args) as engine:
        queues = queue_status(engine)
        lag = read_lag(args, engine)
    if args.json:
        rows = [
            {**asdict(queue), "limits": queue.limits.as_dict() if queue.limits else None}
            for queue in queues
        ]
        for row in rows:
            if row["oldest_ready_age_s"] is not None:
                row["oldest_ready_age_s"] = round(row["oldest_ready_age_s"], 3)
        print(json.dumps({"queues": rows, **_lag_field(lag)}))
        return EXIT_OK
    _print_lag(lag)
    if not queues:
        print("no jobs queued, and none finished in the last hour")
        return EXIT_OK
    header = (
        "QUEUE",
        "READY",
        "SCHEDULED",
        "RUNNING",
        "WAITING ON DEPS",
        "OLDEST READY",
        "SUCCEEDED 1H",
        "FAILED 1H",
        "PAUSED",
        "BY PRIORITY",
    )
    counts = (
        "ready",
        "scheduled",
        "running",
        "waiting_on_dependencies",
        "oldest_ready_age_s",
        "succeeded_last_hour",
    )
    table = [
        [
            q.queue,
            *(_cell(getattr(q, name)) for name in counts),
            str(q.failed_last_hour),
            "paused" if q.paused else "-",
            " ".join(f"{priority}:{jobs}" for priority, jobs in q.by_priority.items()) or "-",
        ]
        for q in queues
    ]
    print("\n".join(_table(header, table)))
    limited = [(q.queue, q.limits, q.waiting) for q in queues if q.limits is not None]
    if limited:
        print()
        print("\n".join(limits_table(limited)))
    for q in queues:
        for job_type in q.unhandled_job_types:
            print(
                f"warning: queue {q.queue!r} holds jobs of type {job_type!r}, which the "
                "handlers of the last worker to run one did not know (archived as failed "
                "with UnknownJobTypeError): register a handler for it, then "
                f"`{PROG} retry-failed --all --job-type {job_type}`",
                file=sys.stderr,
            )
    return EXIT_OK


def jobs(args: argparse.Namespace) -> int:
    states = (args.state,) if args.state is not None else QUEUED_STATES
    with _reading_database(args) as engine:
        warn_if_unknown_queue(engine, "jobs", args.queue)
        try:
            found = [
                job
                for state in states
                for job in list_jobs(
                    engine, state, queue=args.queue, job_type=args.job_type, limit=args.limit
                ).jobs
            ][: args.limit]
        except ConfigurationError as exc:
            raise UsageError(str(exc)) from None
        lag = read_lag(args, engine)
    if args.json:
        # A list of jobs has no room for the lag: it goes to standard error.
        _print_lag(lag, file=sys.stderr)
        print(json.dumps([_jsonable(asdict(job)) for job in found]))
        return EXIT_OK
    _print_lag(lag)
    if not found:
        print(f"no {args.state or 'queued'} jobs")
        return EXIT_OK
    header = ("JOB ID", "QUEUE", "JOB TYPE", "STATE", "ATTEMPTS", "DUE OR FINISHED (UTC)")
    cells = [
        (
            str(job.job_id),
            job.queue,
            job.job_type,
            job.state,
            str(job.attempts),
            (job.finished_at or job.process_at).strftime("%Y-%m-%d %H:%M:%S"),
        )
        for job in found
    ]
    print("\n".join(_table(header, cells)))
    return EXIT_OK


#: What ``jobs`` lists without ``--state``: the jobs in the queue, in these states' order.
QUEUED_STATES = ("running", "ready", "scheduled", "waiting")


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    """A job's fields as JSON takes them: its id as text, its times in ISO 8601."""
    return {name: _json_value(value) for name, value in row.items()}


def _json_value(value: Any) -> Any:
    if isinstance(value, list):
        return [_json_value(item) for item in value]
    if isinstance(value, uuid.UUID):
        return str(value)
    return _iso(value) if isinstance(value, datetime) else value


def failed(args: argparse.Namespace) -> int:
    with _reading_database(args) as engine:
        warn_if_unknown_queue(engine, "failed", args.queue)
        jobs = failed_jobs(engine, queue=args.queue, job_type=args.job_type, limit=args.limit)
        lag = read_lag(args, engine)
    if args.json:
        rows = [
            {
                **asdict(job),
                "job_id": str(job.job_id),
                **{name: _iso(getattr(job, name)) for name in _TIMES},
            }
            for job in jobs
        ]
        print(json.dumps({"failed": rows, **_lag_field(lag)}))
        return EXIT_OK
    _print_lag(lag)
    if not jobs:
        print("no failed jobs in the archive")
        return EXIT_OK
    header = ("JOB ID", "QUEUE", "JOB TYPE", "ATTEMPTS", "FINISHED (UTC)")
    cells = [
        (
            str(job.job_id),
            job.queue,
            job.job_type,
            str(job.attempts),
            job.finished_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
        for job in jobs
    ]
    first, *lines = _table(header, cells)
    print(first)
    for job, line in zip(jobs, lines, strict=True):
        print(line)
        for error_line in (job.error or "(no error recorded)").splitlines():
            print(f"    {error_line}")
    return EXIT_OK


_TIMES = ("enqueued_at", "process_at", "finished_at")


def _print_lag(lag: ReplicaLag | None, file: TextIO = sys.stdout) -> None:
    """The line above a view read from ``--read-url``: how far its server lags."""
    if lag is not None:
        print(lag.describe(), file=file)


def _lag_field(lag: ReplicaLag | None) -> dict[str, Any]:
    """``replica_lag`` of a JSON object read from ``--read-url``; nothing without it."""
    return {"replica_lag": lag.as_dict()} if lag is not None else {}


def retry(args: argparse.Namespace) -> int:
    if bool(args.job_ids) == bool(args.all):
        raise UsageError("give the JOB_IDs to put back, or --all for every failure (not both)")
    job_ids = None if args.all else _uuids(args.job_ids, "failed")
    with _database(args) as engine:
        warn_if_unknown_queue(engine, "retry-failed", args.queue)
        report = retry_failed_report(engine, job_ids, queue=args.queue, job_type=args.job_type)
    count = report.put_back
    print(f"{count} failed job{'s' if count != 1 else ''} put back in the queue")
    for job_id in report.key_held:
        print(f"{job_id} stays archived: a queued job of its queue holds its unique_key")
    return EXIT_OK


def prune(args: argparse.Namespace) -> int:
    older_than = parse_duration(args.older_than)
    with _database(args) as engine:
        deleted = prune_archive(engine, older_than=older_than, status=args.status)
    print(f"{deleted} archived job{'s' if deleted != 1 else ''} deleted")
    return EXIT_OK


FAILED_ARGUMENTS = (
    arg("--queue", help="only this queue"),
    arg("--job-type", help="only this job type"),
    arg(
        "--limit", type=int, default=DEFAULT_FAILED_LIMIT, help=f"at most ({DEFAULT_FAILED_LIMIT})"
    ),
    arg(
        "--json",
        action="store_true",
        help='one object: {"failed": [...]}, and "replica_lag" with --read-url',
    ),
    READ_URL,
)
JOBS_ARGUMENTS = (
    arg("--queue", help="only this queue"),
    arg(
        "--state",
        choices=JOB_STATES,
        help="only jobs in this state (default: the queued ones: running, ready, scheduled, "
        "waiting)",
    ),
    arg("--job-type", help="only this job type"),
    arg(
        "--limit",
        type=int,
        default=DEFAULT_PAGE_SIZE,
        help=f"at most ({DEFAULT_PAGE_SIZE}, up to {MAX_PAGE_SIZE})",
    ),
    arg(
        "--json",
        action="store_true",
        help="a JSON list of jobs: job_id, queue, job_type, state, attempts, enqueued_at, "
        "..., depends_on, dependents, progress, progress_message (with --read-url, the lag "
        "goes to standard error)",
    ),
    READ_URL,
)
RETRY_ARGUMENTS = (
    arg("job_ids", metavar="JOB_ID", nargs="*", help="archived failures"),
    arg("--all", action="store_true", help="every archived failure"),
    arg("--queue", help="only failures of this queue"),
    arg("--job-type", help="only failures of this job type"),
)
PRUNE_ARGUMENTS = (
    arg("--older-than", required=True, metavar="DURATION", help="30d, 12h, 90m, 45s, ..."),
    arg("--status", choices=("success", "failure", "cancelled"), help="only jobs that ended so"),
)


STATUS = Command(
    "status",
    "per queue: ready, scheduled, running, oldest ready, finished in the last hour; limits",
    f"{PROG} status --json",
    (
        arg(
            "--json",
            action="store_true",
            help='one object: {"queues": [...]}, and "replica_lag" with --read-url',
        ),
        READ_URL,
    ),
    status,
)


JOBS = Command(
    "jobs",
    "the jobs of a queue or the archive in one state, or the queued ones, with their ids",
    f"{PROG} jobs --queue billing --state ready --limit 20",
    JOBS_ARGUMENTS,
    jobs,
)


FAILED = Command(
    "failed",
    "the archived failures, newest first, with their errors",
    f"{PROG} failed --queue billing --limit 20",
    FAILED_ARGUMENTS,
    failed,
)


RETRY_FAILED = Command(
    "retry-failed",
    "put archived failures back in the queue (same job id, attempts from zero, due now)",
    f"{PROG} retry-failed --all --job-type charge-card",
    RETRY_ARGUMENTS,
    retry,
)


PRUNE = Command(
    "prune",
    "delete archived jobs that finished long ago",
    f"{PROG} prune --older-than 30d --status success",
    PRUNE_ARGUMENTS,
    prune,
)

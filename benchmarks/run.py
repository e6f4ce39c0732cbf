"""Run the whole benchmark: durable servers, every contender in interleaved rounds, one
table of medians (min-max) and ratios, printed and written to benchmarks/results.md.

    python -m benchmarks.run [--quick] [--only NAME,...] [--rounds R] [--jobs N]

``--only`` takes parts (drain, enqueue, latency, deep, polls, memory), contenders (raw,
library, asyncio, pgqueuer, procrastinate) and servers (postgresql, mariadb): a measurement
runs when it matches a name of every kind given (``--only pgqueuer,latency``: pgqueuer's
latency; ``asyncio``: the library's asyncio worker rows, which ``library`` includes).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import signal
import sys
import time
import traceback
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa

import sqla_proletarian as sp
from benchmarks import vs_procrastinate
from benchmarks.library import EVENTS, count_events
from benchmarks.plan import (
    ASYNC_BATCH_SIZES,
    ASYNC_BEST,
    ASYNC_PROCESSES,
    KINDS,
    LEASE_SECONDS,
    Measurement,
    Plan,
    Settings,
    async_row,
    describe,
    in_mode,
    modes,
    wanted,
)
from benchmarks.report import RESULTS, Results, kept_sections, library_commit
from benchmarks.servers import durable_servers


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small counts, one round")
    parser.add_argument("--only", default="", help="comma-separated names (see above)")
    parser.add_argument("--rounds", type=int, help="rounds (default 5, quick 1)")
    parser.add_argument("--jobs", type=int, help="jobs per drain (default 10,000, quick 2,000)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="the Markdown file")
    parser.add_argument("--keep-servers", action="store_true", help="leave the servers running")
    args = parser.parse_args()
    known = {name for names in KINDS.values() for name in names}
    args.only = {name.strip() for name in args.only.split(",") if name.strip()}
    if args.only - known:
        parser.error(f"unknown --only name(s) {sorted(args.only - known)}; known: {sorted(known)}")
    return args


def settings_of(args: argparse.Namespace) -> Settings:
    settings = Settings.quick() if args.quick else Settings()
    changes = {}
    if args.rounds:
        changes["rounds"] = args.rounds
    if args.jobs:
        changes["jobs"] = args.jobs
        changes["sweep_jobs"] = max(1, args.jobs // 2)
    return dataclasses.replace(settings, **changes)


def run_one(measurement: Measurement, results: Results, events: dict[str, Counter[str]]) -> None:
    """Run one measurement; a failure is noted, and so are the library's warnings."""
    started, before = time.perf_counter(), Counter(EVENTS.counts)
    try:
        measurement.run(results)
    except Exception as exc:
        traceback.print_exc()
        results.notes.append(f"{measurement.label}: failed ({type(exc).__name__}: {exc})")
    logged = EVENTS.counts - before
    if logged:
        events.setdefault(measurement.label, Counter()).update(logged)
    print(f"    {measurement.label} ({time.perf_counter() - started:.1f} s)", flush=True)


def derive_best(plan: Plan, results: Results) -> None:
    """The best batch size and the best setting of the library, per drain section and mode."""
    for server in plan.servers:
        section = plan.drain_section(server)
        pgqueuer = ("pgqueuer tuned",) if server.is_postgresql else ()
        for mode, library_rows, batch_rows in zip(
            modes(LEASE_SECONDS), plan.library_rows, plan.batch_rows, strict=True
        ):
            twin = () if mode == "transaction" else ("sqla-proletarian, best setting",)
            results.best(
                section,
                in_mode("sqla-proletarian, best setting", mode),
                library_rows,
                ref="raw SQL, 1 job/transaction",
                also=(*pgqueuer, *twin),
            )
            twin = () if mode == "transaction" else ("sqla-proletarian, best batch_size",)
            results.best(
                section,
                in_mode("sqla-proletarian, best batch_size", mode),
                batch_rows,
                ref=f"raw SQL, {plan.s.per_transaction} jobs/transaction",
                also=(*pgqueuer, *twin),
            )
        if server.is_postgresql:
            results.best(
                section,
                ASYNC_BEST,
                [async_row(b) for b in ASYNC_BATCH_SIZES[1:]],
                ref="pgqueuer tuned",
                also=("sqla-proletarian, best setting",),
            )


def header(settings: Settings, started: datetime, seconds: float, commit: str) -> list[str]:
    cpus = os.cpu_count()
    return [
        f"Run {started:%Y-%m-%d %H:%M} UTC, {seconds / 60:.1f} min; {cpus} cores,"
        f" Python {platform.python_version()}, SQLAlchemy {sa.__version__},"
        f" sqla-proletarian {sp.__version__} ({commit} when the run began).",
        f"{settings.rounds} round(s), interleaved (round 1 of every contender, then round 2...);"
        f" each cell is the median over the rounds (min-max).",
        "Servers: PostgreSQL 15 and MariaDB 10.11 on 127.0.0.1, DURABLE (fsync,"
        " synchronous_commit, full_page_writes on; innodb_flush_log_at_trx_commit=1,"
        " doublewrite on), sharing the cores with the clients: compare ratios within a run.",
        "Every contender runs a no-op handler; drivers: psycopg 3 (PostgreSQL), PyMySQL (MariaDB).",
        "Ratio: this row's median over the named row's median (for latencies and memory,"
        " lower is better).",
    ]


def method(s: Settings) -> list[str]:
    """How each figure is taken, in a sentence each."""
    return [
        "Drains: the queue is filled by one INSERT ... SELECT on the server (pgqueuer's and"
        " procrastinate's own bulk enqueue for them) into fresh tables, and timed from the"
        " worker's start until every job is done: the library's summary count, or for pgqueuer"
        " and procrastinate the database saying all are done (asked every 20 ms); every drain"
        " is checked (all archived once, none left). Processes are spawned, each with its own"
        " engine, and told to start together. procrastinate drains"
        f" {s.jobs // vs_procrastinate.SHARE:,} of the jobs (1/{vs_procrastinate.SHARE}, in"
        " its sweep too: at its speed that still takes many seconds, and it keeps make bench"
        " under 45 minutes). The library's rows run in both modes, in the"
        f" same rounds: transaction mode, then lease mode (lease_seconds={LEASE_SECONDS:g};"
        f" batched at batch_size {', '.join(map(str, s.lease_batch_sizes))} only, to keep the"
        " run under 40 minutes);"
        " its handler is a no-op in advanced mode that counts its runs by job id, and each"
        " drain counts the extra runs (a job's handler run more than once), the library's"
        " job-transaction-lost events and the deadlocks the server detected"
        " (Innodb_deadlocks, pg_stat_database.deadlocks); any of them not 0 fails the run.",
        "Server per job (drains): what the server did from the worker's start until its last"
        " job was done (not the fill), over the jobs, the median over the rounds"
        " (benchmarks.server_work): on PostgreSQL the WAL bytes (pg_wal_lsn_diff of"
        " pg_current_wal_lsn(), the whole server's: autovacuum's and a checkpoint's full-page"
        " images count too); on MariaDB the redo bytes (Innodb_lsn_current), the rows written"
        " (Handler_write + Handler_update + Handler_delete) and the statements sent (Questions,"
        " with their main Com_* kinds), less the meter's own reads.",
        f"The asyncio worker's rows (PostgreSQL): create_async_queue_worker on"
        f" postgresql+asyncpg, in {ASYNC_PROCESSES} spawned processes of concurrency 4 (pgqueuer"
        " tuned's usual shape: asyncpg, 2 processes), transaction mode, ledger on, the same"
        " counting handler, at batch_size"
        f" {', '.join(map(str, ASYNC_BATCH_SIZES))}; each with its ratio to pgqueuer tuned and"
        " to the threaded worker's row of the same batch size; its best batch_size is the"
        " best of all but batch_size=1.",
        f"Enqueue: bulk = {s.jobs:,} jobs in one call or statement and one commit; per commit"
        f" = {s.commits:,} commits in one thread, a new Connection or Session each.",
        f"Idle latency: a warm-up job, then {s.latency_samples} jobs a round, one at a time,"
        " 50-250 ms after the last one started; from the moment the enqueue's commit returned"
        " to the handler's first line (one monotonic clock across processes); p99 of so few"
        " samples is about their maximum.",
        f"Deep queue: {s.deep:,} jobs filled once before round 1 (each round drains"
        f" {s.head:,} off its head, so it stays near that depth), {s.shallow:,} filled afresh"
        " each round; both ANALYZEd after filling; the worker at its defaults.",
        f"Polls: the worker's poll statement in a loop of one-statement transactions, on a"
        f" fresh empty table, then after {s.deletes:,} jobs were queued and deleted in one"
        " statement, first while a REPEATABLE READ transaction that began before the delete"
        " stays open (no cleanup is possible), then once it has ended, with autovacuum off"
        " for the table on PostgreSQL (MariaDB purges in the background).",
        f"Memory: one worker process's peak RSS (ru_maxrss) at its start and once it has run"
        f" {s.shallow:,} and {s.memory_jobs:,} jobs (or after {s.memory_seconds:.0f} s).",
    ]


def tuning_notes(plan: Plan) -> list[str]:
    notes = []
    for name, tuned in plan.tuned.items():
        tried = "; ".join(f"{describe(settings)} {rate:,.0f}" for settings, rate in tuned.tried)
        jobs = plan.s.sweep_jobs // (vs_procrastinate.SHARE if name == "procrastinate" else 1)
        notes.append(
            f"{name} tuned: before round 1, each setting of the sweep drained"
            f" {jobs:,} jobs {plan.s.sweep_passes} time(s) (all settings in turn,"
            f" then again) and the fastest on average was kept; mean jobs/s: {tried}."
        )
    return notes


def main() -> None:
    args = parse()
    settings = settings_of(args)
    # SIGTERM (make, CI) ends the run through the finally blocks, which stop the servers.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    count_events()
    events: dict[str, Counter[str]] = {}
    started_at, started, commit = datetime.now(UTC), time.perf_counter(), library_commit()
    with durable_servers(keep=args.keep_servers) as servers:
        plan = Plan(settings, servers)
        measurements = [m for m in plan.measurements if wanted(m.tags, args.only)]
        results = Results()
        if not plan.batched:
            results.notes.append(
                "batch_size: create_queue_worker does not know it yet, so the batched rows are"
                " n/a and the process rows run batch_size=1."
            )
        if any("procrastinate" in m.tags for m in measurements):
            vs_procrastinate.install(servers[0].libpq_dsn("bench_procrastinate"))
        plan.fill_deep(args.only)
        plan.tune(args.only)
        for round_number in range(1, settings.rounds + 1):
            print(f"round {round_number} of {settings.rounds}", flush=True)
            for measurement in measurements:
                if measurement.once and round_number > 1:
                    continue
                run_one(measurement, results, events)
    derive_best(plan, results)
    seconds = time.perf_counter() - started
    lines = header(settings, started_at, seconds, commit)
    notes = method(settings) + tuning_notes(plan) + plan.notes + results.notes
    for label, counts in events.items():
        logged = ", ".join(f"{n} {event}" for event, n in counts.most_common())
        notes.append(f"{label}: the library logged {logged} (all rounds, in-process workers)")
    problems = results.problems()
    notes += [f"NOT CLEAN: {problem}" for problem in problems]
    print()
    print("\n".join(lines))
    print()
    print(results.table())
    if notes:
        print()
        print("\n".join(f"- {note}" for note in notes))
    text = ["# Benchmark results", "", *[f"- {line}" for line in lines], "", results.markdown(), ""]
    text += [f"- {note}" for note in notes]
    # Sections other benchmarks wrote (benchmarks.batch_drain) stay.
    previous = args.output.read_text() if args.output.exists() else ""
    text += [f"\n{section}" for section in kept_sections(previous)]
    args.output.write_text("\n".join(text) + "\n")
    print(f"\nwritten to {args.output} ({seconds / 60:.1f} min)")
    if problems:
        shout(problems)
        sys.exit(1)


def shout(problems: list[str]) -> None:
    """Say on stderr, so that nobody misses it, which drains were not clean."""
    bar = "!" * 78
    print(f"\n{bar}", file=sys.stderr)
    print(
        "DRAINS THAT RAN A HANDLER MORE THAN ONCE, LOST A JOB TRANSACTION OR DEADLOCKED:",
        file=sys.stderr,
    )
    for problem in problems:
        print(f"  {problem}", file=sys.stderr)
    print(bar, file=sys.stderr)


if __name__ == "__main__":
    main()

"""Where the worker's client CPU goes, per job: a no-op drain profiled with cProfile.

    python -m benchmarks.profile [--jobs N] [--only NAME,...] [--top K]

For each server (PostgreSQL through psycopg 3, MariaDB through PyMySQL; the durable
benchmark servers), mode (transaction; lease with lease_seconds=30), batch_size (1, 50) and
worker_threads (1, 4), ``--jobs`` queued no-op jobs are drained twice: once plain, timed
(wall clock, and ``time.process_time`` for the client's CPU), once under cProfile. Every
thread the worker starts is profiled (``threading.setprofile`` starts a profiler in each),
each with its own thread's CPU clock (``time.thread_time``), so the profile counts CPU, not
waiting. Prints per setting: client CPU and wall time per job, the top functions by
cumulative and by own time (us/job, profiled), and a summary by group (SQLAlchemy's
statement building and compiling, its execution and results, its pool and the rest, the
DBAPI driver, the library's own code, the handler, logging/telemetry), each group's share of
the profiled CPU times the plain run's CPU per job; a C function's time goes to the group of
the Python function that called it. ``--only`` takes servers (postgresql, mariadb), modes
(transaction, lease), ``batch1``/``batch50`` and ``threads1``/``threads4``. The summary is
written into its own section of benchmarks/results.md.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import os
import pstats
import shlex
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqla_proletarian as sp
from benchmarks.batch_drain import machine
from benchmarks.fill import check_drained, fill, fresh_tables
from benchmarks.library import count_events, noop, run_until
from benchmarks.report import RESULTS, write_section
from benchmarks.servers import Server, durable_servers

SECTION = "profile"
LEASE_SECONDS = 30.0
MODES: dict[str, dict[str, Any]] = {
    "transaction": {},
    "lease": {"lease_seconds": LEASE_SECONDS},
}
BATCH_SIZES = (1, 50)
THREADS = (1, 4)
#: The groups of the summary, by where a function's code lives (the first match wins).
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("handler", ("benchmarks/library.py",)),
    (
        "logging/telemetry",
        ("/logging/", "sqla_proletarian/logs.py", "sqla_proletarian/telemetry.py"),
    ),
    ("library", ("sqla_proletarian/",)),
    ("SQLAlchemy build+compile", ("sqlalchemy/sql/",)),
    ("SQLAlchemy execute+results", ("sqlalchemy/engine/",)),
    ("SQLAlchemy pool, ORM, other", ("sqlalchemy/",)),
    ("DBAPI driver", ("/psycopg/", "/psycopg_binary/", "/psycopg_c/", "/pymysql/")),
    ("stdlib (uuid, json, threading...)", ("",)),
)
GROUP_NAMES = tuple(name for name, _ in GROUPS)

Func = tuple[str, int, str]


@dataclass
class Setting:
    server: Server
    mode: str
    batch_size: int
    threads: int

    @property
    def label(self) -> str:
        return (
            f"{self.server.label}, {self.mode} mode, batch_size={self.batch_size},"
            f" {self.threads} thread" + ("s" if self.threads > 1 else "")
        )

    def tags(self) -> set[str]:
        key = self.server.label.split()[0].lower()
        return {key, self.mode, f"batch{self.batch_size}", f"threads{self.threads}"}


@dataclass
class Measured:
    """One setting's figures: the plain run's times per job, the profile's groups."""

    jobs: int
    wall: float
    cpu: float
    stats: pstats.Stats | None = None
    groups: Counter[str] = field(default_factory=Counter)

    def us(self, seconds: float) -> float:
        return 1e6 * seconds / self.jobs


@contextmanager
def profiled_threads() -> Iterator[list[cProfile.Profile]]:
    """Profile (by thread CPU time) every thread started inside the block; the list holds
    the profiles of those that have ended once the block is over (a profile read while its
    thread is still in a call would time that call by the reading thread's clock)."""
    started: list[tuple[threading.Thread, cProfile.Profile]] = []
    ended: list[cProfile.Profile] = []
    lock = threading.Lock()

    def start(frame: Any, event: str, arg: Any) -> None:
        # Called once at the thread's first event: a profiler of its own replaces this hook.
        profile = cProfile.Profile(time.thread_time)
        with lock:
            started.append((threading.current_thread(), profile))
        profile.enable()

    threading.setprofile(start)
    try:
        yield ended
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
        for thread, profile in started:
            thread.join(10)
            if thread.is_alive():
                print(f"  (thread {thread.name} still running: left out of the profile)")
            else:
                ended.append(profile)


def drain(setting: Setting, jobs: int, profile: bool) -> Measured:
    """Drain ``jobs`` queued no-op jobs with one worker of the setting."""
    engine = setting.server.engine()
    fresh_tables(engine)
    fill(engine, jobs)
    options = {**MODES[setting.mode], "batch_size": setting.batch_size}
    worker = sp.create_queue_worker(engine, noop, worker_threads=setting.threads, **options)
    cpu = time.process_time()
    if profile:
        with profiled_threads() as profiles:
            wall = run_until(worker, jobs)
    else:
        wall = run_until(worker, jobs)
    cpu = time.process_time() - cpu
    check_drained(engine, jobs, setting.label)
    engine.dispose()
    measured = Measured(jobs, wall, cpu)
    if profile:
        measured.stats = pstats.Stats(*profiles)  # type: ignore[arg-type]
        measured.groups = grouped(measured.stats)
    return measured


def group_of(func: Func) -> str:
    path = func[0].replace("\\", "/")
    for name, parts in GROUPS:
        if any(part in path for part in parts):
            return name
    return GROUPS[-1][0]


def grouped(stats: pstats.Stats) -> Counter[str]:
    """Own CPU time by group; a C function's (no file) is shared among its callers' groups
    in proportion to the time it spent under each."""
    groups: Counter[str] = Counter()
    for func, (_, _, own, _, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if func[0] != "~" or not callers:
            groups[group_of(func)] += own
            continue
        under = sum(caller[2] for caller in callers.values()) or 1.0
        for caller, figures in callers.items():
            groups[group_of(caller)] += own * figures[2] / under
    return groups


def where(func: Func) -> str:
    path, line, name = func
    if path == "~":
        return name
    parts = Path(path).parts
    for root in ("site-packages", "wt-n", "main"):
        if root in parts:
            parts = parts[parts.index(root) + 1 :]
            break
    else:
        parts = parts[-2:]
    return f"{'/'.join(parts)}:{line}({name})"


def top(stats: pstats.Stats, jobs: int, key: int, count: int) -> list[str]:
    """The ``count`` functions with the most cumulative (key 3) or own (key 2) time."""
    items = sorted(
        stats.stats.items(),  # type: ignore[attr-defined]
        key=lambda item: item[1][key],
        reverse=True,
    )[:count]
    return [
        f"  {1e6 * figures[3] / jobs:9.1f} {1e6 * figures[2] / jobs:9.1f} {figures[1] / jobs:8.2f}"
        f"  {where(func)}"
        for func, figures in items
    ]


def summary_row(setting: Setting, plain: Measured, profiled: Measured) -> list[str]:
    """One row of the summary: per job, the plain run's CPU, wall and wall - CPU, then each
    group's share of the profile times the plain CPU."""
    total = sum(profiled.groups.values()) or 1.0
    cpu = plain.us(plain.cpu)
    cells = [
        setting.label,
        f"{plain.jobs / plain.wall:,.0f}",
        f"{cpu:,.0f}",
        f"{plain.us(plain.wall):,.0f}",
        f"{plain.us(plain.wall) - cpu:,.0f}",
        f"{profiled.us(total):,.0f}",
    ]
    cells += [f"{cpu * profiled.groups[name] / total:,.0f}" for name in GROUP_NAMES]
    return cells


HEAD = (
    "setting",
    "jobs/s (plain)",
    "client CPU us/job",
    "wall us/job",
    "wall - CPU us/job",
    "profiled CPU us/job",
    *(f"{name} us/job" for name in GROUP_NAMES),
)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=5_000, help="jobs per drain (5,000)")
    parser.add_argument("--top", type=int, default=25, help="functions listed per order (25)")
    parser.add_argument("--only", default="", help="servers, modes, batchN, threadsN")
    parser.add_argument("--output", type=Path, default=RESULTS, help="the Markdown file")
    parser.add_argument("--keep-servers", action="store_true", help="leave the servers running")
    args = parser.parse_args()
    args.only = {name.strip() for name in args.only.split(",") if name.strip()}
    known = {"postgresql", "mariadb", *MODES}
    known |= {f"batch{b}" for b in BATCH_SIZES} | {f"threads{t}" for t in THREADS}
    if args.only - known:
        parser.error(f"unknown --only name(s) {sorted(args.only - known)}; known: {sorted(known)}")
    return args


def wanted(setting: Setting, only: set[str]) -> bool:
    """Named tags narrow their own kind: ``--only mariadb,batch50``."""
    kinds: tuple[Callable[[str], bool], ...] = (
        lambda t: t in ("postgresql", "mariadb"),
        lambda t: t in MODES,
        lambda t: t.startswith("batch"),
        lambda t: t.startswith("threads"),
    )
    tags = setting.tags()
    named = [{t for t in only if kind(t)} for kind in kinds]
    return all(not names or tags & names for names in named)


def main() -> None:
    args = parse()
    command = shlex.join(["python", "-m", "benchmarks.profile", *sys.argv[1:]])
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    count_events()
    started_at, started = datetime.now(UTC), time.perf_counter()
    rows: list[list[str]] = []
    with durable_servers(keep=args.keep_servers) as servers:
        about = machine(servers)
        settings = [
            Setting(server, mode, batch, threads)
            for server, mode, batch, threads in itertools.product(
                servers, MODES, BATCH_SIZES, THREADS
            )
        ]
        for setting in [s for s in settings if wanted(s, args.only)]:
            plain = drain(setting, args.jobs, profile=False)
            profiled = drain(setting, args.jobs, profile=True)
            assert profiled.stats is not None
            print(f"\n=== {setting.label}: {args.jobs:,} jobs", flush=True)
            print(
                f"plain: {plain.jobs / plain.wall:,.0f} jobs/s, client CPU"
                f" {plain.us(plain.cpu):,.0f} us/job, wall {plain.us(plain.wall):,.0f} us/job;"
                f" profiled: CPU {profiled.us(profiled.cpu):,.0f} us/job"
            )
            for key, order in ((3, "cumulative"), (2, "own")):
                print(f"top {args.top} by {order} time (profiled, all worker threads):")
                print(f"  {'cum us/job':>9} {'own us/job':>9} {'calls/job':>8}  function")
                print("\n".join(top(profiled.stats, args.jobs, key, args.top)))
            row = summary_row(setting, plain, profiled)
            print(
                "summary (us/job): "
                + ", ".join(f"{h} {c}" for h, c in zip(HEAD[1:], row[1:], strict=True))
            )
            rows.append(row)
    minutes = (time.perf_counter() - started) / 60
    lines = [
        f"Command: `{command}`; run {started_at:%Y-%m-%d %H:%M} UTC, {minutes:.1f} min.",
        f"Machine: {about}; load average at the end {os.getloadavg()[0]:.1f}.",
        f"Each setting drains {args.jobs:,} queued no-op jobs twice with one in-process"
        " worker (defaults but the mode, batch_size and worker_threads): plain, for jobs/s,"
        " the wall time and the client's CPU (time.process_time over the drain, the timing"
        " loop's own included), then under cProfile: every worker thread profiled by its own"
        " CPU clock (time.thread_time). A group's figure is its share of the profiled CPU"
        " times the plain run's CPU per job (profiling's overhead spread evenly); a C"
        " function's time goes to the group of the Python function that called it. wall -"
        " CPU is the time per job the client did not spend on the CPU: waiting on the server"
        " (and, with 4 threads, on the other threads and the other processes of the cores).",
    ]
    head = "| " + " | ".join(HEAD) + " |"
    table = [head, "|---|" + "---:|" * (len(HEAD) - 1)]
    table += ["| " + " | ".join(row) + " |" for row in rows]
    print("\n" + "\n".join(lines) + "\n\n" + "\n".join(table))
    body = [
        "## Client CPU per job (`python -m benchmarks.profile`, `make bench-profile`)",
        "",
        *(f"- {line}" for line in lines),
        "",
        *table,
    ]
    write_section(args.output, SECTION, "\n".join(body))
    print(f"\nwritten to {args.output} ({minutes:.1f} min)")


if __name__ == "__main__":
    main()

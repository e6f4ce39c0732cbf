"""What a run measures: every figure of every contender, as measurements that add their
rows to the results, each tagged for ``--only``."""

from __future__ import annotations

import itertools
import statistics
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from benchmarks import library, raw, scale, server_work, vs_pgqueuer, vs_procrastinate
from benchmarks.batch_drain import server_deadlocks
from benchmarks.report import Results
from benchmarks.servers import Server

#: The lease of lease mode's drain rows: far longer than any job here takes.
LEASE_SECONDS = 30.0
#: The asyncio worker's rows (PostgreSQL): asyncpg in pgqueuer tuned's usual shape (2
#: processes), at these batch sizes; the best of all but the first is its "best batch_size".
ASYNC_PROCESSES = 2
ASYNC_BATCH_SIZES = (1, 50, 100, 200)
ASYNC_BEST = "sqla-proletarian asyncio worker (asyncpg), best batch_size"


def async_row(batch_size: int) -> str:
    """The name of an asyncio worker row."""
    return (
        f"sqla-proletarian asyncio worker (asyncpg), {ASYNC_PROCESSES} processes x"
        f" concurrency 4, batch_size={batch_size}"
    )


#: The tags ``--only`` accepts, by kind: a measurement runs when, for every kind named,
#: one of its tags was named.
KINDS = {
    "part": ("drain", "enqueue", "latency", "deep", "polls", "memory"),
    "contender": ("raw", "library", "asyncio", "pgqueuer", "procrastinate"),
    "server": ("postgresql", "mariadb"),
}


@dataclass
class Settings:
    """The sizes of a run (``--quick`` makes them small)."""

    rounds: int = 5
    jobs: int = 10_000
    per_transaction: int = 50
    batch_sizes: tuple[int, ...] = (10, 50, 100, 200)
    #: Lease mode's batched rows: fewer, to keep a whole run under 40 minutes.
    lease_batch_sizes: tuple[int, ...] = (50, 200)
    sweep_jobs: int = 5_000
    sweep_passes: int = 2
    commits: int = 1_000
    latency_samples: int = 25
    shallow: int = 10_000
    deep: int = 1_000_000
    head: int = 5_000
    deletes: int = 100_000
    poll_seconds: float = 2.0
    memory_jobs: int = 1_000_000
    memory_seconds: float = 180.0

    @classmethod
    def quick(cls) -> Settings:
        return cls(
            rounds=1,
            jobs=2_000,
            sweep_jobs=1_000,
            sweep_passes=1,
            commits=200,
            latency_samples=10,
            deep=100_000,
            head=1_000,
            deletes=20_000,
            poll_seconds=1.0,
            memory_jobs=20_000,
            memory_seconds=30.0,
        )


@dataclass
class Measurement:
    """One measurement of one round; ``run`` adds its rows to the results."""

    tags: frozenset[str]
    run: Callable[[Results], None]
    label: str
    once: bool = False


@dataclass
class Tuned:
    """The settings the sweep found fastest for a contender, and what it tried."""

    settings: dict[str, Any]
    tried: list[tuple[dict[str, Any], float]] = field(default_factory=list)


def wanted(tags: frozenset[str], only: set[str]) -> bool:
    for names in KINDS.values():
        named = only & set(names)
        if named and not named & tags:
            return False
    return True


def sweep(
    drain: Callable[..., float], grid: dict[str, tuple[Any, ...]], jobs: int, passes: int
) -> Tuned:
    """Drain ``jobs`` ``passes`` times with every combination of the grid (all combinations
    in one pass, then the next); the fastest on average is tuned."""
    combinations = [
        dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())
    ]
    rates: list[list[float]] = [[] for _ in combinations]
    for _ in range(passes):
        for settings, found in zip(combinations, rates, strict=True):
            found.append(drain(jobs, **settings))
            print(f"    sweep {describe(settings)}: {found[-1]:,.0f} jobs/s", flush=True)
    tried = [
        (settings, statistics.mean(found))
        for settings, found in zip(combinations, rates, strict=True)
    ]
    best = max(tried, key=lambda item: item[1])[0]
    return Tuned(best, tried)


def describe(settings: dict[str, Any]) -> str:
    """Settings in words: ``asyncpg, batch_size=10, 1 process``."""
    words = []
    for key, value in settings.items():
        if key == "processes":
            words.append(f"{value} process" + ("es" if value != 1 else ""))
        elif key == "driver":
            words.append(str(value))
        else:
            words.append(f"{key}={value}")
    return ", ".join(words)


def _rate(
    results: Results,
    section: str,
    name: str,
    unit: str,
    ref: str | None,
    measure: Callable[[], float],
) -> None:
    try:
        results.add(section, name, measure(), unit, ref)
    except library.NotAvailable as exc:
        results.missing(section, name, unit, str(exc), ref)


def share(module: Any, jobs: int) -> str:
    """``; 2,500 jobs`` for a contender that drains a share of the run's jobs, else nothing."""
    return f"; {jobs:,} jobs" if module.SHARE != 1 else ""


def _tag(*tags: str) -> frozenset[str]:
    return frozenset(tags)


def modes(lease_seconds: float) -> dict[str, dict[str, Any]]:
    """The worker options of each mode."""
    return {"transaction": {}, "lease": {"lease_seconds": lease_seconds}}


def in_mode(name: str, mode: str, lease_seconds: float = LEASE_SECONDS) -> str:
    """A library row's name in a mode: ``sqla-proletarian lease_seconds=30, batch_size=10``."""
    if mode == "transaction":
        return name
    lease = f"sqla-proletarian lease_seconds={lease_seconds:g},"
    return name.replace("sqla-proletarian,", lease, 1).replace(" (defaults)", "")


class Plan:
    """The measurements of a run, in the order each round takes them."""

    def __init__(self, settings: Settings, servers: list[Server]) -> None:
        self.s = settings
        self.servers = servers
        self.tuned: dict[str, Tuned] = {}
        self.notes: list[str] = []
        self.measurements: list[Measurement] = []
        #: Per mode (transaction, lease): its batch_size rows, and all its library rows.
        self.batch_rows: list[list[str]] = []
        self.library_rows: list[list[str]] = []
        self.batched = library.has_batches(servers[0].engine())
        for server in servers:
            self._drains(server)
        for server in servers:
            self._enqueues(server)
        for server in servers:
            self._latencies(server)
        for server in servers:
            self._scale(server)
        self._memory(servers[0])

    def _add(
        self, tags: frozenset[str], label: str, run: Callable[[Results], None], once: bool = False
    ) -> None:
        self.measurements.append(Measurement(tags, run, label, once))

    # --- drain -------------------------------------------------------------------------

    def drain_section(self, server: Server) -> str:
        return f"drain, {server.label}: {self.s.jobs:,} queued jobs, 4 threads unless said"

    def _drains(self, server: Server) -> None:
        s, engine, url = self.s, server.engine(), server.urls["bench"]
        key = server.label.split()[0].lower()
        section = self.drain_section(server)
        raw1, rawn = "raw SQL, 1 job/transaction", f"raw SQL, {s.per_transaction} jobs/transaction"
        sp_default = "sqla-proletarian, batch_size=1, ledger on (defaults)"
        rate = "jobs/s"

        def add(
            tags: frozenset[str], name: str, ref: str | None, measure: Callable[[], float]
        ) -> None:
            def run(results: Results) -> None:
                _rate(results, section, name, rate, ref, measure)
                results.work(section, name, server_work.take())

            self._add(tags, f"{section}: {name}", run)

        add(_tag("drain", "raw", key), raw1, None, lambda: raw.drain(engine, s.jobs, 1))
        add(
            _tag("drain", "raw", key),
            rawn,
            raw1,
            lambda: raw.drain(engine, s.jobs, s.per_transaction),
        )
        lib = _tag("drain", "library", key)
        pgqueuer = ("pgqueuer tuned",) if server.is_postgresql else ()
        options = {"batch_size": s.per_transaction} if self.batched else {}
        setting = f"batch_size={s.per_transaction}" if self.batched else "batch_size=1"
        self.library_rows, self.batch_rows = [], []
        for mode, lease in modes(LEASE_SECONDS).items():
            # Lease mode's rows after transaction mode's, in the same rounds, each also given
            # as a ratio to its transaction-mode twin.
            batch_sizes = s.lease_batch_sizes if lease else s.batch_sizes
            rows: dict[str, tuple[dict[str, Any], str]] = {
                sp_default: ({}, raw1),
                "sqla-proletarian, batch_size=1, ledger off": ({"max_unclean_ends": None}, raw1),
                **{
                    f"sqla-proletarian, batch_size={b}": ({"batch_size": b}, rawn)
                    for b in batch_sizes
                },
            }
            for name, (kw, ref) in rows.items():
                self._counted_drain(
                    lib,
                    section,
                    in_mode(name, mode),
                    ref,
                    (*pgqueuer, *([name] if lease else [])),
                    engine,
                    lambda kw=kw, lease=lease: library.drain_counted(engine, s.jobs, **kw, **lease),
                )
            self.batch_rows.append(
                [in_mode(f"sqla-proletarian, batch_size={b}", mode) for b in batch_sizes]
            )
            one = f"sqla-proletarian, 1 process x 4 threads, {setting}"
            two = f"sqla-proletarian, 2 processes x 4 threads, {setting}"
            for name, processes, ref in ((one, 1, rawn), (two, 2, in_mode(one, mode))):
                self._counted_drain(
                    lib,
                    section,
                    in_mode(name, mode),
                    ref,
                    (*pgqueuer, *([name] if lease else [])),
                    engine,
                    lambda processes=processes, lease=lease: library.drain_processes(
                        engine, url, s.jobs, processes, **options, **lease
                    ),
                )
            self.library_rows.append([in_mode(name, mode) for name in [*rows, one, two]])
        if not server.is_postgresql:
            return
        pgq, pro = server.libpq_dsn("bench_pgqueuer"), server.libpq_dsn("bench_procrastinate")
        contenders: list[tuple[str, Any, dict[str, Any]]] = [
            ("pgqueuer", vs_pgqueuer, vs_pgqueuer.DEFAULTS),
            ("procrastinate", vs_procrastinate, vs_procrastinate.DEFAULTS),
        ]
        for name, module, defaults in contenders:
            dsn = pgq if name == "pgqueuer" else pro
            tags = _tag("drain", name, key)
            jobs = s.jobs // module.SHARE
            add(
                tags,
                f"{name} defaults ({describe(defaults)}{share(module, jobs)})",
                sp_default,
                lambda module=module, dsn=dsn, defaults=defaults, jobs=jobs: module.drain(
                    dsn, jobs, **defaults
                ),
            )
            self._add(
                tags,
                f"{section}: {name} tuned",
                lambda results, name=name, module=module, dsn=dsn: self._tuned_drain(
                    results, section, name, module, dsn
                ),
            )
            if name == "pgqueuer":
                self._async_drains(engine, url, section)

    def _async_drains(self, engine: sa.Engine, url: str, section: str) -> None:
        """The asyncio worker's rows, beside pgqueuer's: each given as a ratio to pgqueuer
        tuned and to the threaded worker's twin (same batch size, or its best setting)."""
        for batch_size in ASYNC_BATCH_SIZES:
            twin = (
                "sqla-proletarian, batch_size=1, ledger on (defaults)"
                if batch_size == 1
                else f"sqla-proletarian, batch_size={batch_size}"
            )
            self._counted_drain(
                _tag("drain", "library", "asyncio", "postgresql"),
                section,
                async_row(batch_size),
                "pgqueuer tuned",
                (twin,),
                engine,
                lambda batch_size=batch_size: library.drain_async_processes(
                    engine, url, self.s.jobs, ASYNC_PROCESSES, batch_size=batch_size
                ),
            )

    def _counted_drain(
        self,
        tags: frozenset[str],
        section: str,
        name: str,
        ref: str,
        also: tuple[str, ...],
        engine: sa.Engine,
        measure: Callable[[], library.Drained],
    ) -> None:
        """A drain row of the library, with its ``library.PROBLEMS`` counted over the rounds."""

        def run(results: Results) -> None:
            before = server_deadlocks(engine)
            try:
                drained = measure()
            except library.NotAvailable as exc:
                results.missing(section, name, "jobs/s", str(exc), ref)
                return
            # Closed connections report their statistics (PostgreSQL counts deadlocks so).
            engine.dispose()
            drained.counts["deadlocks"] = server_deadlocks(engine) - before
            results.add(section, name, drained.rate, "jobs/s", ref, also)
            results.work(section, name, server_work.take())
            results.count(section, name, drained.counts)

        self._add(tags, f"{section}: {name}", run)

    def tune(self, only: set[str]) -> None:
        """Before round 1: sweep pgqueuer's and procrastinate's settings (those that will run)."""
        server = self.servers[0]
        for name, module in (("pgqueuer", vs_pgqueuer), ("procrastinate", vs_procrastinate)):
            if not wanted(_tag("drain", name, "postgresql"), only):
                continue
            dsn = server.libpq_dsn(f"bench_{name}")
            passes, jobs = self.s.sweep_passes, self.s.sweep_jobs // module.SHARE
            print(f"  tuning {name}: {jobs:,} jobs x {passes} per setting", flush=True)
            try:
                self.tuned[name] = sweep(
                    lambda jobs, module=module, dsn=dsn, **kw: module.drain(dsn, jobs, **kw),
                    module.SWEEP,
                    jobs,
                    passes,
                )
            except Exception as exc:
                traceback.print_exc()
                self.notes.append(f"{name}'s sweep failed ({type(exc).__name__}: {exc})")

    def _tuned_drain(
        self, results: Results, section: str, name: str, module: Any, dsn: str
    ) -> None:
        settings, jobs = self.tuned[name].settings, self.s.jobs // module.SHARE
        row = f"{name} tuned ({describe(settings)}{share(module, jobs)})"
        rate = module.drain(dsn, jobs, **settings)
        results.add(section, row, rate, "jobs/s", "sqla-proletarian, best setting")
        results.work(section, row, server_work.take())

    # --- enqueue -----------------------------------------------------------------------

    def _enqueues(self, server: Server) -> None:
        s, engine = self.s, server.engine()
        key = server.label.split()[0].lower()
        section = f"enqueue, {server.label}"
        bulk = f"raw SQL, one executemany INSERT of {s.jobs:,} jobs + COMMIT"
        commit = "raw SQL, INSERT + COMMIT per job (1 thread)"
        plain = "Session: add a plain ORM row of a job's size + commit, per row"

        def add(
            tags: frozenset[str], name: str, ref: str | None, measure: Callable[[], float]
        ) -> None:
            self._add(
                tags,
                f"{section}: {name}",
                lambda results: _rate(results, section, name, "jobs/s", ref, measure),
            )

        add(_tag("enqueue", "raw", key), bulk, None, lambda: raw.bulk_insert(engine, s.jobs))
        add(
            _tag("enqueue", "library", key),
            f"sqla-proletarian enqueue_many of {s.jobs:,} jobs",
            bulk,
            lambda: library.enqueue_many(engine, s.jobs),
        )
        if server.is_postgresql:
            add(
                _tag("enqueue", "pgqueuer", key),
                f"pgqueuer bulk enqueue of {s.jobs:,} jobs",
                bulk,
                lambda: vs_pgqueuer.fill(server.libpq_dsn("bench_pgqueuer"), s.jobs),
            )
            add(
                _tag("enqueue", "procrastinate", key),
                f"procrastinate batch_defer of {s.jobs:,} jobs",
                bulk,
                lambda: vs_procrastinate.fill(server.libpq_dsn("bench_procrastinate"), s.jobs),
            )
        add(
            _tag("enqueue", "raw", key),
            commit,
            None,
            lambda: raw.insert_commit_loop(engine, s.commits),
        )
        add(
            _tag("enqueue", "library", key),
            "sqla-proletarian enqueue(connection) + commit per job",
            commit,
            lambda: library.enqueue_per_connection(engine, s.commits),
        )
        add(
            _tag("enqueue", "library", key),
            plain,
            None,
            lambda: library.plain_row_per_session(engine, s.commits),
        )
        add(
            _tag("enqueue", "library", key),
            "Session: sqla-proletarian enqueue(session) + commit, per job",
            plain,
            lambda: library.enqueue_per_session(engine, s.commits),
        )

    # --- latency -----------------------------------------------------------------------

    def _latencies(self, server: Server) -> None:
        s, engine, url = self.s, server.engine(), server.urls["bench"]
        key = server.label.split()[0].lower()
        section = (
            f"idle latency, {server.label}: enqueue's commit -> handler start,"
            f" {s.latency_samples} jobs a round"
        )
        wakeup = "LISTEN/NOTIFY wake-up" if server.is_postgresql else "polling_interval=0.1"
        ours = f"sqla-proletarian defaults, worker in another process ({wakeup})"

        def add(tags: frozenset[str], name: str, measure: Callable[[], list[float]]) -> None:
            def run(results: Results) -> None:
                try:
                    latencies = sorted(1000 * value for value in measure())
                except library.NotAvailable as exc:
                    for p in ("p50", "p99"):
                        results.missing(section, f"{name} {p}", "ms", str(exc), f"{ours} {p}")
                    return
                p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]
                ref50 = None if name == ours else f"{ours} p50"
                ref99 = None if name == ours else f"{ours} p99"
                results.add(section, f"{name} p50", statistics.median(latencies), "ms", ref50)
                results.add(section, f"{name} p99", p99, "ms", ref99)

            self._add(tags, f"{section}: {name}", run)

        lib = _tag("latency", "library", key)
        add(lib, ours, lambda: library.idle_latency(engine, url, s.latency_samples))
        if server.is_postgresql:
            add(
                lib,
                "sqla-proletarian poll_only=True, another process (polling_interval=0.1)",
                lambda: library.idle_latency(engine, url, s.latency_samples, poll_only=True),
            )
        add(
            lib,
            "sqla-proletarian defaults, worker in the enqueuing process (in-process wake-up)",
            lambda: library.idle_latency_in_process(engine, s.latency_samples),
        )
        if not server.is_postgresql:
            return
        pgq, pro = server.libpq_dsn("bench_pgqueuer"), server.libpq_dsn("bench_procrastinate")
        add(
            _tag("latency", "pgqueuer", key),
            "pgqueuer defaults (asyncpg, LISTEN/NOTIFY)",
            lambda: vs_pgqueuer.idle_latency(pgq, s.latency_samples),
        )
        add(
            _tag("latency", "pgqueuer", key),
            "pgqueuer through psycopg (LISTEN/NOTIFY)",
            lambda: vs_pgqueuer.idle_latency(pgq, s.latency_samples, "psycopg"),
        )
        add(
            _tag("latency", "procrastinate", key),
            "procrastinate defaults (LISTEN/NOTIFY)",
            lambda: vs_procrastinate.idle_latency(pro, s.latency_samples),
        )

    # --- scale -------------------------------------------------------------------------

    def _scale(self, server: Server) -> None:
        s, engine, deep = self.s, server.engine(), server.engine("bench_deep")
        key = server.label.split()[0].lower()
        section = f"deep queue, {server.label}: the first {s.head:,} jobs, defaults"
        shallow = f"{s.shallow:,} queued"

        def head(results: Results) -> None:
            scale.deep_queue(engine, s.shallow)
            results.add(section, shallow, scale.head_drain(engine, s.head), "jobs/s")
            if s.deep > 0:
                results.add(
                    section, f"{s.deep:,} queued", scale.head_drain(deep, s.head), "jobs/s", shallow
                )

        self._add(_tag("deep", "library", key), section, head)
        polls = f"polls of an empty queue, {server.label}: the worker's poll, 1 thread"
        fresh = "fresh table"

        def dead(results: Results) -> None:
            found = scale.dead_index_polls(engine, s.deletes, s.poll_seconds)
            results.add(polls, fresh, found["fresh"], "polls/s")
            results.add(
                polls, f"after {s.deletes:,} deletes, no vacuum", found["after"], "polls/s", fresh
            )
            results.add(
                polls,
                f"after {s.deletes:,} deletes, an older transaction still open",
                found["held"],
                "polls/s",
                fresh,
            )

        self._add(_tag("polls", "library", key), polls, dead)

    def fill_deep(self, only: set[str]) -> None:
        """Fill every server's deep queue once, if a deep-queue measurement will run."""
        for server in self.servers:
            key = server.label.split()[0].lower()
            if self.s.deep > 0 and wanted(_tag("deep", "library", key), only):
                print(
                    f"  filling the deep queue on {server.label}: {self.s.deep:,} jobs", flush=True
                )
                scale.deep_queue(server.engine("bench_deep"), self.s.deep)

    # --- memory --------------------------------------------------------------------------

    def _memory(self, server: Server) -> None:
        s, engine, url = self.s, server.engine(), server.urls["bench"]
        options = {"batch_size": s.per_transaction} if self.batched else {}
        setting = f"batch_size={s.per_transaction}" if self.batched else "defaults"
        section = f"worker process peak RSS, {server.label}, 4 threads, {setting}"
        checkpoints = sorted({min(s.shallow, s.memory_jobs), s.memory_jobs})

        def run(results: Results) -> None:
            readings = scale.peak_rss(engine, url, checkpoints, s.memory_seconds, **options)
            previous = None
            for (jobs, mib), wanted_jobs in zip(readings, [0, *checkpoints], strict=False):
                name = "at start" if jobs == 0 else f"after {jobs:,} jobs"
                if jobs < wanted_jobs:
                    name += f" (stopped at the {s.memory_seconds:.0f} s limit)"
                results.add(section, name, mib, "MiB", previous)
                previous = name

        self._add(_tag("memory", "library", "postgresql"), section, run, once=True)

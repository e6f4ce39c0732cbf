"""A queue worker process for the fault suite: runs jobs and records every handler run.

Usage: ``python fault_worker.py DB_URL [options]`` (see ``--help``), or
``python fault_worker.py --zygote``: a parent that imports everything once and forks a worker
process for each request it reads on stdin (``{"argv": [...], "log": PATH}``, one JSON a
line), so that the fault suite can kill and replace dozens of workers without paying
Python's start-up each time. A forked worker is a real process with its own connections.

Each job's payload says
how its handler behaves (``kind``): ``ok`` succeeds, ``flaky`` fails its first attempt and
then succeeds, ``bad`` always fails, ``slow`` sleeps ``--slow-ms`` on its first run only,
``long`` on every run.
The worker retries a failed job once, at once, so ``flaky`` ends as success and ``bad`` as
failure, both after two attempts.

Every handler run that reaches its end inserts a row into ``fault_run`` over its own
autocommit connection (so it is counted even if the job's transaction rolls back), then
prints ``done <job_id>``; with ``--effects`` it first inserts a row into ``fault_effect``
through ``job.session``, a write that commits only with the job's outcome (``aborted
<job_id>`` if that write raised: a lost connection). It prints
``start <job_id>`` when it begins (and ``sleeping <job_id>`` when a slow or long run starts
its sleep). The test reads these lines to time its faults.
``ready`` is printed once the worker has started. Every line on stdout starts with the pid
of the process that wrote it, the zygote's own lines (``spawned TOKEN PID``,
``exit PID CODE``) too.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import random
import select
import signal
import sys
import threading
import time
import uuid
from typing import Any

import sqlalchemy as sa
import sqlalchemy.dialects.mysql.pymysql
import sqlalchemy.dialects.postgresql.psycopg
from sqlalchemy.dialects import postgresql

import sqla_proletarian as sp

RUNS = sa.Table(
    "fault_run",
    sa.MetaData(),
    sa.Column("token", sa.String(32), primary_key=True),
    sa.Column("job_id", sa.String(36), nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
)
#: The handler's own writes (``--effects``): committed with the job's outcome or not at all.
EFFECTS = sa.Table(
    "fault_effect",
    RUNS.metadata,
    sa.Column("token", sa.String(32), primary_key=True),
    sa.Column("job_id", sa.String(36), nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
)
#: Seconds a handler keeps trying to record its run while the database is unreachable.
RECORD_DEADLINE = 90.0

_print_lock = threading.Lock()
_local = threading.local()


def say(line: str) -> None:
    """One line to the test on stdout, whole and at once."""
    with _print_lock:
        sys.stdout.write(f"{os.getpid()} {line}\n")
        sys.stdout.flush()


class FlakyError(Exception):
    """Raised by a ``flaky`` job's first attempt."""


class BadJobError(Exception):
    """Raised by every attempt of a ``bad`` job."""


class RunRecorder:
    """Inserts handler runs into ``fault_run``, retrying through lost connections."""

    def __init__(self, url: str, pool_size: int) -> None:
        self.engine = sa.create_engine(
            url, isolation_level="AUTOCOMMIT", pool_size=pool_size, pool_pre_ping=True
        )
        if self.engine.dialect.name == "postgresql":
            self.insert: Any = postgresql.insert(RUNS).on_conflict_do_nothing()
        else:
            # A retry after a commit whose reply was lost finds the token there already.
            self.insert = sa.insert(RUNS).prefix_with("IGNORE")

    def _retrying(self, action: Any) -> Any:
        deadline = time.monotonic() + RECORD_DEADLINE
        pause = 0.02
        while True:
            try:
                with self.engine.connect() as conn:
                    return action(conn)
            except sa.exc.DBAPIError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(pause)
                pause = min(0.5, pause * 2)

    def record(self, job_id: uuid.UUID, attempt: int) -> None:
        values = {
            "token": uuid.uuid4().hex,
            "job_id": str(job_id),
            "pid": os.getpid(),
            "attempt": attempt,
        }
        self._retrying(lambda conn: conn.execute(self.insert, values))

    def count(self, job_id: uuid.UUID) -> int:
        query = sa.select(sa.func.count()).select_from(RUNS).where(RUNS.c.job_id == str(job_id))
        return int(self._retrying(lambda conn: conn.execute(query).scalar_one()))


def make_handler(args: argparse.Namespace, recorder: RunRecorder) -> Any:
    def handle(job: sp.JobContext) -> None:
        _local.handler_done = False
        say(f"start {job.job_id}")
        kind = job.payload["kind"]
        if kind == "long" or (kind == "slow" and recorder.count(job.job_id) == 0):
            say(f"sleeping {job.job_id}")
            time.sleep(args.slow_ms / 1000)
        else:
            time.sleep(random.uniform(args.sleep_min_ms, args.sleep_max_ms) / 1000)
        if args.effects:
            effect = {"token": uuid.uuid4().hex, "job_id": str(job.job_id), "pid": os.getpid()}
            try:
                job.session.execute(sa.insert(EFFECTS).values(**effect, attempt=job.attempts))
            except Exception:
                say(f"aborted {job.job_id}")  # the run ends here, with no done line
                raise
        recorder.record(job.job_id, job.attempts)
        say(f"done {job.job_id}")
        _local.handler_done = True
        if kind == "flaky" and job.attempts == 1:
            raise FlakyError(f"first attempt of {job.job_id} fails")
        if kind == "bad":
            raise BadJobError(f"{job.job_id} always fails")

    return handle


def retry_once(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy:
    return sp.RetryStrategy(retries=1, delays=(0,))


def make_engine(args: argparse.Namespace) -> sa.Engine:
    kwargs: dict[str, Any] = {
        "pool_size": args.pool_size,
        "max_overflow": args.max_overflow,
        "pool_timeout": args.pool_timeout,
    }
    if args.pg_options:
        kwargs["connect_args"] = {"options": args.pg_options}
    engine = sa.create_engine(args.url, **kwargs)
    if args.session_sql:

        @sa.event.listens_for(engine, "connect")
        def set_up_session(dbapi_connection: Any, record: Any) -> None:
            cursor = dbapi_connection.cursor()
            for statement in args.session_sql:
                cursor.execute(statement)
            cursor.close()
            dbapi_connection.commit()

    if args.kill_on_checkout:
        kill_on_checkout(engine, args.kill_on_checkout)

    if args.heartbeat_delay:

        @sa.event.listens_for(engine, "checkout")
        def slow_heartbeat(dbapi_connection: Any, record: Any, proxy: Any) -> None:
            # A starved heartbeat: a late handler's outcome then meets the token's fence
            # before the heartbeat can tell the handler its lease is gone.
            if threading.current_thread().name.endswith("-heartbeat"):
                time.sleep(args.heartbeat_delay)

    if args.kill_before_commit:

        @sa.event.listens_for(engine, "commit")
        def maybe_die(conn: sa.Connection) -> None:
            # The claim's commit after a handler ran: die before it reaches the server.
            done = getattr(_local, "handler_done", False)
            _local.handler_done = False
            if done and random.random() < args.kill_before_commit:
                say("dying-before-commit")
                os.kill(os.getpid(), signal.SIGKILL)

    return engine


def kill_on_checkout(engine: sa.Engine, count: int) -> None:
    """Have the server end the first ``count`` connections the worker takes from its pool,
    right after it takes them: as when a pooled connection was killed, or timed out by the
    server, while it sat idle in the pool."""
    admin = sa.create_engine(engine.url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    left = [count]

    @sa.event.listens_for(engine, "checkout")
    def end_it(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        if left[0] <= 0:
            return
        left[0] -= 1
        cursor = dbapi_connection.cursor()
        if engine.dialect.name == "postgresql":
            cursor.execute("SELECT pg_backend_pid()")
            (session,) = cursor.fetchone()
            kill = sa.text("SELECT pg_terminate_backend(:pid)").bindparams(pid=session)
        else:
            cursor.execute("SELECT CONNECTION_ID()")
            (session,) = cursor.fetchone()
            kill = sa.text(f"KILL {int(session)}")
        cursor.close()
        dbapi_connection.rollback()  # leave it as the pool gave it, idle
        with admin.connect() as conn:
            conn.execute(kill)
        time.sleep(0.05)
        say(f"killed-on-checkout {session}")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("url", help="SQLAlchemy URL of the database holding the queue")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--polling-interval", type=float, default=0.05)
    parser.add_argument("--sleep-min-ms", type=float, default=5)
    parser.add_argument("--sleep-max-ms", type=float, default=30)
    parser.add_argument("--slow-ms", type=float, default=2500)
    parser.add_argument("--pool-size", type=int, default=5)
    parser.add_argument("--max-overflow", type=int, default=10)
    parser.add_argument("--pool-timeout", type=float, default=30)
    parser.add_argument("--max-unclean-ends", default="3", help="a number, or 'none'")
    parser.add_argument("--signals", action="store_true", help="install_signal_handlers=True")
    parser.add_argument(
        "--lease-seconds", type=float, default=None, help="lease mode, with leases this long"
    )
    parser.add_argument(
        "--effects", action="store_true", help="the handler writes a row through job.session"
    )
    parser.add_argument(
        "--heartbeat-delay", type=float, default=0.0, help="seconds each heartbeat waits first"
    )
    parser.add_argument(
        "--kill-before-commit",
        type=float,
        default=0.0,
        help="chance that the process SIGKILLs itself between a handler's end and the commit",
    )
    parser.add_argument(
        "--kill-on-checkout",
        type=int,
        default=0,
        help="have the server end the first N connections right after each is checked out",
    )
    parser.add_argument("--session-sql", action="append", default=[], help="run on connect")
    parser.add_argument("--pg-options", default="", help="libpq options, e.g. '-c x=y'")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(process)d %(threadName)s %(levelname)s %(name)s %(message)s",
    )
    max_unclean = None if args.max_unclean_ends == "none" else int(args.max_unclean_ends)
    recorder = RunRecorder(args.url, pool_size=args.threads + 1)
    worker = sp.create_queue_worker(
        make_engine(args),
        make_handler(args, recorder),
        handler_mode="advanced",
        worker_threads=args.threads,
        polling_interval=args.polling_interval,
        retry_strategy=retry_once,
        install_signal_handlers=args.signals,
        max_unclean_ends=max_unclean,
        lease_seconds=args.lease_seconds,
        worker_id=f"fault-worker-{os.getpid()}",
    )
    worker.start()
    say("ready")
    # The main thread only waits, so that it can take signals; the worker stops by itself
    # only when something went wrong.
    while not worker.wait(0.5):
        pass
    say("worker-stopped")
    print(f"fault worker stopped by itself: {worker.summary_text()}", file=sys.stderr)
    return 3


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies, so no worker outlives the test."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _spawn(request: dict[str, Any]) -> int:
    sys.stdout.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        _die_with_parent()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 2)
        os.close(log)
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.close(stdin)
        code = main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def zygote() -> int:
    """Fork workers on request; report each one's pid and, when it ends, its exit code."""
    _die_with_parent()
    pending = b""
    children: set[int] = set()
    stdin = sys.stdin.fileno()
    open_input = True
    while open_input or children:
        if open_input and select.select([stdin], [], [], 0.02)[0]:
            chunk = os.read(stdin, 65536)
            if not chunk:
                open_input = False
            pending += chunk
            while b"\n" in pending:
                raw, pending = pending.split(b"\n", 1)
                request = json.loads(raw)
                pid = _spawn(request)
                children.add(pid)
                say(f"spawned {request['token']} {pid}")
        elif not open_input:
            time.sleep(0.02)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        sys.exit(zygote())
    sys.exit(main(sys.argv[1:]))

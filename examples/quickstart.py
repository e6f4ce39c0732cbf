"""sqla-proletarian in five minutes, on SQLite: no database server needed.

Run it with ``python examples/quickstart.py``. It walks through:

1. a signup that writes a user row AND enqueues a welcome-email job in one transaction;
2. a signup that rolls back: its job disappears with it and never runs;
3. a job that fails once and succeeds when the retry strategy runs it again;
4. a job that fails for good and reaches the failed-job handler;
5. a JobHandlers dispatch table, a worker that runs it, and the shutdown summary.

The database is a file in a temporary folder, deleted at the end.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import sqla_proletarian as sp

# --- Your application's own models ----------------------------------------------------------
# Your declarative Base and MetaData stay yours: the library's tables live in sp.metadata.


class Base(DeclarativeBase):
    pass


class User(Base):
    __tablename__ = "users"

    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(sa.String(255), unique=True)


class SentEmail(Base):
    """What the welcome-email handler records, inside the job's own transaction."""

    __tablename__ = "sent_emails"

    job_id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(sa.String(255))


# --- The handlers: one function per job type -------------------------------------------------
# A JobHandlers table dispatches on the job type, like Proletarian's defmulti. This worker
# runs in "advanced" mode, so each handler receives the whole job (a JobContext).

handlers = sp.JobHandlers()


@handlers.register("send-welcome-email")
def send_welcome_email(job: sp.JobContext) -> None:
    email = job.payload["email"]
    say(f"  [worker] {job.job_type} (attempt {job.attempts}): welcome, {email}!")
    # job.session is bound to the job's transaction: this row commits together with the
    # job's "success" archive row, or not at all. Exactly once, even if the job runs twice.
    job.session.add(SentEmail(job_id=job.job_id, email=email))


@handlers.register("sync-to-crm")
def sync_to_crm(job: sp.JobContext) -> None:
    if job.attempts == 1:
        say(f"  [worker] {job.job_type} (attempt 1): the CRM is down, raising ConnectionError")
        raise ConnectionError("CRM unreachable (simulated)")
    say(f"  [worker] {job.job_type} (attempt {job.attempts}): synced user {job.payload['email']}")


@handlers.register("charge-card")
def charge_card(job: sp.JobContext) -> None:
    say(f"  [worker] {job.job_type} (attempt {job.attempts}): card declined, raising ValueError")
    raise ValueError("card declined")


def retry_strategy(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy | None:
    """Retry network trouble twice, 0.3 s apart; anything else fails at once."""
    if isinstance(exc, ConnectionError):
        return sp.RetryStrategy(retries=2, delays=[0.3])
    return None


def failed_job_handler(job: sp.JobContext, exc: Exception) -> None:
    """Called once a job has failed for good (after its failure is committed)."""
    say(f"  [failed-job handler] {job.job_type} gave up after {job.attempts} attempt(s): {exc!r}")


# --- Your application code: enqueue in the same transaction as the business data ------------


def sign_up(session: Session, email: str) -> uuid.UUID:
    """Write the user and enqueue the welcome email. Does not commit: the caller decides."""
    user = User(email=email)
    session.add(user)
    return sp.enqueue(session, "send-welcome-email", {"email": email})


def main() -> int:
    log_output = logging.StreamHandler(sys.stdout)
    log_output.setFormatter(EventFormatter())
    logging.getLogger("sqla_proletarian").addHandler(log_output)
    logging.getLogger("sqla_proletarian").setLevel(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="sqla-proletarian-") as folder:
        engine = sa.create_engine(f"sqlite:///{Path(folder) / 'quickstart.db'}")
        try:
            return tour(engine)
        finally:
            engine.dispose()


def tour(engine: sa.Engine) -> int:
    Base.metadata.create_all(engine)  # your tables
    sp.metadata.create_all(engine)  # the job queue's tables (use the migrations in production)
    say(f"sqla-proletarian quickstart, on SQLite ({engine.url.database})\n")

    say("1. Ada signs up: her user row and her welcome-email job are written in ONE transaction.")
    with Session(engine) as session:
        ada_job = sign_up(session, "ada@example.com")
        session.commit()
    say(f"   committed: user ada@example.com and job {ada_job}\n")

    say("2. Bob signs up, but his request fails before the commit: the transaction rolls back.")
    try:
        with Session(engine) as session, session.begin():  # commit at the end, or roll back
            bob_job = sign_up(session, "bob@example.com")
            session.flush()  # the user and job rows are in the database, uncommitted...
            raise RuntimeError("the payment provider timed out")
    except RuntimeError as exc:
        say(f"   the request failed ({exc}), so both rows were rolled back")
    with Session(engine) as session:
        bob = session.scalar(sa.select(User).where(User.email == "bob@example.com"))
        queued = session.scalar(sa.select(sp.Job).where(sp.Job.job_id == bob_job))
    say(f"   user bob@example.com: {'present' if bob else 'absent'}")
    say(f"   his job {bob_job}: {'queued' if queued else 'absent'}\n")

    say("3. Two more jobs: sync-to-crm fails once, then succeeds when retried;")
    say("   charge-card fails every time, so it ends in the failed-job handler.")
    with Session(engine) as session:
        sp.enqueue(session, "sync-to-crm", {"email": "ada@example.com"})
        sp.enqueue(session, "charge-card", {"email": "ada@example.com", "cents": 4200})
        session.commit()
        in_order = sp.Job.__table__.c.seq  # enqueue order
        waiting = session.scalars(sa.select(sp.Job.job_type).order_by(in_order)).all()
    say(f"   the queue holds {len(waiting)} jobs: {', '.join(waiting)}\n")

    say("4. Start a worker and let it work off the queue.")
    worker = sp.create_queue_worker(
        engine,
        handlers,
        handler_mode="advanced",
        retry_strategy=retry_strategy,
        failed_job_handler=failed_job_handler,
        polling_interval=0.05,
    )
    worker.start()
    drained = wait_until_queue_is_empty(engine, timeout=10.0)

    say("\n5. Stop the worker: stop() lets running jobs finish, then returns.")
    worker.stop()
    say(f"   {worker.worker_id} stopped: {worker.summary_text()}\n")

    say("6. The archive, where every finished job ends up:")
    with Session(engine) as session:
        for archived in session.scalars(
            sa.select(sp.ArchivedJob).order_by(sp.ArchivedJob.finished_at)
        ):
            error = f"  error: {archived.error.splitlines()[0]}" if archived.error else ""
            outcome = f"{archived.status:<8} attempts={archived.attempts}"
            say(f"   {archived.job_type:<18} {outcome}{error}")
        sent = session.scalars(sa.select(SentEmail.email)).all()
        bob_ran = session.scalar(sa.select(sp.ArchivedJob).where(sp.ArchivedJob.job_id == bob_job))
    say(f"   welcome emails sent to: {', '.join(sent)}")
    say(f"   Bob's rolled-back job: {'RAN, which is a bug' if bob_ran else 'never ran'}")

    if not drained or bob_ran:
        print("something is wrong: see above", file=sys.stderr)
        return 1
    return 0


def wait_until_queue_is_empty(engine: sa.Engine, timeout: float) -> bool:
    """Poll the job table until it is empty; False if the deadline passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with Session(engine) as session:
            if session.scalar(sa.select(sa.func.count()).select_from(sp.Job)) == 0:
                return True
        time.sleep(0.05)
    return False


# --- Helpers for the narration ---------------------------------------------------------------

_print_lock = threading.Lock()


def say(text: str) -> None:
    """print(), one line at a time across the main thread and the worker's thread."""
    with _print_lock:
        print(text, flush=True)


class EventFormatter(logging.Formatter):
    """Show the library's log events briefly: each record has a stable ``event`` name and
    structured fields (worker_id, job_id, job_type, attempt, ...) as attributes."""

    def format(self, record: logging.LogRecord) -> str:
        words = [record.levelname.lower(), getattr(record, "event", record.getMessage())]
        for name in ("job_type", "attempt", "retries_left"):
            if hasattr(record, name):
                words.append(f"{name}={getattr(record, name)}")
        return "  [log] " + " ".join(words)


if __name__ == "__main__":
    sys.exit(main())

"""Dispatch jobs by type with JobHandlers: Proletarian's ``defmulti``, in both handler modes.

Run it with ``python examples/dispatch.py`` (SQLite in a temporary folder; set
``DATABASE_URL`` for another database). It enqueues a few jobs on two queues and runs them
one by one with ``sp.process_next_job``, the way you would from a REPL or a test:

* queue "emails", default mode: each handler is called as ``handler(job_type, payload)``,
  and a ``@handlers.default`` catch-all takes the job types nobody registered;
* queue "billing", advanced mode: each handler is called as ``handler(job)`` with the
  whole job (a ``JobContext``: job_id, attempts, enqueued_at, ...). This table has no
  catch-all, so an unknown job type fails like any other error (``UnknownJobTypeError``),
  goes through the retry strategy, and ends archived as a failure.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

import sqla_proletarian as sp

# --- Default mode: handler(job_type, payload) ------------------------------------------------
# A function that builds the table closes over what the handlers need (a mailer, a search
# client...) instead of reaching for globals. Here the "mailer" is a list.


def make_email_handlers(outbox: list[str]) -> sp.JobHandlers:
    handlers = sp.JobHandlers()

    @handlers.register("confirmation-email")
    def confirmation_email(job_type: str, payload: dict[str, Any]) -> None:
        outbox.append(f"to {payload['email_address']}: Please confirm your email")
        say(f"  [{job_type}] confirmation email for {payload['first_name']}")

    @handlers.register("reindex-document")
    def reindex_document(job_type: str, payload: dict[str, Any]) -> None:
        say(f"  [{job_type}] document {payload['document_id']} reindexed")

    @handlers.default
    def unknown_job(job_type: str, payload: Any) -> None:
        # Like the seeds' `(defmethod handle-job! :default ...)`: log it and move on.
        say(f"  [default] no handler for job type {job_type!r}; payload {payload!r} dropped")

    return handlers


# --- Advanced mode: handler(job) ---------------------------------------------------------------

billing_handlers = sp.JobHandlers()


@billing_handlers.register("send-invoice")
def send_invoice(job: sp.JobContext) -> None:
    say(
        f"  [{job.job_type}] invoice {job.payload['invoice_id']}: job {job.job_id}, "
        f"attempt {job.attempts}, enqueued at {job.enqueued_at:%H:%M:%S.%f} UTC"
    )


def report_failure(job: sp.JobContext, exc: Exception) -> None:
    say(f"  [failed-job handler] {job.job_type}: {exc}")


# --- Running it --------------------------------------------------------------------------------


def enqueue_examples(session: Session) -> list[uuid.UUID]:
    """Five jobs on two queues, in one transaction (the caller commits)."""
    return [
        sp.enqueue(
            session,
            "confirmation-email",
            {"email_address": "ada@example.com", "first_name": "Ada"},
            queue="emails",
        ),
        sp.enqueue(session, "reindex-document", {"document_id": 42}, queue="emails"),
        sp.enqueue(session, "newsletter", {"issue": 7}, queue="emails"),
        sp.enqueue(session, "send-invoice", {"invoice_id": "INV-1001"}, queue="billing"),
        sp.enqueue(session, "refund", {"invoice_id": "INV-0999"}, queue="billing"),
    ]


def run(engine: sa.Engine) -> int:
    sp.metadata.create_all(engine)  # for the example; use the migrations in production
    with Session(engine) as session:
        job_ids = enqueue_examples(session)
        session.commit()

    outbox: list[str] = []
    say("queue 'emails', default mode: handler(job_type, payload)")
    email_handlers = make_email_handlers(outbox)
    while sp.process_next_job(engine, email_handlers, queue="emails"):
        pass

    say("queue 'billing', advanced mode: handler(job)")
    while sp.process_next_job(
        engine,
        billing_handlers,
        queue="billing",
        handler_mode="advanced",
        failed_job_handler=report_failure,
    ):
        pass

    say("the archive:")
    with Session(engine) as session:
        for job_id in job_ids:
            archived = session.get(sp.ArchivedJob, job_id)
            if archived is None:
                say(f"  job {job_id} did not run: something is wrong")
                return 1
            say(f"  {archived.queue:<8} {archived.job_type:<19} {archived.status}")
    say(f"outbox: {outbox}")
    return 0


def main() -> int:
    logging.basicConfig(format="  [log] %(levelname)s %(message)s")
    url = os.environ.get("DATABASE_URL")
    with tempfile.TemporaryDirectory(prefix="sqla-proletarian-") as folder:
        engine = sa.create_engine(url or f"sqlite:///{Path(folder) / 'dispatch.db'}")
        try:
            return run(engine)
        finally:
            engine.dispose()


def say(text: str) -> None:
    print(text, flush=True)


if __name__ == "__main__":
    sys.exit(main())

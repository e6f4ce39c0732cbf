"""Workflows in the style of Celery's canvas: a chain and a chord, enqueued in one transaction.

Run it with ``python examples/canvas.py`` (SQLite in a temporary folder; set
``DATABASE_URL`` for another database). In ONE transaction it enqueues:

* a chain, fetch-order -> price-order -> write-invoice: each step depends on the one before
  (``depends_on``) and reads its result through ``job.dependency_results`` (an
  advanced-mode handler) or ``sp.current_job().dependency_results`` (a task);
* a fan-out and its join (Celery's chord): ``PARTS`` count-words jobs, one per chunk of a
  text, and a sum-counts job that depends on all of them and adds up their results.

Then a worker of 4 threads drains the queue, and the results are read back:
``sp.wait_for_result`` waits for the join's end and returns what it returned;
``sp.get_result`` reads the chain's last result from the archive.
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

#: The text the fan-out counts, one chunk per part.
TEXT = [
    "jobs are rows in your own database",
    "enqueue a graph in the transaction that writes your data",
    "commit and every step will run",
    "roll back and none of them ever existed",
]
PARTS = len(TEXT)

handlers = sp.JobHandlers()

# --- The chain: fetch-order -> price-order -> write-invoice ----------------------------------


@handlers.task("fetch-order")
def fetch_order(order_id: int) -> dict[str, Any]:
    """The first step: its return value is stored with its archived job (as JSON)."""
    return {"order_id": order_id, "items": [{"sku": "tea", "cents": 450, "quantity": 3}]}


@handlers.register("price-order")
def price_order(job: sp.JobContext) -> dict[str, Any]:
    """An advanced-mode handler: the job's ``dependency_results`` maps each dependency's id to
    its result."""
    (order,) = job.dependency_results.values()
    cents = sum(item["cents"] * item["quantity"] for item in order["items"])
    return {"order_id": order["order_id"], "cents": cents}


@handlers.task("write-invoice")
def write_invoice(currency: str) -> str:
    """A task keeps its own arguments; what the step before returned comes from the running
    job, ``sp.current_job()``."""
    (priced,) = sp.current_job().dependency_results.values()
    return f"invoice for order {priced['order_id']}: {priced['cents'] / 100:.2f} {currency}"


# --- The chord: count-words in parts, then sum-counts ----------------------------------------


@handlers.task("count-words")
def count_words(chunk: str) -> int:
    return len(chunk.split())


@handlers.task("sum-counts")
def sum_counts() -> int:
    """The join: it runs once, after the last part's success, with every part's result."""
    counts = sp.current_job().dependency_results
    say(f"  [worker] sum-counts: {len(counts)} parts, counts {sorted(counts.values())}")
    return sum(counts.values())


# --- Enqueue the whole canvas in one transaction ---------------------------------------------


def enqueue_canvas(session: Session) -> tuple[uuid.UUID, uuid.UUID]:
    """The chain and the chord, in the caller's transaction (no commit here): the chain's
    last job id and the join's."""
    fetched = fetch_order.enqueue(session, 1042)
    priced = sp.enqueue(session, "price-order", depends_on=[fetched])
    invoice = write_invoice.with_options(depends_on=[priced]).enqueue(session, "EUR")

    parts = count_words.enqueue_many(session, [(chunk,) for chunk in TEXT])
    total = sum_counts.with_options(depends_on=parts).enqueue(session)
    return invoice, total


def run(engine: sa.Engine) -> int:
    sp.metadata.create_all(engine)  # for the example; use the migrations in production
    with Session(engine) as session:
        invoice, total = enqueue_canvas(session)
        session.commit()  # the whole canvas exists from here on, or not at all
    say(f"enqueued a chain of 3 jobs and a chord of {PARTS} parts and a join, in one commit")
    waiting = sp.get_job(engine, total)
    say(f"the join is {waiting.state if waiting else 'missing'} before the worker starts")

    worker = sp.create_queue_worker(
        engine, handlers, handler_mode="advanced", worker_threads=4, polling_interval=0.05
    )
    with worker:
        words = sp.wait_for_result(engine, total, timeout=60)
        say(f"sum-counts returned {words} (wait_for_result)")
        last = sp.wait_for_result(engine, invoice, timeout=60)
    with Session(engine) as session:
        stored = sp.get_result(session, invoice)
    say(f"write-invoice returned {stored!r} (get_result)")
    say(f"worker: {worker.summary_text()}")

    expected = sum(len(chunk.split()) for chunk in TEXT)
    if words != expected or stored != last or "13.50 EUR" not in stored:
        print("something is wrong: see above", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    logging.basicConfig(format="  [log] %(levelname)s %(message)s")
    url = os.environ.get("DATABASE_URL")
    with tempfile.TemporaryDirectory(prefix="sqla-proletarian-") as folder:
        engine = sa.create_engine(url or f"sqlite:///{Path(folder) / 'canvas.db'}")
        try:
            return run(engine)
        finally:
            engine.dispose()


def say(text: str) -> None:
    print(text, flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""Lease mode at full speed: one poller per worker feeds its threads, and one completer
archives the handlers' successes together.

The threaded worker's poller claims jobs for its threads (up to ``batch_size`` each) and
puts them on an in-process queue that the threads take from: the threads run handlers only.
While claims come back full, its claimers claim too (each a share of the threads' room, on
a connection of its own), so that several claims are in flight (``CLAIMS_IN_FLIGHT``); a
claim that comes back short stops them, and while the queue is drained the poller alone
waits. A job waiting in the queue keeps its lease (the heartbeat renews it with the running
ones); a stop gives the unstarted ones back at once, uncharged.

A handler that returned without using ``job.session`` has nothing of its own to commit: its
completion joins the completer's group, which ends every queued job where it still carries
its run's token and archives them in one transaction, every ``FLUSH_DELAY`` seconds or
``FLUSH_JOBS`` jobs (a full group in the thread whose job filled it: several groups are
archived at once). Until that commit the job is only leased: a worker that dies in between
leaves it to run again once its lease expires (at-least-once, as any lease-mode crash). A
handler that used its session completes in its own transaction, with its writes.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import UTC

from sqla_proletarian.leases import LeaseConnections, LeasedRun, LeaseRunner
from sqla_proletarian.logs import log_event

#: Seconds a succeeded job waits for others before the completer archives them together.
FLUSH_DELAY = 0.005
#: Jobs the completer archives in one transaction at most.
FLUSH_JOBS = 100
#: Claims a worker has in flight at most while its queue is busy (its poller's and its
#: claimers'; never more than its threads, nor than a claim per two jobs of their room, and
#: one on SQLite, whose claims take turns).
CLAIMS_IN_FLIGHT = 2


class Completer:
    """A thread that archives queued successes together; close() archives what is left."""

    def __init__(self, complete: Callable[[list[LeasedRun]], object], name: str) -> None:
        self._complete = complete
        self._queued: list[LeasedRun] = []
        self._changed = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._flush_until_closed, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add(self, run: LeasedRun) -> None:
        """Queue a run's completion (done at once, in the caller's thread, once closed). The
        run that fills a group (``FLUSH_JOBS``) archives it in the caller's thread, so that
        several groups are archived at once while the jobs keep coming."""
        with self._changed:
            if not self._closing:
                self._queued.append(run)
                if len(self._queued) < FLUSH_JOBS:
                    # Only the first run of a group wakes the thread: it then waits out
                    # FLUSH_DELAY, which the next ones need not cut short.
                    if len(self._queued) == 1:
                        self._changed.notify()
                    return
                runs, self._queued = self._queued[:FLUSH_JOBS], self._queued[FLUSH_JOBS:]
            else:
                runs = [run]
        self._flush(runs)

    def close(self) -> None:
        """Archive what is queued, then end the thread."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _flush_until_closed(self) -> None:
        while True:
            with self._changed:
                while not self._queued and not self._closing:
                    self._changed.wait()
                if not self._queued:
                    return
                deadline = time.monotonic() + FLUSH_DELAY
                while len(self._queued) < FLUSH_JOBS and not self._closing:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._changed.wait(left)
                runs, self._queued = self._queued[:FLUSH_JOBS], self._queued[FLUSH_JOBS:]
            self._flush(runs)

    def _flush(self, runs: list[LeasedRun]) -> None:
        try:
            self._complete(runs)
        except Exception as exc:  # the runner logs its own failures; this is a last guard
            log_event(logging.ERROR, "completion-error", jobs=len(runs), error=repr(exc))


class Feeder:
    """The poller's in-process queue of claimed jobs, the room its threads have, and the
    claimers that claim beside the poller while the queue is busy."""

    def __init__(
        self, runner: LeaseRunner, threads: int, batch_size: int, wake: threading.Event
    ) -> None:
        self.runner = runner
        self._threads = threads
        self._batch_size = batch_size
        #: Set when a thread becomes free (the poller may claim again).
        self._wake = wake
        self._queue: queue.SimpleQueue[LeasedRun | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        #: Notified when room is made, a claim comes back full, or the feeder ends.
        self._changed = threading.Condition(self._lock)
        #: Jobs claimed (or being claimed) and not yet ended: queued or running.
        self._held = 0
        #: Whether the last claim came back full (more jobs are due): the claimers claim.
        self._busy = False
        self._ending = False
        # A share of two jobs at least: a claim of one job is a transaction per job.
        most = threads * batch_size
        claims = min(threads, CLAIMS_IN_FLIGHT, max(1, most // 2))
        if runner.dialect.claim_takes_write_lock:
            claims = 1
        #: The most one claim takes while others may be in flight: a share of the threads'
        #: room, in whole batches.
        self._share = max(batch_size, threads // claims * batch_size)
        self._claimers = [
            threading.Thread(
                target=self._claim_while_busy,
                name=f"{runner.settings.worker_id}-claimer-{index}",
                daemon=True,
            )
            for index in range(1, claims)
        ]
        self._stopping: Callable[[], bool] = lambda: False
        self._claiming: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext
        self.completer = Completer(self._complete, f"{runner.settings.worker_id}-completer")

    def start(
        self,
        stopping: Callable[[], bool],
        claiming: Callable[[], AbstractContextManager[None]],
    ) -> None:
        """Start the completer and the claimers (``claiming``: around each of their claims,
        as around the poller's)."""
        self._stopping, self._claiming = stopping, claiming
        self.completer.start()
        for claimer in self._claimers:
            claimer.start()

    def _complete(self, runs: list[LeasedRun]) -> None:
        """Complete successes together; jobs given back instead are due now: poll."""
        if self.runner.complete(runs):
            self._wake.set()

    def room(self) -> int:
        """Jobs the poller may claim now: up to ``batch_size`` per thread, less the ones
        held (queued, running, or being claimed); none until the held ones are down to a job
        per thread, or half of the most (so that a batch is claimed while the last one still
        runs). Whole batches where there is room for one: each number claimed is a statement
        of its own (its limit), compiled and prepared once, so there are few of them."""
        with self._lock:
            return self._room(None)

    def _room(self, share: int | None) -> int:
        """room(); a claimer's (``share``): a share of the threads' room, or none."""
        batch = self._batch_size
        most = self._threads * batch
        room = most - self._held
        if share is not None:
            return share if room >= share else 0
        if self._held >= max(self._threads, most // 2):
            return 0
        return room if room < batch else room - room % batch

    def claim(self, connections: LeaseConnections, share: int | None = None) -> int:
        """Claim up to room() jobs into the queue (a claimer: its ``share``); how many (1
        for a claim whose jobs all ended at the claim, cancelled or crashed: more may be
        due, poll again at once). A claim that comes back full sets the claimers going."""
        with self._lock:
            room = self._room(share)
            self._held += room  # taken now: a claim beside this one takes the rest
        if not room:
            connections.release()  # no connection is held while every thread is busy
            return 0
        runs: list[LeasedRun] = []
        try:
            runs = self.runner.claim(connections, room)
        finally:
            with self._lock:
                self._held -= room - len(runs)
                self._busy = len(runs) == room
                self._changed.notify_all()
        for run in runs:
            self._queue.put(run)
        return len(runs) or int(connections.claimed_last)

    def _claim_while_busy(self) -> None:
        """A claimer: while the last claim came back full and there is room for a share,
        claim beside the poller on a connection of its own. A failed claim ends the busy
        spell (the poller's next claim meets the error, and handles it)."""
        connections, share = self.runner.open_connections(), self._share
        try:
            while True:
                with self._lock:
                    while not self._ending and not (self._busy and self._room(share)):
                        self._changed.wait()
                    if self._ending:
                        return
                if self._stopping():
                    return
                try:
                    with self._claiming():
                        if not self.claim(connections, share):
                            connections.release()  # a claim that took jobs gave it back
                except Exception as exc:
                    connections.close()
                    with self._lock:
                        self._busy = False
                    log_event(logging.DEBUG, "claimer-error", error=repr(exc))
        finally:
            connections.close()

    def next_due_in(self, connections: LeaseConnections) -> float | None:
        """Seconds until the queue's next job is due (None: none is queued)."""
        due = self.runner.next_due_on(connections)
        if due is None:
            return None
        if due.tzinfo is None:
            due = due.replace(tzinfo=UTC)
        return (due - self.runner.now()).total_seconds()

    def work(self, stopping: Callable[[], bool]) -> None:
        """A worker thread: run the queued jobs until the poller ends the queue."""
        while (run := self._queue.get()) is not None:
            try:
                if stopping():
                    self.runner.give_back([run])
                else:
                    self.runner.run_claimed(run, self.completer.add)
            finally:
                # The poller and the claimers wait for room: they are woken once there is
                # some, not by every job's end while every thread is busy.
                with self._lock:
                    self._held -= 1
                    if self._room(self._share):
                        self._changed.notify_all()
                    room = self._room(None)
                if room:
                    self._wake.set()

    def end(self) -> None:
        """The poller is done: end the claimers (after their claims under way), give the
        unstarted leases back and end the threads' loops."""
        with self._lock:
            self._ending = True
            self._changed.notify_all()
        for claimer in self._claimers:
            if claimer.is_alive():
                claimer.join()
        unstarted: list[LeasedRun] = []
        with contextlib.suppress(queue.Empty):
            while True:
                run = self._queue.get_nowait()
                if run is not None:
                    unstarted.append(run)
        with self._lock:
            self._held -= len(unstarted)
        try:
            self.runner.give_back(unstarted)
        finally:
            for _ in range(self._threads):
                self._queue.put(None)

"""Worker processes, started alike and timed from one "go" (spawned, so no fork of threads).

A child runs ``target(crew, *args)``: it sets itself up, calls ``crew.ready_and_wait()``,
then works until ``crew.stop`` is set, counting its jobs in ``crew.count`` or reporting
through ``crew.report``. The parent times from the go until the children have counted the
jobs, or until a check of its own (the database says the queue is drained) passes.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SPAWN = mp.get_context("spawn")
#: Seconds a crew may take to start, and to finish its work.
START_TIMEOUT = 120.0
WORK_TIMEOUT = 600.0


@dataclass
class Crew:
    """What one child shares with the parent."""

    ready: Any
    go: Any
    stop: Any
    count: Any
    reports: Any

    def ready_and_wait(self) -> None:
        self.ready.set()
        self.go.wait()

    def report(self, *item: object) -> None:
        self.reports.put(item)


def _child(target: Callable[..., None], crew: Crew, args: tuple[Any, ...]) -> None:
    try:
        target(crew, *args)
    except BaseException:
        crew.reports.put(("error", traceback.format_exc()))
        raise


class Crews:
    """``n`` child processes running ``target``; use as a context manager."""

    def __init__(
        self, n: int, target: Callable[..., None], *args: Any, linger: float = 30.0
    ) -> None:
        self.linger = linger
        self.go = SPAWN.Event()
        self.stop = SPAWN.Event()
        self.reports: Any = SPAWN.Queue()
        self.crews = [
            Crew(SPAWN.Event(), self.go, self.stop, SPAWN.Value("q", 0), self.reports)
            for _ in range(n)
        ]
        self.processes = [
            SPAWN.Process(target=_child, args=(target, crew, args), daemon=True)
            for crew in self.crews
        ]
        self.started_at = 0.0

    def __enter__(self) -> Crews:
        for process in self.processes:
            process.start()
        deadline = time.monotonic() + START_TIMEOUT
        for crew in self.crews:
            while not crew.ready.wait(0.2):
                self._raise_reported()
                if time.monotonic() > deadline:
                    raise RuntimeError("worker processes did not start")
        self.started_at = time.monotonic()
        self.go.set()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for process in self.processes:
            process.join(self.linger)
            if process.is_alive():
                process.terminate()
                process.join(5)

    def counted(self) -> int:
        return sum(crew.count.value for crew in self.crews)

    def wait_count(self, jobs: int, timeout: float = WORK_TIMEOUT) -> float:
        """Seconds from the go until the children have counted ``jobs`` between them."""
        deadline = time.monotonic() + timeout
        while self.counted() < jobs:
            self._raise_reported()
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {self.counted()} of {jobs} jobs done in time")
            time.sleep(0.002)
        return time.monotonic() - self.started_at

    def wait_until(self, done: Callable[[], bool], timeout: float = WORK_TIMEOUT) -> float:
        """Seconds from the go until ``done()`` (asked every 20 ms) is true."""
        deadline = time.monotonic() + timeout
        while not done():
            self._raise_reported()
            if time.monotonic() > deadline:
                raise RuntimeError("the worker processes did not finish in time")
            time.sleep(0.02)
        return time.monotonic() - self.started_at

    def next_start(self) -> tuple[int, float]:
        """The next ("start", n, monotonic time) report of a child's handler."""
        _, n, at = self.next_report(30)
        return n, at

    def next_report(self, timeout: float) -> tuple[Any, ...]:
        try:
            item: tuple[Any, ...] = self.reports.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError("no report from the worker processes in time") from None
        if item[0] == "error":
            raise RuntimeError(f"a worker process failed:\n{item[1]}")
        return item

    def _raise_reported(self) -> None:
        for process in self.processes:
            if process.exitcode not in (None, 0):
                raise RuntimeError(f"a worker process exited with {process.exitcode}")
        try:
            item = self.reports.get_nowait()
        except queue.Empty:
            return
        if item[0] == "error":
            raise RuntimeError(f"a worker process failed:\n{item[1]}")
        self.reports.put(item)


def sample_latencies(
    enqueue: Callable[[int], None], started: Callable[[], tuple[int, float]], samples: int
) -> list[float]:
    """Seconds from each enqueue's commit to its handler's start, one job at a time on an
    idle worker: a warm-up job first, then each job 50-250 ms after the last one started.

    ``enqueue(n)`` commits job ``n``; ``started()`` waits for the next start: (n, monotonic
    time), taken in the handler (monotonic clocks agree across processes on Linux).
    """

    def run(n: int) -> float:
        enqueue(n)
        committed = time.monotonic()
        started_n, at = started()
        if started_n != n:
            raise RuntimeError(f"job {started_n} started, expected {n}")
        return at - committed

    run(-1)
    latencies = []
    for n in range(samples):
        time.sleep(random.uniform(0.05, 0.25))
        latencies.append(run(n))
    return latencies

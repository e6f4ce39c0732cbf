"""Real worker processes (``python -m sqla_proletarian worker``) running
``programs/flow_tasks.py:sleep``, whose handlers note each run's start and end from their own
clock: what the process race tests (queue limits, workflows) read their runs from."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from helpers import wait_for

if TYPE_CHECKING:
    from conftest import Database

PROGRAMS = Path(__file__).parent / "programs"
QUEUE = "q"
LEASE = ("--lease-seconds", "2", "--heartbeat-interval", "0.5")
#: Each mode's worker flags: lease mode with a 2 s lease, renewed twice a second.
MODES = {"transaction": (), "lease": LEASE}
#: Seconds a drain of a few seconds' jobs may take on a loaded 2-core machine.
DRAIN_TIMEOUT = 90
SUMMARY = re.compile(r"stopped: (\d+) succeeded, (\d+) retried, (\d+) failed")


@dataclass(frozen=True)
class Run:
    """One handler run, as its handler noted it (``time.time()`` at start and end)."""

    job_id: uuid.UUID
    key: str
    start: float
    end: float
    pid: int


class Workers:
    """Worker processes (``python -m sqla_proletarian worker``) running ``flow_tasks:sleep``
    on the test's database, each with its standard error in a file; the runs they noted.
    Any process left when the test ends is resumed and killed."""

    def __init__(self, database: Database, directory: Path) -> None:
        self.url = database.url.render_as_string(hide_password=False)
        self.directory = directory
        self.events = directory / "events.log"
        self.processes: list[subprocess.Popen[str]] = []

    def start(self, *args: str) -> subprocess.Popen[str]:
        """Start one worker process of the queue with ``args`` (threads, mode) and wait until
        it is about to poll, so that every process started before an enqueue races for it."""
        paths = [str(PROGRAMS), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {
            **os.environ,
            "DATABASE_URL": self.url,
            "FLOW_EVENTS": str(self.events),
            "PYTHONPATH": os.pathsep.join(paths),
        }
        log = self.directory / f"worker-{len(self.processes)}.log"
        with log.open("w") as stderr:
            process = subprocess.Popen(
                [
                    sys.executable,
                    *("-m", "sqla_proletarian", "worker", "flow_tasks:sleep"),
                    *("--handler-mode", "advanced", "--queue", QUEUE),
                    *("--polling-interval", "0.05", "--log-level", "info"),
                    *args,
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                text=True,
            )
        self.processes.append(process)
        assert wait_for(
            lambda: "queue-worker-starting" in self.stderr(process) or process.poll() is not None,
            60,
        ), f"worker {process.pid} did not start:\n{self.stderr(process)}"
        assert process.poll() is None, self.stderr(process)
        return process

    def stderr(self, process: subprocess.Popen[str]) -> str:
        return (self.directory / f"worker-{self.processes.index(process)}.log").read_text()

    def notes(self) -> list[list[str]]:
        if not self.events.exists():
            return []
        return [line.split() for line in self.events.read_text().splitlines()]

    def started(self, process: subprocess.Popen[str]) -> list[uuid.UUID]:
        """The jobs whose handlers started in ``process`` so far."""
        pid = str(process.pid)
        return [
            uuid.UUID(note[1]) for note in self.notes() if note[0] == "start" and note[4] == pid
        ]

    def runs(self) -> list[Run]:
        """Every handler run, once it has ended (a run still going is left out), by start."""
        begun: dict[tuple[str, str], list[str]] = {}
        done = []
        for what, job_id, key, at, pid in self.notes():
            if what == "start":
                begun[job_id, pid] = [key, at]
            else:
                key, start = begun.pop((job_id, pid))
                done.append(Run(uuid.UUID(job_id), key, float(start), float(at), int(pid)))
        assert not begun, f"runs that never ended: {begun}"
        return sorted(done, key=lambda run: run.start)

    def stop(self) -> int:
        """Stop every worker with SIGTERM (a graceful stop, each ending by the signal, or with
        status 143, after its summary); the jobs they count as succeeded, retried and failed,
        summed."""
        for process in self.processes:
            process.send_signal(signal.SIGTERM)
        summaries = []
        for process in self.processes:
            process.wait(timeout=60)
            text = self.stderr(process)
            assert process.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), text
            assert "Traceback" not in text, text
            summaries.append([int(n) for n in SUMMARY.findall(text)[-1]])
        succeeded, retried, failed = (sum(column) for column in zip(*summaries, strict=True))
        assert (retried, failed) == (0, 0), summaries
        return succeeded

    def kill_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
            process.wait(timeout=10)

"""The fault suite's worker processes: forked by a zygote, watched through their stdout,
killed and replaced by the scenarios."""

from __future__ import annotations

import itertools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import IO

from fault_harness import PROGRAM, Check, FaultDatabase


class Zygote:
    """The worker program in ``--zygote`` mode: forks worker processes on request.

    Its stdout carries every worker's lines, each starting with the writer's pid; a reader
    thread hands them to the WorkerProcess of that pid.
    """

    def __init__(self, log_dir: Path) -> None:
        self._log: IO[str] = (log_dir / "zygote.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(PROGRAM), "--zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
        )
        self._lock = threading.Lock()
        self._spawned: dict[str, queue.Queue[int]] = {}
        self._workers: dict[int, WorkerProcess] = {}
        self._early: dict[int, list[str]] = {}
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            pid_text, _, line = raw.rstrip("\n").partition(" ")
            pid = int(pid_text)
            if pid == self.proc.pid:
                word, _, rest = line.partition(" ")
                if word == "spawned":
                    token, child = rest.split()
                    self._spawned[token].put(int(child))
                elif word == "exit":
                    child, code = rest.split()
                    self._deliver(int(child), None, int(code))
                continue
            self._deliver(pid, line, None)

    def _deliver(self, pid: int, line: str | None, code: int | None) -> None:
        with self._lock:
            worker = self._workers.get(pid)
            if worker is None:  # a line written before spawn() registered the worker
                self._early.setdefault(pid, []).append(line if code is None else f"\0{code}")
                return
        if code is None and line is not None:
            worker.take(line)
        elif code is not None:
            worker.ended(code)

    def spawn(self, worker: WorkerProcess, argv: list[str]) -> int:
        token = uuid.uuid4().hex
        reply: queue.Queue[int] = queue.Queue()
        self._spawned[token] = reply
        assert self.proc.stdin is not None
        request = {"token": token, "argv": argv, "log": str(worker.log_path)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = reply.get(timeout=30)
        with self._lock:
            self._workers[pid] = worker
            early = self._early.pop(pid, [])
        worker.pid = pid
        for item in early:
            if item.startswith("\0"):
                worker.ended(int(item[1:]))
            else:
                worker.take(item)
        return pid

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


class WorkerProcess:
    """One worker process: its stdout lines as events, its exit code, its log in a file."""

    def __init__(self, log_dir: Path, name: str) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.log_path.touch()
        self.pid = 0
        self.code: int | None = None
        self._ended = threading.Event()
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: Counter[str] = Counter()
        self.starts: list[str] = []
        self.dones: list[str] = []
        #: Runs whose handler raised before its end (its job.session write failed).
        self.aborted: list[str] = []
        #: Each handler run as [job id, start, end] (monotonic; end None while it runs):
        #: from its start line to its done or aborted line, or to the process's end.
        self.runs: list[list[str | float | None]] = []

    def take(self, line: str) -> None:
        word, _, rest = line.partition(" ")
        self.seen[word] += 1
        if word == "start":
            self.starts.append(rest)
            self.runs.append([rest, time.monotonic(), None])
        elif word in ("done", "aborted"):
            (self.dones if word == "done" else self.aborted).append(rest)
            for run in reversed(self.runs):
                if run[0] == rest and run[2] is None:
                    run[2] = time.monotonic()
                    break
        self.lines.put(line)

    def ended(self, code: int) -> None:
        self.code = code
        ended = time.monotonic()
        for run in self.runs:
            if run[2] is None:
                run[2] = ended
        self._ended.set()
        self.lines.put(None)

    def alive(self) -> bool:
        return not self._ended.is_set()

    def wait_line(
        self, word: str, timeout: float, fresh: bool = True, rest: str | None = None
    ) -> str | None:
        """The next stdout line ``word [rest]`` (skipping older ones if ``fresh``)."""
        if fresh:
            while True:
                try:
                    if self.lines.get_nowait() is None:
                        self.lines.put(None)
                        return None
                except queue.Empty:
                    break
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                return None
            if line is None:
                self.lines.put(None)
                return None
            first, _, tail_ = line.partition(" ")
            if first == word and rest in (None, tail_):
                return line
        return None

    def send(self, signum: int) -> bool:
        """Send a signal; False if the process had already ended."""
        if not self.alive():
            return False
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            return False
        return True

    def wait_exit(self, timeout: float) -> int | None:
        self._ended.wait(timeout)
        return self.code

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.send(signal.SIGKILL):
            self.wait_exit(30)


class Fleet:
    """The worker processes of a scenario, in slots that can be refilled after a kill."""

    def __init__(self, db: FaultDatabase, log_dir: Path) -> None:
        self.db = db
        self.log_dir = log_dir
        self.zygote = Zygote(log_dir)
        self.slots: list[WorkerProcess] = []
        self.args: list[list[str]] = []
        self.every: list[WorkerProcess] = []

    def _spawn(self, index: int) -> WorkerProcess:
        worker = WorkerProcess(self.log_dir, f"w{index}-{len(self.every)}")
        self.every.append(worker)
        self.zygote.spawn(worker, [self.db.url, *self.args[index]])
        return worker

    def start(self, count: int, args: list[str]) -> list[WorkerProcess]:
        for _ in range(count):
            self.args.append(list(args))
            self.slots.append(self._spawn(len(self.slots)))
        return self.slots

    def restart(self, index: int) -> WorkerProcess:
        """A new process in slot ``index`` (the old one must have ended)."""
        old = self.slots[index]
        old.wait_exit(10)
        self.slots[index] = self._spawn(index)
        return self.slots[index]

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for worker in self.slots:
            while worker.seen["ready"] == 0:
                if not worker.alive():
                    raise AssertionError(f"{worker.name} died at start:\n{tail(worker.log())}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"{worker.name} not ready:\n{tail(worker.log())}")
                time.sleep(0.02)

    def alive(self) -> int:
        return sum(1 for worker in self.slots if worker.alive())

    def logs(self) -> str:
        return "\n".join(f"--- {w.name} (pid {w.pid})\n{w.log()}" for w in self.every)

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until no handler is running (a job whose session the server ended can still
        be running its first handler after another run archived it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(len(w.starts) == len(w.dones) + len(w.aborted) for w in self.slots if w.alive()):
                return
            time.sleep(0.05)

    def starts(self) -> Counter[str]:
        """How often each job's handler started, over every worker process."""
        return Counter(job_id for worker in self.every for job_id in worker.starts)

    def check(self, strict: bool) -> Check:
        self.settle()
        effects = any("--effects" in args for args in self.args)
        result = self.db.check(self.starts(), strict, self.rolled_back(), effects)
        result.overlapping = self.overlapping()
        return result

    def overlapping(self, slack: float = 0.05) -> list[str]:
        """Jobs whose handler started while another run of theirs was still going, in any
        worker process (``slack``: how late two processes' lines may arrive here)."""
        by_job: dict[str, list[tuple[float, float]]] = {}
        for worker in self.every:
            for job_id, start, end in worker.runs:
                assert isinstance(job_id, str) and isinstance(start, float)
                by_job.setdefault(job_id, []).append(
                    (start, end if isinstance(end, float) else float("inf"))
                )
        found = []
        for job_id, runs in by_job.items():
            runs.sort()
            if any(later[0] < earlier[1] - slack for earlier, later in itertools.pairwise(runs)):
                found.append(job_id)
        return found

    def rolled_back(self) -> Counter[str]:
        """Runs a live worker gave up, by job id: a deadlock or lock timeout rolled their
        transaction back, or their connection was lost while the worker lived. The job runs
        again, and the library does not count such a run (only a dead worker's is an
        unclean end)."""
        found: Counter[str] = Counter()
        for event in ("job-transaction-lost", "job-connection-lost"):
            for line in events(self.logs(), event):
                match = JOB_ID.search(line)
                if match:
                    found[match.group(1)] += 1
        return found

    def lost_outcomes(self) -> set[str]:
        """Lease mode: jobs a live worker ran whose outcome it could not write (the run's
        connection was lost), and so ran again: the only reruns without a dead or frozen
        worker."""
        found = {job_id for worker in self.every for job_id in worker.aborted}
        logs = self.logs()
        for event in ("outcome-recording-error", "job-connection-lost"):
            for line in events(logs, event):
                match = JOB_ID.search(line)
                if match:
                    found.add(match.group(1))
        return found

    def evidence(self, check: Check, limit: int = 3) -> str:
        """For a failure message: why workers stopped, and what happened to bad jobs."""
        suspects = [*check.lost, *check.wrong_ids, *check.duplicated][:limit]
        names = {w.pid: w.name for w in self.every}
        out = []
        for worker in self.every:
            if worker.seen["worker-stopped"]:
                lines = [line for line in worker.log().splitlines() if ROUTINE.search(line) is None]
                out.append(f"{worker.name} stopped by itself; its log:\n" + tail("\n".join(lines)))
        for job_id in suspects:
            key = str(job_id)
            runs = [(names.get(pid, pid), attempt) for pid, attempt in self.db.runs_of(job_id)]
            out.append(f"job {key}: runs (worker, attempt) {runs}")
            for worker in self.every:
                started, done = worker.starts.count(key), worker.dones.count(key)
                if started or done:
                    out.append(
                        f"  {worker.name} (exit {worker.code}): started {started}x, done {done}x"
                    )
                out += [
                    f"  {worker.name}: {line}" for line in worker.log().splitlines() if key in line
                ]
        return "\n".join(out)

    def close(self) -> None:
        for worker in self.every:
            worker.close()
        self.zygote.close()


#: Log lines that every fault scenario produces by the hundred.
ROUTINE = re.compile(
    r" (job-connection-lost|job-transaction-lost|job-interrupted|handle-job-exception"
    r"|retrying|not-retrying) "
)


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


JOB_ID = re.compile(r"\bjob_id=([0-9a-f-]{36})\b")


def events(log: str, event: str) -> list[str]:
    """The log lines of one library event."""
    pattern = re.compile(rf"\bsqla_proletarian {re.escape(event)}\b")
    return [line for line in log.splitlines() if pattern.search(line)]

"""How a worker process ends after a stop on SIGTERM or SIGINT: as the signal would have
ended it, or, when the stop gave up on running jobs, with ``EXIT_JOBS_UNFINISHED``."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import time
from typing import Any, NoReturn

#: Exit status of a worker process whose stop (on SIGTERM/SIGINT) gave up on running jobs
#: when its shutdown timeout passed: they run again, but the stop was not clean.
EXIT_JOBS_UNFINISHED = 4
#: Exit status of a command that SIGINT (Ctrl-C) interrupted outside the worker's handlers.
EXIT_INTERRUPTED = 130


#: Seconds the exit waits for the main thread to end the process by the signal, when a
#: handler of it is still installed.
SIGNAL_EXIT_GRACE = 5.0


def unfinished_text(who: str, unfinished: int, timeout: float | None = None) -> str:
    """What a worker process (or their supervisor, which has no one timeout) says when its
    stop gave up on running jobs."""
    jobs = "job" if unfinished == 1 else "jobs"
    within = "the shutdown timeout" + (f" ({timeout:g} s)" if timeout is not None else "")
    return (
        f"{who}: {unfinished} running {jobs} did not finish within {within} and will run "
        "again: give longer jobs more time with --shutdown-timeout (await_termination_timeout)"
    )


def exit_after_stop(worker: Any, signum: int) -> NoReturn:
    """End the process after a stop on ``signum``: as the signal would have ended it, or,
    when the stop gave up on running jobs, with EXIT_JOBS_UNFINISHED, saying so."""
    if not worker.unfinished:
        exit_as_signal(signum)
    try:
        write_stderr(
            unfinished_text(
                worker.worker_id, worker.unfinished, worker.options.await_termination_timeout
            )
            + "\n"
        )
        _run_exit_handlers()
    finally:
        os._exit(EXIT_JOBS_UNFINISHED)


def exit_as_signal(signum: int) -> NoReturn:
    """End the process the way ``signum`` would have ended it without a handler, after what
    a normal exit runs: the atexit handlers, and logging's flush."""
    try:
        _run_exit_handlers()
    finally:
        # The signal handler set SIG_DFL when it took the signal, or (lease mode, which
        # keeps it for a second signal) sets it now, in the main thread, and kills again.
        handled = signal.getsignal(signum) != signal.SIG_DFL
        os.kill(os.getpid(), signum)
        if handled:
            time.sleep(SIGNAL_EXIT_GRACE)
        os._exit(128 + signum)  # only if the signal did not end the process


def _run_exit_handlers() -> None:
    """What a normal exit runs before the process ends: the atexit handlers, logging's
    flush, and the standard streams' buffers."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()


def write_stderr(text: str) -> None:
    """Write to standard error without Python's buffers (safe inside a signal handler)."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode(errors="replace"))

"""``worker``'s settings from the command line (``--retries``, ``--retry-delays``,
``--shutdown-timeout``, ``--max-unclean-ends``) and from the handler module's
``worker_options``, the flags winning; its exit status telling whether a burst gave up on a
job; a burst supervisor whose first process cannot start exits with that process's status;
and a worker or a pause naming a queue that never held a job is warned about."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa
from cli_support import (
    archived,
    assert_one_line_error,
    cli,
    rows,
    url_of,
    write_tasks,
)

import sqla_proletarian as sp
from sqla_proletarian import statements
from sqla_proletarian.cli import main

if TYPE_CHECKING:
    from conftest import Database

#: A handler module that declares its worker's options: one retry, a failed-job handler
#: that notes the job, the queue "mail".
OPTIONS_MODULE = """\
import sqla_proletarian as sp

worker_options = {
    "queue": "mail",
    "retry_strategy": lambda job, exc: sp.RetryStrategy(1),
    "failed_job_handler": lambda job, exc: open("given-up.log", "a").write(f"{job.job_id}\\n"),
}


def handle(job_type, payload):
    raise ValueError("no good")
"""

WARNING = "has never held a job"


def burst(url: str, directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return cli("worker", "tasks:handlers", "--handler-mode", "advanced", "--burst", *args,
               "--url", url, cwd=directory)  # fmt: skip


def test_retries_and_retry_delays_from_the_command_line_and_the_burst_exit_status(
    database: Database, tmp_path: Path
) -> None:
    """``--retries 2 --retry-delays 0`` runs a failing job three times and archives it
    failed: the burst exits 3 (a job given up). ``--retries 1 --retry-delays 3600`` leaves
    its retry queued an hour later: nothing given up, exit 0."""
    url = url_of(database)
    write_tasks(tmp_path)
    engine = database.engine()
    with engine.begin() as conn:
        doomed = sp.enqueue(conn, "fails", 1)
    gave_up = burst(url, tmp_path, "--retries", "2", "--retry-delays", "0")
    assert gave_up.returncode == 3, gave_up.stderr
    assert "0 succeeded, 2 retried, 1 failed" in gave_up.stderr
    assert (archived(engine)[doomed].status, archived(engine)[doomed].attempts) == ("failure", 3)

    with engine.begin() as conn:
        later = sp.enqueue(conn, "fails", 2)
    waiting = burst(url, tmp_path, "--retries", "1", "--retry-delays", "3600,5")
    assert waiting.returncode == 0, waiting.stderr
    assert "0 succeeded, 1 retried, 0 failed" in waiting.stderr
    [job] = rows(engine, statements.JOB)
    assert (job.job_id, job.attempts) == (later, 1)
    assert timedelta(seconds=3590) < job.process_at - job.enqueued_at < timedelta(seconds=3610)
    engine.dispose()


def test_the_handler_modules_worker_options_apply_and_flags_override_them(
    database: Database, tmp_path: Path
) -> None:
    """``worker_options`` sets the queue, the retry strategy and the failed-job handler;
    ``--retries 0`` and ``--queue`` on the command line win over the module's."""
    url = url_of(database)
    (tmp_path / "mailer.py").write_text(OPTIONS_MODULE)
    engine = database.engine()
    with engine.begin() as conn:
        first = sp.enqueue(conn, "send", None, queue="mail")
        second = sp.enqueue(conn, "send", None, queue="other")
    from_module = cli("worker", "mailer:handle", "--burst", "--url", url, cwd=tmp_path)
    assert from_module.returncode == 3, from_module.stderr
    assert "proletarian[mail] stopped: 0 succeeded, 1 retried, 1 failed" in from_module.stderr
    assert archived(engine)[first].attempts == 2
    assert (tmp_path / "given-up.log").read_text().split() == [str(first)]

    overridden = cli(
        *("worker", "mailer:handle", "--burst", "--queue", "other", "--retries", "0"),
        *("--url", url),
        cwd=tmp_path,
    )
    assert overridden.returncode == 3, overridden.stderr
    assert "proletarian[other] stopped: 0 succeeded, 0 retried, 1 failed" in overridden.stderr
    assert archived(engine)[second].attempts == 1
    assert (tmp_path / "given-up.log").read_text().split() == [str(first), str(second)]
    engine.dispose()


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Undo what ``main`` does to this process: its logging set-up, the handler's directory
    put first on ``sys.path``."""
    root, library = logging.getLogger(), logging.getLogger("sqla_proletarian")
    handlers, level = list(root.handlers), library.level
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for handler in set(root.handlers) - set(handlers):
        root.removeHandler(handler)
    library.setLevel(level)


@pytest.mark.usefixtures("in_process")
def test_bad_worker_settings_get_one_line_and_status_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each bad flag value, and a bad ``worker_options``, is one line and status 2: one
    through the script, the others through the same ``main`` in this process."""
    url = f"sqlite:///{tmp_path / 'app.db'}"
    sp.metadata.create_all(sa.create_engine(url))
    write_tasks(tmp_path)
    monkeypatch.chdir(tmp_path)
    script = cli("worker", "tasks:handlers", "--retries", "1", "--retry-delays", "1,soon",
                 "--url", url, cwd=tmp_path)  # fmt: skip
    assert "give seconds separated by commas" in assert_one_line_error(script, 2)

    def error_of(*args: str) -> str:
        try:
            status = main(["worker", *args, "--burst", "--url", url])
        except SystemExit as exc:  # argparse's own errors
            status = int(str(exc.code))
        _, stderr = capsys.readouterr()
        assert status == 2 and len(stderr.strip().splitlines()) == 1, (status, stderr)
        return stderr

    cases = {
        ("--retries", "-1"): "retries is -1; give a whole number >= 0",
        ("--retries", "many"): "argument --retries: invalid int value: 'many'",
        ("--retry-delays", "1,5"): "--retry-delays needs --retries N",
        ("--shutdown-timeout", "-1"): "await_termination_timeout is -1.0",
        ("--max-unclean-ends", "0"): "max_unclean_ends is 0; give a whole number >= 1",
        ("--max-unclean-ends", "few"): "give a whole number >= 1, or off",
    }
    for flags, message in cases.items():
        assert message in error_of("tasks:handlers", *flags), flags

    modules = {
        "worker_options = [1]": "is a list: give a dict",
        "worker_options = {'threads': 2}": "unknown worker option(s) threads",
        "worker_options = {'worker_threads': 0}": "worker_threads is 0",
        "worker_options = {'install_signal_handlers': False}": "which the worker command sets",
    }
    for number, (text, message) in enumerate(modules.items()):
        module = f"bad_options_{number}"  # a module name of its own: imports are cached
        (tmp_path / f"{module}.py").write_text(
            f"{text}\n\ndef handle(job_type, payload):\n    pass\n"
        )
        assert message in error_of(f"{module}:handle"), text


def test_a_burst_supervisor_whose_first_process_cannot_start_exits_with_its_error(
    empty_database: Database, tmp_path: Path
) -> None:
    """``worker --processes 2 --burst`` on missing tables exits 1, and with a handler that
    does not import 2, each with the process's one-line error, as without --burst (it
    used to wait forever for the second process)."""
    url = url_of(empty_database)
    write_tasks(tmp_path)
    (tmp_path / "broken.py").write_text("raise RuntimeError('broken on import')\n")
    for handler, status, message in (
        ("tasks:handlers", 1, "run `sqla-proletarian install`"),
        ("broken:handle", 2, "importing broken raised RuntimeError: broken on import"),
    ):
        done = cli(
            *("worker", handler, "--processes", "2", "--burst", "--url", url),
            cwd=tmp_path,
            timeout=30,
        )
        assert message in assert_one_line_error(done, status), handler


@pytest.mark.usefixtures("in_process")
def test_a_queue_that_never_held_a_job_is_warned_about(
    database: Database, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A burst worker and ``pause`` naming a queue with no job, archived job or pause warn
    on standard error and keep their status (through the script), once other queues have
    held jobs; a queue known by any of those three does not warn (through the same
    ``main``, in this process); nor does any queue of a fresh database that never held a
    job (a first deployment's queues)."""
    url = url_of(database)
    write_tasks(tmp_path)
    engine = database.engine()
    fresh = burst(url, tmp_path, "--queue", "emails", "--queue", "reports")
    assert fresh.returncode == 0 and WARNING not in fresh.stderr, fresh.stderr

    with engine.begin() as conn:
        sp.enqueue(conn, "ok", None, queue="reports")
        sp.enqueue(conn, "ok", None, queue="digests")
    misspelled = burst(url, tmp_path, "--queue", "emials")
    assert misspelled.returncode == 0, misspelled.stderr
    assert f"worker: warning: queue 'emials' {WARNING}" in misspelled.stderr
    paused = cli("pause", "emails", "--url", url)
    assert paused.returncode == 0 and f"pause: warning: queue 'emails' {WARNING}" in paused.stderr

    assert sp.process_next_job(engine, lambda job_type, payload: None, queue="digests")
    capsys.readouterr()
    # Known by its pause row, a queued job, an archived job; then a resumed (forgotten) pause.
    for command in (["resume", "emails"], ["jobs", "--queue", "reports"], ["failed", "--queue",
                    "digests"], ["pause", "emails"]):  # fmt: skip
        assert main([*command, "--url", url]) == 0
        stderr = capsys.readouterr().err
        assert (WARNING in stderr) is (command[0] == "pause"), (command, stderr)
    engine.dispose()

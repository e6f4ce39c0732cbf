"""Fixtures of the fault suite, and the report table printed at the end of the run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import fault_fleet as ff
import fault_harness as fh
import fault_report as fr
import pytest
from sqlalchemy.pool import NullPool


@pytest.fixture
def fault_db(database: object) -> fh.FaultDatabase:
    """A fresh database on a server backend, with the runs table of the worker program."""
    backend = database.backend  # type: ignore[attr-defined]
    if backend == "sqlite":
        pytest.skip(
            "fault scenarios need a database server: SQLite has no server to restart, no "
            "sessions to kill and one writer at a time"
        )
    engine = database.engine(poolclass=NullPool)  # type: ignore[attr-defined]
    return fh.FaultDatabase(backend, database.url, engine)  # type: ignore[attr-defined]


@pytest.fixture
def fleet(fault_db: fh.FaultDatabase, tmp_path: Path) -> Iterator[ff.Fleet]:
    """Worker processes for one scenario; every one still running is killed at the end."""
    workers = ff.Fleet(fault_db, tmp_path)
    try:
        yield workers
    finally:
        workers.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not fr.RESULTS:
        return
    terminalreporter.write_sep("=", "fault suite report")
    for line in fr.report_lines():
        terminalreporter.write_line(line)

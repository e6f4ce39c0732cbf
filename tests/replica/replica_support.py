"""What the replica tests share: the test's database on both servers, waiting for the
standby's replay, and pausing it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import URL

#: Seconds the standby may take to replay what the primary committed, on a loaded machine.
REPLAY_TIMEOUT = 60.0


@dataclass
class Replicated:
    """The test's database: engines on the primary and on the standby, and their URLs."""

    primary: sa.Engine
    standby: sa.Engine
    primary_url: URL
    standby_url: URL

    def replayed(self, timeout: float = REPLAY_TIMEOUT) -> None:
        """Wait until the standby has replayed all the primary has written so far."""
        with self.primary.connect() as conn:
            target = conn.exec_driver_sql("SELECT pg_current_wal_lsn()::text").scalar_one()

        def caught_up() -> bool:
            try:
                conn = self.standby.connect()
            except sa.exc.OperationalError:  # its CREATE DATABASE is not replayed yet
                return False
            with conn:
                behind = conn.exec_driver_sql(
                    "SELECT pg_wal_lsn_diff(%(target)s::pg_lsn, pg_last_wal_replay_lsn()) > 0",
                    {"target": target},
                ).scalar_one()
            return not behind

        wait_for(caught_up, "the standby to replay the primary's writes", timeout)


def wait_for(predicate: Callable[[], object], what: str, timeout: float = REPLAY_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def set_replay(engine: sa.Engine, paused: bool) -> None:
    """Pause or resume the standby's replay, and wait until it is so."""
    call = "pg_wal_replay_pause()" if paused else "pg_wal_replay_resume()"
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(f"SELECT {call}")

        def settled() -> bool:
            state = conn.exec_driver_sql("SELECT pg_get_wal_replay_pause_state()").scalar_one()
            return (state == "paused") if paused else (state == "not paused")

        wait_for(settled, f"the standby's replay to be {'paused' if paused else 'resumed'}")

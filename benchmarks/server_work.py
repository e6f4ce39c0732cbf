"""What the database server does per job of a drain, by its own counters.

PostgreSQL: the WAL the drain wrote (``pg_wal_lsn_diff`` of ``pg_current_wal_lsn()`` after
and before; the whole cluster's, so autovacuum's and checkpoints' full-page images count
too). MariaDB, from ``SHOW GLOBAL STATUS`` less what the meter's own reads add: the redo log
written (``Innodb_lsn_current``), the rows written (``Handler_write`` + ``_update`` +
``_delete``: MariaDB 10.11 has no ``Innodb_rows_*``; internal temporary tables are not
counted) and the statements clients sent (``Questions``, and the main ``Com_*`` kinds).
Each is divided by the jobs drained.

Both: the server's CPU time (user + system, from ``/proc``: the PostgreSQL postmaster with its
live children and the children it has reaped; MariaDB's one process), when the server runs on
this machine. Its inverse is how many jobs a second one core of the server carries.

A drain wraps its timed part (after the fill, up to the last job done) in ``metered(url,
jobs)``; the caller that adds the drain's row then takes the figures with ``take()``.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable, Iterator

import sqlalchemy as sa

#: MariaDB's counters read, and the name each is shown under; and every ``Com_*`` counter
#: (the statements by kind: ``Com_insert_select`` is shown as ``INSERT SELECT``).
_MARIADB = {
    "Innodb_lsn_current": "redo bytes",
    "Handler_write": "inserted",
    "Handler_update": "updated",
    "Handler_delete": "deleted",
    "Questions": "statements",
}
_MARIADB_STATUS = sa.text(
    "SHOW GLOBAL STATUS WHERE Variable_name IN ({}) OR Variable_name LIKE 'Com\\_%'".format(
        ", ".join(f"'{name}'" for name in _MARIADB)
    )
)


def _shown(counter: str) -> str:
    return _MARIADB.get(counter) or counter.removeprefix("Com_").upper().replace("_", " ")


_WAL_NOW = sa.text("SELECT pg_current_wal_lsn()::text")
_BACKEND_PID = sa.text("SELECT pg_backend_pid()")
_PID_FILE = sa.text("SELECT @@pid_file")
_WAL_SINCE = sa.text("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), CAST(:since AS pg_lsn))")

#: The figures of the last metered drain, until taken.
_last: dict[str, float] | None = None
#: Called with the server's URL as a metered drain starts (after its fill), before the meter
#: reads: benchmarks.statements starts its own count there.
starting: list[Callable[[sa.URL], None]] = []


def engine_url(url: str | sa.URL) -> sa.URL:
    """A SQLAlchemy URL for ``url``, a plain libpq one (pgqueuer's) read through psycopg."""
    parsed = sa.make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


class Meter:
    """The server's counters at its creation, on a connection of its own; ``per_job(jobs)``
    gives what changed since, divided by ``jobs``."""

    def __init__(self, url: str | sa.URL) -> None:
        self.reader = sa.create_engine(
            engine_url(url), pool_size=1, max_overflow=0, isolation_level="AUTOCOMMIT"
        )
        self.postgresql = self.reader.dialect.name == "postgresql"
        self._own: dict[str, int] = {}
        if not self.postgresql:
            first = self._status()
            self._own = _minus(self._status(), first)  # what one read adds
        self._since: str = ""
        self._before: dict[str, int] = {}
        self._server = self._server_pid()
        self._cpu = _cpu_seconds(self._server)
        if self.postgresql:
            with self.reader.connect() as conn:
                self._since = str(conn.execute(_WAL_NOW).scalar_one())
        else:
            self._before = self._status()

    def _status(self) -> dict[str, int]:
        with self.reader.connect() as conn:
            return {name: int(value) for name, value in conn.execute(_MARIADB_STATUS)}

    def _server_pid(self) -> int | None:
        """The server's process (PostgreSQL: the postmaster), if it runs on this machine."""
        with self.reader.connect() as conn:
            if self.postgresql:
                backend = int(conn.execute(_BACKEND_PID).scalar_one())
                return _parent(backend)
            pid_file = str(conn.execute(_PID_FILE).scalar_one() or "")
        try:
            with open(pid_file) as file:
                return int(file.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def per_job(self, jobs: int) -> dict[str, float]:
        """``WAL bytes`` (PostgreSQL), or ``rows written`` and ``statements`` with their kinds
        (MariaDB), and ``server CPU us`` (both, where measured), per job since the meter was
        made."""
        cpu = _cpu_seconds(self._server)
        measured = (
            {}
            if cpu is None or self._cpu is None
            else {"server CPU us": (cpu - self._cpu) * 1e6 / jobs}
        )
        try:
            if self.postgresql:
                with self.reader.connect() as conn:
                    wal = float(conn.execute(_WAL_SINCE, {"since": self._since}).scalar_one())
                return {"WAL bytes": wal / jobs, **measured}
            delta = _minus(_minus(self._status(), self._before), self._own)
        finally:
            self.reader.dispose()
        named = {_shown(name): n / jobs for name, n in delta.items()}
        figures = {
            "redo bytes": named["redo bytes"],
            "rows written": named["inserted"] + named["updated"] + named["deleted"],
            "statements": named["statements"],
            **measured,
        }
        figures.update({name: n for name, n in named.items() if name.isupper()})
        return figures


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (field 3 onwards)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _parent(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def _cpu_seconds(server: int | None) -> float | None:
    """User + system CPU seconds of ``server``, its reaped children and its live children
    (a PostgreSQL backend's time reaches the postmaster's children counts when it exits)."""
    if server is None:
        return None
    own = _stat(server)
    if own is None:
        return None
    ticks = sum(int(value) for value in own[11:15])  # utime stime cutime cstime
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != server:
            fields = _stat(int(entry.name))
            if fields and int(fields[1]) == server:
                ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _minus(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {name: value - before.get(name, 0) for name, value in after.items()}


@contextlib.contextmanager
def metered(url: str | sa.URL, jobs: int) -> Iterator[None]:
    """Meter the block (a drain of ``jobs``): its figures are kept for ``take()``."""
    global _last
    _last = None
    for start in starting:
        start(engine_url(url))
    meter = Meter(url)
    yield
    _last = meter.per_job(jobs)


def take() -> dict[str, float] | None:
    """The last metered drain's figures (None if none since the last take)."""
    global _last
    figures, _last = _last, None
    return figures


def median_text(readings: list[dict[str, float]]) -> str:
    """``text`` of the median of each figure over several drains' (empty if none)."""
    if not readings:
        return ""
    names = readings[0]
    return text({name: statistics.median(r.get(name, 0.0) for r in readings) for name in names})


def text(figures: dict[str, float]) -> str:
    """``WAL 1,234 B`` or ``redo 1,234 B, rows 3.00, statements 6.02 (SELECT 2.00, ...)``:
    one cell."""
    cpu = f", server CPU {figures['server CPU us']:,.0f} µs" if "server CPU us" in figures else ""
    if "WAL bytes" in figures:
        return f"WAL {figures['WAL bytes']:,.0f} B{cpu}"
    kinds = ", ".join(
        f"{name} {value:.2f}"
        for name, value in figures.items()
        if name.isupper() and value >= 0.005
    )
    cell = f"redo {figures['redo bytes']:,.0f} B, rows {figures['rows written']:.2f}"
    cell += f", statements {figures['statements']:.2f}"
    return cell + (f" ({kinds})" if kinds else "") + cpu

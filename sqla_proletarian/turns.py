"""Turns at SQLite's write lock: the claims of a process's workers on one database file take
turns, and now and then leave the lock free long enough for the application's writers.

SQLite has one writer at a time and no queue for its lock: a writer that finds it taken
sleeps in its busy handler (at most 100 ms between tries) until its busy timeout, 5 s by
default. Claims that follow each other at once would keep it taken, so after a stretch of
``STRETCH`` seconds of claims the next one rests: it leaves the lock free for ``REST``
seconds, longer than the handler's longest sleep, so a writer waiting by then gets it (a
rest in which others committed ends once they have not for ``QUIET`` seconds). While nobody
else writes during the rests, the stretches grow, up to ``MAX_STRETCH``.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from sqlalchemy import URL

#: Seconds of back-to-back claims after which a process's claims on a file rest, while other
#: connections write in the rests; each rest in which none did doubles it, up to
#: ``MAX_STRETCH``.
STRETCH = 0.25
MAX_STRETCH = 0.5
#: Seconds the write lock is then left free: more than SQLite's busy handler ever sleeps.
REST = 0.12
#: Seconds without another connection's commit that end a rest early once one was seen, and
#: how often a resting claim looks.
QUIET = 0.03
LOOK = 0.01

#: The turns of the process's runners, by (process, database file, kind of lock).
_TURNS: weakref.WeakValueDictionary[tuple[Any, ...], Turn] = weakref.WeakValueDictionary()
_GUARD = threading.Lock()


class Turn:
    """One database file's claims in this process: one at a time, paced."""

    def __init__(self, lock: AbstractContextManager[Any]) -> None:
        self._lock = lock
        #: When the current stretch of back-to-back claims began, and the last one ended.
        self._stretch_started = -REST
        self._free_since = -REST
        self._stretch = STRETCH

    @contextmanager
    def taken(
        self, commits: Callable[[], int], sleep: Callable[[float], object] = time.sleep
    ) -> Iterator[None]:
        """Hold the turn for one claim, first resting if the stretch of claims is long.

        ``commits`` counts the other connections' commits to the file (PRAGMA data_version):
        those during the rest say whether anybody else wants to write.
        """
        with self._lock:
            now = time.monotonic()
            if now - self._free_since >= REST:
                self._stretch_started = now
            elif now - self._stretch_started >= self._stretch:
                self._rest(commits, sleep)
                self._stretch_started = time.monotonic()
            try:
                yield
            finally:
                self._free_since = time.monotonic()

    def _rest(self, commits: Callable[[], int], sleep: Callable[[float], object]) -> None:
        """Leave the write lock free (see the module's docstring), then size the next stretch."""
        seen = commits()
        last_other: float | None = None
        while time.monotonic() - self._free_since < REST:
            sleep(LOOK)
            count = commits()
            if count != seen:
                seen, last_other = count, time.monotonic()
            elif last_other is not None and time.monotonic() - last_other >= QUIET:
                break
        alone = last_other is None
        self._stretch = min(2 * self._stretch, MAX_STRETCH) if alone else STRETCH


def turn_for(url: URL, new_lock: Callable[[], AbstractContextManager[Any]]) -> Turn:
    """The turn shared by the process's runners on the database file of ``url`` that take the
    same kind of lock (a task lock, bound to its event loop, is shared within its thread)."""
    database = url.database or ""
    if database and not database.startswith("file:") and database != ":memory:":
        database = os.path.realpath(database)
    threads = new_lock is threading.Lock
    key = (os.getpid(), database, new_lock, None if threads else threading.get_ident())
    with _GUARD:
        turn = _TURNS.get(key)
        if turn is None:
            # Reentrant for threads: a handler calling process_next_job on its own file then
            # fails at SQLite's busy timeout, as it always did, instead of waiting forever.
            turn = _TURNS[key] = Turn(threading.RLock() if threads else new_lock())
        return turn

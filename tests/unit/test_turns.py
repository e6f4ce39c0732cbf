"""SQLite's claims of one process take turns per file and rest between stretches: long enough
for a writer in its busy handler, shorter once it has written and gone quiet."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest
from sqlalchemy import make_url

from sqla_proletarian import turns
from sqla_proletarian.turns import LOOK, MAX_STRETCH, QUIET, REST, STRETCH, Turn, turn_for

#: Seconds each claim of these tests holds the write lock.
CLAIM = 0.01


class Clock:
    """time.monotonic for the turns module, moved by the claims and the rests only."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.rests: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.rests.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(turns.time, "monotonic", fake.monotonic)
    return fake


def claims(turn: Turn, clock: Clock, count: int, commits: list[int]) -> list[float]:
    """Run ``count`` claims back to back; when each one started."""
    started = []
    for _ in range(count):
        with turn.taken(lambda: commits[0], clock.sleep):
            started.append(clock.now)
            clock.now += CLAIM
    return started


def test_claims_rest_after_a_stretch_and_the_stretches_grow_while_nobody_else_writes(
    clock: Clock,
) -> None:
    """The first rest comes after a stretch of STRETCH, leaves the lock free for REST, and,
    nobody having written, the next stretches double up to MAX_STRETCH."""
    turn = Turn(threading.Lock())
    started = claims(turn, clock, 200, [0])
    gaps = [b - a for a, b in itertools.pairwise(started)]
    rests = [(i, gap - CLAIM) for i, gap in enumerate(gaps) if gap > CLAIM * 1.5]
    assert rests, "the claims never left the lock free"
    first = rests[0][0] + 1
    assert started[first - 1] - started[0] >= STRETCH - CLAIM
    assert all(REST - 1e-9 <= rest <= REST + LOOK + 1e-9 for _, rest in rests)
    stretches = [
        started[b] - started[a + 1] + CLAIM for (a, _), (b, _) in itertools.pairwise(rests)
    ]
    assert stretches[0] == pytest.approx(2 * STRETCH, abs=CLAIM)
    assert max(stretches) == pytest.approx(MAX_STRETCH, abs=CLAIM)


def test_a_rest_in_which_another_connection_wrote_ends_once_it_is_quiet(clock: Clock) -> None:
    """A writer that commits during a rest ends it QUIET after its last commit, and the next
    stretch is the short one again."""
    turn = Turn(threading.Lock())
    commits = [0]
    claims(turn, clock, int(STRETCH / CLAIM) + 1, commits)

    def writer_commits_once(seconds: float) -> None:
        clock.sleep(seconds)
        if len(clock.rests) == 1:
            commits[0] += 1

    with turn.taken(lambda: commits[0], writer_commits_once):
        pass
    rested = sum(clock.rests)
    assert LOOK + QUIET - 1e-9 <= rested <= 2 * LOOK + QUIET + 1e-9 < REST
    assert turn._stretch == STRETCH


def test_runners_on_one_file_share_a_turn_however_its_path_is_spelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    absolute = turn_for(make_url(f"sqlite:///{tmp_path / 'jobs.db'}"), threading.Lock)
    assert turn_for(make_url("sqlite:///jobs.db"), threading.Lock) is absolute
    assert turn_for(make_url("sqlite:///other.db"), threading.Lock) is not absolute

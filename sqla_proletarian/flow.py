"""Flow control: claims that keep a queue's limits (``set_queue_limits``) across every worker.

The ordinary poll skips a queue that has limits; a claim that meets one claims its jobs here,
in the same transaction as the rest of the claim, both modes alike:

- ``max_running``: the queue has N slots (rows of ``proletarian_slot``). Each job claimed
  takes a free slot, locked with ``FOR UPDATE SKIP LOCKED``. In transaction mode the slot is
  that row lock, held until the job's transaction ends (with its worker, if it dies). In lease
  mode the slot names the job and its lease token, and stays taken while the job carries the
  token unexpired: a completed, retried, released or expired lease frees it with no write, so
  a late completion (fenced by its token) frees nothing twice.
- ``max_running_per_key``: the same with slots per ``concurrency_key``, made on first need.
  Due jobs are walked in claim order; a key with no free slot is skipped, so it never holds
  back other keys' jobs.
- Rate limits: every start is a row of ``proletarian_start``. Before its claim transaction a
  worker reserves starts in a short transaction of its own, in turn with the queue's other
  workers (the limit row's lock): at most what the window (``seconds``, plus ``RATE_MARGIN``)
  has left. A sliding window over stored start times: no window ever holds more than
  ``count``. While the window has room to spare, a reservation makes starts ahead for the
  runner's next claims (its pool), counted at a moment to come: a later reservation counts
  them wherever between the two their handlers start. Reservations a claim did not use are
  deleted with the runner's next reservation. A handler starts between its reservation and
  ``RATE_MARGIN`` past the moment its start counts at, or not at all (its job goes back
  unrun, uncharged), so the windows hold over the handlers' own start times too.

A worker learns that a queue has limits at a claim that comes back short, within a second
(the poll skipped the queue); from then on it reads the queue's limits at each claim, and
forgets them when they are cleared.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine

from sqla_proletarian import direct
from sqla_proletarian.limits import QueueLimits, read_versions
from sqla_proletarian.logs import log_event
from sqla_proletarian.statements import flow as sql

#: Seconds a rate limit's window counts beyond its own ``seconds``: the time between a
#: claim's reservation and its handler's start, so that no window of ``seconds`` over the
#: handlers' own start times holds more than ``count`` either.
RATE_MARGIN = 0.2
#: Seconds after its counted start a rate-limited handler may still start: part of
#: ``RATE_MARGIN``, the rest for the moments between that check and the handler's call.
START_WITHIN = RATE_MARGIN * 0.75
#: The key of a claimed job (dict) that a rate limit admitted: the latest time (the worker's
#: clock) its handler may start at; a run that would start later is given back unrun.
START_BY = "start_by"
#: The key of a claimed job (dict) that a rate limit admitted: the starts counted for it (a
#: start row's id per start), given back should the job go back unrun.
COUNTED = "counted_starts"


def too_late(job: dict[str, Any], now: datetime) -> bool:
    """Whether a rate-limited job's handler would start past the margin its start was
    counted with (a worker so slow that a window of its own start times could hold more
    than the limit): its job goes back to the queue unrun and uncharged instead."""
    start_by = job.get(START_BY)
    return start_by is not None and now > start_by


#: Due jobs read at a time by a claim that walks a queue by key.
CANDIDATES = 50
#: Reads of due jobs a claim makes at most, each past the keys found at their limit.
ROUNDS = 4
#: Seconds between a runner's looks for queues that got limits (at a claim that found fewer
#: jobs than it could take). Until it looks, the poll skips such a queue.
LOOK_INTERVAL = 1.0
#: Claims' worth of a queue's own starts a runner's first reservation makes ahead, for its
#: next claims (the pool); doubled each time its claims use a pool up, halved each time most
#: of one expires unused, up to ``POOL_MOST`` starts.
POOL_CLAIMS = 8
POOL_MOST = 10_000
#: A reservation that makes starts ahead counts them all at a moment after it is made (its
#: ``at``): this share of the rate's ``seconds`` later, at least ``POOL_LEAST`` and at most
#: ``POOL_HORIZON`` seconds. The runner's claims draw on them for the first half of that
#: time, so that a claim's handlers (a batch run one after another) have the second half and
#: ``START_WITHIN`` to start; each starts between the reservation and ``START_WITHIN`` past
#: its ``at``, which every later reservation whose starts could share a window with it counts.
POOL_SHARE = 0.5
POOL_LEAST = 2 * RATE_MARGIN
POOL_HORIZON = 2.0
#: Seconds between a runner's deletions of a rate-limited queue's starts that no window
#: counts any more.
PRUNE_INTERVAL = 1.0

Slot = tuple[str, str, int, uuid.UUID]
T = TypeVar("T")


@dataclass
class Reserved:
    """Starts reserved for one claim of a queue, by slot key (``""``: the queue's own)."""

    #: A start is its row's id: a row that counts n starts is there n times.
    by_key: dict[str, list[uuid.UUID]] = field(default_factory=dict)
    #: The queue's limits, read under its limit row's lock, and when they were set.
    limits: QueueLimits = field(default_factory=QueueLimits)
    version: Any = None
    #: Taken from the pool: its limits may be older than the claim (the claim checks).
    pooled: bool = False
    #: When they count as started in every window (when they were reserved, or later for
    #: starts made ahead), and until when the runner's claims may draw on them (pooled).
    at: datetime | None = None
    until: datetime | None = None

    def unused(self) -> list[uuid.UUID]:
        return [start for starts in self.by_key.values() for start in starts]


class FlowControl:
    """A runner's flow control: which of its queues have limits (what its claims found), and
    the reservations its rate-limited queues need before a claim. Shared by the runner's
    threads; each claim has its own ``FlowClaim``."""

    def __init__(self, engine: Engine, queues: tuple[str, ...], *, leases: bool) -> None:
        self.engine = engine
        self.queues = queues
        self.leases = leases
        #: The queues known to have limits, with the limits last read, and when (monotonic).
        self.known: dict[str, tuple[QueueLimits, Any]] = {}
        self.looked = 0.0
        #: When the runner last removed a queue's starts that no window counts (monotonic).
        self.pruned: dict[str, float] = {}
        #: Starts reserved ahead for the next claims, by queue; starts to delete.
        self.pool: dict[str, Reserved] = {}
        self.stale: list[uuid.UUID] = []
        #: How many starts the next reservation of a queue makes ahead (``POOL_CLAIMS`` claims'
        #: worth at first), and the queues whose last pool the claims used up.
        self.ahead: dict[str, int] = {}
        self.used_up: set[str] = set()
        self._pool_lock = threading.Lock()
        #: Held by the runner's reservation under way: its other threads wait for its pool
        #: instead of each reserving (and taking turns on the limit row) for itself.
        self._reserving = threading.Lock()

    def prepare(
        self,
        conn: Connection,
        clock: Callable[[], datetime],
        batch: int,
        begin: Callable[[Connection], None],
    ) -> dict[str, Reserved]:
        """Before a claim's transaction: the starts that rate-limited queues allow it (at
        ``clock()``, read only if one is rated). A
        queue's own rate is served from the starts a recent reservation made ahead (the
        pool) while they are fresh; else, and for per-key rates, they are reserved in a
        short transaction of its own (committed, so every worker counts them)."""
        if not self.looked:
            self._first_look(conn, begin)
        # In name order: workers that serve the same queues in other orders take turns on
        # their limit rows without a deadlock.
        rated = sorted(q for q, (limits, _) in self.known.items() if _rated(limits))
        if not rated:
            return {}
        now = clock()  # read only here: a claim of no rated queue reads the clock once
        reserved: dict[str, Reserved] = {}
        needed = self._take_pooled(rated, reserved, now, batch)
        if not needed:
            return reserved
        # In the asyncio worker the reservation under way may be another task's, on this
        # very thread: waiting for it would stop the event loop it needs, so this claim
        # reserves for itself instead.
        if not self._reserving.acquire(blocking=asyncio._get_running_loop() is None):
            reserved.update(self._reserve_committed(conn, begin, needed, now, batch))
            return reserved
        try:
            # The reservation that held the lock may have pooled the starts this one needs.
            needed = self._take_pooled(needed, reserved, now, batch)
            if needed:
                reserved.update(self._reserve_committed(conn, begin, needed, now, batch))
        finally:
            self._reserving.release()
        return reserved

    def _reserve_committed(
        self,
        conn: Connection,
        begin: Callable[[Connection], None],
        needed: list[str],
        now: datetime,
        batch: int,
    ) -> dict[str, Reserved]:
        """Reserve for ``needed`` in a short transaction of its own, committed (giving the
        stale starts back); what was reserved, by queue."""
        with self._pool_lock:
            stale, self.stale = self.stale, []
        try:
            return _committed(
                conn, begin, lambda: self._reserve_in(conn, needed, stale, now, batch)
            )
        except BaseException:
            with self._pool_lock:
                self.stale.extend(stale)
            raise

    def _take_pooled(
        self, queues: list[str], reserved: dict[str, Reserved], now: datetime, batch: int
    ) -> list[str]:
        """Serve ``queues`` from their pools into ``reserved``; those left to reserve."""
        with self._pool_lock:
            for queue in queues:
                pooled = self._from_pool(queue, now, batch)
                if pooled is not None:
                    reserved[queue] = pooled
        return [queue for queue in queues if queue not in reserved]

    def _reserve_in(
        self,
        conn: Connection,
        needed: list[str],
        stale: list[uuid.UUID],
        now: datetime,
        batch: int,
    ) -> dict[str, Reserved]:
        """In the reservation's transaction: give the stale starts back, take the needed
        queues' limit rows in turn, and reserve; what was reserved, by queue."""
        made: dict[str, Reserved] = {}
        _give_back_in(conn, stale)
        for queue in needed:
            conn.execute(*sql.lock_limits(queue))
        # Read once the locks are held: a change committed meanwhile is seen.
        fresh = read_versions(conn, tuple(needed))
        for queue in needed:
            if queue not in fresh or not _rated(fresh[queue][0]):
                continue  # the claim reads the limits again and learns of the change
            limits, version = fresh[queue]
            prune = time.monotonic() - self.pruned.get(queue, 0.0) > PRUNE_INTERVAL
            ahead = 0 if limits.rate_limit_per_key else self._ahead(queue, batch)
            reservation = _reserve(conn, queue, limits, now, batch, ahead, prune=prune)
            reservation.version = version
            made[queue] = self._to_pool(queue, reservation, batch)
            if prune:
                self.pruned[queue] = time.monotonic()
        return made

    def _first_look(self, conn: Connection, begin: Callable[[Connection], None]) -> None:
        """The runner's first claim reads which of its queues have limits, so that even a
        runner of one claim (``process_next_job``) claims a limited queue's jobs."""
        self.known = _committed(conn, begin, lambda: read_versions(conn, self.queues))
        self.looked = time.monotonic()

    def _ahead(self, queue: str, batch: int) -> int:
        """How many starts the queue's next reservation makes ahead: twice the last pool's
        if the claims used it up, half if most of it expired unused."""
        least = batch * POOL_CLAIMS
        with self._pool_lock:
            ahead = max(self.ahead.get(queue, least), least)
            if queue in self.used_up:
                self.used_up.discard(queue)
                ahead = min(2 * ahead, POOL_MOST)
            self.ahead[queue] = ahead
        return ahead

    def _from_pool(self, queue: str, now: datetime, batch: int) -> Reserved | None:
        """Up to ``batch`` of the queue's pooled starts still fresh (``until`` has not
        passed, so that its handlers have time to start before ``START_WITHIN`` past the
        moment they count at); older ones go to ``stale``, to be deleted."""
        pool = self.pool.get(queue)
        if pool is None:
            return None
        if pool.until is None or now > pool.until:
            unused = pool.unused()
            if 2 * len(unused) > self.ahead.get(queue, 0):
                self.ahead[queue] = self.ahead.get(queue, 0) // 2
            self.stale.extend(unused)
            del self.pool[queue]
            return None
        starts = pool.by_key[""]
        taken, pool.by_key[""] = starts[:batch], starts[batch:]
        if not pool.by_key[""]:
            self.used_up.add(queue)
            del self.pool[queue]
        return Reserved(
            {"": taken},
            at=pool.at,
            until=pool.until,
            limits=pool.limits,
            version=pool.version,
            pooled=True,
        )

    def _to_pool(self, queue: str, made: Reserved, batch: int) -> Reserved:
        """The claim's part of a reservation; what it made ahead is pooled for the next
        claims (a queue's own rate only)."""
        starts = made.by_key.get("", [])
        if len(starts) <= batch:
            return made
        made.by_key[""], ahead = starts[:batch], starts[batch:]
        with self._pool_lock:
            old = self.pool.pop(queue, None)
            if old is not None:
                self.stale.extend(old.unused())
            self.pool[queue] = Reserved(
                {"": ahead},
                at=made.at,
                until=made.until,
                limits=made.limits,
                version=made.version,
            )
        return made

    def give_back(self, unused: list[uuid.UUID]) -> None:
        """Starts a claim reserved and did not use (or counted for jobs that went back unrun,
        too late to start): given back by the runner's next reservation, in its short
        transaction (never in a claim's, which may last as long as its job, while other
        workers' reservations would wait for their rows)."""
        with self._pool_lock:
            self.stale.extend(unused)

    def give_back_now(self) -> None:
        """Give back at once, in a short transaction, the starts this runner holds unused
        (a claim's, a run's found too late to start, its pool's): a runner that claims no
        more (``process_next_job``) has no next reservation to do it. Fewer starts counted
        only ever leave a window under-used; a failure leaves them counted."""
        with self._pool_lock:
            stale, self.stale = self.stale, []
            for pooled in self.pool.values():
                stale.extend(pooled.unused())
            self.pool.clear()
        if not stale:
            return
        try:
            with self.engine.begin() as conn:
                _give_back_in(conn, stale)
        except Exception as exc:
            log_event(logging.DEBUG, "starts-give-back-error", error=repr(exc))

    def drop_pool(self, queue: str) -> None:
        """The queue's limits changed: its pooled starts are given back at the next
        reservation."""
        with self._pool_lock:
            old = self.pool.pop(queue, None)
            if old is not None:
                self.stale.extend(old.unused())

    def begin(self, conn: Connection, reserved: dict[str, Reserved]) -> FlowClaim:
        """The flow control of one claim, in its transaction on ``conn``."""
        return FlowClaim(self, conn, reserved)


def _committed(conn: Connection, begin: Callable[[Connection], None], work: Callable[[], T]) -> T:
    """What ``work`` returned, its statements made on ``conn`` in a transaction of their own
    (opened by ``begin``), committed; rolled back if it raised."""
    begin(conn)
    try:
        result = work()
        conn.commit()
    except BaseException:
        if conn.in_transaction() and not conn.invalidated:
            conn.rollback()
        raise
    return result


def _give_back_in(conn: Connection, starts: list[uuid.UUID]) -> None:
    """Delete the given starts (a row counted n times is there n times) on ``conn``."""
    if starts:
        for statement in sql.give_back_starts(Counter(starts)):
            conn.execute(*statement)


def _rated(limits: QueueLimits) -> bool:
    return limits.rate_limit is not None or limits.rate_limit_per_key is not None


def _window_start(now: datetime, seconds: float) -> datetime:
    return now - timedelta(seconds=seconds + RATE_MARGIN)


def _reserve(
    conn: Connection,
    queue: str,
    limits: QueueLimits,
    now: datetime,
    batch: int,
    ahead: int,
    *,
    prune: bool,
) -> Reserved:
    """Reserve the starts one claim of ``queue`` may make (the queue's own, ``ahead`` more
    for the next claims; and each key's for the due jobs a claim would meet first, keys with
    none left looked past)."""
    if prune:
        rates = (limits.rate_limit, limits.rate_limit_per_key)
        longest = max(rate[1] for rate in rates if rate)
        conn.execute(*sql.prune_starts(queue, _window_start(now, longest)))
    wanted: dict[str, int] = {}
    at, until = now, None
    if limits.rate_limit is not None:
        count, seconds = limits.rate_limit
        since = _window_start(now, seconds)
        counts = _sums(conn.execute(*sql.starts_since(queue, [""], since)).all())
        left = count - counts.get("", 0)
        # Starts made ahead only while the window has room to spare (at least half of it
        # left after them), half the spare at most, so that other runners find some: where
        # the limit binds, no runner holds starts it may not use. Made ahead, they all count
        # at a moment to come (``POOL_SHARE``), and the runner's claims draw on them for
        # the first half of the time until then.
        ahead = max(0, min(ahead, (left - batch - math.ceil(count / 2)) // 2))
        if ahead:
            horizon = min(max(seconds * POOL_SHARE, POOL_LEAST), POOL_HORIZON)
            at, until = now + timedelta(seconds=horizon), now + timedelta(seconds=horizon / 2)
        wanted[""] = min(batch + ahead, left)
    if limits.rate_limit_per_key is not None:
        wanted.update(_key_starts(conn, queue, limits.rate_limit_per_key, now, batch))
    rows: list[dict[str, Any]] = []
    reserved = Reserved(at=at, until=until, limits=limits)
    for key, number in wanted.items():
        if number <= 0:
            reserved.by_key[key] = []
            continue
        row_id = uuid.uuid4()
        reserved.by_key[key] = [row_id] * number
        rows.append(
            {"id": row_id, "queue": queue, "slot_key": key, "started_at": at, "starts": number}
        )
    if rows:
        conn.execute(*sql.insert_starts(rows))
    return reserved


def _sums(rows: Sequence[Any]) -> dict[str, int]:
    """Starts by key, as whole numbers (MySQL's SUM is a DECIMAL)."""
    return {key: int(total or 0) for key, total in rows}


def _key_starts(
    conn: Connection, queue: str, rate: tuple[int, float], now: datetime, batch: int
) -> dict[str, int]:
    """How many starts to reserve for each key the claim will meet: as many as it has due
    jobs among the first read, up to what its window has left, ``batch`` in all."""
    count, seconds = rate
    left: dict[str, int] = {}
    demand: Counter[str] = Counter()
    full: list[str] = []
    seen: list[uuid.UUID] = []
    for _ in range(ROUNDS):
        rows = conn.execute(*sql.candidates(queue, now, CANDIDATES, full=full, seen=seen)).all()
        if not rows:
            break
        seen.extend(row[0] for row in rows)
        new = sorted({row[1] for row in rows if row[1] is not None and row[1] not in left})
        if new:
            since = _window_start(now, seconds)
            counts = _sums(conn.execute(*sql.starts_since(queue, new, since)).all())
            for key in new:
                left[key] = max(0, count - counts.get(key, 0))
                if not left[key]:
                    full.append(key)
        demand.update(row[1] for row in rows if row[1] is not None and left[row[1]])
        if sum(min(left[key], n) for key, n in demand.items()) >= batch:
            break
    wanted: dict[str, int] = {}
    total = 0
    for key, n in demand.items():
        number = min(left[key], n, batch - total)
        if number <= 0:
            break
        wanted[key] = number
        total += number
    return wanted


class FlowClaim:
    """One claim's flow control: the limits it claims under, the slots it took and the starts
    it used.

    The limits come from the claim's reservations (read under the limit rows' locks), else
    from what the runner read before: a queue with ``max_running`` has its slots taken only
    while its limits are still those (their version is checked by the same statement), so
    the claim reads them again only when that statement finds no slot. A known queue with no
    ``max_running`` and no reservations has its limits read by the claim itself."""

    def __init__(
        self, control: FlowControl, conn: Connection, reserved: dict[str, Reserved]
    ) -> None:
        self.control = control
        self.conn = conn
        self.reserved = reserved
        #: Slots taken for the claim's jobs: (queue, key, n, job id).
        self.taken: list[Slot] = []
        #: The slots the claim has locked, by (queue, key): a claim's own locks do not make
        #: its later lock statements skip them.
        self._locked: dict[tuple[str, str], list[int]] = {}
        self._known = dict(control.known)
        for queue, r in reserved.items():
            self._known[queue] = (r.limits, r.version)
        #: Whether the claim read the limits itself (then it does not look again).
        self._looked = False
        unchecked = [
            queue
            for queue, (limits, _) in self._known.items()
            if (queue not in reserved or reserved[queue].pooled) and limits.max_running is None
        ]
        if unchecked:
            self._read()

    def _read(self) -> None:
        self._looked = True
        self._known = read_versions(self.conn, self.control.queues)
        self.control.known = dict(self._known)
        self.control.looked = time.monotonic()

    def limits(self, queue: str) -> QueueLimits | None:
        """The queue's limits as this claim knows them (None: none known)."""
        known = self._known.get(queue)
        return None if known is None else known[0]

    def came_back_short(self) -> None:
        """The claim found fewer jobs than it could take: a queue may have limits it did not
        know of (the poll skipped it). Read them, for the next claim, unless a claim did
        within ``LOOK_INTERVAL``."""
        if not self._looked and time.monotonic() - self.control.looked > LOOK_INTERVAL:
            self._read()

    def claim(
        self,
        queue: str,
        now: datetime,
        want: int,
        poll: Callable[[int], list[dict[str, Any]]],
        *,
        with_runs: bool,
        excluding: list[uuid.UUID] | None,
    ) -> list[dict[str, Any]] | None:
        """Lock up to ``want`` due jobs of a limited queue, as many as its limits leave:
        ``poll(n)`` claims n of them in claim order where no limit counts by key. None: the
        queue has no limits any more (the ordinary poll's turn)."""
        for attempt in range(2):
            known = self._known.get(queue)
            if known is None:
                return None
            limits, version = known
            reserved = self.reserved.get(queue)
            if _rated(limits) and (reserved is None or reserved.version != version):
                self.control.drop_pool(queue)
                return []  # limits newer than the claim's reservations: the next claim's turn
            starts = reserved.by_key if reserved is not None else {}
            if limits.rate_limit is not None:
                want = min(want, len(starts.get("", [])))
            if want <= 0:
                return []
            queue_slots: list[int] = []
            if limits.max_running is not None:
                queue_slots = self._free(queue, "", limits.max_running, want, now, version)
                if not queue_slots:
                    if attempt or self._looked:
                        return []  # every slot is taken
                    self._read()  # none found: every slot taken, or other limits now
                    if self._known.get(queue) == known:
                        return []
                    continue
                want = min(want, len(queue_slots))
            break
        if limits.per_key:
            picked = self._by_key(queue, limits, now, want, with_runs, excluding, starts, version)
        else:
            picked = [(job, None) for job in poll(want)]
        jobs = []
        for index, (job, key_slot) in enumerate(picked):
            job_id = job["job_id"]
            if reserved is not None and reserved.at is not None:
                job[START_BY] = reserved.at + timedelta(seconds=START_WITHIN)
            if queue_slots:
                self.taken.append((queue, "", queue_slots[index], job_id))
            if limits.rate_limit is not None:
                job.setdefault(COUNTED, []).append(starts[""].pop())
            if key_slot is not None:
                self.taken.append((queue, job["concurrency_key"], key_slot, job_id))
            jobs.append(job)
        return jobs

    def _by_key(
        self,
        queue: str,
        limits: QueueLimits,
        now: datetime,
        want: int,
        with_runs: bool,
        excluding: list[uuid.UUID] | None,
        starts: dict[str, list[uuid.UUID]],
        version: Any,
    ) -> list[tuple[dict[str, Any], int | None]]:
        """Walk the queue's due jobs in claim order, taking each whose key has a free slot
        (and a reserved start) until ``want``; a key with none is looked past."""
        conn = self.conn
        held = set(excluding or ())
        picked: list[tuple[dict[str, Any], int | None]] = []
        full: set[str] = set()
        seen: list[uuid.UUID] = []
        spare: dict[str, list[int]] = {}
        for _ in range(ROUNDS):
            statement = sql.candidates(queue, now, CANDIDATES, full=sorted(full), seen=seen)
            rows = conn.execute(*statement).all()
            if not rows:
                break
            for job_id, key in rows:
                seen.append(job_id)
                if job_id in held or (key is not None and key in full):
                    continue
                slot = None
                if key is not None:
                    if limits.rate_limit_per_key is not None and not starts.get(key):
                        full.add(key)
                        continue
                    if limits.max_running_per_key is not None:
                        most = limits.max_running_per_key
                        slot = self._key_slot(queue, key, most, now, spare, version)
                        if slot is None:
                            full.add(key)
                            continue
                lock = sql.lock_job(job_id, queue, now, with_runs=with_runs)
                job = conn.execute(*lock).mappings().first()
                if job is None:  # another worker took it meanwhile
                    if slot is not None:
                        spare.setdefault(key, []).append(slot)
                    continue
                picked_job = dict(job)
                if key is not None and limits.rate_limit_per_key is not None:
                    picked_job[COUNTED] = [starts[key].pop()]
                picked.append((picked_job, slot))
                if len(picked) == want:
                    return picked
        return picked

    def _key_slot(
        self,
        queue: str,
        key: str,
        most: int,
        now: datetime,
        spare: dict[str, list[int]],
        version: Any,
    ) -> int | None:
        """A free slot of the key (one this claim took and did not use first), made when the
        key has fewer slots than its limit."""
        if spare.get(key):
            return spare[key].pop()
        free = self._free(queue, key, most, 1, now, version)
        if free:
            return free[0]
        made = {n for _, n in self.conn.execute(*sql.slot_numbers(queue, [key]))}
        missing = [n for n in range(1, most + 1) if n not in made]
        if not missing:
            return None
        self._make_slots(queue, key, missing)
        free = self._free(queue, key, most, 1, now, version)
        return free[0] if free else None

    def _make_slots(self, queue: str, key: str, numbers: list[int]) -> None:
        """Make a key's slots. A transaction-mode claim (on a server with row locks) makes
        them in a transaction of their own, committed at once, so that no other claim waits
        for its job to end; a lease claim (short) and SQLite (one writer) in the claim's."""
        rows = [{"queue": queue, "slot_key": key, "n": n} for n in numbers]
        name = self.conn.dialect.name
        if self.control.leases or name == "sqlite":
            self.conn.execute(*sql.insert_slots(rows, name))
            return
        with self.control.engine.begin() as other:
            other.execute(*sql.insert_slots(rows, name))

    def _free(
        self, queue: str, key: str, most: int, want: int, now: datetime, version: Any
    ) -> list[int]:
        """Lock up to ``want`` free slots of ``(queue, key)``; their numbers. A slot whose
        lease was committed after the lock statement's snapshot is checked again here."""
        conn = self.conn
        mine = self._locked.setdefault((queue, key), [])
        statement = sql.free_slots(queue, key, most, want, now, mine, version)
        rows = direct.execute(conn, *statement).rows
        mine.extend(n for n, _, _ in rows)
        named = [job_id for _, job_id, _ in rows if job_id is not None]
        if not named:
            return [n for n, _, _ in rows]
        live = set(direct.execute(conn, *sql.live_leases(named, now)).rows)
        return [n for n, job_id, token in rows if (job_id, token) not in live]

    def finish(self, token: uuid.UUID | None = None) -> None:
        """In the claim's transaction, before its commit: lease mode names each slot's holder
        (the job and the claim's ``token``); the starts reserved and not used go back with
        the runner's next reservation (counted until then: a window under-used, never
        over)."""
        if token is not None and self.taken:
            groups: dict[tuple[str, str], dict[int, uuid.UUID]] = {}
            for queue, key, n, job_id in self.taken:
                groups.setdefault((queue, key), {})[n] = job_id
            for (queue, key), holders in groups.items():
                name = self.conn.dialect.name
                direct.execute(self.conn, *sql.name_holders(queue, key, holders, token, name))
        unused = [start for reserved in self.reserved.values() for start in reserved.unused()]
        if unused:
            self.control.give_back(unused)

"""Owners of run records: locks that live as long as the worker's session."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    String,
    bindparam,
    column,
    exists,
    func,
    literal,
    select,
    table,
    true,
)

from sqla_proletarian.dialects import OwnerLock
from sqla_proletarian.statements.base import Statement

_PG_LOCKS = table(
    "pg_locks",
    column("locktype"),
    column("database"),
    column("classid"),
    column("objid"),
    column("objsubid"),
    column("granted"),
)
_PG_DATABASE = table("pg_database", column("oid"), column("datname"))
#: An advisory lock on a bigint key, held in this database (pg_locks shows its two halves).
_ADVISORY_HERE = (
    _PG_LOCKS.c.locktype == literal("advisory"),
    _PG_LOCKS.c.objsubid == literal(1),
    _PG_LOCKS.c.granted.is_(true()),
    _PG_LOCKS.c.database
    == select(_PG_DATABASE.c.oid)
    .where(_PG_DATABASE.c.datname == func.current_database())
    .scalar_subquery(),
)
_ADVISORY_LOCKS_HELD = select(_PG_LOCKS.c.classid, _PG_LOCKS.c.objid).where(*_ADVISORY_HERE)

_KEY = bindparam("key", type_=BigInteger)
_NAME = bindparam("name", type_=String(64))
_HOLD = {"advisory": select(func.pg_advisory_lock(_KEY)), "named": select(func.get_lock(_NAME, 0))}
_RELEASE = {
    "advisory": select(func.pg_advisory_unlock(_KEY)),
    "named": select(func.release_lock(_NAME)),
}
_HI = bindparam("hi", type_=BigInteger)
_LO = bindparam("lo", type_=BigInteger)
#: True (PostgreSQL) or 1 (MySQL) when nobody holds the lock: its owner's session is gone.
#: Both only look: taking the lock to test it (pg_try_advisory_xact_lock) would make a dead
#: owner look alive to every other claim until the testing one ends.
_FREE = {
    "advisory": select(
        ~exists().where(*_ADVISORY_HERE, _PG_LOCKS.c.classid == _HI, _PG_LOCKS.c.objid == _LO)
    ),
    "named": select(func.is_free_lock(_NAME)),
}


def _owner_params(kind: OwnerLock, owner: str) -> dict[str, Any]:
    if kind == "advisory":
        # The first 64 bits of the owner's random hex, as PostgreSQL's signed bigint key.
        return {"key": int(owner[:16], 16) - (1 << 63)}
    return {"name": owner}


def _free_params(kind: OwnerLock, owner: str) -> dict[str, Any]:
    if kind == "advisory":
        high, low = advisory_lock_tag(owner)
        return {"hi": high, "lo": low}
    return {"name": owner}


def hold_owner(kind: OwnerLock, owner: str) -> Statement:
    """Take the session lock that marks ``owner``'s run records as belonging to a live worker."""
    return _HOLD[kind], _owner_params(kind, owner)


def release_owner(kind: OwnerLock, owner: str) -> Statement:
    """Give the owner's session lock back (before its connection returns to the pool)."""
    return _RELEASE[kind], _owner_params(kind, owner)


def owner_gone(kind: OwnerLock, owner: str) -> Statement:
    """Whether the owner's lock is free, i.e. the session that held it has ended; read
    without taking the lock."""
    return _FREE[kind], _free_params(kind, owner)


def advisory_locks_held() -> Statement:
    """PostgreSQL: the bigint advisory locks held in this database, as (classid, objid)
    halves; reading ``pg_locks`` takes no lock a worker could wait for."""
    return _ADVISORY_LOCKS_HELD, {}


def advisory_lock_tag(owner: str) -> tuple[int, int]:
    """The (classid, objid) under which ``pg_locks`` shows an owner's advisory lock: the high
    and low 32 bits of its bigint key."""
    key: int = _owner_params("advisory", owner)["key"]
    return (key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF


def used_locks(owners: list[str]) -> Statement:
    """MySQL/MariaDB: for each owner, the connection holding its named lock, or NULL (the
    lock is only looked at, never taken)."""
    names = [bindparam(f"owner_{index}", type_=String(64)) for index in range(len(owners))]
    statement = select(*(func.is_used_lock(name) for name in names))
    return statement, {f"owner_{index}": owner for index, owner in enumerate(owners)}

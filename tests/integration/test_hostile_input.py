"""Hostile and bad input at enqueue: it round-trips exactly, or is refused clearly with
nothing written. Nothing a caller passes ever reaches SQL as text."""

from __future__ import annotations

import math
import uuid
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import sqla_proletarian as sp

# --- helpers ------------------------------------------------------------------------------


def same(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (so True != 1, 1 != 1.0, -0.0 != 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def count(engine: sa.Engine, model: type[Any]) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.count()).select_from(model)) or 0)


def enqueue_via(engine: sa.Engine, via: str, job_type: Any, payload: Any, **kw: Any) -> uuid.UUID:
    """Enqueue through a Session or a Connection and commit."""
    if via == "session":
        with Session(engine) as session:
            job_id = sp.enqueue(session, job_type, payload, **kw)
            session.commit()
        return job_id
    with engine.begin() as conn:
        return sp.enqueue(conn, job_type, payload, **kw)


def refused(
    engine: sa.Engine,
    via: str,
    job_type: Any,
    payload: Any,
    error: type[Exception] = sp.ProletarianError,
    **kw: Any,
) -> str:
    """Enqueue input that must be refused; commit anyway; return the error message.

    Committing after the refusal proves nothing was added to the transaction.
    """
    before = count(engine, sp.Job)
    if via == "session":
        with Session(engine) as session:
            with pytest.raises(error) as info:
                sp.enqueue(session, job_type, payload, **kw)
            session.commit()
    else:
        with engine.begin() as conn, pytest.raises(error) as info:
            sp.enqueue(conn, job_type, payload, **kw)
    assert count(engine, sp.Job) == before, "a refused job was written"
    return str(info.value)


class Ran:
    """An advanced-mode handler that remembers the jobs it ran."""

    def __init__(self) -> None:
        self.jobs: list[sp.JobContext] = []

    def __call__(self, job: sp.JobContext) -> None:
        self.jobs.append(job)


def run_one(engine: sa.Engine, queue: str) -> sp.JobContext | None:
    """Run at most one job of ``queue`` and return what its handler received."""
    ran = Ran()
    claimed = sp.process_next_job(engine, ran, queue=queue, handler_mode="advanced")
    assert claimed == bool(ran.jobs)
    return ran.jobs[0] if ran.jobs else None


def storable_name(name: str) -> bool:
    """Whether a queue name or job type is one every backend can store exactly."""
    if not 1 <= len(name) <= sp.types.MAX_NAME_LENGTH or "\x00" in name:
        return False
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# --- property tests -----------------------------------------------------------------------

#: Characters SQL and drivers care about, and one that needs 4 bytes in UTF-8.
SPECIAL_CHARS = [*"'\";\\%_-/* \t\n\r`$", "\U0001f600", "\ufeff", "\u0301"]
#: Characters no database can store in a name: NUL and lone surrogates.
UNSTORABLE_CHARS = ["\x00", "\ud800", "\udfff"]
#: Any code point (lone surrogates included), with the interesting ones drawn often.
NAME_CHAR = st.one_of(st.characters(exclude_categories=()), st.sampled_from(SPECIAL_CHARS))
ANY_CHAR = st.one_of(NAME_CHAR, st.sampled_from(UNSTORABLE_CHARS))
ANY_TEXT = st.text(ANY_CHAR, max_size=40)
NAMES = st.one_of(
    st.text(NAME_CHAR, min_size=1, max_size=20),
    st.text(NAME_CHAR, min_size=250, max_size=sp.types.MAX_NAME_LENGTH),
    st.text(ANY_CHAR, min_size=1, max_size=10),
    st.just("x'; DROP TABLE proletarian_job; --"),
)
JSON_LIKE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | ANY_TEXT,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(ANY_TEXT, children, max_size=5)
    ),
    max_leaves=25,
)

PROPERTY_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@PROPERTY_SETTINGS
@given(payload=JSON_LIKE, via=st.sampled_from(["session", "connection"]))
def test_any_json_like_payload_round_trips_exactly_or_is_refused_at_enqueue(
    engine: sa.Engine, payload: Any, via: str
) -> None:
    """Payloads of None/bool/int (huge ones too)/float/text (NUL, lone surrogates)/lists/
    dicts reach the handler equal and of the same types, or are refused with nothing written."""
    try:
        job_id = enqueue_via(engine, via, "payload", payload)
    except sp.ProletarianError:
        refused(engine, via, "payload", payload)
        # The only payloads the JSON serializer refuses here use its reserved key.
        assert "__proletarian__" in repr(payload)
        return
    job = run_one(engine, sp.DEFAULT_QUEUE)
    assert job is not None and job.job_id == job_id
    assert same(job.payload, payload), (job.payload, payload)
    assert count(engine, sp.Job) == 0


@PROPERTY_SETTINGS
@given(job_type=NAMES, queue=NAMES, via=st.sampled_from(["session", "connection"]))
def test_any_job_type_and_queue_name_round_trip_exactly_or_are_refused_at_enqueue(
    engine: sa.Engine, job_type: str, queue: str, via: str
) -> None:
    """Unicode names up to 255 characters (quotes, ';', backslashes, emoji) are stored and
    compared exactly: a worker polling the queue name finds the job and gets its type back.
    Names no database can store (NUL, lone surrogates) are refused with nothing written."""
    if not (storable_name(job_type) and storable_name(queue)):
        message = refused(engine, via, job_type, {"k": 1}, queue=queue)
        assert "NUL" in message or "surrogate" in message
        return
    job_id = enqueue_via(engine, via, job_type, {"k": 1}, queue=queue)
    job = run_one(engine, queue)
    assert job is not None and job.job_id == job_id
    assert job.job_type == job_type
    assert job.queue == queue
    with Session(engine) as session:
        archived = session.get(sp.ArchivedJob, job_id)
        assert archived is not None
        assert (archived.job_type, archived.queue) == (job_type, queue)
    assert count(engine, sp.Job) == 0


# --- explicit cases -----------------------------------------------------------------------


def test_sql_in_a_queue_name_and_job_type_is_data_and_the_tables_survive(
    engine: sa.Engine,
) -> None:
    """A queue name and job type made of SQL round-trip as text; no table is dropped."""
    evil = "x'; DROP TABLE proletarian_job; --"
    evil_type = 'y"); DELETE FROM proletarian_archived_job; --\\'
    job_id = enqueue_via(engine, "session", evil_type, {evil: evil}, queue=evil)
    job = run_one(engine, evil)
    assert job is not None and job.job_id == job_id
    assert (job.queue, job.job_type, job.payload) == (evil, evil_type, {evil: evil})
    tables = set(sa.inspect(engine).get_table_names())
    assert set(sp.metadata.tables) <= tables
    assert count(engine, sp.ArchivedJob) == 1


#: Pairs of queue names that must be different queues.
DISTINCT_QUEUES = [
    ("a", "a "),
    ("a ", "a"),
    ("a", "A"),
    ("\u00e9", "e\u0301"),
    ("ss", "\u00df"),
    ("a", "a\t"),
]


def test_queue_names_that_differ_in_any_character_are_different_queues(
    engine: sa.Engine, subtests: pytest.Subtests
) -> None:
    """A worker polling one queue never takes a job of a queue whose name differs only by a
    trailing space, case, accent composition or a similar-looking letter."""
    for name, neighbour in DISTINCT_QUEUES:
        with subtests.test(queue=name, polled=neighbour):
            job_id = enqueue_via(engine, "connection", "t", None, queue=name)
            stolen = run_one(engine, neighbour)
            job = stolen or run_one(engine, name)
            assert job is not None and job.job_id == job_id
            assert stolen is None, f"a worker polling {neighbour!r} took a job of {name!r}"


def test_names_of_255_four_byte_characters_round_trip(engine: sa.Engine) -> None:
    """The longest allowed job type and queue name, in emoji (4 UTF-8 bytes each), fit."""
    longest = "\U0001f600" * sp.types.MAX_NAME_LENGTH
    for via in ("session", "connection"):
        job_id = enqueue_via(engine, via, longest, None, queue=longest)
        job = run_one(engine, longest)
        assert job is not None and job.job_id == job_id
        assert (job.job_type, job.queue) == (longest, longest)


def _cycle() -> list[Any]:
    loop: list[Any] = [1]
    loop.append(loop)
    return loop


def _knot() -> dict[str, Any]:
    knot: dict[str, Any] = {}
    knot["self"] = {"again": knot}
    return knot


def _deep(depth: int) -> list[Any]:
    deep: list[Any] = []
    inner = deep
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return deep


NAIVE = datetime(2030, 1, 1)

#: (case, job_type, payload, enqueue options, error class, fragments the message must hold)
BAD_INPUT: list[tuple[str, Any, Any, dict[str, Any], type[Exception], tuple[str, ...]]] = [
    ("job type of 256", "t" * 256, None, {}, sp.InvalidJobError, ("job_type", "256", "255")),
    ("queue of 256", "t", None, {"queue": "q" * 256}, sp.InvalidJobError, ("queue", "256", "255")),
    ("empty job type", "", None, {}, sp.InvalidJobError, ("job_type", "non-empty")),
    ("empty queue", "t", None, {"queue": ""}, sp.InvalidJobError, ("queue", "non-empty")),
    ("int job type", 42, None, {}, sp.InvalidJobError, ("job_type", "give a string")),
    ("bytes job type", b"t", None, {}, sp.InvalidJobError, ("job_type", "give a string")),
    ("NUL in job type", "a\x00b", None, {}, sp.InvalidJobError, ("job_type", "NUL")),
    ("NUL in queue", "t", None, {"queue": "\x00"}, sp.InvalidJobError, ("queue", "NUL")),
    ("surrogate in queue", "t", None, {"queue": "\ud800"}, sp.InvalidJobError, ("surrogate",)),
    ("naive process_at", "t", None, {"process_at": NAIVE}, sp.InvalidJobError, ("naive", "aware")),
    ("naive clock", "t", None, {"clock": lambda: NAIVE}, sp.InvalidJobError, ("naive", "aware")),
    ("process_in NaN", "t", None, {"process_in": math.nan}, sp.InvalidJobError, ("finite",)),
    ("process_in inf", "t", None, {"process_in": math.inf}, sp.InvalidJobError, ("finite",)),
    ("process_in bool", "t", None, {"process_in": True}, sp.InvalidJobError, ("timedelta",)),
    ("process_in str", "t", None, {"process_in": "10"}, sp.InvalidJobError, ("timedelta",)),
    ("job_id not a UUID", "t", None, {"job_id": "1"}, sp.InvalidJobError, ("uuid.UUID",)),
    ("NaN", "t", {"a": [1, math.nan]}, {}, sp.PayloadSerializationError, ("NaN", "['a'][1]")),
    ("inf", "t", [math.inf], {}, sp.PayloadSerializationError, ("infinities", "[0]")),
    ("-inf", "t", -math.inf, {}, sp.PayloadSerializationError, ("infinities",)),
    ("int key", "t", {"o": {1: "v"}}, {}, sp.PayloadSerializationError, ("keys must be strings",)),
    ("tuple key", "t", {(1, 2): 0}, {}, sp.PayloadSerializationError, ("keys must be strings",)),
    ("None key", "t", {None: 0}, {}, sp.PayloadSerializationError, ("keys must be strings",)),
    ("list cycle", "t", _cycle(), {}, sp.PayloadSerializationError, ("cycle",)),
    ("dict cycle", "t", _knot(), {}, sp.PayloadSerializationError, ("cycle",)),
    ("set", "t", {1, 2}, {}, sp.PayloadSerializationError, ("cannot be stored as JSON",)),
    ("bytes", "t", b"raw", {}, sp.PayloadSerializationError, ("cannot be stored as JSON",)),
    ("object", "t", object(), {}, sp.PayloadSerializationError, ("cannot be stored as JSON",)),
    ("timedelta", "t", timedelta(1), {}, sp.PayloadSerializationError, ("cannot be stored",)),
    (
        "reserved key",
        "t",
        {"__proletarian__": "uuid", "value": "x"},
        {},
        sp.PayloadSerializationError,
        ("reserved key",),
    ),
    # An int past Python's int/str conversion limit (4300 digits) has no JSON text.
    ("5000-digit int", "t", {"n": 10**5000}, {}, sp.PayloadSerializationError, ()),
    # Nesting deeper than the recursion limit cannot be encoded (nor decoded).
    ("nested 3000 deep", "t", _deep(3000), {}, sp.PayloadSerializationError, ("nested",)),
]


def test_bad_input_is_refused_at_enqueue_with_a_clear_message_and_nothing_written(
    engine: sa.Engine, subtests: pytest.Subtests
) -> None:
    """Oversized and empty names, NUL, naive datetimes, NaN and infinities, non-string keys,
    cycles, values JSON cannot hold, huge ints and deep nesting: each is refused with a
    ProletarianError saying what is wrong, through a Session and a Connection alike."""
    for case, job_type, payload, options, error, fragments in BAD_INPUT:
        for via in ("session", "connection"):
            with subtests.test(case=case, via=via):
                message = refused(engine, via, job_type, payload, error=error, **options)
                for fragment in fragments:
                    assert fragment in message


def test_huge_integers_and_extreme_floats_round_trip(engine: sa.Engine) -> None:
    """Integers far beyond 64 bits and the extreme finite floats come back exactly."""
    payload = {
        "big": 2**200,
        "neg": -(10**300),
        "max": 1.7976931348623157e308,
        "tiny": 5e-324,
        "negzero": -0.0,
        "third": 1 / 3,
    }
    job_id = enqueue_via(engine, "connection", "t", payload)
    job = run_one(engine, sp.DEFAULT_QUEUE)
    assert job is not None and job.job_id == job_id
    assert same(job.payload, payload)


def test_enqueue_refuses_what_is_not_an_open_transaction(engine: sa.Engine) -> None:
    """A closed Connection is refused telling to enqueue inside an open transaction; an
    Engine is refused with NotATransactionError explaining what to pass instead."""
    conn = engine.connect()
    conn.close()
    with pytest.raises(sp.ProletarianError) as info:
        sp.enqueue(conn, "t", None)
    assert "closed" in str(info.value) and "engine.begin()" in str(info.value)
    with pytest.raises(sp.NotATransactionError) as not_a_transaction:
        sp.enqueue(engine, "t", None)  # type: ignore[arg-type]
    assert "Session or Connection" in str(not_a_transaction.value)
    assert count(engine, sp.Job) == 0


class UserBase(DeclarativeBase):
    pass


class Account(UserBase):
    """A table of the user's own, to make a flush fail."""

    __tablename__ = "user_account"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)


def test_a_session_in_a_failed_transaction_is_refused_until_rolled_back(
    engine: sa.Engine,
) -> None:
    """After the user's own flush fails (IntegrityError), enqueue refuses clearly, telling
    to roll back; nothing is written, and after rollback enqueue works again."""
    UserBase.metadata.create_all(engine)
    with Session(engine) as session:
        session.add(Account(id=1))
        session.commit()
        session.add(Account(id=1))
        with pytest.raises(sa.exc.IntegrityError):
            session.flush()
        with pytest.raises(sp.ProletarianError) as info:
            sp.enqueue(session, "t", None)
        assert "rolled back" in str(info.value)
        assert "session.rollback()" in str(info.value)
        session.rollback()
        assert count(engine, sp.Job) == 0
        job_id = sp.enqueue(session, "t", None)
        session.commit()
    job = run_one(engine, sp.DEFAULT_QUEUE)
    assert job is not None and job.job_id == job_id

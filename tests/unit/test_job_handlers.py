"""JobHandlers dispatch by job type in both handler modes; JobContext is a frozen value."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy.orm import Session

import sqla_proletarian as sp

NOW = datetime(2024, 1, 1, tzinfo=UTC)


def context(job_type: str, payload: Any = None) -> sp.JobContext:
    return sp.JobContext(
        job_id=uuid.UUID(int=1),
        queue="default",
        job_type=job_type,
        payload=payload,
        attempts=1,
        enqueued_at=NOW,
        process_at=NOW,
        session=Session(),
    )


def test_default_mode_calls_the_registered_function_with_job_type_and_payload() -> None:
    handlers = sp.JobHandlers()
    calls: list[tuple[str, Any]] = []

    @handlers.register("email")
    def send_email(job_type: str, payload: Any) -> str:
        calls.append((job_type, payload))
        return "sent"

    assert handlers("email", {"to": "a@b"}) == "sent"
    assert calls == [("email", {"to": "a@b"})]


def test_advanced_mode_calls_the_registered_function_with_the_job_context() -> None:
    handlers = sp.JobHandlers()
    seen: list[sp.JobContext] = []
    handlers.register("resize")(seen.append)
    handlers.register("other")(lambda job: pytest.fail("wrong handler"))
    job = context("resize", [1, 2])
    handlers(job)
    assert seen == [job]


def test_the_default_handler_catches_unregistered_job_types() -> None:
    handlers = sp.JobHandlers()
    handlers.register("known")(lambda job_type, payload: "known")

    @handlers.default
    def fallback(job_type: str, payload: Any) -> str:
        return f"default:{job_type}"

    assert handlers("known", None) == "known"
    assert handlers("unknown", None) == "default:unknown"


def test_the_default_handler_receives_the_job_context_in_advanced_mode() -> None:
    handlers = sp.JobHandlers()
    handlers.default(lambda job: f"default:{job.job_type}:{job.payload}")
    assert handlers(context("unknown", 7)) == "default:unknown:7"


def test_without_a_default_an_unknown_job_type_raises_an_error_naming_it() -> None:
    handlers = sp.JobHandlers()
    handlers.register("email")(lambda job_type, payload: None)
    handlers.register("sms")(lambda job_type, payload: None)
    with pytest.raises(sp.UnknownJobTypeError) as info:
        handlers("mystery", None)
    assert info.value.job_type == "mystery"
    assert info.value.known_types == ("email", "sms")
    assert "(known job types: 'email', 'sms')" in str(info.value)
    assert "@handlers.register('mystery')" in str(info.value)
    assert "@handlers.default" in str(info.value)
    assert isinstance(info.value, sp.ProletarianError)
    with pytest.raises(sp.UnknownJobTypeError):
        handlers(context("mystery"))


def test_registering_a_job_type_twice_is_refused() -> None:
    handlers = sp.JobHandlers()
    handlers.register("email")(lambda job_type, payload: None)
    with pytest.raises(sp.ConfigurationError, match="already has a handler"):
        handlers.register("email")(lambda job_type, payload: None)


@pytest.mark.parametrize("job_type", ["", None, 3])
def test_a_job_type_must_be_a_non_empty_string(job_type: Any) -> None:
    with pytest.raises(sp.ConfigurationError):
        sp.JobHandlers().register(job_type)


def test_membership_tells_which_job_types_have_their_own_handler() -> None:
    handlers = sp.JobHandlers()
    handlers.register("email")(lambda job_type, payload: None)
    handlers.default(lambda job_type, payload: None)
    assert "email" in handlers
    assert "sms" not in handlers


def test_calling_the_table_with_anything_else_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="handler"):
        sp.JobHandlers()("only-one-argument")


def test_the_decorators_return_the_function_unchanged() -> None:
    handlers = sp.JobHandlers()

    def handle(job_type: str, payload: Any) -> None:
        return None

    assert handlers.register("t")(handle) is handle
    assert handlers.default(handle) is handle


def test_a_job_context_is_frozen() -> None:
    job = context("t")
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.attempts = 2  # type: ignore[misc]


def test_a_job_context_compares_by_value_and_hides_its_session() -> None:
    first, second = context("t", {"a": 1}), context("t", {"a": 1})
    assert first == second
    assert "session" not in repr(first)

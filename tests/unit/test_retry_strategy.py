"""RetryStrategy: the original's retry arithmetic, and refusal of invalid strategies."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest

import sqla_proletarian as sp
from sqla_proletarian.retry import as_retry_strategy

NOW = datetime(2024, 5, 17, 12, 0, tzinfo=UTC)


# The original's table: (retries, delays in seconds), attempt -> (retries left, delay).
# With no delays a retry is due at once (delay 0); None: no retry is left, so no delay.
ORIGINAL_TABLE = [
    ((0, ()), 1, 0, None),
    ((1, ()), 1, 1, 0.0),
    ((2, ()), 1, 2, 0.0),
    ((1, ()), 2, 0, None),
    ((5, ()), 2, 4, 0.0),
    ((5, ()), 3, 3, 0.0),
    ((1, []), 1, 1, 0.0),
    ((1, [1]), 1, 1, 1.0),
    ((2, [1]), 2, 1, 1.0),
    ((2, [1, 2]), 2, 1, 2.0),
    ((10, [1, 2]), 3, 8, 2.0),
    ((10, [1, 2]), 4, 7, 2.0),
]


@pytest.mark.parametrize(
    ("strategy", "attempt", "retries_left", "delay"),
    ORIGINAL_TABLE,
    ids=[f"{{{s[0]},{list(s[1])}}},{a}" for s, a, _, _ in ORIGINAL_TABLE],
)
def test_retry_arithmetic_follows_the_original_table(
    strategy: tuple[int, list[int]], attempt: int, retries_left: int, delay: float | None
) -> None:
    retry = sp.RetryStrategy(*strategy)
    assert retry.retries_left(attempt) == retries_left
    if delay is not None:
        assert retry.delay(attempt) == delay
        assert retry.retry_at(attempt, NOW) == NOW + timedelta(seconds=delay)


def test_the_worked_example_retries_twice_with_one_then_five_seconds() -> None:
    retry = sp.RetryStrategy(2, [1, 5])
    assert [retry.retries_left(a) for a in (1, 2, 3)] == [2, 1, 0]
    assert [retry.delay(a) for a in (1, 2)] == [1.0, 5.0]


def test_retries_left_never_goes_below_zero_after_the_last_retry() -> None:
    assert sp.RetryStrategy(2).retries_left(10) == 0


def test_delays_may_be_timedeltas_or_fractional_seconds() -> None:
    retry = sp.RetryStrategy(3, [timedelta(milliseconds=1500), 2.25, timedelta(minutes=1)])
    assert retry.delays == (1.5, 2.25, 60.0)
    assert retry.retry_at(1, NOW) == NOW + timedelta(seconds=1.5)
    assert retry.retry_at(3, NOW) == NOW + timedelta(minutes=1)
    assert retry.retry_at(9, NOW) == NOW + timedelta(minutes=1)


def test_delays_may_be_any_iterable_and_are_kept_as_a_tuple() -> None:
    assert sp.RetryStrategy(2, (d for d in [1, 2])).delays == (1.0, 2.0)


def test_a_retry_strategy_is_a_frozen_value() -> None:
    retry = sp.RetryStrategy(1, [1])
    assert retry == sp.RetryStrategy(1, [timedelta(seconds=1)])
    with pytest.raises(AttributeError):
        retry.retries = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("retries", "words"),
    [
        (-1, ["retries", "-1", ">= 0"]),
        (True, ["retries", "True", "whole number"]),
        (1.0, ["retries", "1.0", "whole number"]),
        ("3", ["retries", "'3'", "whole number"]),
        (None, ["retries", "None"]),
    ],
)
def test_invalid_retries_are_refused_with_a_message_saying_what_to_give(
    retries: object, words: list[str]
) -> None:
    with pytest.raises(sp.InvalidRetryStrategyError) as info:
        sp.RetryStrategy(retries)  # type: ignore[arg-type]
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("delays", "words"),
    [
        ("12", ["delays", "list"]),
        (b"12", ["delays", "list"]),
        (5, ["delays", "5", "list"]),
        (["1"], ["delays[0]", "'1'", "number or a timedelta"]),
        ([1, -1], ["delays[1]", "-1", ">= 0"]),
        ([math.nan], ["delays[0]", "nan", "finite"]),
        ([math.inf], ["delays[0]", "inf", "finite"]),
        ([timedelta(seconds=-1)], ["delays[0]", ">= 0"]),
        ([True], ["delays[0]", "True"]),
        ([None], ["delays[0]", "None"]),
    ],
)
def test_invalid_delays_are_refused_with_a_message_naming_the_bad_delay(
    delays: object, words: list[str]
) -> None:
    with pytest.raises(sp.InvalidRetryStrategyError) as info:
        sp.RetryStrategy(1, delays)
    for word in words:
        assert word in str(info.value)


def test_invalid_retry_strategy_error_is_a_proletarian_error() -> None:
    assert issubclass(sp.InvalidRetryStrategyError, sp.ProletarianError)


def test_what_a_retry_strategy_function_returns_must_be_a_strategy_or_none() -> None:
    strategy = sp.RetryStrategy(1)
    assert as_retry_strategy(strategy) is strategy
    assert as_retry_strategy(None) is None
    with pytest.raises(sp.InvalidRetryStrategyError, match=r"return a sqla_proletarian\.Retry"):
        as_retry_strategy({"retries": 1})

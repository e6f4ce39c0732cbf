"""RetryStrategy.exponential: delays that double from ``base`` up to ``cap``, with full
jitter by default, and refusal of arguments that cannot make such delays."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

import sqla_proletarian as sp

NOW = datetime(2024, 5, 17, 12, 0, tzinfo=UTC)


def test_without_jitter_retry_n_waits_base_times_two_to_the_n_minus_one_up_to_cap() -> None:
    strategy = sp.RetryStrategy.exponential(8, base=0.5, cap=10, jitter=False)
    assert isinstance(strategy, sp.RetryStrategy)
    assert [strategy.delay(n) for n in range(1, 9)] == [0.5, 1, 2, 4, 8, 10, 10, 10]
    assert strategy.retries_left(1) == 8 and strategy.retries_left(9) == 0
    assert strategy.retry_at(3, NOW) == NOW + timedelta(seconds=2)


def test_the_defaults_start_at_a_second_cap_at_an_hour_and_jitter() -> None:
    strategy = sp.RetryStrategy.exponential(30)
    delays = [strategy.delay(1) for _ in range(200)]
    assert all(0 <= d <= 1 for d in delays)
    assert len(set(delays)) > 100, "full jitter draws a different delay each time"
    assert all(0 <= strategy.delay(25) <= 3600 for _ in range(200))
    assert max(strategy.delay(25) for _ in range(200)) > 1800


def test_full_jitter_spreads_each_retry_over_zero_to_its_capped_delay() -> None:
    strategy = sp.RetryStrategy.exponential(10, base=2, cap=20)
    for attempt, longest in [(1, 2), (2, 4), (3, 8), (4, 16), (5, 20), (9, 20)]:
        delays = [strategy.delay(attempt) for _ in range(300)]
        assert all(0 <= d <= longest for d in delays)
        assert min(delays) < longest / 4 and max(delays) > longest * 3 / 4


def test_a_huge_attempt_number_waits_the_cap() -> None:
    strategy = sp.RetryStrategy.exponential(100_000, cap=60, jitter=False)
    assert strategy.delay(5000) == 60.0


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"retries": -1}, "retries"),
        ({"retries": 3, "base": 0}, "base"),
        ({"retries": 3, "base": float("nan")}, "base"),
        ({"retries": 3, "base": "1"}, "base"),
        ({"retries": 3, "cap": float("inf")}, "cap"),
        ({"retries": 3, "cap": 4e8}, "cap"),
        ({"retries": 3, "base": 10, "cap": 5}, "cap"),
        ({"retries": 3, "jitter": "yes"}, "jitter"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(sp.InvalidRetryStrategyError, match=named):
        sp.RetryStrategy.exponential(**kwargs)  # type: ignore[arg-type]

"""Retry strategies and the arithmetic that turns one into the next run's time."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqla_proletarian.errors import InvalidRetryStrategyError

#: Longest delay before a retry: ten years. Every backend stores the time that gives.
MAX_RETRY_DELAY = timedelta(days=3650).total_seconds()


def _seconds(delay: Any, index: int) -> float:
    if isinstance(delay, timedelta):
        delay = delay.total_seconds()
    if isinstance(delay, bool) or not isinstance(delay, int | float):
        raise InvalidRetryStrategyError(
            f"delays[{index}] is {delay!r}; give seconds as a number or a timedelta"
        )
    if not math.isfinite(delay) or delay < 0:
        raise InvalidRetryStrategyError(
            f"delays[{index}] is {delay!r}; a delay must be a finite number of seconds >= 0"
        )
    if delay > MAX_RETRY_DELAY:
        raise InvalidRetryStrategyError(
            f"delays[{index}] is {delay!r} seconds, more than ten years "
            f"({MAX_RETRY_DELAY:.0f} s); give a shorter delay, or no retry"
        )
    return float(delay)


@dataclass(frozen=True, init=False)
class RetryStrategy:
    """How often a failed job runs again and how long to wait before each retry.

    ``retries`` is the number of runs after the first; ``delays`` (seconds or timedeltas)
    gives the wait before retry *n* as ``delays[n-1]``, the last delay when the list is
    shorter, and no wait when it is empty.
    """

    retries: int
    delays: tuple[float, ...]

    def __init__(self, retries: int, delays: Any = ()) -> None:
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise InvalidRetryStrategyError(
                f"retries is {retries!r}; give a whole number >= 0 (0 means never retry)"
            )
        if isinstance(delays, str | bytes) or not hasattr(delays, "__iter__"):
            raise InvalidRetryStrategyError(
                f"delays is {delays!r}; give a list of seconds or timedeltas, or leave it empty"
            )
        object.__setattr__(self, "retries", retries)
        object.__setattr__(self, "delays", tuple(_seconds(d, i) for i, d in enumerate(delays)))

    @classmethod
    def exponential(
        cls, retries: int, base: float = 1.0, cap: float = 3600.0, jitter: bool = True
    ) -> RetryStrategy:
        """``retries`` retries with exponential backoff: retry *n* (from 1) waits
        ``min(cap, base * 2 ** (n - 1))`` seconds, or with ``jitter`` (the default) a time
        drawn uniformly from 0 to that ("full jitter"), so that jobs that failed together do
        not all retry at the same moment."""
        return ExponentialRetryStrategy(retries, base, cap, jitter)

    def retries_left(self, attempt: int) -> int:
        """Retries still allowed after run number ``attempt`` (1-based) has failed."""
        if self.retries == 0:
            return 0
        return max(0, self.retries + 1 - attempt)

    def delay(self, attempt: int) -> float:
        """Seconds to wait after run number ``attempt`` failed."""
        if not self.delays:
            return 0.0
        return self.delays[min(attempt, len(self.delays)) - 1]

    def retry_at(self, attempt: int, now: datetime) -> datetime:
        """When the next run may start, after run number ``attempt`` failed at ``now``."""
        return now + timedelta(seconds=self.delay(attempt))


@dataclass(frozen=True, init=False)
class ExponentialRetryStrategy(RetryStrategy):
    """``RetryStrategy.exponential``: retry *n* waits ``min(cap, base * 2 ** (n - 1))``
    seconds, or a time drawn uniformly from 0 to that with ``jitter``."""

    base: float
    cap: float
    jitter: bool

    def __init__(self, retries: int, base: float, cap: float, jitter: bool) -> None:
        super().__init__(retries)
        for name, value in (("base", base), ("cap", cap)):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidRetryStrategyError(
                    f"{name} is {value!r}; give a number of seconds > 0"
                )
            if not (math.isfinite(value) and 0 < value <= MAX_RETRY_DELAY):
                raise InvalidRetryStrategyError(
                    f"{name} is {value!r}; give a number of seconds > 0, at most ten years "
                    f"({MAX_RETRY_DELAY:.0f} s)"
                )
        if cap < base:
            raise InvalidRetryStrategyError(
                f"cap ({cap!r}) is less than base ({base!r}); cap is the longest delay, so "
                "give a cap >= base"
            )
        if not isinstance(jitter, bool):
            raise InvalidRetryStrategyError(f"jitter is {jitter!r}; give True or False")
        object.__setattr__(self, "base", float(base))
        object.__setattr__(self, "cap", float(cap))
        object.__setattr__(self, "jitter", jitter)

    def delay(self, attempt: int) -> float:
        """Seconds to wait after run number ``attempt`` failed (before retry ``attempt``)."""
        # 2.0 ** 1023 is the largest power a float holds; beyond the cap anyway.
        longest = min(self.cap, self.base * 2.0 ** min(max(attempt, 1) - 1, 1023))
        return random.uniform(0.0, longest) if self.jitter else longest


def as_retry_strategy(value: object) -> RetryStrategy | None:
    """What a retry strategy function returned, checked: a RetryStrategy or None."""
    if value is None or isinstance(value, RetryStrategy):
        return value
    raise InvalidRetryStrategyError(
        f"the retry strategy function returned {value!r}; "
        "return a sqla_proletarian.RetryStrategy, or None for no retry"
    )

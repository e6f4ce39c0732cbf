"""sp.Snooze takes seconds or a timedelta, finite, from 0 to a week; anything else is
refused where it is raised, with what to give."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

import sqla_proletarian as sp
from sqla_proletarian.errors import MAX_SNOOZE_SECONDS


@pytest.mark.parametrize(
    ("given", "seconds"),
    [
        (0, 0.0),
        (30, 30.0),
        (1.5, 1.5),
        (timedelta(minutes=2), 120.0),
        (timedelta(days=7), MAX_SNOOZE_SECONDS),
        (MAX_SNOOZE_SECONDS, MAX_SNOOZE_SECONDS),
    ],
)
def test_a_snooze_takes_seconds_or_a_timedelta(given: float | timedelta, seconds: float) -> None:
    snooze = sp.Snooze(given)
    assert snooze.seconds == seconds
    assert snooze.delay == timedelta(seconds=seconds)
    assert isinstance(snooze, sp.ProletarianError)
    assert f"snoozed for {seconds:g} s" in str(snooze)


@pytest.mark.parametrize(
    "given",
    [
        -1,
        -0.001,
        timedelta(seconds=-1),
        math.nan,
        math.inf,
        MAX_SNOOZE_SECONDS + 1,
        timedelta(days=7, seconds=1),
        "30",
        None,
        True,
    ],
)
def test_a_snooze_of_a_bad_value_says_what_to_give(given: object) -> None:
    with pytest.raises(sp.ConfigurationError) as refused:
        sp.Snooze(given)  # type: ignore[arg-type]
    message = str(refused.value)
    assert message.startswith(f"Snooze({given!r}):")
    assert "a finite number or a timedelta from 0 to 604800 (a week)" in message

"""The pause between polls after transient database errors doubles and stays bounded."""

import itertools

from sqla_proletarian.polling import MAX_TRANSIENT_BACKOFF, MIN_TRANSIENT_BACKOFF, next_backoff


def test_the_first_pause_after_a_success_is_the_minimum() -> None:
    assert next_backoff(0.0) == MIN_TRANSIENT_BACKOFF


def test_each_further_pause_doubles_until_the_maximum_and_stays_there() -> None:
    pauses = [next_backoff(0.0)]
    for _ in range(12):
        pauses.append(next_backoff(pauses[-1]))
    assert pauses[:4] == [0.05, 0.1, 0.2, 0.4]
    assert max(pauses) == MAX_TRANSIENT_BACKOFF == 5.0
    assert pauses[-3:] == [MAX_TRANSIENT_BACKOFF] * 3
    assert all(b >= a for a, b in itertools.pairwise(pauses))

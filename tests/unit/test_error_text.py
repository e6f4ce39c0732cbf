"""The archive's error text cut to a bound in UTF-8 bytes: whole up to the bound, its head and
tail around a marker line beyond it, never a character split."""

from __future__ import annotations

import pytest

from sqla_proletarian.running import cut_middle


@pytest.mark.parametrize("character", ["a", "é", "€", "🙂"])
def test_text_of_exactly_the_bound_is_kept_and_one_byte_more_is_cut_within_it(
    character: str,
) -> None:
    limit = 12_000  # a whole number of 1, 2, 3 and 4-byte characters
    exact = character * (limit // len(character.encode()))

    assert cut_middle(exact, limit) == exact
    over = cut_middle(exact + "x", limit)
    assert len(over.encode()) <= limit and "cut here ...]" in over
    assert over.startswith(character * 100) and over.endswith(character * 100 + "x")


def test_lines_are_cut_whole_and_the_marker_counts_what_went() -> None:
    lines = [f"line {n:04}" for n in range(1000)]  # 10 bytes each with its line end

    kept = cut_middle("\n".join(lines), 2000).splitlines()

    [at] = [i for i, line in enumerate(kept) if line.startswith("[... ")]
    head, tail = kept[:at], kept[at + 1 :]
    assert head == lines[: len(head)] and tail == lines[len(lines) - len(tail) :]
    cut = len(lines) - len(head) - len(tail)
    assert kept[at] == f"[... {cut * 10:,} bytes ({cut:,} lines) cut here ...]"


def test_one_long_line_is_cut_inside_it_at_character_boundaries() -> None:
    text = "€" * 10_000

    kept = cut_middle(text, 1000)

    first, marker, last = kept.split("\n")
    assert set(first) == set(last) == {"€"} and marker.startswith("[... ")
    assert len(kept.encode()) <= 1000

"""The results of a run: rows of values over the rounds, printed as one table of medians
(min-max) and ratios, and written as Markdown."""

from __future__ import annotations

import re
import statistics
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import server_work

RESULTS = Path(__file__).resolve().parent / "results.md"
#: A section of the results file that one benchmark writes and the others keep.
_SECTION = re.compile(r"<!-- section: (\w+) -->\n.*?<!-- end section: \1 -->", re.DOTALL)


def library_commit() -> str:
    """The library's commit, and whether the work tree had changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "sqla_proletarian"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"
    return f"commit {rev}" + (" with uncommitted changes in sqla_proletarian/" if dirty else "")


def kept_sections(text: str) -> list[str]:
    """The marked sections of a results file, which a rewrite of the rest keeps."""
    return [match.group(0) for match in _SECTION.finditer(text)]


def write_section(path: Path, name: str, body: str) -> None:
    """Put ``body`` into the results file as section ``name``, in place of an earlier one."""
    section = f"<!-- section: {name} -->\n{body}\n<!-- end section: {name} -->"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    for match in _SECTION.finditer(text):
        if match.group(1) == name:
            path.write_text(text[: match.start()] + section + text[match.end() :])
            return
    path.write_text(text.rstrip("\n") + "\n\n" + section + "\n")


@dataclass
class Row:
    """One figure of one contender: a value per round, or why there is none."""

    section: str
    name: str
    unit: str
    ref: str | None = None
    values: list[float] = field(default_factory=list)
    note: str | None = None
    #: Further rows to give a ratio to (a name, or a name's start before its " (...)").
    also: tuple[str, ...] = ()
    #: What a drain counted over the rounds (extra handler runs, lost transactions...).
    counts: Counter[str] | None = None
    #: What the server did per job, a value per round by figure (benchmarks.server_work).
    work: dict[str, list[float]] = field(default_factory=dict)

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    def spread(self) -> str:
        if not self.values:
            return self.note or "n/a"
        text = _number(statistics.median(self.values), self.unit)
        if len(self.values) > 1:
            low, high = _number(min(self.values), self.unit), _number(max(self.values), self.unit)
            text += f" ({low}-{high})"
        return text

    def work_text(self) -> str:
        """The server's work per job, the median over the rounds of each figure."""
        if not self.work:
            return ""
        return server_work.text({name: statistics.median(v) for name, v in self.work.items()})


def _number(value: float, unit: str) -> str:
    if unit in ("ms", "MiB", "s"):
        return f"{value:,.1f}"
    return f"{value:,.0f}"


class Results:
    """Rows in the order they were first added, by (section, name)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], Row] = {}
        self.notes: list[str] = []

    def row(
        self, section: str, name: str, unit: str, ref: str | None = None, also: tuple[str, ...] = ()
    ) -> Row:
        key = (section, name)
        if key not in self.rows:
            self.rows[key] = Row(section, name, unit, ref, also=also)
        return self.rows[key]

    def add(
        self,
        section: str,
        name: str,
        value: float,
        unit: str,
        ref: str | None = None,
        also: tuple[str, ...] = (),
    ) -> None:
        self.row(section, name, unit, ref, also).values.append(value)

    def work(self, section: str, name: str, figures: dict[str, float] | None) -> None:
        """Add one round's server work per job to a row (``server_work.take()``)."""
        row = self.rows[(section, name)]
        for figure, value in (figures or {}).items():
            row.work.setdefault(figure, []).append(value)

    def count(self, section: str, name: str, counts: Counter[str]) -> None:
        """Add one round's counts to a row (kept even when they are all zero)."""
        row = self.rows[(section, name)]
        row.counts = row.counts or Counter()
        for key, n in counts.items():
            row.counts[key] += n

    def problems(self) -> list[str]:
        """The rows whose counts are not all zero, in words."""
        return [
            f"{row.section}: {row.name}: {counted(row.counts)}"
            for row in self.rows.values()
            if row.counts and any(row.counts.values())
        ]

    def missing(
        self, section: str, name: str, unit: str, note: str, ref: str | None = None
    ) -> None:
        self.row(section, name, unit, ref).note = note

    def best(
        self,
        section: str,
        name: str,
        among: list[str],
        ref: str | None = None,
        also: tuple[str, ...] = (),
    ) -> None:
        """A row repeating the best (highest median) of the named rows of a section, placed
        after the last of them."""
        rows = [self.rows[(section, n)] for n in among if (section, n) in self.rows]
        measured = [row for row in rows if row.values]
        if not measured:
            return
        top = max(measured, key=lambda row: row.median or 0.0)
        note = top.name.removeprefix("sqla-proletarian, ").removeprefix(f"{prefix(name)}, ")
        best = Row(section, name, top.unit, ref, list(top.values), note, also, top.counts, top.work)
        self.rows.pop((section, name), None)
        keys = list(self.rows)
        last = max(keys.index((row.section, row.name)) for row in rows)
        keys.insert(last + 1, (section, name))
        self.rows[(section, name)] = best
        self.rows = {key: self.rows[key] for key in keys}

    def _find(self, section: str, name: str) -> Row | None:
        """The row ``name`` of a section, or the one whose name is ``name (...)``."""
        found = self.rows.get((section, name))
        if found is not None:
            return found
        for (in_section, other), row in self.rows.items():
            if in_section == section and other.startswith(f"{name} ("):
                return row
        return None

    def ratio(self, row: Row) -> str:
        if row.median is None:
            return ""
        ratios = []
        for name in (row.ref, *row.also):
            ref = None if name is None else self._find(row.section, name)
            if ref is not None and ref.median:
                ratios.append(f"{row.median / ref.median:.2f}x {ref.name}")
        return "; ".join(ratios)

    def lines(self) -> list[tuple[str, str, str, str, str]]:
        """(name, median (min-max), server work per job, ratio, counts) per row, with a header
        line per section."""
        out: list[tuple[str, str, str, str, str]] = []
        section = None
        for row in self.rows.values():
            if row.section != section:
                section = row.section
                out.append((f"[{section}, {row.unit}]", "", "", "", ""))
            name = row.name if not (row.values and row.note) else f"{row.name} = {row.note}"
            line = (name, row.spread(), row.work_text(), self.ratio(row), counted(row.counts))
            out.append(line)
        return out

    def table(self) -> str:
        lines = self.lines()
        widths = [max(len(line[i]) for line in lines) for i in range(4)]
        text = []
        for name, spread, work, ratio, counts in lines:
            if not spread:
                text.append(name)
            else:
                work = f"  {work:<{widths[2]}}" if widths[2] else ""
                text.append(
                    f"  {name:<{widths[0]}}  {spread:>{widths[1]}}{work}  {ratio:<{widths[3]}}"
                    f"  {counts}".rstrip()
                )
        return "\n".join(text)

    def markdown(self) -> str:
        """The table in Markdown; a column of the server's work per job and one of counts when
        some row has them."""
        with_work = any(row.work for row in self.rows.values())
        with_counts = any(row.counts is not None for row in self.rows.values())
        head = ["figure", "median (min-max)"] + ["server per job (median)"] * with_work
        head += ["ratio"] + ["counted (all rounds)"] * with_counts
        align = "|---|---:|" + "---|" * with_work + "---|" + "---|" * with_counts
        text = ["| " + " | ".join(head) + " |", align]
        for name, spread, work, ratio, counts in self.lines():
            if not spread:
                cells = [f"**{name.strip('[]')}**", ""] + [""] * with_work + [""]
            else:
                cells = [name, spread] + [work] * with_work + [ratio]
            cells += [counts] * with_counts
            text.append("| " + " | ".join(cells) + " |")
        return "\n".join(text)


def counted(counts: Counter[str] | None) -> str:
    """``extra runs: 0, job-transaction-lost: 0, deadlocks: 0``, or nothing."""
    if counts is None:
        return ""
    return ", ".join(f"{name}: {n:,}" for name, n in counts.items())


def prefix(name: str) -> str:
    """A row name's part before its first comma (``sqla-proletarian lease_seconds=30``)."""
    return name.split(",", 1)[0]

"""The fault suite's report: one row per scenario and database, printed as a table at the
end of the run (see conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass

from fault_harness import Check, FaultDatabase


@dataclass
class Result:
    """One row of the report."""

    scenario: str
    database: str
    jobs: int
    faults: str
    lost: int
    duplicated: int
    unclean: int
    alive: str
    recover_s: float | None
    drain_s: float | None
    passed: bool = True


RESULTS: list[Result] = []


def record(
    scenario: str,
    db: FaultDatabase,
    check: Check,
    faults: str,
    alive: str,
    recover_s: float | None,
    drain_s: float | None,
    problems: list[str],
) -> None:
    RESULTS.append(
        Result(
            scenario=scenario,
            database=db.backend,
            jobs=check.jobs,
            faults=faults + (" + a restart by someone else" if check.disturbed else ""),
            lost=len(check.lost),
            duplicated=len(check.duplicated),
            unclean=check.unclean,
            alive=alive,
            recover_s=recover_s,
            drain_s=drain_s,
            passed=not problems,
        )
    )


def report_lines() -> list[str]:
    headers = (
        "scenario",
        "database",
        "jobs",
        "faults injected",
        "lost",
        "dup",
        "unclean",
        "alive",
        "recover s",
        "drain s",
        "ok",
    )
    rows = [
        (
            r.scenario,
            r.database,
            str(r.jobs),
            r.faults,
            str(r.lost),
            str(r.duplicated),
            str(r.unclean),
            r.alive,
            "-" if r.recover_s is None else f"{r.recover_s:.2f}",
            "-" if r.drain_s is None else f"{r.drain_s:.2f}",
            "yes" if r.passed else "NO",
        )
        for r in RESULTS
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]

    def fmt(cells: tuple[str, ...]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True))

    return [
        fmt(headers),
        fmt(tuple("-" * w for w in widths)),
        *(fmt(row) for row in rows),
        "",
        "dup: jobs whose handler ran to its end more often than their retries call for.",
        "unclean: runs that ended without an outcome (the archive's attempts beyond those",
        "the job's retries call for).",
        "alive: workers alive at the end / workers that should be (killed ones were replaced).",
        "recover s: from the end of the fault to the next job archived (scenario 7: to the",
        "timed-out job archived); drain s: from the end of the fault to an empty queue.",
    ]

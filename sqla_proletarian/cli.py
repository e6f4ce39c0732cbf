"""The ``sqla-proletarian`` command line."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run the command line."""
    raise SystemExit("sqla-proletarian: the command line is not built yet")

"""Lease mode counts every run: runs given back uncharged are counted on the job.

Revision ID: sqlap_0007
Revises: sqlap_0006
Create Date: 2026-12-06 00:00:00

``uncharged_runs`` on ``proletarian_job`` (0): a leased run whose connection was lost, or
that a stop gave up, is counted in ``attempts`` and here, so that it takes neither a retry
nor an unclean end. Queued jobs are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_proletarian.migrations import add_uncharged_runs, drop_uncharged_runs

revision: str = "sqlap_0007"
down_revision: str | Sequence[str] | None = "sqlap_0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add ``uncharged_runs`` to ``proletarian_job``."""
    add_uncharged_runs()


def downgrade() -> None:
    """Remove ``uncharged_runs``."""
    drop_uncharged_runs()

"""Give each run record the owner whose live session vouches for it.

Revision ID: sqlap_0002
Revises: sqlap_0001
Create Date: 2026-12-01 00:00:00

A run record counts as an unclean end only once its owner (a worker's database session, or
its process on SQLite) is gone. Records of 0.1 workers have no owner and are removed.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_proletarian.migrations import add_run_owners, drop_run_owners

revision: str = "sqlap_0002"
down_revision: str | Sequence[str] | None = "sqlap_0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add ``proletarian_job_run.owner``."""
    add_run_owners()


def downgrade() -> None:
    """Remove ``proletarian_job_run.owner``."""
    drop_run_owners()

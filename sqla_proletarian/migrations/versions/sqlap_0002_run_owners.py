"""Give each run record the owner whose live session vouches for it; notify enqueues.

Revision ID: sqlap_0002
Revises: sqlap_0001
Create Date: 2026-12-01 00:00:00

A run record counts as an unclean end only once its owner (a worker's database session, or
its process on SQLite) is gone. Records of 0.1 workers have no owner and are removed.
On PostgreSQL a trigger NOTIFYs the queues that got jobs, so listening workers wake at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_proletarian.migrations import (
    add_enqueue_notifications,
    add_run_owners,
    drop_enqueue_notifications,
    drop_run_owners,
)

revision: str = "sqlap_0002"
down_revision: str | Sequence[str] | None = "sqlap_0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add ``proletarian_job_run.owner`` and, on PostgreSQL, the enqueue trigger."""
    add_run_owners()
    add_enqueue_notifications()


def downgrade() -> None:
    """Remove the enqueue trigger and ``proletarian_job_run.owner``."""
    drop_enqueue_notifications()
    drop_run_owners()

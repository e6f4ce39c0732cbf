"""Keep the earlier ends of a job that ``retry_failed`` put back in the queue.

Revision ID: sqlap_0008
Revises: sqlap_0007
Create Date: 2026-12-06 00:00:00

A new table, ``proletarian_job_history`` (``seq``, ``job_id``, ``status``, ``attempts``,
``finished_at``, ``error``, indexed by ``job_id``), empty at first. The archive keeps its one
row per job id; queued and archived jobs are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_proletarian.migrations import add_job_history, drop_job_history

revision: str = "sqlap_0008"
down_revision: str | Sequence[str] | None = "sqlap_0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create ``proletarian_job_history``."""
    add_job_history()


def downgrade() -> None:
    """Drop ``proletarian_job_history`` and the ends it kept."""
    drop_job_history()

"""Job control: priorities, unique jobs, periodic schedules and paused queues.

Revision ID: sqlap_0004
Revises: sqlap_0003
Create Date: 2026-12-02 00:00:00

``proletarian_job`` gets ``run_order`` (the priority negated, so that the poll index reads
higher priorities first in ascending order) and ``unique_key`` (unique per queue while the
job is queued); the archive keeps ``run_order``. ``proletarian_periodic`` records each
schedule's last enqueued occurrence and ``proletarian_paused_queue`` the paused queues.
Queued jobs stay, with priority 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_proletarian.migrations import add_job_control, drop_job_control

revision: str = "sqlap_0004"
down_revision: str | Sequence[str] | None = "sqlap_0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add priorities, unique keys, and the periodic and paused-queue tables."""
    add_job_control()


def downgrade() -> None:
    """Remove them again; queued jobs stay."""
    drop_job_control()

"""Flow control: queue limits, concurrency keys, rate-limit starts and snoozes.

Revision ID: sqlap_0009
Revises: sqlap_0008
Create Date: 2026-12-06 00:00:00

``concurrency_key`` (NULL) and ``snoozes`` (0) on the job and archive tables; new tables
``proletarian_queue_limit``, ``proletarian_slot`` and ``proletarian_start``, empty at first.
Queued and archived jobs are otherwise untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_proletarian.migrations import add_flow_control, drop_flow_control

revision: str = "sqlap_0009"
down_revision: str | Sequence[str] | None = "sqlap_0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the flow-control columns and tables."""
    add_flow_control()


def downgrade() -> None:
    """Drop them: limits, concurrency keys and snooze counts are gone."""
    drop_flow_control()

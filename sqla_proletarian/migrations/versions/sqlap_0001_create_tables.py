"""Create the job, archived-job and job-run tables.

Revision ID: sqlap_0001
Revises:
Create Date: 2026-11-30 00:00:00

The DDL lives in ``sqla_proletarian.migrations.create_tables`` so that a user who keeps a
single head gets exactly this schema from a revision of their own.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_proletarian.migrations import create_tables, drop_tables

revision: str = "sqlap_0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = ("sqla_proletarian",)
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create the library's tables and indexes."""
    create_tables()


def downgrade() -> None:
    """Drop the library's tables."""
    drop_tables()

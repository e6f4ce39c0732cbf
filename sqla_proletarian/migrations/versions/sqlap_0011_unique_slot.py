"""Unique keys held by one generated column on MySQL and MariaDB.

Revision ID: sqlap_0011
Revises: sqlap_0010
Create Date: 2026-12-06 00:00:00

MySQL and MariaDB: ``unique_slot`` (a VIRTUAL column) on the job table with a unique index,
and the index on ``(queue, unique_key)`` no longer unique. Nothing changes on PostgreSQL and
SQLite. Queued jobs keep their keys.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_proletarian.migrations import add_unique_slot, drop_unique_slot

revision: str = "sqlap_0011"
down_revision: str | Sequence[str] | None = "sqlap_0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Hold unique keys in the generated column's unique index (MySQL and MariaDB)."""
    add_unique_slot()


def downgrade() -> None:
    """Make the index on (queue, unique_key) unique again."""
    drop_unique_slot()

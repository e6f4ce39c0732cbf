"""Keep a finished job's unique key in the archive, so a failure put back holds it again.

Revision ID: sqlap_0005
Revises: sqlap_0004
Create Date: 2026-12-03 00:00:00

A nullable ``proletarian_archived_job.unique_key``, written with every outcome;
``retry_failed`` puts a failed job back with its key. Jobs archived before the upgrade have
none, and queued jobs are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_proletarian.migrations import add_archived_unique_key, drop_archived_unique_key

revision: str = "sqlap_0005"
down_revision: str | Sequence[str] | None = "sqlap_0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add ``proletarian_archived_job.unique_key``."""
    add_archived_unique_key()


def downgrade() -> None:
    """Remove ``proletarian_archived_job.unique_key``."""
    drop_archived_unique_key()

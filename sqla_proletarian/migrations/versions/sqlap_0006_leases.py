"""Lease mode: jobs that run with no transaction open, under a lease their worker renews.

Revision ID: sqlap_0006
Revises: sqlap_0005
Create Date: 2026-12-04 00:00:00

Nullable ``lease_token``, ``lease_owner``, ``heartbeat_at``, ``due_at`` and
``cancel_requested_at`` on ``proletarian_job``, and ``unclean_ends`` (0). Queued jobs are
untouched; no index is added (a leased job's ``process_at`` is its lease's expiry).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_proletarian.migrations import add_leases, drop_leases

revision: str = "sqlap_0006"
down_revision: str | Sequence[str] | None = "sqlap_0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the lease columns to ``proletarian_job``."""
    add_leases()


def downgrade() -> None:
    """Remove the lease columns; a leased job is due again at its own time."""
    drop_leases()

"""Workflows, results and progress: dependencies between jobs, stored results, progress.

Revision ID: sqlap_0010
Revises: sqlap_0009
Create Date: 2026-12-06 00:00:00

``waiting_on`` (0) on the job table and ``result`` (NULL) on the archive; new tables
``proletarian_dependency`` and ``proletarian_progress``, empty at first. Queued and archived
jobs are otherwise untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_proletarian.migrations import add_workflows, drop_workflows

revision: str = "sqlap_0010"
down_revision: str | Sequence[str] | None = "sqlap_0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the workflow columns and tables."""
    add_workflows()


def downgrade() -> None:
    """Drop them: dependencies, results and progress are gone."""
    drop_workflows()

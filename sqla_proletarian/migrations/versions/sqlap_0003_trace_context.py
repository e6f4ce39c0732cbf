"""Keep the trace context of the code that enqueued a job, so its run joins the same trace.

Revision ID: sqlap_0003
Revises: sqlap_0002
Create Date: 2026-12-01 12:00:00

A nullable ``proletarian_job.trace_context`` (W3C trace context headers as JSON), written at
enqueue when OpenTelemetry is installed; jobs queued before the upgrade simply have none.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_proletarian.migrations import add_trace_context, drop_trace_context

revision: str = "sqlap_0003"
down_revision: str | Sequence[str] | None = "sqlap_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add ``proletarian_job.trace_context``."""
    add_trace_context()


def downgrade() -> None:
    """Remove ``proletarian_job.trace_context``."""
    drop_trace_context()

"""Write the library's schema changes into an Alembic project's own history, on its head.

A project that keeps one head does not list the library's version location: its own
revision calls the library's migration helpers instead. :func:`write_revision` writes that
revision, on the project's single head, for the library revisions its history does not
apply yet (all of them the first time, a new release's afterwards), so plain ``alembic
upgrade head`` and ``alembic revision --autogenerate`` keep working.
"""

from __future__ import annotations

import ast
import logging
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from sqla_proletarian.errors import ConfigurationError
from sqla_proletarian.logs import log_event
from sqla_proletarian.migrations import REVISION_HELPERS

if TYPE_CHECKING:
    from alembic.script import ScriptDirectory

__all__ = ["applied_revisions", "tables_are_current", "write_revision"]

_TEMPLATE = '''\
"""The job queue's tables: sqla-proletarian's {covered}.

Written by `sqla-proletarian alembic-revision`. Each call is the frozen schema change of one
library revision; a later release's revisions go into a later revision of this project,
written by the same command.

Revision ID: {revision}
Revises: {down_revision}
Create Date: {created}
"""

from sqla_proletarian.migrations import (
{imports}
)

revision = "{revision}"
down_revision = {down_revision_value}
branch_labels = None
depends_on = None


def upgrade() -> None:
{upgrades}


def downgrade() -> None:
{downgrades}
'''


def write_revision(path: str | Path) -> Path | None:
    """Write a revision into the Alembic project at ``path`` (its ``alembic.ini``, its
    environment folder or its versions folder) that applies the library revisions its
    history lacks, on top of its single head; return the file written, or ``None`` when
    the history already applies every library revision.

    Refused, writing nothing: a history with several heads (merge them first), and one that
    lists the library's own revisions (its version location is already in the project).
    """
    from alembic.util import CommandError, rev_id

    try:
        script, folder = _script_directory(Path(path))
        heads = script.get_heads()
        revisions = list(script.walk_revisions())
    except CommandError as exc:
        raise ConfigurationError(f"{path}: {exc}") from None
    ours = sorted(head for head in heads if head.startswith("sqlap_"))
    if ours:
        raise ConfigurationError(
            f"{path}: the project lists the library's own revisions ({ours[0]} is a head): it "
            "takes the library's branch with `alembic upgrade heads`; remove "
            "sqla_proletarian.migrations:versions from its version_locations to keep one head"
        )
    if len(heads) > 1:
        raise ConfigurationError(
            f"{path}: the history has {len(heads)} heads ({', '.join(sorted(heads))}): merge "
            "them first (`alembic merge heads`), then write the library's revision on top"
        )
    applied = applied_revisions(Path(str(revision.path)) for revision in revisions)
    missing = [step for step in REVISION_HELPERS if step[0] not in applied]
    if not missing:
        return None
    head = heads[0] if heads else None
    if head is not None:
        head_script = script.get_revision(head)
        assert head_script is not None
        folder = Path(str(head_script.path)).parent
    revision = rev_id()
    covered = missing[0][0] if len(missing) == 1 else f"{missing[0][0]} to {missing[-1][0]}"
    upgrades = [(name, number) for number, ups, _ in missing for name in ups]
    downgrades = [name for _, _, downs in reversed(missing) for name in downs]
    text = _TEMPLATE.format(
        covered=f"revision {covered}" if len(missing) == 1 else f"revisions {covered}",
        revision=revision,
        down_revision=head or "",
        down_revision_value=f'"{head}"' if head else "None",
        created=datetime.now(UTC).isoformat(sep=" ", timespec="seconds"),
        imports="\n".join(
            f"    {name}," for name in sorted({*(n for n, _ in upgrades), *downgrades})
        ),
        upgrades="\n".join(f"    {name}()  # {number}" for name, number in upgrades),
        downgrades="\n".join(f"    {name}()" for name in downgrades),
    )
    target = folder / f"{revision}_sqla_proletarian_{missing[-1][0].removeprefix('sqlap_')}.py"
    target.write_text(text)
    log_event(
        logging.INFO,
        "alembic-revision-written",
        path=str(target),
        down_revision=head,
        applies=",".join(number for number, _, _ in missing),
    )
    return target


def applied_revisions(paths: Iterable[Path]) -> set[str]:
    """The library revisions whose every helper the ``upgrade()`` of one of these revision
    files calls (a revision this module wrote, or one written by hand)."""
    called: set[str] = set()
    for path in paths:
        called |= _upgrade_calls(path)
    return {number for number, ups, _ in REVISION_HELPERS if set(ups) <= called}


def _upgrade_calls(path: Path) -> set[str]:
    """The names of the functions that ``upgrade()`` of a revision file calls."""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return set()  # sourceless or unreadable: Alembic reports it itself
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "upgrade":
            for call in ast.walk(node):
                if isinstance(call, ast.Call):
                    func = call.func
                    if isinstance(func, ast.Name):
                        names.add(func.id)
                    elif isinstance(func, ast.Attribute):
                        names.add(func.attr)
    return names


def _script_directory(path: Path) -> tuple[ScriptDirectory, Path]:
    """The project's revisions at ``path``, and the folder a first revision goes into."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    if path.is_file():
        config = Config(str(path))
        script = ScriptDirectory.from_config(config)
        return script, Path(script._version_locations[0])
    if not path.is_dir():
        raise ConfigurationError(
            f"{path}: no such file or folder: give the project's alembic.ini, its environment "
            "folder (with env.py) or its versions folder"
        )
    if (path / "env.py").is_file() and (path / "versions").is_dir():
        path = path / "versions"
    return ScriptDirectory(str(path.parent), version_locations=[str(path)]), path


def tables_are_current(conn: Connection) -> bool:
    """Whether the library's tables all exist with every column this version's models
    know (and, on MySQL and MariaDB, the job table's unique slot, which they do not): made
    by a project's own revision, they carry no library revision to compare."""
    from sqla_proletarian.models import JOB_TABLE, UNIQUE_SLOT, metadata

    inspector = sa.inspect(conn)
    mysql = conn.dialect.name in ("mysql", "mariadb")
    for table in metadata.sorted_tables:
        if not inspector.has_table(table.name):
            return False
        present = {column["name"] for column in inspector.get_columns(table.name)}
        expected = set(table.columns.keys())
        if mysql and table.name == JOB_TABLE:
            expected.add(UNIQUE_SLOT)
        if not expected <= present:
            return False
    return True

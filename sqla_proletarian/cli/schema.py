"""``install``: create or upgrade the library's tables."""

from __future__ import annotations

import argparse

from sqla_proletarian.cli.common import PROG, Command, _database
from sqla_proletarian.maintenance import install_tables
from sqla_proletarian.supervisor import EXIT_OK


def install(args: argparse.Namespace) -> int:
    from sqla_proletarian.migrations import BRANCH_LABEL, HEAD_REVISION

    with _database(args) as engine:
        applied = install_tables(engine)
    if applied:
        print(f"installed {', '.join(applied)}: the library's tables are at {HEAD_REVISION}")
    else:
        print(f"the library's tables are up to date ({HEAD_REVISION}, branch {BRANCH_LABEL})")
    return EXIT_OK


INSTALL = Command(
    "install",
    "create or upgrade the library's tables (its Alembic migrations, in alembic_version)",
    f"{PROG} install --url postgresql+psycopg://app@db/app",
    (),
    install,
    "For a database without an Alembic project of its own. To use your own Alembic\n"
    "project later, add sqla_proletarian.migrations:versions to its version_locations:\n"
    "`alembic upgrade heads` then finds the library's revisions applied.",
)

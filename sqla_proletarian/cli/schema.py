"""``install``: create or upgrade the library's tables; ``alembic-revision``: write the
revision that does it into an Alembic project's own history."""

from __future__ import annotations

import argparse
from pathlib import Path

from sqla_proletarian.cli.common import PROG, Command, _database
from sqla_proletarian.maintenance import install_tables
from sqla_proletarian.supervisor import EXIT_OK


def install(args: argparse.Namespace) -> int:
    from sqla_proletarian.migrations import HEAD_REVISION

    with _database(args) as engine:
        applied = install_tables(engine)
    if applied:
        print(f"installed {', '.join(applied)}: the library's tables are at {HEAD_REVISION}")
    else:
        print(f"the library's tables are up to date ({HEAD_REVISION})")
    return EXIT_OK


INSTALL = Command(
    "install",
    "create or upgrade the library's tables (its Alembic migrations, in alembic_version)",
    f"{PROG} install --url postgresql+psycopg://app@db/app",
    (),
    install,
    "For a database without an Alembic project of its own (with one, see alembic-revision).\n"
    "A database whose own Alembic history made the library's tables as this version has\n"
    "them is up to date. To use your own Alembic project later, add\n"
    "sqla_proletarian.migrations:versions to its version_locations: `alembic upgrade heads`\n"
    "then finds the library's revisions applied.",
)


def alembic_revision(args: argparse.Namespace) -> int:
    from sqla_proletarian.migrations import HEAD_REVISION
    from sqla_proletarian.migrations.revision import write_revision

    written = write_revision(args.path)
    if written is None:
        print(
            f"{args.path}: the project's history already applies the library's revisions "
            f"up to {HEAD_REVISION}: nothing written"
        )
    else:
        shown = written.relative_to(Path.cwd()) if written.is_relative_to(Path.cwd()) else written
        print(f"wrote {shown}: run `alembic upgrade head`")
    return EXIT_OK


ALEMBIC_REVISION = Command(
    "alembic-revision",
    "write a revision of your Alembic project that makes the library's tables, on its head",
    f"{PROG} alembic-revision alembic.ini",
    (
        (
            ("path",),
            {
                "metavar": "PATH",
                "help": "the project's alembic.ini, its environment folder or its versions folder",
            },
        ),
    ),
    alembic_revision,
    "The revision calls the library's migration helpers (sqla_proletarian.migrations) for\n"
    "each library revision the project's history does not apply yet, with down_revision the\n"
    "project's single head: the history keeps one head, and `alembic upgrade head` applies\n"
    "it. Run it again after upgrading the package: it writes the new revisions' calls, or\n"
    "nothing. No database is opened.",
)

"""Alembic environment that installs sqla-proletarian's tables into one database.

The database URL comes from ``-x url=...``, else from ``SP_DATABASE_URL``, else from
``sqlalchemy.url`` in the ini file. A program can instead hand over an open connection as
``config.attributes["connection"]`` (Alembic's "sharing a connection" recipe).
"""

from __future__ import annotations

import os
from logging.config import fileConfig
from typing import Any

import sqlalchemy as sa
from alembic import context
from sqlalchemy.schema import SchemaItem

import sqla_proletarian as sp
from sqla_proletarian.models import compared_on

config = context.config

# Leave logging alone when a program runs the commands in-process and says so.
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = sp.metadata


def only_library_tables(
    obj: SchemaItem, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """Autogenerate here concerns the library's tables only, never the rest of the database."""
    return not sp.include_object(obj, name, type_, reflected, compare_to)


def database_url() -> str:
    url = (
        context.get_x_argument(as_dictionary=True).get("url")
        or os.environ.get("SP_DATABASE_URL")
        or config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise SystemExit(
            "No database URL: pass `-x url=dialect+driver://user@host/dbname` "
            "or set SP_DATABASE_URL."
        )
    return url


def configure(**options: Any) -> None:
    connection = options.get("connection")
    # What a server's schema holds beyond the MetaData (MySQL's unique slot) is left out.
    on_server = compared_on(connection.dialect) if connection is not None else None

    def include_object(
        obj: SchemaItem, name: str | None, type_: str, reflected: bool, compare_to: Any
    ) -> bool:
        return only_library_tables(obj, name, type_, reflected, compare_to) and (
            on_server is None or on_server(obj, name, type_, reflected, compare_to)
        )

    context.configure(
        target_metadata=target_metadata,
        include_object=include_object,
        compare_type=True,
        **options,
    )


def run_migrations_offline() -> None:
    """Write the SQL to standard output (``--sql``) instead of running it."""
    configure(url=database_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = sa.create_engine(database_url(), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as connection:
            configure(connection=connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()

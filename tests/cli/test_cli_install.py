"""``sqla-proletarian install``: the library's migrations applied to a database without an
Alembic project, recorded in ``alembic_version`` so that an Alembic project that later lists
the library's version location finds them applied; idempotent, upgrading older revisions,
refusing databases whose history is not the library's alone."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from cli_support import cli, url_of

import sqla_proletarian as sp
import sqla_proletarian.migrations as spm
from sqla_proletarian.maintenance import install_tables
from sqla_proletarian.models import compared_on

if TYPE_CHECKING:
    from conftest import Database

REPO = Path(__file__).resolve().parents[2]

APP_ENV = """
from alembic import context

config = context.config
applied = config.attributes["applied"]
context.configure(
    connection=config.attributes["connection"],
    on_version_apply=lambda ctx, step, heads, run_args: applied.append(step.up_revision_id),
)
with context.begin_transaction():
    context.run_migrations()
"""

APP_REVISION = '''
"""The app's own table."""

import sqlalchemy as sa
from alembic import op

revision = "app_0001"
down_revision = None
branch_labels = ("app",)
depends_on = None


def upgrade():
    op.create_table("account", sa.Column("id", sa.Integer(), primary_key=True))


def downgrade():
    op.drop_table("account")
'''


def versions(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(MigrationContext.configure(conn).get_current_heads())


def only_library_tables(obj: Any, name: str | None, type_: str, *args: Any) -> bool:
    return not sp.include_object(obj, name, type_, *args)


def library_differences(engine: sa.Engine) -> list[Any]:
    """What autogenerate would change in the library's tables (and only those), leaving out
    what the server's schema holds beyond the models (MySQL's unique slot)."""
    on_server = compared_on(engine.dialect)

    def included(obj: Any, name: str | None, type_: str, *args: Any) -> bool:
        return only_library_tables(obj, name, type_, *args) and on_server(obj, name, type_, *args)

    options = {"compare_type": True, "include_object": included}
    with engine.connect() as conn:
        return list(compare_metadata(MigrationContext.configure(conn, opts=options), sp.metadata))


def app_project(root: Path) -> Config:
    """An app's Alembic project that adds the library's version location, as
    docs/howto/alembic.md says to."""
    (root / "migrations" / "versions").mkdir(parents=True)
    (root / "migrations" / "env.py").write_text(APP_ENV)
    (root / "migrations" / "versions" / "app_0001.py").write_text(APP_REVISION)
    (root / "alembic.ini").write_text(
        textwrap.dedent(
            """\
            [alembic]
            script_location = %(here)s/migrations
            path_separator = newline
            version_locations =
                %(here)s/migrations/versions
                sqla_proletarian.migrations:versions
            """
        )
    )
    return Config(str(root / "alembic.ini"))


VERSIONS = Path(spm.VERSION_LOCATION)


def library_revisions() -> list[str]:
    """The library's revisions, oldest first, from its version folder."""
    return sorted("_".join(path.stem.split("_")[:2]) for path in VERSIONS.glob("sqlap_*.py"))


def test_install_twice_then_an_app_project_sees_no_pending_library_revision(
    empty_database: Database, tmp_path: Path
) -> None:
    """The first install applies every revision, the second none; the app's own Alembic
    project, with the library's version location added, has nothing of the library's left
    to run, and `upgrade heads` runs only the app's revision."""
    url = url_of(empty_database)
    first = cli("install", "--url", url)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == (
        f"installed {', '.join(library_revisions())}: "
        f"the library's tables are at {spm.HEAD_REVISION}"
    )
    again = cli("install", "--url", url)
    assert again.returncode == 0, again.stderr
    assert "up to date" in again.stdout
    engine = empty_database.engine()
    assert versions(engine) == {spm.HEAD_REVISION}
    assert library_differences(engine) == []

    config = app_project(tmp_path)
    script = ScriptDirectory.from_config(config)
    pending = list(script.iterate_revisions(f"{spm.BRANCH_LABEL}@head", versions(engine)))
    assert pending == []
    applied: list[str] = []
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        config.attributes["applied"] = applied
        command.upgrade(config, "heads")
    assert applied == ["app_0001"]
    assert versions(engine) == {spm.HEAD_REVISION, "app_0001"}
    assert sa.inspect(engine).has_table("account")
    assert library_differences(engine) == []


def test_install_upgrades_a_database_at_an_older_library_revision(
    empty_database: Database,
) -> None:
    """A database the library's own environment left at sqlap_0001 gets the rest."""
    engine = empty_database.engine()
    config = Config(str(REPO / "alembic.ini"))
    config.attributes["configure_logger"] = False
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, spm.INITIAL_REVISION)
    assert install_tables(engine) == library_revisions()[1:]
    assert versions(engine) == {spm.HEAD_REVISION}
    assert library_differences(engine) == []
    assert install_tables(engine) == []


def test_install_refuses_tables_made_without_migrations_and_foreign_histories(
    tmp_path: Path,
) -> None:
    """Tables from metadata.create_all, and an alembic_version of another project, are
    refused with advice, and nothing is changed (the same checks on every backend)."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'made.db'}")
    sp.metadata.create_all(engine)
    with pytest.raises(sp.ProletarianError, match=r"metadata\.create_all.*alembic stamp"):
        install_tables(engine)
    assert versions(engine) == set()

    other = sa.create_engine(f"sqlite:///{tmp_path / 'other.db'}")
    with other.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        conn.exec_driver_sql("INSERT INTO alembic_version VALUES ('app_0001')")
    with pytest.raises(sp.ProletarianError, match=r"another Alembic project \(app_0001\)"):
        install_tables(other)
    assert not sa.inspect(other).has_table("proletarian_job")
    with other.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = 'sqlap_9999'")
    with pytest.raises(sp.ProletarianError, match=r"sqlap_9999.*upgrade the package"):
        install_tables(other)
    engine.dispose()
    other.dispose()

"""``sqla-proletarian alembic-revision``: the library's tables in an existing Alembic project's
own history, on its single head, so that plain ``alembic upgrade head`` and ``alembic revision
--autogenerate`` keep working; and ``install`` then finds the tables up to date."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.operations import Operations
from alembic.script import ScriptDirectory
from sqlalchemy.orm import Session

import sqla_proletarian as sp
import sqla_proletarian.migrations as spm
from sqla_proletarian.cli import main
from sqla_proletarian.maintenance import install_tables
from sqla_proletarian.models import UNIQUE_SLOT

if TYPE_CHECKING:
    from conftest import Database

ALEMBIC = [sys.executable, "-m", "alembic"]

MODELS = """\
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class User(Base):
    __tablename__ = "users"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(sa.String(200))
"""

#: docs/howto/alembic.md's env.py, online mode: the app's models, the library's filter.
ENV = """\
import os

import sqlalchemy as sa
from alembic import context

import sqla_proletarian as sp
from models import Base

engine = sa.create_engine(os.environ["DATABASE_URL"], poolclass=sa.pool.NullPool)
with engine.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        include_object=sp.include_object,
    )
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
"""


def project(root: Path) -> Path:
    """A fresh Alembic project (``alembic init``) with the app's models and the docs' env.py."""
    ini = root / "alembic.ini"
    config = Config(str(ini))
    command.init(config, str(root / "migrations"))  # writes alembic.ini and the template
    (root / "migrations" / "env.py").write_text(ENV)
    (root / "models.py").write_text(MODELS)
    return ini


def alembic(root: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Plain ``alembic ARGS`` in the project's folder, as its developers run it."""
    pythonpath = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(root)]))
    done = subprocess.run(
        [*ALEMBIC, *args],
        cwd=root,
        env={**os.environ, "DATABASE_URL": url, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The ``sqla-proletarian`` command line, in this process: what it printed."""
    capsys.readouterr()
    status = main(list(args))
    out, err = capsys.readouterr()
    assert status == 0, (status, out, err)
    return out


def heads(root: Path) -> list[str]:
    return ScriptDirectory.from_config(Config(str(root / "alembic.ini"))).get_heads()


def test_revision_on_the_projects_head_keeps_plain_upgrade_head_and_autogenerate_working(
    empty_database: Database, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An existing project with its own revision: the command writes the library's revision
    on its head; `alembic upgrade head` makes the library's tables as the models have them,
    the next `alembic revision --autogenerate` is empty and the history has one head, and
    `install` says the tables are up to date, changing nothing."""
    url = empty_database.url.render_as_string(hide_password=False)
    root = tmp_path / "app"
    root.mkdir()
    project(root)
    alembic(root, url, "revision", "--autogenerate", "-m", "users")
    [own] = heads(root)

    printed = cli(capsys, "alembic-revision", str(root / "alembic.ini"))
    [written] = [
        path for path in (root / "migrations" / "versions").glob("*.py") if own not in path.name
    ]
    assert printed == f"wrote {written}: run `alembic upgrade head`\n"
    script = ScriptDirectory.from_config(Config(str(root / "alembic.ini")))
    [head] = script.get_heads()
    assert head != own
    assert script.get_revision(head).down_revision == own  # type: ignore[union-attr]

    alembic(root, url, "upgrade", "head")
    engine = empty_database.engine()
    try:
        inspector = sa.inspect(engine)
        # MySQL's job table has its unique slot beyond the models (unique_slot_ddl).
        mysql = engine.dialect.name in ("mysql", "mariadb")
        for table in sp.metadata.sorted_tables:
            columns = {column["name"] for column in inspector.get_columns(table.name)}
            extra = {UNIQUE_SLOT} if mysql and table.name == "proletarian_job" else set()
            assert columns == set(table.columns.keys()) | extra, table.name
        with engine.connect() as conn:
            recorded = set(conn.scalars(sa.text("SELECT version_num FROM alembic_version")))
        assert recorded == {head}

        done = alembic(root, url, "revision", "--autogenerate", "-m", "next")
        assert "Detected" not in done.stderr, done.stderr  # nothing to add, nothing to drop
        assert len(heads(root)) == 1
        [following] = (root / "migrations" / "versions").glob("*_next.py")
        assert "proletarian" not in following.read_text()

        assert cli(capsys, "--url", url, "install") == (
            f"the library's tables are up to date ({spm.HEAD_REVISION})\n"
        )
        assert install_tables(engine) == []
        with engine.connect() as conn:
            assert set(conn.scalars(sa.text("SELECT version_num FROM alembic_version"))) == {head}
        assert cli(capsys, "alembic-revision", str(root / "migrations")) == (
            f"{root / 'migrations'}: the project's history already applies the library's "
            f"revisions up to {spm.HEAD_REVISION}: nothing written\n"
        )

        with Session(engine) as session:  # the queue works on the tables the project made
            sp.enqueue(session, "hello", {"from": "the project's history"})
            session.commit()
        assert sp.process_next_job(engine, lambda job_type, payload: None)
    finally:
        engine.dispose()


HAND_WRITTEN = '''\
"""The queue's tables, written by hand up to sqlap_0005."""

from alembic import op

from sqla_proletarian import migrations

revision = "app_0002"
down_revision = "app_0001"
branch_labels = None
depends_on = None


def upgrade():
    migrations.create_tables(op)
    migrations.add_run_owners(op)
    migrations.add_enqueue_notifications(op)
    migrations.add_trace_context(op)
    migrations.add_job_control(op)
    migrations.add_archived_unique_key(op)


def downgrade():
    migrations.drop_tables(op)
'''

FIRST = '''\
"""The app's first revision."""

revision = "app_0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade():
    pass


def downgrade():
    pass
'''


def versions_folder(root: Path, *files: tuple[str, str]) -> Path:
    folder = root / "versions"
    folder.mkdir(parents=True)
    for name, text in files:
        (folder / name).write_text(text)
    return folder


def test_a_later_release_gets_a_revision_with_only_the_library_revisions_the_history_lacks(
    tmp_path: Path,
) -> None:
    """A history whose own revision applies the library up to sqlap_0005 gets a revision on
    its head that applies the later ones (sqlap_0006 on), and then nothing more."""
    from sqla_proletarian.migrations.revision import write_revision

    folder = versions_folder(tmp_path, ("app_0001.py", FIRST), ("app_0002.py", HAND_WRITTEN))
    written = write_revision(folder)
    assert written is not None and written.parent == folder
    text = written.read_text()
    assert 'down_revision = "app_0002"' in text
    body = text.split("def upgrade() -> None:\n", 1)[1]
    assert [line.strip() for line in body.split("\n\n\n")[0].strip().splitlines()] == [
        "add_leases()  # sqlap_0006",
        "add_uncharged_runs()  # sqlap_0007",
        "add_job_history()  # sqlap_0008",
        "add_flow_control()  # sqlap_0009",
        "add_workflows()  # sqlap_0010",
        "add_unique_slot()  # sqlap_0011",
    ]
    assert (
        "    drop_unique_slot()\n    drop_workflows()\n    drop_flow_control()\n"
        "    drop_job_history()\n"
        "    drop_uncharged_runs()\n"
        "    drop_leases()\n" in text
    )
    script = ScriptDirectory(str(tmp_path), version_locations=[str(folder)])
    assert len(script.get_heads()) == 1
    assert write_revision(folder) is None


def test_a_history_with_several_heads_or_the_librarys_branch_is_refused_with_advice(
    tmp_path: Path,
) -> None:
    """Several heads: merge them first. The library's version location listed: the project
    already takes the library's branch. Nothing is written."""
    from sqla_proletarian.migrations.revision import write_revision

    other = FIRST.replace("app_0001", "app_0009")
    folder = versions_folder(tmp_path / "two", ("a.py", FIRST), ("b.py", other))
    with pytest.raises(sp.ConfigurationError, match=r"2 heads \(app_0001, app_0009\).*merge"):
        write_revision(folder)
    assert sorted(path.name for path in folder.iterdir()) == ["a.py", "b.py"]

    root = tmp_path / "branch"
    root.mkdir()
    (root / "alembic.ini").write_text(
        textwrap.dedent(
            f"""\
            [alembic]
            script_location = {root / "migrations"}
            path_separator = newline
            version_locations =
                {versions_folder(root / "migrations", ("a.py", FIRST))}
                sqla_proletarian.migrations:versions
            """
        )
    )
    with pytest.raises(sp.ConfigurationError, match=r"library's own revisions.*version_locations"):
        write_revision(root / "alembic.ini")
    with pytest.raises(sp.ConfigurationError, match=r"no such file or folder"):
        write_revision(tmp_path / "missing")


def test_every_library_revision_has_its_helpers_in_order() -> None:
    """REVISION_HELPERS names each revision of the library's branch, oldest first, and
    helpers the package exports: what the command writes covers the whole schema."""
    script = ScriptDirectory(
        str(Path(spm.VERSION_LOCATION).parent), version_locations=[spm.VERSION_LOCATION]
    )
    revisions = [revision.revision for revision in script.walk_revisions()][::-1]
    assert [number for number, _, _ in spm.REVISION_HELPERS] == revisions
    assert revisions[-1] == spm.HEAD_REVISION
    for _, ups, downs in spm.REVISION_HELPERS:
        for name in (*ups, *downs):
            assert name in spm.__all__ and callable(getattr(spm, name)), name


def test_install_on_a_projects_history_without_the_current_tables_points_at_the_command(
    tmp_path: Path,
) -> None:
    """A database whose alembic_version holds a project's revision and whose library tables
    are missing or older than the package: install refuses, changing nothing, and names
    `alembic-revision`; once the tables have every column, it is up to date."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'app.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        conn.exec_driver_sql("INSERT INTO alembic_version VALUES ('app_0001')")
    sp.metadata.tables["proletarian_job"].create(engine)
    with pytest.raises(sp.ProletarianError, match=r"app_0001.*alembic-revision"):
        install_tables(engine)
    assert set(sa.inspect(engine).get_table_names()) == {"alembic_version", "proletarian_job"}

    sp.metadata.create_all(engine)
    assert install_tables(engine) == []
    with engine.connect() as conn:
        assert conn.scalar(sa.text("SELECT version_num FROM alembic_version")) == "app_0001"
    engine.dispose()


def test_install_on_a_projects_history_at_sqlap_0010_wants_the_unique_slot_on_mysql(
    empty_database: Database,
) -> None:
    """A project whose own revisions called the helpers up to sqlap_0010: on MySQL and
    MariaDB its job table lacks the unique slot of sqlap_0011, so install refuses and names
    `alembic-revision`; once its revision calls add_unique_slot, it is up to date. On the
    other servers sqlap_0011 changes nothing: up to date at once."""
    engine = empty_database.engine()
    with engine.begin() as conn:
        ops = Operations(MigrationContext.configure(conn))
        for revision, helpers, _ in spm.REVISION_HELPERS:
            if revision != "sqlap_0011":
                for helper in helpers:
                    getattr(spm, helper)(ops)
        conn.exec_driver_sql("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        conn.exec_driver_sql("INSERT INTO alembic_version VALUES ('app_0001')")
    if engine.dialect.name in ("mysql", "mariadb"):
        with pytest.raises(sp.ProletarianError, match=r"app_0001.*alembic-revision"):
            install_tables(engine)
        with engine.begin() as conn:
            spm.add_unique_slot(Operations(MigrationContext.configure(conn)))
    assert install_tables(engine) == []

"""examples/flask_sqlalchemy_app.py on every backend: ``db.session`` enqueues in the request's
transaction (a request that commits leaves exactly one job, one that fails leaves none), and
``db.engine`` runs the jobs, from ``flask run-jobs`` in-process or as a worker process. The
Flask how-to's own app (docs/howto/outbox-flask.md) and this example run their jobs under the
command-line worker, inside the app's context."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from helpers import archived, archived_job, count, jobs, wait_for
from sqlalchemy.orm import Session

import sqla_proletarian as sp

if TYPE_CHECKING:
    from conftest import Database

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "flask_sqlalchemy_app.py"
HOWTO = ROOT / "docs" / "howto" / "outbox-flask.md"


def load_example() -> ModuleType:
    """Import the example once, as module ``sp_example_flask_sqlalchemy_app``."""
    name = "sp_example_flask_sqlalchemy_app"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # declarative models resolve their annotations here
    spec.loader.exec_module(module)
    return module


class App:
    """The example's app on one database, and the engine Flask-SQLAlchemy made for it."""

    def __init__(self, example: ModuleType, url: str) -> None:
        self.example = example
        self.url = url
        self.flask = example.create_app(url)
        with self.flask.app_context():
            self.engine: sa.Engine = example.db.engine

    def orders(self) -> int:
        return count(self.engine, self.example.Order)


@pytest.fixture
def app(empty_database: Database) -> Iterator[App]:
    """The example on a fresh, empty database: create_app installs every table itself."""
    app = App(load_example(), empty_database.url.render_as_string(hide_password=False))
    try:
        yield app
    finally:
        app.engine.dispose()


def test_request_that_commits_enqueues_exactly_one_job_with_its_order(app: App) -> None:
    response = app.flask.test_client().post("/orders", json={"item": "tea"})
    assert response.status_code == 201, response.get_data(as_text=True)
    body = response.get_json()
    [job] = jobs(app.engine)
    assert job.job_id == uuid.UUID(body["job_id"])
    assert job.job_type == "confirm-order"
    assert sp.JsonSerializer().loads(job.payload) == {"order_id": body["order_id"]}
    assert app.orders() == 1


def test_request_that_aborts_after_enqueueing_leaves_no_job_and_no_order(app: App) -> None:
    """An import aborts (422) at its third item, after two orders and their jobs were
    flushed: none of them commits, and the next request starts from a clean session."""
    client = app.flask.test_client()
    response = client.post("/orders/import", json={"items": ["tea", "coffee", ""]})
    assert response.status_code == 422
    assert app.orders() == 0
    assert count(app.engine, sp.Job) == 0

    assert client.post("/orders/import", json={"items": ["tea", "coffee"]}).status_code == 201
    assert app.orders() == 2
    assert count(app.engine, sp.Job) == 2


def test_request_that_raises_after_enqueueing_leaves_no_job(app: App) -> None:
    """A view that raises (a 500) after enqueueing through db.session commits nothing."""
    example = app.example

    def order_then_crash() -> str:
        example.place_order("tea")
        raise RuntimeError("the stock service timed out")

    app.flask.add_url_rule("/crash", "crash", order_then_crash, methods=["POST"])
    assert app.flask.test_client().post("/crash").status_code == 500
    assert count(app.engine, sp.Job) == 0
    assert app.orders() == 0


def test_run_jobs_until_empty_runs_the_job_on_db_engine(app: App) -> None:
    """`flask run-jobs --until-empty` runs the committed job with process_next_job; its write
    through job.session confirms the order."""
    client = app.flask.test_client()
    order_id = client.post("/orders", json={"item": "tea"}).get_json()["order_id"]
    result = app.flask.test_cli_runner().invoke(args=["run-jobs", "--until-empty"])
    assert result.exit_code == 0, result.output
    assert result.output == "ran 1 job(s)\n"
    [done] = archived(app.engine)
    assert (done.job_type, done.status, done.attempts) == ("confirm-order", "success", 1)
    assert client.get(f"/orders/{order_id}").get_json() == {"item": "tea", "confirmed": True}
    assert app.flask.test_cli_runner().invoke(args=["run-jobs", "--until-empty"]).output == (
        "ran 0 job(s)\n"
    )


def test_run_jobs_worker_process_runs_jobs_until_sigterm(app: App, tmp_path: Path) -> None:
    """`flask --app examples/flask_sqlalchemy_app.py run-jobs` is a worker process on
    db.engine: it runs a job committed by a request, and SIGTERM stops it with a summary."""
    with subprocess.Popen(
        [sys.executable, "-m", "flask", "--app", str(EXAMPLE), "run-jobs"],
        cwd=tmp_path,
        env={**os.environ, "DATABASE_URL": app.url},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as worker:
        try:
            response = app.flask.test_client().post("/orders", json={"item": "tea"})
            job_id = uuid.UUID(response.get_json()["job_id"])

            def done() -> Any:
                return archived_job(app.engine, job_id) or worker.poll() is not None

            assert wait_for(done, timeout=30)
            assert worker.poll() is None, worker.communicate()[1]
            worker.send_signal(signal.SIGTERM)
            _, stderr = worker.communicate(timeout=30)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.communicate()
    assert worker.returncode == -signal.SIGTERM, stderr
    assert "stopped: 1 succeeded, 0 retried, 0 failed" in stderr
    job = archived_job(app.engine, job_id)
    assert job is not None and job.status == "success"
    with Session(app.engine) as session:
        order = session.scalars(sa.select(app.example.Order)).one()
        assert order.confirmed


# --- under the command-line worker -----------------------------------------------------------


def command_line_worker(
    handler: str, cwd: Path, url: str, *args: str
) -> subprocess.CompletedProcess[str]:
    """``sqla-proletarian worker HANDLER ARGS`` run to its end in ``cwd`` (the handler's module
    there), on ``url``."""
    pythonpath = os.pathsep.join(filter(None, [str(cwd), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "sqla_proletarian", "worker", handler, *args],
        cwd=cwd,
        env={**os.environ, "DATABASE_URL": url, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def howto_app(directory: Path) -> ModuleType:
    """The how-to's ``app.py``, written from the page to ``directory`` and imported (once)."""
    found = re.search(r"<!-- file: app\.py -->\n```python\n(.*?)\n```\n", HOWTO.read_text(), re.S)
    assert found, f"{HOWTO} has no app.py block"
    (directory / "app.py").write_text(found[1] + "\n")
    name = "sp_howto_flask_app"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, directory / "app.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_howto_app_runs_its_jobs_under_the_command_line_worker(
    empty_database: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The how-to's app.py, as the page writes it: a signup's job runs under
    `sqla-proletarian worker 'app:create_handlers()' --burst`, whose handler uses
    ``current_app`` (the app's context around each job); archived ``success`` at its first
    attempt, and the user it marked is welcomed."""
    url = empty_database.url.render_as_string(hide_password=False)
    monkeypatch.setenv("DATABASE_URL", url)
    howto = howto_app(tmp_path)
    flask_app = howto.create_app()
    engine: sa.Engine = flask_app.extensions["engine"]
    try:
        response = flask_app.test_client().post("/signup", json={"email": "ada@example.com"})
        assert response.status_code == 201, response.get_data(as_text=True)

        done = command_line_worker("app:create_handlers()", tmp_path, url, "--burst")
        assert done.returncode == 0, done.stderr
        assert "Working outside of application context" not in done.stderr
        [job] = archived(engine)
        assert (job.job_type, job.status, job.attempts) == ("send-welcome-email", "success", 1)
        with Session(engine) as session:
            assert session.scalars(sa.select(howto.User.welcomed)).all() == [True]
    finally:
        engine.dispose()


def test_example_runs_its_jobs_under_the_command_line_worker_in_the_apps_context(
    app: App,
) -> None:
    """`sqla-proletarian worker 'flask_sqlalchemy_app:create_handlers()' --burst` runs the
    example's job (its handler logs through ``current_app``): archived ``success`` at its first
    attempt, and the order confirmed."""
    response = app.flask.test_client().post("/orders", json={"item": "tea"})
    job_id = uuid.UUID(response.get_json()["job_id"])
    done = command_line_worker(
        "flask_sqlalchemy_app:create_handlers()", EXAMPLE.parent, app.url, "--burst"
    )
    assert done.returncode == 0, done.stderr
    job = archived_job(app.engine, job_id)
    assert job is not None and (job.status, job.attempts) == ("success", 1), done.stderr
    assert app.flask.test_client().get(f"/orders/{response.get_json()['order_id']}").get_json() == {
        "item": "tea",
        "confirmed": True,
    }

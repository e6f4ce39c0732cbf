"""The examples and the README's main snippet run and do what they say."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sqla_proletarian as sp

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
README = ROOT / "README.md"


def load_example(name: str) -> ModuleType:
    """Import examples/<name>.py once, as module ``sp_example_<name>``."""
    module_name = f"sp_example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # declarative models resolve their annotations here
    spec.loader.exec_module(module)
    return module


def run_python(args: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def wait_for(condition: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Poll ``condition`` until it returns something truthy; fail at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout} s")
        time.sleep(0.05)


# --- quickstart ----------------------------------------------------------------------------


def test_quickstart_runs_on_sqlite_and_prints_the_shutdown_summary(tmp_path: Path) -> None:
    """quickstart.py exits 0 within seconds: one retry, one failure, the rolled-back job never
    runs, and the summary counts each outcome."""
    started = time.monotonic()
    result = run_python([str(EXAMPLES / "quickstart.py")], cwd=tmp_path)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "proletarian[default] stopped: 2 succeeded, 1 retried, 1 failed" in out
    assert "Bob's rolled-back job: never ran" in out
    assert "user bob@example.com: absent" in out
    assert "sync-to-crm (attempt 2): synced" in out
    assert "[failed-job handler] charge-card gave up after 1 attempt(s)" in out
    assert re.search(r"charge-card\s+failure\s+attempts=1\s+error: ValueError: card declined", out)
    assert re.search(r"sync-to-crm\s+success\s+attempts=2", out)
    assert "welcome emails sent to: ada@example.com\n" in out
    assert elapsed < 30, f"the quickstart took {elapsed:.1f} s"
    assert list(tmp_path.iterdir()) == [], "the quickstart left files behind"


# --- the Flask app ---------------------------------------------------------------------------


@pytest.fixture
def flask_app(empty_database: Any) -> Iterator[Any]:
    """The example's Flask app on a fresh database, its worker stopped afterwards."""
    flask_example = load_example("flask_app")
    app = flask_example.create_app(empty_database.url.render_as_string(hide_password=False))
    try:
        yield app
    finally:
        app.extensions["proletarian_worker"].stop()
        app.extensions["sqlalchemy_engine"].dispose()


def count(engine: sa.Engine, table: Any, *where: Any) -> int:
    with Session(engine) as session:
        return session.scalar(sa.select(sa.func.count()).select_from(table).where(*where)) or 0


def test_flask_signup_commits_user_and_job_together_and_the_worker_runs_it(
    flask_app: Any,
) -> None:
    """POST /signup writes the user and the job in one transaction; the app's own worker,
    started by create_app, runs the job, whose write through job.session marks the user."""
    worker = flask_app.extensions["proletarian_worker"]
    engine = flask_app.extensions["sqlalchemy_engine"]
    assert worker.running

    response = flask_app.test_client().post("/signup", json={"email": "ada@example.com"})
    assert response.status_code == 201, response.get_data(as_text=True)
    job_id = uuid.UUID(response.get_json()["job_id"])

    def archived() -> sp.ArchivedJob | None:
        with Session(engine) as session:
            return session.get(sp.ArchivedJob, job_id)

    job = wait_for(archived)
    assert (job.job_type, job.status, job.attempts) == ("send-welcome-email", "success", 1)
    user = flask_app.test_client().get("/users/ada@example.com")
    assert user.get_json() == {"email": "ada@example.com", "welcomed": True}

    worker.stop()
    assert not worker.running
    assert worker.summary_text() == "1 succeeded, 0 retried, 0 failed"


def test_flask_signup_that_fails_rolls_back_both_the_user_and_the_job(flask_app: Any) -> None:
    """A second signup with a taken email fails at commit (409): neither its user row nor its
    job survives, so the welcome email is sent once."""
    engine = flask_app.extensions["sqlalchemy_engine"]
    users = load_example("flask_app").User
    client = flask_app.test_client()
    assert client.post("/signup", json={"email": "ada@example.com"}).status_code == 201
    wait_for(lambda: count(engine, sp.ArchivedJob) == 1)

    again = client.post("/signup", json={"email": "ada@example.com"})
    assert again.status_code == 409
    flask_app.extensions["proletarian_worker"].stop()  # nothing more can run from here
    assert count(engine, users) == 1
    assert count(engine, sp.Job) == 0
    assert count(engine, sp.ArchivedJob) == 1


def test_flask_request_that_raises_after_enqueueing_leaves_neither_row(
    flask_app: Any,
) -> None:
    """The request's Session is rolled back when a view raises after writing a user and
    enqueueing a job: both rows vanish, whatever the error."""
    flask_example = load_example("flask_app")
    engine = flask_app.extensions["sqlalchemy_engine"]

    def signup_then_crash() -> str:
        session = flask_example.db_session()
        session.add(flask_example.User(email="bob@example.com"))
        sp.enqueue(session, "send-welcome-email", {"email": "bob@example.com"})
        session.flush()  # both rows are in the database, uncommitted
        raise RuntimeError("the payment provider timed out")

    flask_app.add_url_rule("/crash", "crash", signup_then_crash, methods=["POST"])
    response = flask_app.test_client().post("/crash")
    assert response.status_code == 500
    assert count(engine, flask_example.User) == 0
    assert count(engine, sp.Job) == 0
    flask_app.extensions["proletarian_worker"].stop()
    assert count(engine, sp.ArchivedJob) == 0


# --- dispatch --------------------------------------------------------------------------------


def test_dispatch_example_routes_jobs_by_type_in_both_handler_modes(
    engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """dispatch.py: default mode calls handler(job_type, payload) with a catch-all; advanced
    mode calls handler(job) and, with no catch-all, archives an unknown job type as failed."""
    dispatch = load_example("dispatch")
    assert dispatch.run(engine) == 0
    out = capsys.readouterr().out
    assert "[confirmation-email] confirmation email for Ada" in out
    assert "[default] no handler for job type 'newsletter'" in out
    assert re.search(r"\[send-invoice\] invoice INV-1001: job [0-9a-f-]{36}, attempt 1,", out)
    assert "[failed-job handler] refund: no handler is registered for job type 'refund'" in out
    assert "outbox: ['to ada@example.com: Please confirm your email']" in out
    with Session(engine) as session:
        rows = session.execute(sa.select(sp.ArchivedJob.job_type, sp.ArchivedJob.status))
        outcomes = {job_type: status for job_type, status in rows}
        refund = session.scalars(
            sa.select(sp.ArchivedJob).where(sp.ArchivedJob.job_type == "refund")
        ).one()
    assert outcomes == {
        "confirmation-email": "success",
        "reindex-document": "success",
        "newsletter": "success",
        "send-invoice": "success",
        "refund": "failure",
    }
    assert refund.error is not None and refund.error.startswith("sqla_proletarian.errors.Unknown")


def test_dispatch_example_runs_as_a_script(tmp_path: Path) -> None:
    """`python examples/dispatch.py` exits 0 on SQLite and prints the archive."""
    result = run_python([str(EXAMPLES / "dispatch.py")], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"billing\s+refund\s+failure", result.stdout)


# --- canvas ----------------------------------------------------------------------------------


def test_canvas_example_runs_a_chain_and_a_chord_enqueued_in_one_transaction(
    engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """canvas.py: each chain step reads the one before's result, the join waits for its
    parts, runs once with all their results and returns their sum, which wait_for_result
    and get_result read back."""
    canvas = load_example("canvas")
    assert canvas.run(engine) == 0
    out = capsys.readouterr().out
    assert "the join is waiting before the worker starts" in out
    assert "sum-counts: 4 parts, counts [6, 7, 8, 10]" in out
    assert "sum-counts returned 31 (wait_for_result)" in out
    assert "write-invoice returned 'invoice for order 1042: 13.50 EUR' (get_result)" in out
    assert "worker: 8 succeeded, 0 retried, 0 failed" in out
    with Session(engine) as session:
        rows = session.execute(sa.select(sp.ArchivedJob.job_type, sp.ArchivedJob.status)).all()
    assert sorted(rows) == sorted(
        [("fetch-order", "success"), ("price-order", "success"), ("write-invoice", "success")]
        + [("count-words", "success")] * 4
        + [("sum-counts", "success")]
    )
    assert count(engine, sp.Job) == 0


def test_canvas_example_runs_as_a_script(tmp_path: Path) -> None:
    """`python examples/canvas.py` exits 0 on SQLite and prints the join's sum."""
    result = run_python([str(EXAMPLES / "canvas.py")], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sum-counts returned 31 (wait_for_result)" in result.stdout
    assert list(tmp_path.iterdir()) == [], "the example left files behind"


# --- the README ------------------------------------------------------------------------------


def readme_main_snippet() -> str:
    """The python block right after the README's "runs the next code block" marker."""
    text = README.read_text(encoding="utf-8")
    marker = text.index("test_examples.py runs the next code block")
    match = re.compile(r"```python\n(.*?)```", re.DOTALL).search(text, marker)
    assert match is not None
    return match.group(1)


def test_readme_main_snippet_runs_as_written(tmp_path: Path) -> None:
    """The README's main example runs unchanged on SQLite: the job enqueued with the user
    commits, the worker runs it, and the summary it prints is the one the comment shows."""
    script = tmp_path / "readme_snippet.py"
    script.write_text(readme_main_snippet(), encoding="utf-8")
    result = run_python([str(script)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "Welcome, ada@example.com!",
        "1 succeeded, 0 retried, 0 failed",
    ]
    assert (tmp_path / "app.db").exists()

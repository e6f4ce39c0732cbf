"""examples/fastapi_app.py on every backend through its async driver, driven by real requests
(httpx.AsyncClient over ASGITransport) inside the app's own lifespan: a signup that commits
runs its welcome job; one that fails (a duplicate email, 409) leaves no job."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import httpx
import sqlalchemy as sa
from helpers import archived, count, jobs, run_records

import sqla_proletarian as sp

if TYPE_CHECKING:
    from conftest import Database

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fastapi_app.py"
#: The async driver of each backend.
ASYNC_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+asyncpg",
    "mariadb": "mysql+aiomysql",
}


def load_example() -> ModuleType:
    """Import the example once, as module ``sp_example_fastapi_app``."""
    name = "sp_example_fastapi_app"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # declarative models resolve their annotations here
    spec.loader.exec_module(module)
    return module


async def welcomed(client: httpx.AsyncClient, email: str, timeout: float = 10.0) -> bool:
    """Ask the app until the user is welcomed (the job ran) or time is up."""
    for _ in range(int(timeout / 0.05)):
        response = await client.get(f"/users/{email}")
        if response.status_code == 200 and response.json()["welcomed"]:
            return True
        await asyncio.sleep(0.05)
    return False


def test_a_committed_signup_runs_its_welcome_job_and_a_failed_signup_leaves_no_job(
    empty_database: Database,
) -> None:
    example = load_example()
    url = empty_database.url.set(drivername=ASYNC_DRIVERS[empty_database.backend])
    app = example.create_app(url.render_as_string(hide_password=False))

    async def main() -> tuple[list[int], dict[str, Any], sp.AsyncQueueWorker]:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://example.test"
            ) as client,
        ):
            worker = app.state.worker
            assert worker.running, "the lifespan started the worker"
            first = await client.post("/signup", json={"email": "ada@example.com"})
            assert first.status_code == 201, first.text
            assert await welcomed(client, "ada@example.com"), "the welcome job ran"
            again = await client.post("/signup", json={"email": "ada@example.com"})
            await asyncio.sleep(0.3)  # time enough for a job, had one been committed
            status = (await client.get("/worker")).json()
            return [first.status_code, again.status_code], status, worker

    codes, status, worker = asyncio.run(main())
    assert codes == [201, 409]
    assert status == {"running": True, "succeeded": 1, "retried": 0, "failed": 0}
    assert not worker.running, "the lifespan stopped the worker"
    engine = empty_database.engine()
    assert [(a.job_type, a.status) for a in archived(engine)] == [("send-welcome-email", "success")]
    assert jobs(engine) == [] and run_records(engine) == 0, "the failed signup left no job"
    assert count(engine, example.User) == 1
    with engine.connect() as conn:
        assert conn.execute(sa.select(example.User.welcomed)).scalar_one() is True

"""examples/dashboard_flask.py and examples/dashboard_fastapi.py on every backend, through
each framework's own test client: the dashboard answers under its prefix with its links
there, only to a logged-in admin, and its actions work through the mount."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import httpx
from dashboard_support import archive

import sqla_proletarian as sp

if TYPE_CHECKING:
    from conftest import Database

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TOKEN = re.compile(r'name="csrf_token" value="([0-9a-f]{64})"')


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` once, as ``sp_example_<name>``."""
    module_name = f"sp_example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def test_flask_mount_serves_admins_under_the_prefix_and_refuses_others(
    database: Database,
) -> None:
    """Before login: 403 on every dashboard path; after: the overview with links under
    /admin/queue, the JSON, and a retry that goes through the mount and back."""
    [failed] = archive(database.engine(), ("default", "charge", "failure", sp.utc_now()))
    app = load_example("dashboard_flask").create_app(database.url.render_as_string(False))
    client = app.test_client()

    assert client.get("/admin/queue/").status_code == 403
    assert client.get("/admin/queue/api/overview").status_code == 403
    assert client.post("/login", data={"password": "wrong"}).status_code == 401
    assert client.post("/login", data={"password": "admin"}).status_code == 302

    overview = client.get("/admin/queue/")
    text = overview.get_data(as_text=True)
    assert overview.status_code == 200
    assert 'src="/admin/queue/static/dashboard.js"' in text
    assert client.get("/admin/queue/static/dashboard.js").status_code == 200
    assert client.get("/admin/queue/api/overview").json["queues"][0]["failed_last_hour"] == 1
    token = TOKEN.search(client.get("/admin/queue/jobs?state=failed").get_data(as_text=True))
    assert token is not None
    done = client.post(
        "/admin/queue/actions/retry",
        data={"job_id": str(failed), "confirm": "yes", "csrf_token": token.group(1)},
    )
    assert done.status_code == 303 and done.headers["Location"].startswith("/admin/queue/")
    assert [
        job.job_id for job in sp.list_jobs(app.extensions["proletarian_engine"], "ready").jobs
    ] == [failed]
    client.post("/logout")
    assert client.get("/admin/queue/").status_code == 403
    app.extensions["proletarian_engine"].dispose()


def test_fastapi_mount_serves_admins_under_the_prefix_without_warnings(
    database: Database,
) -> None:
    """Through a2wsgi (no deprecation warning, unlike starlette.middleware.wsgi): a 403
    before login, then the overview and the jobs under /admin/queue, and a confirmed
    retry."""
    [failed] = archive(database.engine(), ("default", "charge", "failure", sp.utc_now()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        app = load_example("dashboard_fastapi").create_app(database.url.render_as_string(False))

    async def visit() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            assert (await client.get("/admin/queue/")).status_code == 403
            login = await client.post("/login", data={"password": "admin"})
            assert login.status_code == 303

            overview = await client.get("/admin/queue/")
            assert overview.status_code == 200
            assert 'href="/admin/queue/jobs?state=failed"' in overview.text
            bare = await client.get("/admin/queue")  # Starlette adds the slash
            assert (bare.status_code, bare.headers["location"]) == (
                307,
                "http://testserver/admin/queue/",
            )
            listed = await client.get("/admin/queue/jobs", params={"state": "failed"})
            assert f'href="/admin/queue/jobs/{failed}"' in listed.text
            token = TOKEN.search(listed.text)
            assert token is not None
            fields = {"job_id": str(failed), "csrf_token": token.group(1)}
            asked = await client.post("/admin/queue/actions/retry", data=fields)
            assert asked.status_code == 200 and 'id="confirm"' in asked.text
            done = await client.post(
                "/admin/queue/actions/retry",
                data={**fields, "confirm": "yes"},
                headers={"Origin": "http://testserver"},
            )
            assert done.status_code == 303
            assert done.headers["location"].startswith("/admin/queue/?done=retried")

    asyncio.run(visit())
    assert sp.list_jobs(app.state.engine, "failed").jobs == ()
    app.state.engine.dispose()

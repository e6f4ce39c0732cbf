"""The command line's view of async applications: an async URL's sync twin and a sync URL's
async twin (the same database, the query kept), and which handlers are ``async def``."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.engine import make_url

import sqla_proletarian as sp
from sqla_proletarian.asyncapp import async_url, is_async_handler, sync_url

TWINS = [
    ("postgresql+asyncpg://app:pw@db:5433/jobs?application_name=w", "postgresql+psycopg"),
    ("postgresql+psycopg_async://app@db/jobs", "postgresql+psycopg"),
    ("mysql+aiomysql://app@db/jobs?charset=utf8mb4", "mysql+pymysql"),
    ("sqlite+aiosqlite:///jobs.db", "sqlite+pysqlite"),
]


@pytest.mark.parametrize(("text", "drivername"), TWINS)
def test_an_async_url_has_a_sync_twin_on_the_same_database(text: str, drivername: str) -> None:
    url = make_url(text)

    twin = sync_url(url)

    assert twin.drivername == drivername
    assert twin.set(drivername=url.drivername) == url
    assert async_url(url) == url


@pytest.mark.parametrize(
    ("text", "drivername"),
    [
        ("postgresql+psycopg://app@db/jobs", "postgresql+psycopg_async"),
        ("postgresql+psycopg2://app@db/jobs", "postgresql+asyncpg"),
        ("mysql+pymysql://app@db/jobs", "mysql+aiomysql"),
        ("sqlite:///jobs.db", "sqlite+aiosqlite"),
    ],
)
def test_a_sync_url_has_an_async_twin_and_is_its_own_sync_one(text: str, drivername: str) -> None:
    url = make_url(text)

    assert async_url(url).drivername == drivername
    assert sync_url(url) == url


def test_a_driver_with_no_known_twin_is_refused_with_the_ones_that_have_one() -> None:
    with pytest.raises(
        sp.ConfigurationError, match=r"pg8000 has no asyncio twin.*postgresql\+psycopg,"
    ):
        async_url(make_url("postgresql+pg8000://app@db/jobs"))


def test_async_def_functions_callables_and_tables_with_one_are_async() -> None:
    async def job(job_type: str, payload: Any) -> None: ...

    def plain(job_type: str, payload: Any) -> None: ...

    class Callable:
        async def __call__(self, job_type: str, payload: Any) -> None: ...

    mixed, sync_only = sp.JobHandlers(), sp.JobHandlers()
    mixed.register("a")(plain)
    mixed.default(job)
    sync_only.register("a")(plain)

    assert [is_async_handler(h) for h in (job, Callable(), mixed)] == [True, True, True]
    assert [is_async_handler(h) for h in (plain, sync_only)] == [False, False]

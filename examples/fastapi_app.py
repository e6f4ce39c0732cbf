"""A FastAPI app: a signup enqueues its welcome email in the request's AsyncSession
transaction, and the app's lifespan runs an asyncio queue worker beside the web server.

Run it on SQLite (no server; ``pip install uvicorn`` first)::

    uvicorn --factory examples.fastapi_app:from_environment

then::

    curl -X POST localhost:8000/signup -H 'content-type: application/json' \\
         -d '{"email": "ada@example.com"}'
    curl localhost:8000/users/ada@example.com     # "welcomed": true once the job ran

Set ``DATABASE_URL`` for another database, through its async driver:
``postgresql+asyncpg://...``, ``postgresql+psycopg://...``, ``mysql+aiomysql://...``.

What is particular to FastAPI and asyncio:

* one ``AsyncSession`` per request, from a dependency; the endpoint writes the user and
  enqueues the job in it (``sp.enqueue(session, ...)`` is a sync call, like
  ``session.add``), then commits both together before it answers. A signup that fails
  (a duplicate email: 409) rolls back, and its job never existed;
* the worker (``sp.create_async_queue_worker``) runs as tasks on the server's event loop,
  started and stopped by the lifespan; a stop lets running jobs finish;
* the handler is an ``async def`` in advanced mode: ``job.session`` is an AsyncSession in
  the job's own transaction, so marking the user welcomed commits with the job, or not at
  all;
* the library's tables are on their own MetaData (``sp.metadata``); here the lifespan
  creates them, in production use the migrations (docs/howto/alembic.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import sqla_proletarian as sp

log = logging.getLogger("fastapi_app")


class Base(DeclarativeBase):
    pass


class User(Base):
    __tablename__ = "fastapi_example_users"

    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(sa.String(255), unique=True)
    welcomed: Mapped[bool] = mapped_column(default=False)


class Signup(BaseModel):
    email: str


handlers = sp.JobHandlers()


@handlers.register("send-welcome-email")
async def send_welcome_email(job: sp.AsyncJobContext) -> None:
    """Send the email (here: log it), and mark the user welcomed in the job's transaction."""
    user = (
        await job.session.scalars(sa.select(User).where(User.email == job.payload["email"]))
    ).one()
    log.info("Welcome, %s! (attempt %d)", user.email, job.attempts)
    user.welcomed = True  # commits with the job's archive row, or not at all


async def request_session(request: Request) -> AsyncIterator[AsyncSession]:
    """The request's one AsyncSession; what the endpoint did not commit rolls back."""
    async with request.app.state.sessions() as session:
        yield session


RequestSession = Annotated[AsyncSession, Depends(request_session)]


def create_app(database_url: str) -> FastAPI:
    """The app on ``database_url`` (an async driver's URL), with its worker in the lifespan."""
    engine = create_async_engine(database_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
            await conn.run_sync(sp.metadata.create_all)
        worker = sp.create_async_queue_worker(engine, handlers, handler_mode="advanced")
        app.state.worker = worker
        async with worker:  # start() here, stop() when the server shuts down
            yield
        log.info("worker stopped: %s", worker.summary_text())
        await engine.dispose()

    app = FastAPI(lifespan=lifespan)
    app.state.sessions = async_sessionmaker(engine, expire_on_commit=False)

    @app.post("/signup", status_code=201)
    async def signup(signup: Signup, session: RequestSession) -> dict[str, Any]:
        user = User(email=signup.email)
        session.add(user)
        sp.enqueue(session, "send-welcome-email", {"email": signup.email})
        try:
            await session.commit()  # the user and the job, together
        except IntegrityError:
            raise HTTPException(409, f"{signup.email} has signed up already") from None
        return {"id": user.id, "email": user.email}

    @app.get("/users/{email}")
    async def user(email: str, session: RequestSession) -> dict[str, Any]:
        found = await session.scalar(sa.select(User).where(User.email == email))
        if found is None:
            raise HTTPException(404, f"no user {email}")
        return {"id": found.id, "email": found.email, "welcomed": found.welcomed}

    @app.get("/worker")
    async def worker_status(request: Request) -> dict[str, Any]:
        worker: sp.AsyncQueueWorker = request.app.state.worker
        return {"running": worker.running, **worker.summary()}

    return app


def from_environment() -> FastAPI:
    """The app on ``DATABASE_URL`` (default: SQLite through aiosqlite, in this directory)."""
    return create_app(os.environ.get("DATABASE_URL", "sqlite+aiosqlite:///fastapi_example.db"))

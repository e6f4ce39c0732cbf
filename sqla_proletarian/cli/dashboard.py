"""``dashboard``: serve the web dashboard of the queues."""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from sqla_proletarian.cli.common import (
    PROG,
    READ_URL,
    Command,
    _check_tables,
    _database,
    _error,
    _read_database,
    arg,
)
from sqla_proletarian.errors import ProletarianError
from sqla_proletarian.supervisor import EXIT_OK


def dashboard(args: argparse.Namespace) -> int:
    from sqla_proletarian.dashboard import create_dashboard
    from sqla_proletarian.dashboard.server import create_server, server_url

    with _database(args) as engine, _read_database(args) as read_engine:
        _check_tables(engine)
        app = create_dashboard(engine, read_only=args.read_only, read_engine=read_engine)
        try:
            server = create_server(app, args.host, args.port)
        except OSError as exc:
            raise ProletarianError(
                f"cannot listen on {args.host}:{args.port} ({exc.strerror or exc}): give "
                "another --port, or stop what uses this one"
            ) from None
        with server:
            mode = " (read-only)" if args.read_only else ""
            mode += " reading from --read-url" if read_engine is not None else ""
            print(f"dashboard at {server_url(server)}{mode}; Ctrl-C stops it", flush=True)
            if args.host not in ("127.0.0.1", "localhost", "::1"):
                _error(
                    "dashboard",
                    f"warning: listening on {args.host}: the dashboard has no login of its "
                    "own, so anyone who reaches this port can use it",
                )
            _serve_until_signal(server)
    return EXIT_OK


def _serve_until_signal(server: Any) -> None:
    """Serve until SIGINT or SIGTERM, each handled here: a process started in the
    background of a script inherits SIGINT ignored, and Python then raises no
    KeyboardInterrupt for it."""

    def stop(signum: int, frame: object) -> None:
        # shutdown() waits for serve_forever() to return, so it cannot run in its thread.
        threading.Thread(target=server.shutdown, name="dashboard-stop", daemon=True).start()

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.serve_forever()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


DASHBOARD_ARGUMENTS = (
    arg("--host", default="127.0.0.1", help="the address to listen on (127.0.0.1: this machine)"),
    arg("--port", type=int, default=8080, help="the port (8080; 0: any free one)"),
    arg("--read-only", action="store_true", help="show the queues, offer no action"),
    READ_URL,
)


DASHBOARD = Command(
    "dashboard",
    "serve the web dashboard of the queues (on 127.0.0.1 unless --host says otherwise)",
    f"{PROG} dashboard --port 8080 --read-only",
    DASHBOARD_ARGUMENTS,
    dashboard,
    "Needs Jinja2 (pip install 'sqla-proletarian[dashboard]'). It has no login of its\n"
    "own: keep it on 127.0.0.1 and reach it through an SSH tunnel, or mount\n"
    "create_dashboard() in your app behind its login (docs/dashboard.md).",
)

"""A small threaded HTTP server for the dashboard on its own (``sqla-proletarian dashboard``):
the standard library's ``wsgiref``, one thread per request.

It binds to 127.0.0.1 unless told otherwise: the dashboard has no login of its own, so
reach it through an SSH tunnel or a proxy that has one.
"""

from __future__ import annotations

import logging
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from sqla_proletarian.dashboard.web import WSGIApp
from sqla_proletarian.logs import logger

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


class ThreadingServer(ThreadingMixIn, WSGIServer):
    """wsgiref's server, answering each request in a thread of its own."""

    daemon_threads = True
    allow_reuse_address = True


class QuietHandler(WSGIRequestHandler):
    """Logs each request through the library's logger (at DEBUG), not to stderr."""

    def log_message(self, format: str, *args: Any) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "dashboard-request %s",
                format % args,
                extra={"event": "dashboard-request", "client": self.address_string()},
            )


def create_server(app: WSGIApp, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> WSGIServer:
    """A threaded server of ``app`` bound to ``host``:``port`` (0: a free port); call its
    ``serve_forever()``, and ``shutdown()`` from another thread to stop it."""
    return make_server(host, port, app, server_class=ThreadingServer, handler_class=QuietHandler)


def server_url(server: WSGIServer) -> str:
    """The address the server listens on, as a URL."""
    host, port = server.server_address[:2]
    text = host.decode() if isinstance(host, bytes) else str(host)
    shown = f"[{text}]" if ":" in text else text
    return f"http://{shown}:{port!s}/"

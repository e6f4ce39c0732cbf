"""``sqla-proletarian dashboard`` on every backend: it serves the dashboard on 127.0.0.1,
read-only when asked, says where, and stops on Ctrl-C with status 0."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa

import sqla_proletarian as sp

if TYPE_CHECKING:
    from conftest import Database

_BESIDE = Path(sys.executable).with_name("sqla-proletarian")
CLI = str(_BESIDE) if _BESIDE.exists() else shutil.which("sqla-proletarian") or "sqla-proletarian"


def test_the_dashboard_command_serves_on_localhost_read_only_and_stops_on_ctrl_c(
    database: Database,
) -> None:
    env = {**os.environ, "DATABASE_URL": database.url.render_as_string(hide_password=False)}
    process = subprocess.Popen(
        [CLI, "dashboard", "--port", "0", "--read-only"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("dashboard at http://127.0.0.1:"), line
        assert "(read-only)" in line
        url = line.split()[2].rstrip(";")
        with urllib.request.urlopen(url, timeout=10) as response:
            page = response.read().decode()
        assert response.status == 200 and "read-only" in page and "<h1>Queues</h1>" in page
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(url + "actions/prune", data=b""))
        assert refused.value.code == 403
        refused.value.close()
        process.send_signal(signal.SIGINT)
        assert process.wait(10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        assert process.stderr is not None
        errors = process.stderr.read()
        process.stdout.close()  # type: ignore[union-attr]
        process.stderr.close()
    assert "Traceback" not in errors


def test_the_dashboard_command_refuses_a_port_in_use(tmp_path: Path) -> None:
    """A port that is taken is one line that says so, and status 1 (SQLite only: the
    database plays no part)."""
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    engine = sa.create_engine(url)
    sp.metadata.create_all(engine)
    engine.dispose()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [CLI, "dashboard", "--url", url, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert done.returncode == 1
    assert "cannot listen on 127.0.0.1" in done.stderr and "another --port" in done.stderr

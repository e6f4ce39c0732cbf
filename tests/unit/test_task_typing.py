"""Tasks are typed: ``mypy --strict`` accepts the typed uses in tests/typing/typed_tasks.py
and rejects the wrong argument types of tests/typing/wrong_task_call.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TYPING = Path(__file__).parent.parent / "typing"
ROOT = Path(__file__).parent.parent.parent


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for both runs: the second reads the package's types from it."""
    pytest.importorskip("mypy")
    return tmp_path_factory.mktemp("mypy-cache")


def mypy(path: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    """``mypy --strict`` on one file, with the package under test first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TYPING)])}
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(cache), str(path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )


def test_mypy_strict_accepts_typed_uses_of_tasks(mypy_cache: Path) -> None:
    result = mypy(TYPING / "typed_tasks.py", mypy_cache)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success" in result.stdout


def test_mypy_strict_rejects_a_task_enqueued_with_wrong_argument_types(mypy_cache: Path) -> None:
    result = mypy(TYPING / "wrong_task_call.py", mypy_cache)
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2, result.stdout
    assert all('to "enqueue" of "Task"' in line for line in errors), result.stdout
    assert '"int"; expected "str"' in errors[0]
    assert '"urgent"' in errors[1] and 'expected "bool"' in errors[1]

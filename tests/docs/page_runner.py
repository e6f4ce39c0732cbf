"""Run the code blocks of one documentation page, in order, in the current directory.

Usage: ``python page_runner.py BLOCKS.json RESULT.json``. ``BLOCKS.json`` holds the page's
blocks as ``test_docs.py`` parsed them; every ``python`` block is executed in one namespace
(compiled under the page's name and real line numbers, so a traceback points into the page),
every command of a ``console`` block is run with bash (a ``bash``/``sh`` block as one script,
with ``bash -e``; under ``<!-- output checked -->`` what each command prints is compared with
the page), the commands of a block marked ``<!-- not run: WHY -->`` are only checked with
``bash -n``, and every block marked ``<!-- file: NAME -->`` is written to ``NAME`` and
checked by parsing. The first failure is
written to ``RESULT.json`` (its line, and what went wrong) and ends the run.
"""

from __future__ import annotations

import builtins
import configparser
import json
import os
import subprocess
import sys
import tomllib
import traceback
import types
import warnings
from pathlib import Path
from typing import Any

#: Seconds one console command may take.
COMMAND_TIMEOUT = 60


class BlockFailed(Exception):
    """A block of the page did not do what the page says."""


def check_file(path: Path, language: str, text: str) -> None:
    """Parse a written file by what it is, so a broken sample fails the page."""
    suffix = path.suffix.lower()
    if language in ("python", "py") or suffix == ".py":
        compile(text, str(path), "exec")
    elif language in ("ini", "systemd") or suffix in (".ini", ".cfg", ".service", ".timer"):
        parser = configparser.ConfigParser(interpolation=None, strict=True)
        parser.optionxform = str  # type: ignore[assignment,method-assign]
        parser.read_string(text, source=str(path))
    elif language == "toml" or suffix == ".toml":
        tomllib.loads(text)
    elif language == "json" or suffix == ".json":
        json.loads(text)
    elif language in ("bash", "sh", "shell") or suffix == ".sh":
        done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        if done.returncode:
            raise BlockFailed(f"bash -n {path.name}:\n{done.stderr}")


def run_shell(block: dict[str, Any]) -> None:
    """Run the block's commands with bash, one shell each, or only parse them (``bash -n``)
    when the page marks the block as not runnable; compare their output when it is checked."""
    options = ["-n"] if block["not_run"] else ["-e"] if block["language"] != "console" else []
    outputs = block["outputs"] or [None] * len(block["commands"])
    for (line_no, command), expected in zip(block["commands"], outputs, strict=True):
        try:
            done = subprocess.run(
                ["bash", *options, "-c", command],
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise BlockFailed(
                f"line {line_no}: `{command}` did not finish within {COMMAND_TIMEOUT} s\n"
                f"{exc.stdout or ''}{exc.stderr or ''}"
            ) from None
        if done.returncode and block["not_run"]:
            raise BlockFailed(f"line {line_no}: `{command}` is not valid bash\n{done.stderr}")
        if done.returncode:
            raise BlockFailed(
                f"line {line_no}: `{command}` exited with {done.returncode}\n"
                f"--- stdout\n{done.stdout}--- stderr\n{done.stderr}"
            )
        printed = "\n".join(line.rstrip() for line in done.stdout.splitlines()).strip("\n")
        if expected is not None and printed != expected:
            raise BlockFailed(
                f"line {line_no}: `{command}` printed what the page does not show\n"
                f"--- the page\n{expected}\n--- printed\n{printed}"
            )


def page_namespace() -> dict[str, Any]:
    """A fresh ``__main__`` module for the page's code: what SQLAlchemy, dataclasses and
    pickle look classes up in is the module their ``__module__`` names."""
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module
    return module.__dict__


def run_blocks(page: str, blocks: list[dict[str, Any]]) -> dict[str, Any] | None:
    namespace = page_namespace()
    for block in blocks:
        line = block["line"]
        try:
            if block["file"]:
                path = Path(block["file"])
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(block["text"])
                check_file(path, block["language"], block["text"])
            elif block["language"] == "python":
                padded = "\n" * line + block["text"]  # the code starts on the fence's next line
                exec(compile(padded, page, "exec"), namespace)
            elif block["commands"]:
                run_shell(block)
        except BlockFailed as exc:
            return {"line": line, "language": block["language"], "error": str(exc)}
        except BaseException:
            return {
                "line": line,
                "language": block["language"],
                "error": traceback.format_exc(),
            }
    return None


def main() -> int:
    blocks_file, result_file = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(blocks_file).read_text())
    sys.path.insert(0, os.getcwd())
    warnings.simplefilter("default")
    try:
        from sqlalchemy.exc import SAWarning

        warnings.simplefilter("error", SAWarning)
    except ImportError:  # pragma: no cover - sqlalchemy is a dependency
        pass
    failure = run_blocks(spec["page"], spec["blocks"])
    Path(result_file).write_text(json.dumps({"failure": failure}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

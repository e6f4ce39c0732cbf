"""Run the code blocks of one documentation page, in order, in the current directory.

Usage: ``python page_runner.py BLOCKS.json RESULT.json``. ``BLOCKS.json`` holds the page's
blocks as ``test_docs.py`` parsed them; every ``python`` block is executed in one namespace
(compiled under the page's name and real line numbers, so a traceback points into the page),
every command of a ``console`` block is run with bash (a ``bash``/``sh`` block as one script,
with ``bash -e``; under ``<!-- output checked -->`` what each command prints is compared with
the page), but a plain ``sqla-proletarian ARGS`` command (no shell syntax) runs in this
interpreter through the command line's ``main()``, as the console script would run it, which
spares the page an interpreter start and the package's import for each such command; the
commands of a block marked ``<!-- not run: WHY -->`` are only checked with
``bash -n``, and every block marked ``<!-- file: NAME -->`` is written to ``NAME`` and
checked by parsing. The first failure is
written to ``RESULT.json`` (its line, and what went wrong) and ends the run.
"""

from __future__ import annotations

import builtins
import configparser
import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tomllib
import traceback
import types
import warnings
from pathlib import Path
from typing import Any, NamedTuple

#: Seconds one console command may take (test_docs.py scales it for the machine's load).
COMMAND_TIMEOUT = float(os.environ.get("SP_PAGE_COMMAND_TIMEOUT", "60"))

#: What makes a command more than a plain program call, outside quotes: bash runs those.
SHELL_SYNTAX = re.compile(r"[|&;<>()$`\\*?\[\]{}~\n]")
#: A quoted word: single quotes keep everything; double quotes expand ``$``, backquotes, ``\``.
QUOTED = re.compile(r"'[^']*'|\"[^\"$`\\]*\"")

#: Commands that run until stopped (``dashboard``): never run in this interpreter.
LONG_RUNNING = {"dashboard"}

#: The pages' way to show a failing command's exit status, which this interpreter can print.
SHOW_STATUS = ' || echo "exit status $?"'
#: ``NAME=value`` before the command: the command's own environment.
ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")


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


class Call(NamedTuple):
    """A plain ``sqla-proletarian`` command: its arguments, its own environment variables,
    and whether a failure's status is printed (``|| echo "exit status $?"``)."""

    argv: list[str]
    env: dict[str, str]
    show_status: bool


def in_process_call(command: str) -> Call | None:
    """A plain ``[NAME=value ...] sqla-proletarian ARGS [|| echo "exit status $?"]``
    command, or None for what bash runs."""
    show_status = command.endswith(SHOW_STATUS)
    command = command.removesuffix(SHOW_STATUS)
    if SHELL_SYNTAX.search(QUOTED.sub("''", command)):
        return None
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    env = {}
    while words and ASSIGNMENT.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if not words or words[0] != "sqla-proletarian" or LONG_RUNNING & set(words[1:]):
        return None
    return Call(words[1:], env, show_status)


class CommandTimeout(Exception):
    """A command run in this interpreter did not finish in time."""


def _alarm(signum: int, frame: object) -> None:
    raise CommandTimeout


def run_in_process(call: Call) -> subprocess.CompletedProcess[str]:
    """Run the command line's ``main(argv)`` here, capturing what it prints, with the
    package's modules loaded once; modules of the page's folder are imported afresh by the
    next command, as a new interpreter would."""
    from sqla_proletarian.cli import main

    out, err = io.StringIO(), io.StringIO()
    before = set(sys.modules)
    saved = {name: os.environ.get(name) for name in call.env}
    os.environ.update(call.env)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, COMMAND_TIMEOUT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), logging_kept():
            try:
                status = main(call.argv)
            except SystemExit as exc:  # --help, --version, a usage error
                status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        here = os.getcwd()
        for name in set(sys.modules) - before:
            path = getattr(sys.modules[name], "__file__", None) or ""
            if path.startswith(here + os.sep):
                del sys.modules[name]
    if status and call.show_status:
        out.write(f"exit status {status}\n")
        status = 0
    return subprocess.CompletedProcess(call.argv, status, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def logging_kept() -> Any:
    """Undo what the command line does to logging (a handler on stderr, the library's
    level), so the page's later blocks log as they would without it."""
    import logging

    root, library = logging.getLogger(), logging.getLogger("sqla_proletarian")
    handlers, levels = list(root.handlers), (root.level, library.level)
    try:
        yield
    finally:
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(levels[0])
        library.setLevel(levels[1])


def run_command(command: str, options: list[str]) -> subprocess.CompletedProcess[str]:
    """Run one command: in this interpreter when it is a plain ``sqla-proletarian`` call that
    runs (not only parsed), else with bash."""
    call = None if options == ["-n"] else in_process_call(command)
    if call is not None:
        return run_in_process(call)
    return subprocess.run(
        ["bash", *options, "-c", command],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        stdin=subprocess.DEVNULL,
    )


def run_shell(block: dict[str, Any]) -> None:
    """Run the block's commands with bash, one shell each, or only parse them (``bash -n``)
    when the page marks the block as not runnable; compare their output when it is checked."""
    options = ["-n"] if block["not_run"] else ["-e"] if block["language"] != "console" else []
    outputs = block["outputs"] or [None] * len(block["commands"])
    for (line_no, command), expected in zip(block["commands"], outputs, strict=True):
        try:
            done = run_command(command, options)
        except subprocess.TimeoutExpired as exc:
            raise BlockFailed(
                f"line {line_no}: `{command}` did not finish within {COMMAND_TIMEOUT:g} s\n"
                f"{exc.stdout or ''}{exc.stderr or ''}"
            ) from None
        except CommandTimeout:
            raise BlockFailed(
                f"line {line_no}: `{command}` did not finish within {COMMAND_TIMEOUT:g} s"
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

"""The ``sqla-proletarian`` command line: a thin shell over the library's public functions.

One function per command, listed in ``COMMANDS`` (name, summary, example, arguments, run):
adding a command is adding an entry; a group of commands (``limits set``, ``limits show``)
is an entry whose ``actions`` are entries too. Every command reads the database URL from
``--url`` or ``DATABASE_URL``. Bad input gets one line on standard error that says what to
do, and exit status 2 (usage) or 1 (anything else); never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from sqla_proletarian import __version__
from sqla_proletarian.cli.common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    PROG,
    Command,
    UsageError,
    _error,
    _one_line,
    explain,
    parse_duration,
)
from sqla_proletarian.cli.control import CANCEL, ENQUEUE, LIMITS, PAUSE, RESUME
from sqla_proletarian.cli.dashboard import DASHBOARD
from sqla_proletarian.cli.inspection import FAILED, JOBS, PRUNE, RETRY_FAILED, STATUS
from sqla_proletarian.cli.schema import ALEMBIC_REVISION, INSTALL
from sqla_proletarian.cli.worker import WORKER, load_handler, load_periodic_jobs
from sqla_proletarian.errors import ConfigurationError, InvalidJobError

__all__ = [
    "COMMANDS",
    "build_parser",
    "explain",
    "load_handler",
    "load_periodic_jobs",
    "main",
    "parse_duration",
]

COMMANDS: tuple[Command, ...] = (
    INSTALL,
    ALEMBIC_REVISION,
    WORKER,
    ENQUEUE,
    STATUS,
    JOBS,
    FAILED,
    RETRY_FAILED,
    PAUSE,
    RESUME,
    LIMITS,
    CANCEL,
    PRUNE,
    DASHBOARD,
)


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors in one line; an option no command knows is refused by
    the command it was given to, with the nearest option it has ("did you mean")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The commands' parsers, by name (``limits set`` for a group's), the top-level
        #: parser's.
        self.commands: dict[str, _Parser] = {}

    def error(self, message: str) -> NoReturn:
        command = None if self.prog == PROG else self.prog.removeprefix(f"{PROG} ")
        _error(command, f"{message} (see {self.prog} --help)")
        raise SystemExit(EXIT_USAGE)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            parser = self.commands.get(_command_name(parsed), self)
            parser.error(parser.unrecognized(unknown))
        return parsed

    def unrecognized(self, unknown: list[str]) -> str:
        """argparse's message for arguments this parser does not know, and the option the
        first mistyped one most likely meant."""
        message = f"unrecognized arguments: {' '.join(unknown)}"
        known = [name for action in self._actions for name in action.option_strings]
        for word in unknown:
            if word.startswith("--"):
                close = difflib.get_close_matches(word.partition("=")[0], known, n=1)
                if close:
                    return f"{message}; did you mean {close[0]}?"
        return message


def _add_common_arguments(parser: argparse.ArgumentParser, default: object) -> None:
    """``--url`` and ``--log-level``, taken before the command or after it."""
    parser.add_argument(
        "--url",
        default=default,
        help="the database URL (default: the DATABASE_URL environment variable)",
    )
    parser.add_argument(
        "--log-level",
        default=default,
        choices=("debug", "info", "warning", "error"),
        help="the library's log level (worker: info; other commands: warning)",
    )


def build_parser() -> _Parser:
    # After the command the options only override what was given before it.
    common = _Parser(add_help=False)
    _add_common_arguments(common, argparse.SUPPRESS)
    parser = _Parser(
        prog=PROG,
        description="A durable job queue in your SQLAlchemy database: commands.",
        epilog="examples:\n"
        + "\n".join(
            f"  {example.example}" for command in COMMANDS for example in _examples(command)
        )
        + f"\n\n`{PROG} COMMAND --help` tells more.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common_arguments(parser, None)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        _add_command(parser, subparsers, command, common, "")
    return parser


def _add_command(
    parser: _Parser, subparsers: Any, command: Command, common: _Parser, group: str
) -> None:
    """The parser of ``command`` (of the group ``group``, if any), and its actions'."""
    sub: _Parser = subparsers.add_parser(
        command.name,
        parents=[common],
        help=command.summary,
        description=command.summary[:1].upper() + command.summary[1:] + ".",
        epilog=(f"{command.details}\n" if command.details else "")
        + "example"
        + ("s" if command.actions else "")
        + ":\n"
        + "\n".join(f"  {example.example}" for example in _examples(command)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for names, options in command.arguments:
        sub.add_argument(*names, **options)
    name = f"{group} {command.name}".strip()
    parser.commands[name] = sub
    if command.actions:
        actions = sub.add_subparsers(dest="action", metavar="ACTION", required=True)
        for action in command.actions:
            _add_command(parser, actions, action, common, name)
    else:
        sub.set_defaults(run=command.run)


def _examples(command: Command) -> tuple[Command, ...]:
    """The commands whose examples show ``command``: itself, or its actions."""
    return command.actions or (command,)


def _command_name(args: argparse.Namespace) -> str:
    """The command given, with its action for a group's (``limits set``); empty for none."""
    return " ".join(
        name for name in (getattr(args, "command", None), getattr(args, "action", None)) if name
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; the process's exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    _configure_logging(args.log_level or ("info" if args.command == "worker" else "warning"))
    command = _command_name(args)
    try:
        status: int = args.run(args)
    except (UsageError, InvalidJobError) as exc:
        return _error(command, _one_line(exc), EXIT_USAGE)
    except ConfigurationError as exc:
        code = EXIT_USAGE if args.command == "worker" else EXIT_FAILURE
        return _error(command, _one_line(exc), code)
    except KeyboardInterrupt:
        return _error(command, "interrupted", EXIT_INTERRUPTED)
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except Exception as exc:
        return _error(command, explain(exc), EXIT_FAILURE)
    return status


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("sqla_proletarian").setLevel(level.upper())

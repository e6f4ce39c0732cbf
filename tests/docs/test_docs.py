"""Every code block of every ``docs/**/*.md`` page does what the page says: one test a page;
and every shell block of README.md runs (or is marked as not runnable) the same way.

The convention (what a page may contain):

- A ```` ```python ```` block is executed; the page's python blocks run in order in one
  namespace, in a fresh temporary directory, with ``DATABASE_URL`` set to
  ``sqlite:///<tmp>/app.db``.
- A ```` ```console ```` block: each line starting with ``$ `` is run with bash in that
  directory (the venv's ``bin`` first on ``PATH``, the directory on ``PYTHONPATH``) and must
  exit 0 within 60 s (a plain ``sqla-proletarian ARGS`` command, without shell syntax, runs
  in the page's own interpreter through the command line's ``main()``, as its console
  script would) (a line ending in ``\\`` continues on the next); other lines are sample
  output and are not compared. A console block without any ``$ `` line is all commands (each
  line but blank ones and ``#`` comments).
- A ```` ```bash ````, ```` ```sh ```` or ```` ```shell ```` block is one script, run with
  ``bash -e`` in that directory (60 s).
- A shell block (console, bash, sh, shell) right after ``<!-- not run: WHY -->`` is not run,
  because running it would install software, start something that runs until stopped, or
  need what the page cannot provide; WHY says which, and may not be empty. Its commands are
  still checked with ``bash -n``, so a shell syntax error fails the page.
- A console block right after ``<!-- output checked -->`` has its sample output compared: what
  each command prints on stdout must be the lines that follow it, up to the next ``$ `` line.
- A block right after ``<!-- file: NAME -->`` is not executed but written to ``NAME`` in that
  directory, and checked by parsing (``.py`` compiled, ``ini``/``.service`` with
  configparser, ``toml`` with tomllib, ``json``, ``bash -n``); its language must be one of
  ``WRITABLE`` (a typo fails the page).
- Any other block (no language, or another language without a file marker) fails the page.

README.md follows the same rules for its shell blocks only: its one Python block is the
tour's example (tests/integration/test_examples.py runs it), and its other blocks show output.

Each page runs in a subprocess of its own (``page_runner.py``), so pages cannot see each
other's modules, engines or threads. A failure names the page and the line of the block.
The time limits (``PAGE_TIMEOUT``, ``COMMAND_TIMEOUT``) grow with the machine's load.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

import sqla_proletarian as sp

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RUNNER = Path(__file__).with_name("page_runner.py")
VENV_BIN = Path(sys.executable).parent
#: Seconds a whole page may take on an idle machine (its console commands have 60 s each);
#: both limits grow with the machine's load (``load_factor``).
PAGE_TIMEOUT = 110
COMMAND_TIMEOUT = 60
#: The most the limits grow: a page that needs more is stuck, not slow.
MAX_LOAD_FACTOR = 5.0

FENCE = re.compile(r"^(?P<indent> {0,12})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
FILE_MARKER = re.compile(r"^\s*<!--\s*file:\s*(?P<name>\S+)\s*-->\s*$")
NOT_RUN_MARKER = re.compile(r"^\s*<!--\s*not run:(?P<why>.*?)-->\s*$")
OUTPUT_MARKER = re.compile(r"^\s*<!--\s*output checked\s*-->\s*$")
#: Languages of the blocks that run through bash.
SHELL = ("console", "bash", "sh", "shell")
#: Languages a page may run without a file marker.
RUNNABLE = ("python", *SHELL)
#: Languages a file block may have (those with a parser are checked by page_runner.py).
WRITABLE = (
    *RUNNABLE,
    *("py", "ini", "systemd", "toml", "json", "dockerfile", "sql"),
    *("yaml", "text", "mako", "nginx", "env"),
)


class PageError(Exception):
    """A page breaks the docs convention (before anything of it runs)."""


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    language: str
    text: str
    file: str | None = None
    #: The shell commands, each with its line: run, or only checked with ``bash -n`` when
    #: ``not_run`` says why not.
    commands: list[tuple[int, str]] = field(default_factory=list)
    not_run: str | None = None
    #: Under ``<!-- output checked -->``: the stdout each command must print.
    outputs: list[str] | None = None


def parse_page(path: Path, text: str | None = None, *, shell_only: bool = False) -> list[Block]:
    """The page's code blocks, each with its line; a block that breaks the rules raises.
    With ``shell_only`` (the README), only the shell blocks and the files they may use."""
    name = display_name(path)
    lines = (path.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    marker: str | None = None
    not_run: tuple[int, str] | None = None
    checked: int | None = None
    index = 0
    while index < len(lines):
        line = lines[index]
        found = FILE_MARKER.match(line)
        skipped = NOT_RUN_MARKER.match(line)
        if found:
            marker = found["name"]
            index += 1
            continue
        if OUTPUT_MARKER.match(line):
            checked = index + 1
            index += 1
            continue
        if skipped:
            not_run = (index + 1, skipped["why"].strip())
            if not not_run[1]:
                raise PageError(
                    f"{name}:{index + 1}: <!-- not run: --> without a reason: say why the "
                    "block cannot run, e.g. <!-- not run: starts a server that runs until "
                    "stopped -->"
                )
            index += 1
            continue
        opening = FENCE.match(line)
        if not opening:
            if line.strip():
                marker = None
                if not_run is not None or checked is not None:
                    where, what = (
                        (not_run[0], "not run:") if not_run else (checked, "output checked")
                    )
                    raise PageError(
                        f"{name}:{where}: <!-- {what} --> must come right before the "
                        "shell block it marks"
                    )
            index += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        language = opening["info"].strip().split(" ")[0].lower()
        start = index + 1
        body: list[str] = []
        index += 1
        while index < len(lines):
            closing = lines[index].strip()
            if closing.startswith(fence[0] * len(fence)) and not closing.strip(fence[0]):
                break
            body.append(lines[index][indent:] if lines[index][:indent].isspace() else lines[index])
            index += 1
        else:
            raise PageError(f"{name}:{start}: the code block is never closed")
        index += 1
        block = Block(line=start, language=language, text="\n".join(body) + "\n", file=marker)
        block.not_run = not_run[1] if not_run is not None else None
        check_output, marker, not_run, checked = checked is not None, None, None, None
        if block.not_run is not None and (language not in SHELL or block.file is not None):
            raise PageError(
                f"{name}:{start}: <!-- not run: --> marks only a shell block "
                f"({', '.join(SHELL)}) that is not a file; this is a ```{language} block"
            )
        if shell_only and language not in SHELL and block.file is None:
            continue
        if block.file is not None and language not in WRITABLE:
            raise PageError(
                f"{name}:{start}: unknown language {language!r} for {block.file}: use one of "
                f"{', '.join(WRITABLE)}"
            )
        if block.file is None:
            if not language:
                raise PageError(
                    f"{name}:{start}: a code block without a language: mark it ```python or "
                    "```console, or put <!-- file: NAME --> before it"
                )
            if language not in RUNNABLE:
                raise PageError(
                    f"{name}:{start}: a ```{language} block must follow <!-- file: NAME --> "
                    "(only python and console blocks run unmarked)"
                )
        if block.file is None and language in SHELL:
            if language == "console":
                block.commands = console_commands(block, body)
            elif block.text.strip():
                block.commands = [(start + 1, block.text)]
            if not block.commands:
                raise PageError(f"{name}:{start}: a ```{language} block without a command")
        if check_output:
            if language != "console" or block.file or block.not_run:
                raise PageError(
                    f"{name}:{start}: <!-- output checked --> marks only a console block that runs"
                )
            block.outputs = console_outputs(block, body)
        blocks.append(block)
    return blocks


def console_commands(block: Block, body: list[str]) -> list[tuple[int, str]]:
    """The ``$ `` lines of a console block (all its lines when it has none), with their
    line numbers; a line ending in a backslash continues on the next."""
    prompted = any(line.startswith("$ ") for line in body)
    commands: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for offset, line in enumerate(body, start=block.line + 1):
        if pending is not None:
            pending = (pending[0], pending[1] + "\n" + line)
        elif line.startswith("$ "):
            pending = (offset, line[2:])
        elif not prompted and line.strip() and not line.lstrip().startswith("#"):
            pending = (offset, line)
        else:
            continue
        if not pending[1].endswith("\\"):
            commands.append(pending)
            pending = None
    if pending is not None:
        commands.append(pending)
    return commands


def console_outputs(block: Block, body: list[str]) -> list[str]:
    """The sample output of each command of a console block: the lines after it, up to the
    next command."""
    firsts = [line - block.line - 1 for line, _ in block.commands]
    outputs = []
    for (first, (_, command)), end in zip(
        zip(firsts, block.commands, strict=True), [*firsts[1:], len(body)], strict=True
    ):
        lines = body[first + command.count("\n") + 1 : end]
        outputs.append("\n".join(text.rstrip() for text in lines).strip("\n"))
    return outputs


def display_name(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def load_factor() -> float:
    """How many times slower than on an idle machine a page may run now: the runnable
    processes per core (the 1-minute load average), at least 1, at most MAX_LOAD_FACTOR."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover - not on Linux or macOS
        return 1.0
    return min(MAX_LOAD_FACTOR, max(1.0, load / (os.cpu_count() or 1)))


def communicate_scaled(
    process: subprocess.Popen[str], timeout: float
) -> tuple[str, str, float | None]:
    """Wait for ``process`` to end within ``timeout`` seconds times the highest load factor
    seen meanwhile: its stdout, its stderr, and None; or, when it is still running then, it
    is killed and the limit it was given comes last."""
    start, factor = time.monotonic(), load_factor()
    while True:
        try:
            stdout, stderr = process.communicate(timeout=1)
            return stdout, stderr, None
        except subprocess.TimeoutExpired:
            factor = max(factor, load_factor())
            if time.monotonic() - start > timeout * factor:
                process.kill()
                stdout, stderr = process.communicate()
                return stdout, stderr, timeout * factor


def run_page(
    path: Path, workdir: Path, text: str | None = None, *, shell_only: bool = False
) -> None:
    """Run every block of a page in ``workdir``; fail the test with the page and line."""
    name = display_name(path)
    try:
        blocks = parse_page(path, text, shell_only=shell_only)
    except PageError as exc:
        pytest.fail(str(exc), pytrace=False)
    spec = workdir / ".page-blocks.json"
    result = workdir / ".page-result.json"
    spec.write_text(json.dumps({"page": name, "blocks": [asdict(b) for b in blocks]}))
    env = dict(os.environ)
    env.update(
        DATABASE_URL=f"sqlite:///{workdir / 'app.db'}",
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        # The page's folder, then the package under test (a checkout's, when it is on the path).
        PYTHONPATH=os.pathsep.join(filter(None, [str(workdir), env.get("PYTHONPATH")])),
        PYTHONDONTWRITEBYTECODE="1",
        SP_PAGE_COMMAND_TIMEOUT=f"{COMMAND_TIMEOUT * load_factor():.0f}",
    )
    env.pop("PYTEST_ADDOPTS", None)
    with subprocess.Popen(
        [sys.executable, str(RUNNER), str(spec), str(result)],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    ) as process:
        stdout, stderr, limit = communicate_scaled(process, PAGE_TIMEOUT)
    if limit is not None:
        pytest.fail(f"{name}: the page did not finish within {limit:.0f} s\n{stderr}")
    if not result.exists():
        pytest.fail(
            f"{name}: the page's runner died (exit {process.returncode})\n"
            f"--- stdout\n{stdout}--- stderr\n{stderr}",
            pytrace=False,
        )
    failure = json.loads(result.read_text())["failure"]
    if failure is not None:
        pytest.fail(
            f"{name}:{failure['line']}: the ```{failure['language']} block failed\n"
            f"{failure['error']}\n--- the page's output\n{stdout}{stderr}",
            pytrace=False,
        )


PAGES = sorted(DOCS.glob("**/*.md"))


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_runs_as_written(page: Path, tmp_path: Path) -> None:
    """Each block of the page runs (python, console) or parses (file blocks) as written."""
    run_page(page, tmp_path)


def test_readme_shell_blocks_run_as_written(tmp_path: Path) -> None:
    """Each shell block of README.md runs, or is marked as not runnable and parses as bash."""
    run_page(ROOT / "README.md", tmp_path, shell_only=True)


def test_api_reference_mentions_every_public_name() -> None:
    """docs/reference/api.md names every name in ``sqla_proletarian.__all__``."""
    text = (DOCS / "reference" / "api.md").read_text()
    missing = [name for name in sp.__all__ if f"`{name}`" not in text and f"{name}(" not in text]
    assert not missing, f"docs/reference/api.md does not mention: {missing}"


def test_runner_refuses_unmarked_and_unknown_blocks(tmp_path: Path) -> None:
    """A block without a language, or in another language without a file marker, is refused
    before anything runs, naming the page and the line."""
    page = tmp_path / "page.md"
    for opening, expected in (("```", "without a language"), ("```yaml", "```yaml block")):
        text = f"# Title\n\nSome text.\n\n{opening}\nkey: value\n```\n"
        with pytest.raises(PageError, match=rf"page\.md:5: .*{re.escape(expected)}"):
            parse_page(page, text)
    assert parse_page(page, "<!-- file: app.yaml -->\n```yaml\nkey: value\n```\n")[0].file
    with pytest.raises(PageError, match=r"page\.md:2: unknown language 'pyhton'"):
        parse_page(page, "<!-- file: app.py -->\n```pyhton\nx = 1\n```\n")
    with pytest.raises(PageError, match=r"page\.md:1: <!-- not run: --> without a reason"):
        parse_page(page, "<!-- not run: -->\n```console\n$ make test\n```\n")
    with pytest.raises(PageError, match=r"page\.md:2: <!-- not run: --> marks only a shell"):
        parse_page(page, "<!-- not run: slow -->\n```python\nx = 1\n```\n")
    with pytest.raises(PageError, match=r"page\.md:2: <!-- output checked --> marks only a"):
        parse_page(page, "<!-- output checked -->\n```bash\necho hi\n```\n")
    with pytest.raises(PageError, match=r"page\.md:1: <!-- not run: --> must come right before"):
        parse_page(page, "<!-- not run: slow -->\nSome text.\n\n```console\n$ true\n```\n")


def test_runner_failure_names_page_and_line(tmp_path: Path) -> None:
    """A failing python block, a failing command and a broken file each fail the page with
    its name and the line of the failing block; blocks run in order in one namespace."""
    page = tmp_path / "page.md"
    cases = {
        "```python\nx = 1\n```\n\n```python\nassert x == 2, 'x is 1'\n```\n": (
            ":5: the ```python block",
            "x is 1",
        ),
        "```console\n$ true\nsample output\n$ exit 3\n```\n": (":1: the ```console", "exit 3"),
        "<!-- file: app.toml -->\n```toml\n[broken\n```\n": (":2: the ```toml", "TOMLDecode"),
        "```bash\nfalse\necho never\n```\n": (":1: the ```bash", "exited with 1"),
        "```console\ntrue\nexit 4\n```\n": (":1: the ```console", "exit 4"),
        "<!-- output checked -->\n```console\n$ echo one\none\n$ echo two; echo 3\ntwo\n```\n": (
            ":2: the ```console",
            "printed what the page does not show",
        ),
        "<!-- not run: runs until stopped -->\n```console\nworker tasks:make() --burst\n```\n": (
            ":2: the ```console",
            "syntax error",
        ),
        # In the page's interpreter: a failing command's status and error; a wrong output.
        "```console\n$ sqla-proletarian status --url sqlite:///no/such/dir/x.db\n```\n": (
            ":1: the ```console",
            "exited with 1\n--- stdout\n--- stderr\nsqla-proletarian status: error:",
        ),
        "<!-- output checked -->\n```console\n"
        '$ sqla-proletarian pause || echo "exit status $?"\nexit status 9\n```\n': (
            "--- the page\nexit status 9\n--- printed\nexit status 2",
            ":2: the ```console",
        ),
        "<!-- output checked -->\n```console\n"
        "$ sqla-proletarian --version\nsqla-proletarian 9\n```\n": (
            f"printed what the page does not show\n--- the page\nsqla-proletarian 9\n"
            f"--- printed\nsqla-proletarian {sp.__version__}",
            ":2: the ```console",
        ),
    }
    for text, (where, why) in cases.items():
        workdir = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        workdir.mkdir()
        with pytest.raises(pytest.fail.Exception) as failed:
            run_page(page, workdir, text)
        assert where in str(failed.value) and why in str(failed.value), str(failed.value)


LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def heading_anchors(text: str) -> set[str]:
    """The anchors a Markdown renderer gives a page's headings (GitHub's slugs)."""
    anchors = set()
    in_code = False
    for line in text.splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower().replace("`", "")
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_links_between_pages_resolve() -> None:
    """Every relative link of a docs page names a file that exists, and a heading of it."""
    broken = []
    for page in PAGES:
        for found in LINK.finditer(page.read_text()):
            target = found["target"]
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not resolved.exists():
                broken.append(f"{where}: no such file")
            elif (
                anchor
                and resolved.suffix == ".md"
                and anchor not in heading_anchors(resolved.read_text())
            ):
                broken.append(f"{where}: no heading #{anchor} there")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_runner_runs_plain_commands_in_its_own_interpreter() -> None:
    """A plain ``sqla-proletarian ARGS`` command (with its own environment variables, and
    the pages' ``|| echo "exit status $?"``) runs through ``main()`` in the page's
    interpreter; a command with shell syntax outside quotes, or one that runs until
    stopped, goes to bash."""
    from page_runner import Call, in_process_call

    assert in_process_call('sqla-proletarian enqueue a \'{"b": [1, "$x"]}\' --in 5m') == Call(
        ["enqueue", "a", '{"b": [1, "$x"]}', "--in", "5m"], {}, False
    )
    assert in_process_call(
        "U=sqlite:///b.db sqla-proletarian worker 'app:make()' --burst || echo \"exit status $?\""
    ) == Call(["worker", "app:make()", "--burst"], {"U": "sqlite:///b.db"}, True)
    for command in (
        'sqla-proletarian worker t:h --burst || echo "failed"',
        'sqla-proletarian cancel "$(sqla-proletarian enqueue x)"',
        "cd shop && sqla-proletarian install",
        "sqla-proletarian dashboard --port 8000",
        "sqla-proletarian jobs > jobs.txt",
        "alembic upgrade head",
    ):
        assert in_process_call(command) is None, command

"""MkDocs hook: links from a docs page to a file of the repository outside ``docs/``.

The pages link to ``../examples/*.py``, ``../../benchmarks/results.md`` and the like, which
work where the repository is read (GitHub, an editor) but are not pages of the site. On the
site such a link points to the file in the repository when ``repo_url`` is set in
mkdocs.yml, and otherwise becomes its plain text, so ``mkdocs build --strict`` still fails on
every other broken link.

The generated reference of the package (``reference/python/package.md``) must document every
name of ``sqla_proletarian.__all__``: a name it misses fails the build.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s#]+)(?P<anchor>#[^)\s]*)?\)")

#: The generated page of the package's exports.
PACKAGE_PAGE = "reference/python/package.md"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Rewrite the page's links that leave the docs folder for a file of the repository."""
    docs = Path(config["docs_dir"]).resolve()
    root = Path(config["config_file_path"]).resolve().parent
    source = Path(page.file.abs_src_path).resolve().parent
    repo_url = (config.get("repo_url") or "").rstrip("/")

    def rewrite(found: re.Match[str]) -> str:
        target = found["target"]
        if re.match(r"[a-z]+:", target):
            return found[0]
        path = (source / target).resolve()
        if path.is_relative_to(docs) or not path.is_relative_to(root) or not path.exists():
            return found[0]  # a page of the site, or a broken link for --strict to report
        if not repo_url:
            return found["text"]
        where = path.relative_to(root).as_posix()
        return f"[{found['text']}]({repo_url}/blob/main/{where}{found['anchor'] or ''})"

    return LINK.sub(rewrite, markdown)


def exported_names(init: Path) -> list[str]:
    """``__all__`` of a package's ``__init__.py``, read without importing it."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise PluginError(f"{init} has no __all__")


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Fail the build when the package's generated reference leaves out an exported name."""
    if page.file.src_uri != PACKAGE_PAGE:
        return html
    root = Path(config["config_file_path"]).resolve().parent
    documented = set(re.findall(r'id="sqla_proletarian\.(?:[a-z_]+\.)?(\w+)"', html))
    missing = [
        n for n in exported_names(root / "sqla_proletarian" / "__init__.py") if n not in documented
    ]
    if missing:
        raise PluginError(
            f"{PACKAGE_PAGE} documents no {', '.join(missing)}: add a `::: "
            "sqla_proletarian.MODULE.NAME` entry for each"
        )
    return html

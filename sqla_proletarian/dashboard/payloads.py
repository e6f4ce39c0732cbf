"""A job's payload as the detail page shows it: indented JSON, every value escaped, long
strings and large arrays or objects folded into ``<details>`` that open on a click.

Payloads the JSON parser cannot read (another serializer's) are shown as the stored text.
"""

from __future__ import annotations

import json
from typing import Any

from markupsafe import Markup

#: Strings longer than this are folded, showing their first ``PREVIEW`` characters.
LONG_STRING = 120
PREVIEW = 60
#: Arrays and objects with more items than this are folded.
MANY_ITEMS = 12
#: Nesting deeper than this is shown as compact JSON text.
MAX_DEPTH = 40
_INDENT = "  "


def render_payload(text: str) -> Markup:
    """The payload's HTML (inside a ``<pre>``)."""
    try:
        value = json.loads(text)
    except ValueError:
        return Markup('<span class="raw">{}</span>').format(text)
    return _value(value, 0)


def _value(value: Any, depth: int) -> Markup:
    if isinstance(value, dict) and value and depth < MAX_DEPTH:
        items = [
            Markup('{}<span class="key">{}</span>: {}').format(
                _INDENT * (depth + 1), json.dumps(key), _value(item, depth + 1)
            )
            for key, item in value.items()
        ]
        return _container("{", "}", items, depth, f"{len(items)} keys")
    if isinstance(value, list) and value and depth < MAX_DEPTH:
        items = [Markup("{}{}").format(_INDENT * (depth + 1), _value(v, depth + 1)) for v in value]
        return _container("[", "]", items, depth, f"{len(items)} items")
    text = json.dumps(value, ensure_ascii=False)
    if isinstance(value, str) and len(value) > LONG_STRING:
        return Markup(
            '<details class="fold"><summary><span class="string preview">{}…</span> '
            '<span class="size">({} characters)</span></summary> '
            '<span class="string">{}</span></details>'
        ).format(text[: PREVIEW + 1], len(value), text)
    kind = "string" if isinstance(value, str) else "literal"
    return Markup('<span class="{}">{}</span>').format(kind, text)


def _container(opening: str, closing: str, items: list[Markup], depth: int, size: str) -> Markup:
    body = Markup(",\n").join(items)
    end = Markup("{}{}").format(_INDENT * depth, closing)
    if len(items) > MANY_ITEMS:
        return Markup(
            '<details class="fold"><summary>{} <span class="size">{}</span>'
            '<span class="closing"> {}</span></summary>\n{}\n{}</details>'
        ).format(opening, size, closing, body, end)
    return Markup("{}\n{}\n{}").format(opening, body, end)

"""Payload serialization: JSON that keeps datetimes, dates, UUIDs and Decimals. No pickle."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable
from datetime import date, datetime
from decimal import Decimal
from typing import Any, Protocol

from sqla_proletarian.errors import PayloadSerializationError

#: The key that marks a tagged value in the JSON text; refused as a key of user dicts.
TAG = "__proletarian__"


class Serializer(Protocol):
    """Turns a payload into text and back. ``dumps`` raises PayloadSerializationError."""

    def dumps(self, payload: Any) -> str: ...

    def loads(self, text: str) -> Any: ...


#: The keys and indexes from the payload down to a value.
Path = tuple[str | int, ...]


def _where(path: Path) -> str:
    """A value's place, as an error names it: ``payload['items'][0]``."""
    return "payload" + "".join(f"[{step!r}]" for step in path)


def _json_writer() -> Callable[[Any], str]:
    """The JSON text of a value: CPython's C encoder made once (``JSONEncoder.encode`` makes
    it anew for every value, most of the time of a small payload), where it gives what
    ``encode`` gives; else ``encode``."""
    encoder = json.JSONEncoder(ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return encoder.encode
    try:
        c_encode = make(
            None,
            encoder.default,
            json.encoder.encode_basestring_ascii,
            None,
            ":",
            ",",
            False,
            False,
            False,
        )
    except TypeError:
        return encoder.encode

    def write(value: Any) -> str:
        return "".join(c_encode(value, 0))

    sample = {"a": [1, 2.5, "\u00e9\n", None, True, {"b": -0.0}], "c": "x"}
    return write if write(sample) == encoder.encode(sample) else encoder.encode


#: The JSON text of a payload (that needs no tags, or whose tags are in place).
_to_json = _json_writer()

#: Scalars that JSON keeps as they are (exactly these types: subclasses take the walk).
_PLAIN_SCALARS = frozenset({type(None), bool, int, str})
#: Deeper payloads take the walk (which also finds cycles).
_PLAIN_DEPTH = 32


def _plain(value: Any, depth: int) -> bool:
    """Whether ``value`` is JSON as it stands (the usual payload: dicts with string keys,
    lists, strings, numbers), so that the walk that tags values and names bad ones can be
    skipped; False means "walk it", never "refused"."""
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return True
    if kind is float:
        return math.isfinite(value)
    if depth >= _PLAIN_DEPTH:
        return False
    scalars = _PLAIN_SCALARS
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str or key == TAG:
                return False
            if type(item) not in scalars and not _plain(item, depth + 1):
                return False
        return True
    if kind is list or kind is tuple:
        for item in value:
            if type(item) not in scalars and not _plain(item, depth + 1):
                return False
        return True
    return False


def _tagged(kind: str, value: str) -> dict[str, str]:
    return {TAG: kind, "value": value}


class JsonSerializer:
    """Strict JSON: every accepted value comes back equal, except that a tuple comes back
    as a list (JSON has one sequence type).

    Accepted: None, bool, int, finite float, str, list, tuple, dict with str keys, datetime,
    date, UUID and Decimal. NaN and infinities, non-string keys, cycles,
    sets, bytes and arbitrary objects are refused with a message naming where they are.
    """

    def dumps(self, payload: Any) -> str:
        if _plain(payload, 0):
            try:
                return _to_json(payload)
            except ValueError:
                pass  # a very long int: the walk below says what to do
        try:
            return _to_json(self._encode(payload, (), set()))
        except RecursionError:
            raise PayloadSerializationError(
                "payload is nested too deeply to store as JSON; flatten it", None
            ) from None
        except PayloadSerializationError:
            raise
        except ValueError as exc:
            # int -> str conversion refuses very long ints (sys.get_int_max_str_digits()).
            raise PayloadSerializationError(
                f"payload cannot be written as JSON ({exc}); store very long numbers as strings",
                payload,
            ) from None

    def loads(self, text: str) -> Any:
        return json.loads(text, object_hook=self._decode_object)

    def _encode(self, value: Any, path: Path, seen: set[int]) -> Any:
        # ``path`` is the keys and indexes down to ``value``, spelled out only in an error.
        if value is None or isinstance(value, bool | str):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            if not math.isfinite(value):
                raise PayloadSerializationError(
                    f"{_where(path)} is {value!r}; NaN and infinities have no JSON form: "
                    "use None or a string",
                    value,
                )
            return float(value)
        if isinstance(value, datetime):
            return _tagged("datetime", value.isoformat())
        if isinstance(value, date):
            return _tagged("date", value.isoformat())
        if isinstance(value, uuid.UUID):
            return _tagged("uuid", str(value))
        if isinstance(value, Decimal):
            if not value.is_finite():
                raise PayloadSerializationError(
                    f"{_where(path)} is Decimal {value}; only finite decimals can be stored", value
                )
            return _tagged("decimal", str(value))
        if isinstance(value, list | tuple | dict):
            if id(value) in seen:
                raise PayloadSerializationError(
                    f"{_where(path)} contains itself (a cycle); pass a tree of values", value
                )
            seen.add(id(value))
            try:
                if isinstance(value, dict):
                    return self._encode_dict(value, path, seen)
                return [self._encode(item, (*path, i), seen) for i, item in enumerate(value)]
            finally:
                seen.discard(id(value))
        raise PayloadSerializationError(
            f"{_where(path)} is a {type(value).__name__}, which cannot be stored as JSON; "
            "pass None, bool, int, float, str, list, dict, datetime, date, UUID or Decimal",
            value,
        )

    def _encode_dict(self, value: dict[Any, Any], path: Path, seen: set[int]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise PayloadSerializationError(
                    f"{_where(path)} has the key {key!r} of type {type(key).__name__}; "
                    "JSON keys must be strings",
                    value,
                )
            if key == TAG:
                raise PayloadSerializationError(
                    f"{_where(path)} uses the reserved key {TAG!r}; rename it", value
                )
            out[key] = self._encode(item, (*path, key), seen)
        return out

    @staticmethod
    def _decode_object(obj: dict[str, Any]) -> Any:
        kind = obj.get(TAG)
        if kind is None or len(obj) != 2 or "value" not in obj:
            return obj
        text = obj["value"]
        if kind == "datetime":
            return datetime.fromisoformat(text)
        if kind == "date":
            return date.fromisoformat(text)
        if kind == "uuid":
            return uuid.UUID(text)
        if kind == "decimal":
            return Decimal(text)
        return obj


#: The serializer used when none is given.
DEFAULT_SERIALIZER: Serializer = JsonSerializer()

"""Payload serialization: JSON that keeps datetimes, dates, UUIDs and Decimals. No pickle."""

from __future__ import annotations

import json
import math
import uuid
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
        try:
            encoded = self._encode(payload, (), set())
            return json.dumps(encoded, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
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

"""JsonSerializer: strict JSON whose values come back equal, and clear refusals of the rest."""

from __future__ import annotations

import json
import math
import uuid
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest

import sqla_proletarian as sp
from sqla_proletarian.serialization import DEFAULT_SERIALIZER, TAG

SERIALIZER = sp.JsonSerializer()


@pytest.mark.parametrize(
    "payload",
    [
        None,
        True,
        0,
        -(2**70),
        1.5,
        -0.0,
        "",
        "héllo ✓ \U0001f600",
        [],
        {},
        [1, "two", None, [3.25]],
        {"a": {"b": [1, {"c": None}]}},
        datetime(2024, 2, 29, 23, 59, 59, 999999, tzinfo=UTC),
        datetime(2024, 2, 29, 23, 59, 59, 123456, tzinfo=timezone(timedelta(hours=-5))),
        datetime(2024, 1, 1, 8, 30),
        date(1999, 12, 31),
        uuid.UUID("12345678-1234-5678-1234-567812345678"),
        Decimal("1.10"),
        Decimal("-12345678901234567890.000000001"),
        {"when": date(2020, 1, 1), "ids": [uuid.UUID(int=1)], "price": Decimal("9.99")},
    ],
    ids=repr,
)
def test_accepted_payloads_come_back_equal(payload: Any) -> None:
    text = SERIALIZER.dumps(payload)
    assert isinstance(text, str)
    back = SERIALIZER.loads(text)
    assert back == payload
    assert type(back) is type(payload)


def test_datetimes_keep_their_utc_offset_and_microseconds() -> None:
    value = datetime(2024, 6, 1, 12, 0, 0, 1, tzinfo=timezone(timedelta(hours=2)))
    back = SERIALIZER.loads(SERIALIZER.dumps({"at": value}))["at"]
    assert back.utcoffset() == timedelta(hours=2)
    assert back.microsecond == 1


def test_decimals_keep_their_exact_digits() -> None:
    assert str(SERIALIZER.loads(SERIALIZER.dumps(Decimal("1.10")))) == "1.10"


def test_tuples_come_back_as_lists() -> None:
    assert SERIALIZER.loads(SERIALIZER.dumps((1, (2, 3)))) == [1, [2, 3]]


def test_the_same_list_twice_is_not_a_cycle() -> None:
    shared = [1, 2]
    assert SERIALIZER.loads(SERIALIZER.dumps({"a": shared, "b": [shared, shared]})) == {
        "a": [1, 2],
        "b": [[1, 2], [1, 2]],
    }


def test_the_text_is_plain_json_with_tagged_special_values() -> None:
    text = SERIALIZER.dumps({"d": date(2024, 1, 2), "n": 1})
    assert json.loads(text) == {"d": {TAG: "date", "value": "2024-01-02"}, "n": 1}
    assert text.isascii()


def test_a_dict_that_only_resembles_a_tag_is_returned_as_it_is() -> None:
    text = json.dumps({TAG: "unknown-kind", "value": "x"})
    assert SERIALIZER.loads(text) == {TAG: "unknown-kind", "value": "x"}


def test_the_default_serializer_is_a_json_serializer() -> None:
    assert isinstance(DEFAULT_SERIALIZER, sp.JsonSerializer)


def _cyclic_list() -> list[Any]:
    value: list[Any] = [1]
    value.append(value)
    return value


def _cyclic_dict() -> dict[str, Any]:
    value: dict[str, Any] = {}
    value["self"] = {"again": value}
    return value


class Thing:
    pass


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (math.nan, ["nan", "None or a string"]),
        ({"x": [math.inf]}, ["payload['x'][0]", "inf"]),
        (-math.inf, ["-inf"]),
        ({1: "a"}, ["key 1", "int", "strings"]),
        ({("a",): 1}, ["tuple", "strings"]),
        (_cyclic_list(), ["cycle"]),
        (_cyclic_dict(), ["cycle"]),
        ({1, 2}, ["set"]),
        ({"data": b"raw"}, ["payload['data']", "bytes"]),
        ([Thing()], ["payload[0]", "Thing"]),
        ({TAG: "datetime", "value": "2024-01-01"}, ["reserved key", TAG]),
        ({"nested": {TAG: 1}}, ["payload['nested']", "reserved key"]),
        (Decimal("NaN"), ["Decimal NaN", "finite"]),
        (Decimal("-Infinity"), ["finite"]),
        (Decimal("sNaN"), ["finite"]),
        (timedelta(seconds=1), ["timedelta"]),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, list) else None,
)
def test_payloads_that_would_not_come_back_equal_are_refused(
    payload: Any, words: list[str]
) -> None:
    with pytest.raises(sp.PayloadSerializationError) as info:
        SERIALIZER.dumps(payload)
    message = str(info.value)
    assert message.startswith("payload"), "the message names the place in the payload"
    assert "long numbers" not in message, "the refusal is not re-wrapped as another one"
    assert info.value.field == "payload"
    for word in words:
        assert word in message


def test_payload_serialization_error_is_an_invalid_job_error_and_a_proletarian_error() -> None:
    with pytest.raises(sp.PayloadSerializationError) as info:
        SERIALIZER.dumps({"s": {1}})
    assert isinstance(info.value, sp.InvalidJobError)
    assert isinstance(info.value, sp.ProletarianError)
    assert info.value.field == "payload"


def test_a_payload_nested_too_deeply_for_json_is_refused_with_a_proletarian_error() -> None:
    payload: list[Any] = []
    for _ in range(5000):
        payload = [payload]
    with pytest.raises(sp.PayloadSerializationError):
        SERIALIZER.dumps(payload)

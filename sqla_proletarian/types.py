"""Column types that behave the same on PostgreSQL, MySQL/MariaDB and SQLite."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import DateTime, Dialect, String, Text
from sqlalchemy.dialects import mysql
from sqlalchemy.types import TypeDecorator, TypeEngine

#: Longest queue name and job type, in characters.
MAX_NAME_LENGTH = 255


class UTCDateTime(TypeDecorator[datetime]):
    """An aware UTC datetime with microseconds: TIMESTAMPTZ, DATETIME(6), or text on SQLite.

    Naive datetimes are refused: a job's time is an instant, and guessing its zone loses jobs.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        if dialect.name == "postgresql":
            return dialect.type_descriptor(DateTime(timezone=True))
        return dialect.type_descriptor(DateTime())

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r}: give an aware datetime")
        value = value.astimezone(UTC)
        if dialect.name == "postgresql":
            return value
        return value.replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def name_type() -> TypeEngine[str]:
    """A queue name or job type: compared byte for byte (binary collation on MySQL)."""
    return String(MAX_NAME_LENGTH).with_variant(
        mysql.VARCHAR(MAX_NAME_LENGTH, charset="utf8mb4", collation="utf8mb4_bin"),
        "mysql",
        "mariadb",
    )


def payload_type() -> TypeEngine[str]:
    """Serialized payload text: TEXT, or LONGTEXT on MySQL (whose TEXT stops at 64 KiB)."""
    return Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")

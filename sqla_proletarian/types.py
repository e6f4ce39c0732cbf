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


class ExactName(TypeDecorator[str]):
    """A queue name or job type, compared exactly: case, accents and trailing spaces count.

    On MySQL and MariaDB a binary NO PAD collation (``utf8mb4_bin`` pads, so 'a' would equal
    'a '): ``utf8mb4_nopad_bin`` on MariaDB, ``utf8mb4_0900_bin`` on MySQL 8.
    """

    impl = String(MAX_NAME_LENGTH)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(
                mysql.VARCHAR(
                    MAX_NAME_LENGTH, charset="utf8mb4", collation=exact_collation(dialect)
                )
            )
        return dialect.type_descriptor(String(MAX_NAME_LENGTH))


def exact_collation(dialect: Dialect) -> str:
    """The binary, NO PAD utf8mb4 collation of a MySQL-family server."""
    return "utf8mb4_nopad_bin" if getattr(dialect, "is_mariadb", False) else "utf8mb4_0900_bin"


def name_type() -> TypeEngine[str]:
    """A queue name or job type column type."""
    return ExactName()


def payload_type() -> TypeEngine[str]:
    """Serialized payload text: TEXT, or LONGTEXT on MySQL (whose TEXT stops at 64 KiB)."""
    return Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")

"""What a failure records, on every backend and in both modes: the exception's type and message
first, then its whole traceback (the handler's own frames, chained causes, the innermost
frame), in the archive, in get_job and in the ``handle-job-exception`` log event; a traceback
too long for the archive keeps its head and its tail, within MAX_ERROR_BYTES of UTF-8 (which
MariaDB's TEXT column must hold, whatever the message's characters)."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import archived_job, enqueue_committed, events

import sqla_proletarian as sp
from sqla_proletarian.running import MAX_ERROR_BYTES

MODES = {"transaction": {}, "lease": {"lease_seconds": 30.0}}


def _read_settings(text: str) -> Any:
    """The user's helper the handler calls: json.loads raises deep inside the json package."""
    return json.loads(text)


def parse_settings(job_type: str, payload: Any) -> None:
    _read_settings(payload["settings"])


def _down_odd(depth: int) -> None:
    if depth == 0:
        raise ValueError("the bottom of the recursion")
    _down_even(depth - 1)


def _down_even(depth: int) -> None:
    _down_odd(depth - 1)


def recurse(job_type: str, payload: Any) -> None:
    """200 frames of the test module, two functions in turn (so no line repeats and
    the traceback module folds none)."""
    _down_odd(200)


def fail_with(job_type: str, payload: Any) -> None:
    raise ValueError(payload["message"])


def _error_of(engine: sa.Engine, job_id: Any) -> str:
    row = archived_job(engine, job_id)
    assert row is not None and row.status == "failure", row
    assert row.error is not None
    return row.error


def _one_failure(engine: sa.Engine, handler: Any, payload: Any, mode: str) -> str:
    job_id = enqueue_committed(engine, "work", payload)
    assert sp.process_next_job(engine, handler, **MODES[mode])
    return _error_of(engine, job_id)


@pytest.mark.parametrize("mode", MODES)
def test_a_failure_in_a_helper_keeps_the_handlers_frames_the_innermost_and_the_summary(
    engine: sa.Engine, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A json.loads that fails inside the handler's helper: the archive, get_job and the
    log event (a ``traceback`` attribute, not in the one-line message) show this file's
    frames and json's own, and the summary comes first as before."""
    caplog.set_level(logging.WARNING, logger="sqla_proletarian")
    job_id = enqueue_committed(engine, "work", {"settings": "{not json"})

    assert sp.process_next_job(engine, parse_settings, **MODES[mode])

    error = _error_of(engine, job_id)
    lines = error.splitlines()
    assert lines[0].startswith("json.decoder.JSONDecodeError: Expecting property name")
    assert lines[1] == "Traceback (most recent call last):"
    assert f'File "{__file__}"' in error
    assert "in parse_settings" in error and "in _read_settings" in error
    innermost = [line for line in lines if line.lstrip().startswith("File ")][-1]
    assert "json" in innermost and "decoder.py" in innermost, innermost
    assert lines[-1] == lines[0]
    detail = sp.get_job(engine, job_id)
    assert detail is not None and detail.error == error
    [record] = events(caplog.records, "handle-job-exception")
    assert record.traceback == error
    assert "\n" not in record.getMessage() and "JSONDecodeError" in record.getMessage()
    # Archived as failed: job-failed, once, with the same traceback.
    [failed] = events(caplog.records, "job-failed")
    assert (failed.levelno, failed.traceback, failed.job_id) == (logging.ERROR, error, job_id)
    assert "\n" not in failed.getMessage() and "JSONDecodeError" in failed.getMessage()


def test_a_retried_run_logs_its_traceback_too(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The run that is retried logs the same traceback as the one that fails for good."""
    caplog.set_level(logging.WARNING, logger="sqla_proletarian")
    enqueue_committed(engine, "work", {"settings": "{not json"})

    def once(context: sp.JobContext, exc: Exception) -> sp.RetryStrategy:
        return sp.RetryStrategy(retries=1, delays=[0])

    for _ in range(2):
        assert sp.process_next_job(engine, parse_settings, retry_strategy=once)

    tracebacks = [r.traceback for r in events(caplog.records, "handle-job-exception")]
    assert len(tracebacks) == 2
    # Only the run that failed for good logs job-failed.
    [failed] = events(caplog.records, "job-failed")
    assert failed.traceback == tracebacks[1] and failed.attempt == 2
    assert all(f'File "{__file__}"' in text and "in _read_settings" in text for text in tracebacks)


def test_a_chained_cause_is_kept_with_the_exception_it_caused(engine: sa.Engine) -> None:
    """``raise ... from`` keeps both tracebacks, the cause's first."""

    def handler(job_type: str, payload: Any) -> None:
        try:
            parse_settings(job_type, payload)
        except ValueError as exc:
            raise RuntimeError("the settings could not be read") from exc

    error = _one_failure(engine, handler, {"settings": "["}, "transaction")

    assert error.splitlines()[0] == "RuntimeError: the settings could not be read"
    cause = error.index("json.decoder.JSONDecodeError")
    assert (
        cause
        < error.index("direct cause of the following exception")
        < error.rindex("RuntimeError: the settings could not be read")
    )


@pytest.mark.parametrize("mode", MODES)
def test_a_200_frame_traceback_keeps_its_head_and_tail_within_the_bound(
    engine: sa.Engine, mode: str
) -> None:
    """Cut in the middle, at line ends, with a line that says how much went: the summary,
    the handler's own frame, the innermost frame and the exception's line are all kept."""
    error = _one_failure(engine, recurse, None, mode)

    assert len(error.encode()) <= MAX_ERROR_BYTES
    lines = error.splitlines()
    [marker] = [line for line in lines if line.startswith("[... ")]
    assert marker.endswith(" lines) cut here ...]") and " bytes (" in marker
    head, tail = error.split(marker)
    assert head.startswith("ValueError: the bottom of the recursion\nTraceback")
    assert "in recurse" in head and "in _down_odd" in head
    assert 'raise ValueError("the bottom of the recursion")' in tail
    assert tail.endswith("\nValueError: the bottom of the recursion")
    cut = int(marker.split()[1].replace(",", ""))
    frames = 2 * 200  # each frame has its File line and its source line at least
    assert cut > 0 and error.count(f'File "{__file__}"') < frames // 2


@pytest.mark.parametrize(
    ("character", "count", "whole"),
    [("🙂", 20_000, False), ("€", 4_800, True), ("é", 9_000, False)],
    ids=["80000-bytes", "14400-bytes", "18000-bytes"],
)
def test_non_ascii_messages_are_bounded_in_bytes_and_fit_mariadb(
    engine: sa.Engine, character: str, count: int, whole: bool
) -> None:
    """The bound counts UTF-8 bytes: 20,000 four-byte characters (80,000 bytes, beyond
    MariaDB's 65,535-byte TEXT; 16,384 characters of them would be 65,536) and 9,000
    two-byte ones (9,000 characters, under the bound in characters) are cut within
    MAX_ERROR_BYTES and keep the message's end; 14,400 bytes of message are kept whole."""
    message = f"start {character * count} end"

    error = _one_failure(engine, fail_with, {"message": message}, "transaction")

    assert len(error.encode()) <= MAX_ERROR_BYTES
    assert error.startswith(f"ValueError: start {character * 100}")
    assert error.endswith(f"ValueError: {message}" if whole else f"{character * 100} end")
    assert ("cut here ...]" in error) is not whole

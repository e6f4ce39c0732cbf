"""The library's exceptions: one base class, and subclasses that carry what a caller needs."""

from __future__ import annotations

from typing import Any


class ProletarianError(Exception):
    """Base class of every error sqla-proletarian raises."""


class InvalidJobError(ProletarianError, ValueError):
    """A job cannot be enqueued as given; nothing was written."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class PayloadSerializationError(InvalidJobError):
    """The payload cannot be serialized; nothing was written."""

    def __init__(self, message: str, payload: Any = None) -> None:
        self.payload = payload
        self.field = "payload"
        # The message names the place in the payload itself ("payload['a'][0] is ...").
        Exception.__init__(self, message)


class PayloadDeserializationError(ProletarianError):
    """A stored payload cannot be decoded by the worker's serializer."""

    def __init__(self, job_id: object, message: str) -> None:
        self.job_id = job_id
        super().__init__(
            f"the payload of job {job_id} cannot be decoded: {message}. "
            "Was it written by hand or by another serializer? Pass the serializer that "
            "wrote it to the worker."
        )


class NotATransactionError(ProletarianError, TypeError):
    """enqueue() was given something that is not a Session or a Connection."""


class InvalidRetryStrategyError(ProletarianError, ValueError):
    """A RetryStrategy, or what a retry strategy function returned, is not valid."""


class ConfigurationError(ProletarianError, ValueError):
    """A worker option is not valid."""


class UnknownJobTypeError(ProletarianError, LookupError):
    """A JobHandlers table has no handler for a job type and no default handler."""

    def __init__(self, job_type: str) -> None:
        self.job_type = job_type
        super().__init__(
            f"no handler is registered for job type {job_type!r}: register one with "
            f"@handlers.register({job_type!r}) or add a catch-all with @handlers.default"
        )


class JobCrashedError(ProletarianError):
    """A job's runs ended uncleanly (its worker died or lost its connection) too often."""

    def __init__(self, job_id: object, unclean_ends: int) -> None:
        self.job_id = job_id
        self.unclean_ends = unclean_ends
        super().__init__(
            f"job {job_id} crashed its worker: {unclean_ends} runs ended without an outcome "
            "(the worker process died or lost its database connection mid-job), so it was "
            "archived as failed instead of being run again. Fix the handler, then enqueue "
            "the job again; raise max_unclean_ends to allow more such runs."
        )

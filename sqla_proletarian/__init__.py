"""sqla-proletarian: a durable, transactional job queue for SQLAlchemy applications."""

from typing import TYPE_CHECKING, Any

from sqla_proletarian.control import cancel_job, pause_queue, paused_queues, resume_queue
from sqla_proletarian.enqueue import enqueue, enqueue_many
from sqla_proletarian.errors import (
    ConfigurationError,
    InvalidJobError,
    InvalidProgressError,
    InvalidRetryStrategyError,
    JobCrashedError,
    JobFailedError,
    JobNotFoundError,
    JobTimeoutError,
    NoCurrentJobError,
    NotATransactionError,
    PayloadDeserializationError,
    PayloadSerializationError,
    ProletarianError,
    ResultNotReady,
    ResultSerializationError,
    ResultTooLargeError,
    Snooze,
    UnknownJobTypeError,
)
from sqla_proletarian.handlers import AsyncJobContext, JobContext, JobHandlers, current_job
from sqla_proletarian.inspection import (
    JOB_STATES,
    EarlierOutcome,
    FailedJob,
    FinishedMinute,
    JobDetail,
    JobInfo,
    JobPage,
    QueueStatus,
    failed_jobs,
    finished_per_minute,
    get_job,
    list_jobs,
    queue_status,
)
from sqla_proletarian.limits import (
    QueueLimits,
    clear_queue_limits,
    queue_limits,
    set_queue_limits,
)
from sqla_proletarian.maintenance import (
    RetryReport,
    prune_archive,
    retry_failed,
    retry_failed_report,
)
from sqla_proletarian.models import (
    DEFAULT_QUEUE,
    ArchivedJob,
    Job,
    JobHistory,
    JobRun,
    include_object,
    metadata,
)
from sqla_proletarian.options import WorkerOptions
from sqla_proletarian.periodic import PeriodicJob
from sqla_proletarian.replicas import ReplicaLag, replica_lag
from sqla_proletarian.results import get_result, wait_for_result, wait_for_result_async
from sqla_proletarian.retry import RetryStrategy
from sqla_proletarian.serialization import JsonSerializer, Serializer
from sqla_proletarian.tasks import Task
from sqla_proletarian.values import MAX_PRIORITY, MIN_PRIORITY, utc_now, uuid4, uuid7
from sqla_proletarian.worker import QueueWorker, create_queue_worker, process_next_job

if TYPE_CHECKING:
    from sqla_proletarian.aio import (
        AsyncQueueWorker,
        create_async_queue_worker,
        enqueue_async,
        enqueue_many_async,
    )

#: Imported on first use: the asyncio module needs greenlet (``pip install -e '.[asyncio]'``).
_ASYNCIO_NAMES = frozenset(
    {"AsyncQueueWorker", "create_async_queue_worker", "enqueue_async", "enqueue_many_async"}
)


def __getattr__(name: str) -> Any:
    if name in _ASYNCIO_NAMES:
        from sqla_proletarian import aio

        return getattr(aio, name)
    raise AttributeError(f"module 'sqla_proletarian' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "DEFAULT_QUEUE",
    "JOB_STATES",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "ArchivedJob",
    "AsyncJobContext",
    "AsyncQueueWorker",
    "ConfigurationError",
    "EarlierOutcome",
    "FailedJob",
    "FinishedMinute",
    "InvalidJobError",
    "InvalidProgressError",
    "InvalidRetryStrategyError",
    "Job",
    "JobContext",
    "JobCrashedError",
    "JobDetail",
    "JobFailedError",
    "JobHandlers",
    "JobHistory",
    "JobInfo",
    "JobNotFoundError",
    "JobPage",
    "JobRun",
    "JobTimeoutError",
    "JsonSerializer",
    "NoCurrentJobError",
    "NotATransactionError",
    "PayloadDeserializationError",
    "PayloadSerializationError",
    "PeriodicJob",
    "ProletarianError",
    "QueueLimits",
    "QueueStatus",
    "QueueWorker",
    "ReplicaLag",
    "ResultNotReady",
    "ResultSerializationError",
    "ResultTooLargeError",
    "RetryReport",
    "RetryStrategy",
    "Serializer",
    "Snooze",
    "Task",
    "UnknownJobTypeError",
    "WorkerOptions",
    "cancel_job",
    "clear_queue_limits",
    "create_async_queue_worker",
    "create_queue_worker",
    "current_job",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
    "failed_jobs",
    "finished_per_minute",
    "get_job",
    "get_result",
    "include_object",
    "list_jobs",
    "metadata",
    "pause_queue",
    "paused_queues",
    "process_next_job",
    "prune_archive",
    "queue_limits",
    "queue_status",
    "replica_lag",
    "resume_queue",
    "retry_failed",
    "retry_failed_report",
    "set_queue_limits",
    "utc_now",
    "uuid4",
    "uuid7",
    "wait_for_result",
    "wait_for_result_async",
]

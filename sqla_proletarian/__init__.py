"""sqla-proletarian: a durable, transactional job queue for SQLAlchemy applications."""

from sqla_proletarian.control import cancel_job, pause_queue, paused_queues, resume_queue
from sqla_proletarian.enqueue import enqueue, enqueue_many
from sqla_proletarian.errors import (
    ConfigurationError,
    InvalidJobError,
    InvalidRetryStrategyError,
    JobCrashedError,
    NotATransactionError,
    PayloadDeserializationError,
    PayloadSerializationError,
    ProletarianError,
    UnknownJobTypeError,
)
from sqla_proletarian.handlers import JobContext, JobHandlers
from sqla_proletarian.maintenance import prune_archive
from sqla_proletarian.models import (
    DEFAULT_QUEUE,
    ArchivedJob,
    Job,
    JobRun,
    include_object,
    metadata,
)
from sqla_proletarian.periodic import PeriodicJob
from sqla_proletarian.retry import RetryStrategy
from sqla_proletarian.serialization import JsonSerializer, Serializer
from sqla_proletarian.values import MAX_PRIORITY, MIN_PRIORITY, utc_now, uuid4, uuid7
from sqla_proletarian.worker import (
    QueueWorker,
    WorkerOptions,
    create_queue_worker,
    process_next_job,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_QUEUE",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "ArchivedJob",
    "ConfigurationError",
    "InvalidJobError",
    "InvalidRetryStrategyError",
    "Job",
    "JobContext",
    "JobCrashedError",
    "JobHandlers",
    "JobRun",
    "JsonSerializer",
    "NotATransactionError",
    "PayloadDeserializationError",
    "PayloadSerializationError",
    "PeriodicJob",
    "ProletarianError",
    "QueueWorker",
    "RetryStrategy",
    "Serializer",
    "UnknownJobTypeError",
    "WorkerOptions",
    "cancel_job",
    "create_queue_worker",
    "enqueue",
    "enqueue_many",
    "include_object",
    "metadata",
    "pause_queue",
    "paused_queues",
    "process_next_job",
    "prune_archive",
    "resume_queue",
    "utc_now",
    "uuid4",
    "uuid7",
]

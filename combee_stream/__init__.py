"""combee-stream: learn agent playbooks from traces with Combee, over Kafka or files.

The public API is this module's ``__all__``; everything else is an implementation detail.
Errors derive from :class:`CombeeError` (tree in :mod:`combee_stream.errors`).
"""

from combee_stream.config import Config, load_config
from combee_stream.errors import CombeeError, ConfigError, UserError
from combee_stream.kafka.producer import TraceProducer
from combee_stream.kafka.subscriber import PromptSubscriber
from combee_stream.schemas import (
    Feedback,
    Playbook,
    PromptUpdate,
    Step,
    Trace,
)
from combee_stream.wiring import Engine, run_learn

__all__ = [
    "CombeeError",
    "Config",
    "ConfigError",
    "Engine",
    "Feedback",
    "Playbook",
    "PromptSubscriber",
    "PromptUpdate",
    "Step",
    "Trace",
    "TraceProducer",
    "UserError",
    "load_config",
    "run_learn",
]

"""combee-stream: learn agent playbooks from traces with Combee, over Kafka or files.

The public API is this module's ``__all__``; everything else is an implementation detail.
"""

from combee_stream.config import Config, ConfigError, load_config
from combee_stream.errors import UserError
from combee_stream.kafka.producer import TraceProducer
from combee_stream.kafka.subscriber import PromptSubscriber
from combee_stream.schemas import (
    Feedback,
    Playbook,
    PromptUpdate,
    Step,
    Trace,
)

__all__ = [
    "Config",
    "ConfigError",
    "Feedback",
    "Playbook",
    "PromptSubscriber",
    "PromptUpdate",
    "Step",
    "Trace",
    "TraceProducer",
    "UserError",
    "load_config",
]

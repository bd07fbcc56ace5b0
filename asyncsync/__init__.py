"""asyncsync: publish trainer weights into a vLLM fleet and generate token-in-token-out.

Everything users import lives in this namespace; see ``__all__``.
"""

from asyncsync._errors import (
    AsyncSyncError,
    FleetError,
    GenerationError,
    ProtocolError,
    PublishError,
    ServerError,
    ServerTimeout,
    ServerUnavailable,
)
from asyncsync._retry import RetryPolicy
from asyncsync._timeouts import Timeouts
from asyncsync.client import AsyncVLLMClient, WeightComparison
from asyncsync.fleet import Fleet, FleetResult, Outcome, ServerState
from asyncsync.publisher import AsyncWeightPublisher, PublishReport, ServerOutcome

__version__ = "0.1.0"

__all__ = [
    "AsyncSyncError",
    "AsyncVLLMClient",
    "AsyncWeightPublisher",
    "Fleet",
    "FleetError",
    "FleetResult",
    "GenerationError",
    "Outcome",
    "ProtocolError",
    "PublishError",
    "PublishReport",
    "RetryPolicy",
    "ServerError",
    "ServerOutcome",
    "ServerState",
    "ServerTimeout",
    "ServerUnavailable",
    "Timeouts",
    "WeightComparison",
    "__version__",
]

"""asyncsync: publish trainer weights into a vLLM fleet and generate token-in-token-out.

Everything users import lives in this namespace; see ``__all__``.
"""

from asyncsync._errors import (
    AsyncSyncError,
    FleetError,
    GenerationAborted,
    GenerationError,
    ProtocolError,
    PublishError,
    ServerError,
    ServerTimeout,
    ServerUnavailable,
)
from asyncsync._retry import RetryPolicy
from asyncsync._routing import StalenessStats
from asyncsync._timeouts import Timeouts
from asyncsync.client import AsyncVLLMClient, WeightComparison
from asyncsync.fleet import Fleet, FleetResult, Outcome, ServerState
from asyncsync.generation import (
    Completion,
    CompletionStream,
    PromptScores,
    RetokenizedWarning,
    TokenDelta,
    WeightVersionSpan,
)
from asyncsync.publisher import AsyncWeightPublisher, PublishReport, ServerOutcome
from asyncsync.trajectory import Trajectory

__version__ = "0.1.0"

__all__ = [
    "AsyncSyncError",
    "AsyncVLLMClient",
    "AsyncWeightPublisher",
    "Completion",
    "CompletionStream",
    "Fleet",
    "FleetError",
    "FleetResult",
    "GenerationAborted",
    "GenerationError",
    "Outcome",
    "PromptScores",
    "ProtocolError",
    "PublishError",
    "PublishReport",
    "RetokenizedWarning",
    "RetryPolicy",
    "ServerError",
    "ServerOutcome",
    "ServerState",
    "ServerTimeout",
    "ServerUnavailable",
    "StalenessStats",
    "Timeouts",
    "TokenDelta",
    "Trajectory",
    "WeightComparison",
    "WeightVersionSpan",
    "__version__",
]

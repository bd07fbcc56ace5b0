"""asyncsync: publish trainer weights into a vLLM fleet and generate token-in-token-out.

Everything users import lives in this namespace; see ``__all__``. Two modules stand
apart: `asyncsync.blocking` (the same API without ``await``, for scripts and
notebooks) and `asyncsync.metrics` (metrics hooks).
"""

import logging as _logging
from typing import Any as _Any

from asyncsync import backends
from asyncsync._chat import openai_client as _openai_client  # noqa: F401  # registers fleet.openai
from asyncsync._chat.chat import ChatFallbackWarning, ChatSession, ChatStats, ChatTurn
from asyncsync._chat.chat_reply import ChatReply
from asyncsync._chat.gateway import ChatGateway
from asyncsync._chat.prefix import PrefixReport, UnstablePrefixError
from asyncsync._chat.render import ChatDelta, ChatRenderer, ChatRenderWarning
from asyncsync._chat.stream import ChatStream
from asyncsync._chat.trajectory import Lineage, Trajectory
from asyncsync._core import deprecation as _deprecation
from asyncsync._core.completion import (
    Completion,
    PromptScores,
    RetokenizedWarning,
    TokenDelta,
    WeightVersionSpan,
)
from asyncsync._core.errors import (
    AsyncSyncError,
    ClosedError,
    FleetError,
    GenerationAborted,
    GenerationError,
    IncompatibleWeightsError,
    ProtocolError,
    PublishError,
    ServerError,
    ServerTimeout,
    ServerUnavailableError,
    UnsupportedVLLMError,
    WeightMismatchError,
    WeightsModifiedError,
)
from asyncsync._core.loop import run
from asyncsync._core.state import ServerState
from asyncsync._core.timeouts import Timeouts
from asyncsync._core.types import CallOutcome, FleetResult
from asyncsync._fleet.routing import StalenessStats
from asyncsync._generation.engine import CompletionStream
from asyncsync._http.retry import RetryPolicy
from asyncsync._wire.chat import ChatRequestError
from asyncsync._wire.control import WeightComparison
from asyncsync._wire.generation.sampling import Sampling, SamplingFields
from asyncsync.backends.shm import share_weights
from asyncsync.client import AsyncVLLMClient
from asyncsync.fleet import Fleet
from asyncsync.publisher import (
    AsyncWeightPublisher,
    PublishReport,
    ServerOutcome,
    Verify,
    VerifyResult,
)

__version__ = "0.2.0"

# Each module logs to its own logger under "asyncsync"; the application configures them.
_logging.getLogger("asyncsync").addHandler(_logging.NullHandler())

__all__ = [
    "AsyncSyncError",
    "AsyncVLLMClient",
    "AsyncWeightPublisher",
    "CallOutcome",
    "ChatDelta",
    "ChatFallbackWarning",
    "ChatGateway",
    "ChatRenderWarning",
    "ChatRenderer",
    "ChatReply",
    "ChatRequestError",
    "ChatSession",
    "ChatStats",
    "ChatStream",
    "ChatTurn",
    "ClosedError",
    "Completion",
    "CompletionStream",
    "Fleet",
    "FleetError",
    "FleetResult",
    "GenerationAborted",
    "GenerationError",
    "IncompatibleWeightsError",
    "Lineage",
    "PrefixReport",
    "PromptScores",
    "ProtocolError",
    "PublishError",
    "PublishReport",
    "RetokenizedWarning",
    "RetryPolicy",
    "Sampling",
    "SamplingFields",
    "ServerError",
    "ServerOutcome",
    "ServerState",
    "ServerTimeout",
    "ServerUnavailableError",
    "StalenessStats",
    "Timeouts",
    "TokenDelta",
    "Trajectory",
    "UnstablePrefixError",
    "UnsupportedVLLMError",
    "Verify",
    "VerifyResult",
    "WeightComparison",
    "WeightMismatchError",
    "WeightVersionSpan",
    "WeightsModifiedError",
    "__version__",
    "backends",
    "run",
    "share_weights",
]

#: Old spellings kept for one release (each access warns with the new name).
_DEPRECATED: dict[str, tuple[str, _Any]] = {
    "ServerUnavailable": ("ServerUnavailableError", ServerUnavailableError),
    "UnsupportedVLLM": ("UnsupportedVLLMError", UnsupportedVLLMError),
    "WeightMismatch": ("WeightMismatchError", WeightMismatchError),
    # renamed in 0.2.0, so that a name says one thing (CHANGELOG.md "Renamed")
    "Outcome": ("CallOutcome", CallOutcome),
    "Verification": ("VerifyResult", VerifyResult),
}


def __getattr__(name: str) -> _Any:
    return _deprecation.module_getattr(__name__, _DEPRECATED, name)


# Exceptions and warnings are named by their public module in tracebacks
# ("asyncsync.PublishError", not the private module that defines them).
for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type) and issubclass(_obj, BaseException | Warning):
        _obj.__module__ = __name__
del _name, _obj

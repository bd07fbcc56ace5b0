"""asyncsync: publish trainer weights into a vLLM fleet and generate token-in-token-out.

Everything users import lives in this namespace; see ``__all__``.
"""

from asyncsync._errors import (
    AsyncSyncError,
    GenerationError,
    ProtocolError,
    PublishError,
    ServerError,
    ServerTimeout,
    ServerUnavailable,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncSyncError",
    "GenerationError",
    "ProtocolError",
    "PublishError",
    "ServerError",
    "ServerTimeout",
    "ServerUnavailable",
    "__version__",
]

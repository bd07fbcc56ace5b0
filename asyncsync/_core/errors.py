"""The one exception tree of asyncsync.

Every error raised by the SDK derives from `AsyncSyncError` and carries, where
known, the server URL, the route, the HTTP status and an excerpt of the response body,
so that a failure in a fleet of many servers can be traced to one of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "AsyncSyncError",
    "ClosedError",
    "FleetError",
    "GenerationAborted",
    "GenerationError",
    "IncompatibleWeightsError",
    "ProtocolError",
    "PublishError",
    "ServerError",
    "ServerTimeout",
    "ServerUnavailableError",
    "UnsupportedVLLMError",
    "WeightMismatchError",
    "WeightsModifiedError",
]

_BODY_EXCERPT_CHARS = 500


def _excerpt(body: str | None) -> str | None:
    if body is None:
        return None
    body = body.strip()
    if len(body) > _BODY_EXCERPT_CHARS:
        return body[:_BODY_EXCERPT_CHARS] + f"... [{len(body) - _BODY_EXCERPT_CHARS} more chars]"
    return body


class AsyncSyncError(Exception):
    """Base class of every asyncsync error.

    Attributes:
        server: base URL of the server involved, if any.
        route: HTTP route (e.g. ``"/update_weights"``), if any.
        status: HTTP status code, if a response was received.
        body: excerpt of the response body, if any.
    """

    def __init__(
        self,
        message: str,
        *,
        server: str | None = None,
        route: str | None = None,
        status: int | None = None,
        body: str | None = None,
    ) -> None:
        self.message = message
        self.server = server
        self.route = route
        self.status = status
        self.body = _excerpt(body)
        super().__init__(message)

    def __str__(self) -> str:
        where = []
        if self.server is not None:
            where.append(self.server)
        if self.route is not None:
            where.append(self.route)
        text = self.message
        if where:
            text = f"{text} [{' '.join(where)}]"
        if self.status is not None:
            text = f"{text} (HTTP {self.status})"
        return text

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep keyword-only context across pickling (process pools, multiprocessing).
        return (
            _rebuild,
            (type(self), self.message, self.server, self.route, self.status, self.body),
        )


def _rebuild(
    cls: type[AsyncSyncError],
    message: str,
    server: str | None,
    route: str | None,
    status: int | None,
    body: str | None,
) -> AsyncSyncError:
    err = cls.__new__(cls)
    AsyncSyncError.__init__(err, message, server=server, route=route, status=status, body=body)
    return err


class ServerError(AsyncSyncError):
    """The server answered with a non-2xx status, or with a 2xx body that is not the
    JSON the route promises (never mistaken for a success).

    Attributes:
        retry_after: seconds from the answer's ``Retry-After`` header, if it sent one.
    """

    retry_after: float | None = None


class ServerTimeout(AsyncSyncError, TimeoutError):
    """A call exceeded its deadline (connect, control, update or generate phase)."""


class ServerUnavailableError(AsyncSyncError):
    """The server could not be reached (connection refused, reset, DNS, closed client)."""


class ClosedError(AsyncSyncError, RuntimeError):
    """A method of a closed `Fleet`, `AsyncVLLMClient`, `AsyncWeightPublisher` or
    stream was called: the message names which one. Create a new one (closing is
    final)."""


class ProtocolError(AsyncSyncError):
    """The request or response does not fit the protocol: a route the server's vLLM
    version lacks, a parameter name, shape or dtype mismatch, an unsupported version."""


class UnsupportedVLLMError(ProtocolError):
    """The installed or running vLLM lacks something asyncsync needs (found by probing
    it; a server's RL protocol is read from its version number: see docs/versions.md).

    Attributes:
        version: the vLLM version, as the probe read it (``"unknown"`` if it could not).
        missing: what is missing, in words (a flag, a route, an engine contract).
    """

    version: str = "unknown"
    missing: str = ""

    def __init__(self, version: str, missing: str, *, server: str | None = None) -> None:
        super().__init__(
            f"vLLM {version} is not supported by asyncsync: {missing} (see docs/versions.md)",
            server=server,
        )
        self.version = version
        self.missing = missing

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.version, self.missing), {"server": self.server})


class IncompatibleWeightsError(ProtocolError, ValueError):
    """Weights refused before anything was sent: they do not fit the checkpoint the
    servers serve (a name it does not have, a shape or a dtype that differs, a
    checkpoint tensor a full round does not update). Checked in the trainer process
    against each server's checkpoint table, which asyncsync's weight-transfer engine
    describes (learned once per server); no server was touched, every server keeps its
    weights and stays clean. Also a `ValueError`: bad input raises before anything is
    sent (docs/errors.md).

    Weights that cannot describe themselves (a stream) are checked tensor by tensor as
    they are produced: then ``whole`` is False, the error names the first mismatch,
    and one found after the round's first chunk fails the round (`PublishError`,
    caused by this error) like any other error.

    Attributes:
        problems: every mismatch, one sentence each (the message shows the first ones).
        parameters: the names involved, in the order the problems list them.
        servers: the servers whose checkpoint the weights were checked against.
        whole: the whole round was checked at once (its metadata), before anything
            was sent.
    """

    #: problems shown in the message; `problems` holds all of them
    shown = 20

    def __init__(
        self,
        problems: Sequence[str],
        *,
        parameters: Sequence[str] = (),
        servers: Sequence[str] = (),
        whole: bool = True,
    ) -> None:
        self.problems: tuple[str, ...] = tuple(problems)
        self.parameters: tuple[str, ...] = tuple(parameters)
        self.servers: tuple[str, ...] = tuple(servers)
        self.whole = whole
        where = ", ".join(self.servers) or "the servers"
        lines = list(self.problems[: self.shown])
        if len(self.problems) > self.shown:
            lines.append(f"... and {len(self.problems) - self.shown} more (.problems)")
        when = (
            "refused before anything was sent"
            if whole
            else "found as the weights were produced (a stream is checked tensor by tensor)"
        )
        super().__init__(
            f"the weights do not fit the checkpoint served at {where} "
            f"({len(self.problems)} problem(s), {when}): " + "; ".join(lines)
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_incompatible,
            (self.problems, self.parameters, self.servers, self.whole),
        )


def _rebuild_incompatible(
    problems: tuple[str, ...],
    parameters: tuple[str, ...],
    servers: tuple[str, ...],
    whole: bool,
) -> IncompatibleWeightsError:
    return IncompatibleWeightsError(problems, parameters=parameters, servers=servers, whole=whole)


class GenerationError(AsyncSyncError):
    """A generation request failed or its response could not be interpreted."""


class GenerationAborted(GenerationError):
    """The server aborted a generation before it finished (``finish_reason == "abort"``),
    typically because the server was paused with ``mode="abort"`` for a weight update.

    Retryable: nothing is wrong with the request. The tokens sampled before the abort are
    kept, exact and version-tagged, so a caller may resend the prompt or continue from
    ``prompt + completion.token_ids``.

    Attributes:
        completions: one partial `Completion` per sample (``n``), in
            order; each has ``finish_reason == "abort"`` or its real reason.
        retryable: always True.
    """

    retryable = True

    def __init__(
        self,
        message: str,
        *,
        completions: Sequence[Any] = (),
        server: str | None = None,
        route: str | None = None,
        status: int | None = None,
        body: str | None = None,
    ) -> None:
        super().__init__(message, server=server, route=route, status=status, body=body)
        self.completions: tuple[Any, ...] = tuple(completions)

    @property
    def completion(self) -> Any:
        """The first (for ``n == 1`` the only) partial completion."""
        return self.completions[0] if self.completions else None

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_aborted,
            (self.message, self.completions, self.server, self.route, self.status, self.body),
        )


def _rebuild_aborted(
    message: str,
    completions: tuple[Any, ...],
    server: str | None,
    route: str | None,
    status: int | None,
    body: str | None,
) -> GenerationAborted:
    return GenerationAborted(
        message, completions=completions, server=server, route=route, status=status, body=body
    )


class PublishError(AsyncSyncError):
    """A weight-sync round failed on at least one server.

    Attributes:
        version: the version the round tried to publish.
        outcomes: per-server outcome objects, keyed by server URL.
        needs_resync: URLs of servers left dirty (mid-update, or holding weights of no
            published version) that need a later successful round before they serve
            generations again; those the round never reached included.
        never_reached: those of ``needs_resync`` the round could not connect to (refused,
            or no connection in time): nothing of the round reached them. Is the server
            up? A round resyncs it once it answers.
    """

    def __init__(
        self,
        message: str,
        *,
        version: str | None = None,
        outcomes: Mapping[str, Any] | None = None,
        needs_resync: Sequence[str] = (),
        never_reached: Sequence[str] = (),
        server: str | None = None,
        route: str | None = None,
        status: int | None = None,
        body: str | None = None,
    ) -> None:
        super().__init__(message, server=server, route=route, status=status, body=body)
        self.version = version
        self.outcomes: dict[str, Any] = dict(outcomes or {})
        self.needs_resync: tuple[str, ...] = tuple(needs_resync)
        self.never_reached: tuple[str, ...] = tuple(never_reached)

    def __str__(self) -> str:
        text = super().__str__()
        reached = [url for url in self.needs_resync if url not in self.never_reached]
        if reached:
            text = f"{text}; needs resync: {', '.join(reached)}"
        if self.never_reached:
            text = (
                f"{text}; never reached (could not connect: is it up? a round resyncs it "
                f"once it answers): {', '.join(self.never_reached)}"
            )
        return text

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_publish,
            (self.message, self.version, self.outcomes, self.needs_resync, self.never_reached),
        )


def _rebuild_publish(
    message: str,
    version: str | None,
    outcomes: dict[str, Any],
    needs_resync: tuple[str, ...],
    never_reached: tuple[str, ...] = (),
) -> PublishError:
    return PublishError(
        message,
        version=version,
        outcomes=outcomes,
        needs_resync=needs_resync,
        never_reached=never_reached,
    )


class WeightMismatchError(AsyncSyncError):
    """Verification found a server whose weights differ from the trainer's
    (``publish(..., verify=...)``): the message says what differed.

    Attributes:
        mismatched: the parameters whose checksums differ (empty when a probe
            generation found the difference).
    """

    def __init__(
        self, message: str, *, server: str | None = None, mismatched: Sequence[str] = ()
    ) -> None:
        super().__init__(message, server=server)
        self.mismatched: tuple[str, ...] = tuple(mismatched)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_mismatch, (self.message, self.server, self.mismatched))


def _rebuild_mismatch(
    message: str, server: str | None, mismatched: tuple[str, ...]
) -> WeightMismatchError:
    return WeightMismatchError(message, server=server, mismatched=mismatched)


class WeightsModifiedError(PublishError):
    """A zero-copy round read the trainer's own tensors while the trainer modified them
    in place (their version counters moved during the round): the servers may have
    loaded a mix of old and new values, so the round failed and the published version
    is unchanged. Publish again once the trainer holds the weights still.

    Attributes:
        parameters: the names of the tensors that changed during the round.
    """

    def __init__(
        self,
        message: str,
        *,
        parameters: Sequence[str] = (),
        version: str | None = None,
        outcomes: Mapping[str, Any] | None = None,
        needs_resync: Sequence[str] = (),
        never_reached: Sequence[str] = (),
    ) -> None:
        super().__init__(
            message,
            version=version,
            outcomes=outcomes,
            needs_resync=needs_resync,
            never_reached=never_reached,
        )
        self.parameters: tuple[str, ...] = tuple(parameters)

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_modified,
            (
                self.message, self.parameters, self.version, self.outcomes,
                self.needs_resync, self.never_reached,
            ),
        )  # fmt: skip


def _rebuild_modified(
    message: str,
    parameters: tuple[str, ...],
    version: str | None,
    outcomes: dict[str, Any],
    needs_resync: tuple[str, ...],
    never_reached: tuple[str, ...] = (),
) -> WeightsModifiedError:
    return WeightsModifiedError(
        message,
        parameters=parameters,
        version=version,
        outcomes=outcomes,
        needs_resync=needs_resync,
        never_reached=never_reached,
    )


class FleetError(ExceptionGroup[Exception], AsyncSyncError):  # type: ignore[override]
    """A fleet call failed on at least one server.

    An `ExceptionGroup` of the per-server errors (each an
    `AsyncSyncError` naming its server), so ``except* ServerTimeout:`` works, and
    an `AsyncSyncError`, so ``except AsyncSyncError:`` does too.

    Attributes:
        operation: the fleet method that failed (e.g. ``"update_weights"``).
        outcomes: every targeted server's outcome, keyed by URL, successes included.
        failed: URLs of the servers that failed, in fleet order.
        succeeded: URLs of the servers that succeeded, in fleet order.
    """

    # BaseExceptionGroup owns ``message``; the AsyncSyncError context fields are class
    # defaults here because a fleet error is about many servers, not one.
    server: str | None = None
    route: str | None = None
    status: int | None = None
    body: str | None = None

    def __new__(
        cls,
        message: str,
        exceptions: Sequence[Exception],
        *,
        operation: str | None = None,
        outcomes: Mapping[str, Any] | None = None,
    ) -> FleetError:
        return super().__new__(cls, message, exceptions)

    def __init__(
        self,
        message: str,
        exceptions: Sequence[Exception],
        *,
        operation: str | None = None,
        outcomes: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message, exceptions)
        self.operation = operation
        self.outcomes: dict[str, Any] = dict(outcomes or {})

    @property
    def failed(self) -> tuple[str, ...]:
        return tuple(url for url, o in self.outcomes.items() if not getattr(o, "ok", False))

    @property
    def succeeded(self) -> tuple[str, ...]:
        return tuple(url for url, o in self.outcomes.items() if getattr(o, "ok", False))

    def derive(self, excs: Sequence[Exception]) -> FleetError:  # type: ignore[override]
        # Used by ``except*`` and ``split``: keep the type and the outcomes of the
        # servers whose errors remain in the subgroup.
        servers = {getattr(e, "server", None) for e in excs}
        outcomes = {
            url: o for url, o in self.outcomes.items() if getattr(o, "ok", False) or url in servers
        }
        return FleetError(self.message, excs, operation=self.operation, outcomes=outcomes)

    def __str__(self) -> str:
        return BaseExceptionGroup.__str__(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_fleet,
            (self.message, tuple(self.exceptions), self.operation, self.outcomes),
        )


def _rebuild_fleet(
    message: str,
    exceptions: tuple[Exception, ...],
    operation: str | None,
    outcomes: dict[str, Any],
) -> FleetError:
    return FleetError(message, exceptions, operation=operation, outcomes=outcomes)

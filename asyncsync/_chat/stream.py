"""A streamed turn: sampled ids parsed into message deltas as they arrive.

`stream_sample` reads a generation's stream (``/inference/v1/generate``'s SSE, through
the fleet) while a `StreamParser` turns each batch of sampled ids into `ChatDelta`
objects for a `TurnSink` (the gateway's encoder of a dialect's events, or a
`ChatStream`); `reconcile` makes what was streamed add up to the parsed message.
`ChatStream` is a streamed turn in Python (`ChatSession.stream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Protocol

from asyncsync._chat.chat_reply import ChatReply
from asyncsync._chat.render import ChatDelta, StreamParser
from asyncsync._core.completion import Completion
from asyncsync._core.errors import AsyncSyncError
from asyncsync._generation.engine import CompletionStream
from asyncsync._wire.chat import TurnRequest

__all__ = ["ChatStream", "TurnSink", "reconcile", "stream_sample"]

logger = logging.getLogger("asyncsync.generate")


class TurnSink(Protocol):
    """Where a streamed turn's pieces go as they are produced."""

    async def started(self, prompt_token_ids: list[int]) -> None:
        """The prompt is built and generation starts."""

    async def delta(self, delta: ChatDelta) -> None:
        """A piece of the message, parsed."""


class DerenderState(Protocol):
    """What is known of a server's streamed derender (None: not tried yet)."""

    streamed_derender: bool | None


def _ended_on_id(completion: Completion) -> bool:
    """Whether the sample stopped on an id (end of turn, a stop id) that derender would
    show as text."""
    return (
        completion.finish_reason == "stop"
        and bool(completion.token_ids)
        and not isinstance(completion.stop_reason, str)
    )


async def stream_sample(
    stream: CompletionStream,
    prompt: list[int],
    parser: StreamParser,
    sink: TurnSink,
    streamed: list[ChatDelta],
    state: DerenderState | None,
    server: str | None,
) -> Completion:
    """Generate through ``stream`` while each batch of the ids that arrived is parsed
    into deltas for ``sink`` (and kept in ``streamed``). The last sampled id is held
    back until the end (it may be the end of the turn, which is not text). A server
    that cannot derender a streamed sample (``state``) is remembered: its turns send
    their message when the sample ends."""

    async def parse(ids: list[int], end: tuple[str, int | str | None] | None) -> None:
        if state is not None and state.streamed_derender is False:
            return  # the whole message goes out when the sample ends
        try:
            found = await parser.feed(ids, end)
        except AsyncSyncError as err:
            if state is None or err.status not in (400, 404, 405, 422):
                raise
            state.streamed_derender = False
            logger.warning(
                "%s does not derender a streamed sample (%s): streamed turns send their "
                "message when it ends",
                server,
                err,
            )
            return
        if state is not None:
            state.streamed_derender = True
        for d in found:
            streamed.append(d)
            await sink.delta(d)

    chunks: asyncio.Queue[list[int] | None] = asyncio.Queue()

    async def read() -> None:
        try:
            async for delta in stream:
                chunks.put_nowait(list(delta.token_ids))
        finally:
            chunks.put_nowait(None)

    await sink.started(prompt)
    held: list[int] = []
    async with stream:
        reader = asyncio.ensure_future(read())
        try:
            done = False
            while not done:
                ids = await chunks.get()
                batch = [] if ids is None else ids
                done = ids is None
                while not done and not chunks.empty():
                    more = chunks.get_nowait()
                    done = more is None
                    batch += more or []
                held += batch
                if not done:
                    ready, held = held[:-1], held[-1:]
                    await parse(ready, None)
            await reader
        except BaseException:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
            raise
    completion = stream.completion
    if _ended_on_id(completion) and held:
        held = held[:-1]  # the end-of-turn id: derendered, it would show as text
    await parse(held, (completion.finish_reason or "stop", completion.stop_reason))
    return completion


async def reconcile(reply: ChatReply, streamed: list[ChatDelta], sink: TurnSink) -> ChatReply:
    """Make what was streamed add up to the final message: the text (and reasoning) not
    streamed yet, the tool calls the stream did not show; the reply keeps the ids the
    stream gave its calls."""
    parsed = (("reasoning", reply.message.reasoning_content), ("text", reply.message.content))
    for kind, said in parsed:
        sent = "".join(d.text for d in streamed if d.type == kind)
        final = said or ""
        if final.startswith(sent) and len(final) > len(sent):
            await sink.delta(ChatDelta(kind, final[len(sent) :]))  # type: ignore[arg-type]
        elif not final.startswith(sent):
            logger.warning(
                "streamed %s %r is not a prefix of the parsed message's %r", kind, sent, final
            )
    started = [d for d in streamed if d.type == "tool_call"]
    calls = list(reply.message.tool_calls)
    for i, call in enumerate(calls[len(started) :], start=len(started)):
        await sink.delta(ChatDelta("tool_call", "", i, call.id, call.function.name))
        await sink.delta(ChatDelta("tool_arguments", call.function.arguments, i))
    ids = [d.call_id for d in started]
    return reply.with_call_ids(ids) if ids else reply


class _Runs(Protocol):
    async def run(self, turn: TurnRequest, *, sink: Any = None) -> ChatReply: ...


class _QueueSink:
    """A `TurnSink` feeding a `ChatStream`."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[ChatDelta | None] = asyncio.Queue()
        self.prompt: list[int] | None = None

    async def started(self, prompt_token_ids: list[int]) -> None:
        self.prompt = prompt_token_ids

    async def delta(self, delta: ChatDelta) -> None:
        self.queue.put_nowait(delta)


class ChatStream:
    """A streamed turn (`ChatSession.stream`): `ChatDelta` objects as the sampled ids
    are parsed, then `reply`. The turn runs from ``__aenter__``; leaving the block
    before it ended cancels it (nothing is recorded)."""

    def __init__(self, session: _Runs, turn: TurnRequest) -> None:
        self._session = session
        self._turn = turn
        self._sink = _QueueSink()
        self._task: asyncio.Task[ChatReply] | None = None

    @property
    def reply(self) -> ChatReply:
        """The turn's `ChatReply` (once the deltas are all read)."""
        if self._task is None or not self._task.done():
            raise RuntimeError("the stream has not finished yet")
        return self._task.result()

    async def __aenter__(self) -> ChatStream:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def _run(self) -> ChatReply:
        try:
            return await self._session.run(self._turn, sink=self._sink)
        finally:
            self._sink.queue.put_nowait(None)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def __aiter__(self) -> AsyncIterator[ChatDelta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[ChatDelta]:
        if self._task is None:
            raise RuntimeError("use the stream as `async with session.stream(...) as s:`")
        while True:
            delta = await self._sink.queue.get()
            if delta is None:
                break
            yield delta
        await self._task  # its error, if it failed

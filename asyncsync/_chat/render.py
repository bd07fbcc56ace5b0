"""Where a chat session's renders and derenders run: on the generation server, or in
this process with vLLM's own renderer and parsers.

- `ServerRendering`: the server's routes (render of each dialect, derender whole and
  streamed), over the fleet's transport.
- `ChatRenderer`: the same code the server runs (vLLM's ``ServingRender`` and
  ``ServingDerender``, built the way vLLM's GPU-less render server builds them, from the
  model and the server's own flags), called in this process: a turn then costs the
  generation server one generate call. Needs vLLM importable here.
- `StreamParser`: sampled ids, as they stream, into message deltas (text, reasoning,
  tool calls): vLLM's own streaming parser, kept alive across chunks in this process, or
  the server's streamed derender, one call per batch of chunks (chunks that arrive while
  a call is out go together in the next).

A session checks a `ChatRenderer` against the server (`ChatSession`): on its first turn
and every ``check_every``-th one its render is compared with the server's, and its
derender too; a difference sends the session to server rendering with a
`ChatRenderWarning`.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from asyncsync._core import encoding as _json
from asyncsync._core.errors import ServerError, UnsupportedVLLMError
from asyncsync._wire.chat import (
    DERENDER_PROMPT_TAIL,
    DERENDER_ROUTE,
    Rendered,
    derender_stream_body,
    parse_chat_response,
    parse_derendered_chunk,
    parse_rendered,
    plan_derender,
    plan_derender_stream,
    plan_render_route,
)

if TYPE_CHECKING:
    from asyncsync.fleet import Fleet

__all__ = [
    "ChatDelta",
    "ChatRenderWarning",
    "ChatRenderer",
    "Rendering",
    "ServerRendering",
    "StreamParser",
]

logger = logging.getLogger("asyncsync.generate")

T = TypeVar("T")


#: How many calls a `ChatRenderer` runs at once on its thread; the rest wait in the
#: order they came. Calls that run together take turns on one thread (and one GIL), so
#: every call of a burst would finish near the burst's end; in order, the first finish
#: first and their turns reach the server while the rest render. Not one: the renderer
#: hands template renders and tokenizations to vLLM's tokenizer pool, and other calls'
#: validation and results run on the loop meanwhile. Alone, 32 renders at once go at
#: about 715 a second one at a time, 850 four at a time, 960 all at once; in a session
#: at 32 episodes in flight, four at a time made more turns a second than all at once
#: (benchmarks/chat_stages.py; docs/performance.md).
CALLS_AT_ONCE = 4


class ChatRenderWarning(UserWarning):
    """A `ChatRenderer` rendered or parsed a turn differently from the server: the
    session renders on the server from then on (issued once per session)."""


@dataclass(frozen=True, slots=True)
class ChatDelta:
    """A piece of a streamed turn's message, as it is parsed.

    Attributes:
        type: ``"text"``, ``"reasoning"``, ``"tool_call"`` (a call starts: ``call_id``
            and ``name``) or ``"tool_arguments"`` (more of a call's argument text).
        text: the new text (content, reasoning or argument text).
        index: the tool call's index in the message.
        call_id: the tool call's id (``"tool_call"``).
        name: the called tool's name (``"tool_call"``).
    """

    type: Literal["text", "reasoning", "tool_call", "tool_arguments"]
    text: str = ""
    index: int = 0
    call_id: str | None = None
    name: str | None = None


class Rendering(Protocol):
    """What renders and derenders a session's turns."""

    name: str

    async def render(self, route: str, body: Mapping[str, Any]) -> Rendered: ...

    async def derender(self, body: Mapping[str, Any]) -> dict[str, Any]: ...

    async def derender_stream(
        self, body: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]: ...


@dataclass(eq=False, slots=True)
class _Held:
    """A render in `ChatRenderer`'s cache: in flight (``task``) or made (``value``);
    ``made_at`` is when it started (``time.monotonic()``)."""

    made_at: float
    task: asyncio.Task[Rendered] | None
    value: Rendered | None = None
    keep: bool = True


def _copy(rendered: Rendered) -> Rendered:
    """A caller's own copy of a cached render (a session may change what it gets)."""
    return Rendered(list(rendered.token_ids), copy.deepcopy(rendered.sampling_params))


class ServerRendering:
    """Render and derender on one server of a fleet (its own template and parsers)."""

    name = "server"

    def __init__(self, fleet: Fleet, url: str) -> None:
        self.url = url
        self._endpoint = fleet.client(url)._endpoint

    async def render(self, route: str, body: Mapping[str, Any]) -> Rendered:
        return await self._endpoint.request(plan_render_route(route), _json.dumps(dict(body)))

    async def derender(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._endpoint.request(plan_derender(), _json.dumps(dict(body)))

    async def derender_stream(
        self, body: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        got = await self._endpoint.request(plan_derender_stream(), _json.dumps(dict(body)))
        return got.chunk, got.stream_state


# ------------------------------------------------------------------ in this process
class ChatRenderer:
    """vLLM's own renderer and parsers in this process, configured like the servers.

    ::

        renderer = az.ChatRenderer(model_dir, "--enable-auto-tool-choice",
                                   "--tool-call-parser", "hermes")
        async with az.ChatGateway(fleet, renderer=renderer) as gateway: ...
        session = az.ChatSession(fleet, renderer=renderer)

    Renders every dialect and parses the sampled ids (whole and streamed) with the same
    code vLLM's render server runs, built from ``model`` and ``server_args`` (the flags
    the servers were started with that shape rendering and parsing: tool and reasoning
    parsers, chat template, its kwargs). A session using it asks its server only to
    generate; it checks the renderer against the server's render and derender on its
    first turn and every ``check_every``-th turn after (a request already checked
    against that server, such as the shared first turn of a group of episodes, is not
    checked again), and renders on the server from the first difference on, with a
    `ChatRenderWarning`.

    Identical requests are rendered once: a render is a function of the request's bytes
    (the prompt ids and the sampling parameters; no seed or id is drawn), so a request
    equal to one rendered in the last ``cache_seconds`` gets a copy of that render, and
    identical requests in flight share one. In a group of episodes that start from the
    same prompt (GRPO), the group's first turns cost one render. A caller that is
    cancelled does not cancel the render the others wait for; a render that fails
    fails every caller that shares it and is not kept. Templates that read the clock
    (``strftime_now``, in the servers' template or a request's own) are never answered
    from a finished render, only shared while in flight, so no prompt carries a time
    older than the render it shares. ``cache_size=0`` renders every request.

    Its calls run on a thread of its own, at most four at a time, in the order they
    came: of a burst of turns that end in the same decode step (their
    derenders, then their next renders), the first go back to the server while the
    rest wait, rather than every call of the burst finishing near its end, as when all
    of them take turns on the thread at once.

    Needs vLLM importable in this process (the ``[server]`` extra); built on first use,
    in a worker thread (importing vLLM takes seconds).

    Args:
        model: the model's path or name, as the servers were given it.
        *server_args: the servers' flags that shape rendering and parsing.
        check_every: check one turn in this many against the server (>= 1).
        cache_size: how many recent renders are kept (>= 0; 0: none, nor shared).
        cache_seconds: how long a render is reused after it started (> 0).

    Attributes:
        rendered: renders vLLM's renderer made.
        reused: renders answered from the cache or shared with one in flight.
    """

    name = "local"

    def __init__(
        self,
        model: str | os.PathLike[str],
        *server_args: str,
        check_every: int = 16,
        cache_size: int = 256,
        cache_seconds: float = 60.0,
    ):
        if type(check_every) is not int or check_every < 1:
            raise ValueError(f"check_every must be an int >= 1, got {check_every!r}")
        if type(cache_size) is not int or cache_size < 0:
            raise ValueError(f"cache_size must be an int >= 0, got {cache_size!r}")
        if (
            isinstance(cache_seconds, bool)
            or not isinstance(cache_seconds, int | float)
            or not cache_seconds > 0
            or cache_seconds == float("inf")
        ):
            raise ValueError(f"cache_seconds must be a finite number > 0, got {cache_seconds!r}")
        if not all(isinstance(a, str) for a in server_args):
            raise TypeError("server_args must be strings (the servers' command-line flags)")
        self.model = os.fspath(model)
        self.server_args = tuple(server_args)
        self.check_every = check_every
        self._state: Any = None
        self._types: Any = None
        self._building: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        #: requests already found equal to a server's render: (url, route, body) digests
        self._checked: OrderedDict[tuple[str, str, bytes], None] = OrderedDict()
        self.cache_size = cache_size
        self.cache_seconds = float(cache_seconds)
        #: recent renders by (route, request bytes), oldest first
        self._renders: OrderedDict[tuple[str, bytes], _Held] = OrderedDict()
        #: whether the servers' template reads the clock (known once built)
        self._clock = True
        self.rendered = 0
        self.reused = 0
        #: calls running at once on the renderer's loop; the rest wait their turn
        self._at_once = CALLS_AT_ONCE
        self._turns: asyncio.Semaphore | None = None

    def __repr__(self) -> str:
        return f"ChatRenderer({self.model!r}, {' '.join(self.server_args)!r})"

    # ------------------------------------------------------------ building
    async def start(self) -> None:
        """Build vLLM's renderer now (done on first use otherwise)."""
        if self._state is not None:
            return
        if self._building is None:
            self._building = asyncio.ensure_future(self._build())
        await asyncio.shield(self._building)

    async def _build(self) -> None:
        # vLLM's renderer reads its own deprecated ``max_tokens`` field of every chat
        # request; in the server that warning goes to its log, here it would go to the
        # caller's process on every turn.
        warnings.filterwarnings(
            "ignore", message="max_tokens is deprecated", category=DeprecationWarning
        )
        loop = asyncio.new_event_loop()
        thread = threading.Thread(
            target=loop.run_forever, name="asyncsync-chat-renderer", daemon=True
        )
        thread.start()
        self._loop, self._thread = loop, thread
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._build_there(), loop))
        logger.info("in-process chat renderer built for %s", self.model)

    async def _build_there(self) -> None:
        """On the renderer's own loop: vLLM's render-server state."""
        args, config, types = self._configure()
        from starlette.datastructures import State
        from vllm.entrypoints.launchers.render.app_state import init_render_app_state

        self._turns = asyncio.Semaphore(self._at_once)  # this loop's
        state = State()
        await init_render_app_state(config, state, args)
        self._clock = _reads_clock(state, config)
        self._types = types
        self._state = state

    async def _there(self, work: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run ``work()`` on the renderer's own loop (vLLM's renderer reads files and
        templates and computes: never on the caller's loop), when its turn comes
        (``CALLS_AT_ONCE``)."""
        await self.start()
        assert self._loop is not None

        async def in_turn() -> T:
            assert self._turns is not None
            async with self._turns:
                return await work()

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(in_turn(), self._loop))

    async def aclose(self) -> None:
        """Stop the renderer's thread (a later call starts it again). Idempotent."""
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        self._state, self._building = None, None
        held, self._renders = list(self._renders.values()), OrderedDict()
        for entry in held:  # renders in flight end with the renderer's loop
            if entry.task is not None and not entry.task.get_loop().is_closed():
                entry.task.get_loop().call_soon_threadsafe(entry.task.cancel)
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            await asyncio.to_thread(thread.join, 30)
            loop.close()

    def _configure(self) -> tuple[Any, Any, Any]:
        """vLLM's arguments and config for a render server of ``model`` (a thread)."""
        try:
            import vllm.entrypoints.launchers.render.app_state
        except ImportError as exc:
            try:
                import vllm

                found = str(vllm.__version__)
            except ImportError:
                found = "(not installed)"
            raise UnsupportedVLLMError(
                found,
                "ChatRenderer runs vLLM's GPU-less render server code in this process, "
                "which vLLM 0.32 and later have; render on the servers (ChatSession "
                "without renderer=) instead",
            ) from exc
        from vllm import AsyncEngineArgs, envs
        from vllm.config import VllmConfig
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
            DerenderChatRequest,
            DerenderChatStreamRequest,
        )
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = make_arg_parser(FlexibleArgumentParser())
        args = parser.parse_args(["--model", self.model, *self.server_args])
        engine_args = AsyncEngineArgs.from_cli_args(args)
        model_config = engine_args.create_model_config()
        model_config.quantization = None
        envs.VLLM_CPU_KVCACHE_SPACE = 0
        config = VllmConfig(
            model_config=model_config,
            structured_outputs_config=engine_args.create_structured_outputs_config(),
        )
        types = {
            "chat": ChatCompletionRequest,
            "anthropic": AnthropicMessagesRequest,
            "responses": ResponsesRequest,
            "derender": DerenderChatRequest,
            "derender_stream": DerenderChatStreamRequest,
        }
        return args, config, types

    @property
    def served_name(self) -> str:
        """The model name the in-process renderer answers to."""
        return self.model

    # ------------------------------------------------------------ calls
    def _local(self, body: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(body)
        if "model" in out:
            out["model"] = self.served_name
        return out

    @staticmethod
    def _raise(result: Any, route: str) -> None:
        error = getattr(result, "error", None)
        if error is not None and hasattr(error, "code"):
            raise ServerError(
                f"the in-process renderer refused the request: {error.message}",
                server="in-process",
                route=route,
                status=int(error.code),
                body=_json.dumps(result.model_dump()).decode(),
            )

    def _validated(self, kind: str, body: Mapping[str, Any], route: str) -> Any:
        from pydantic import ValidationError

        try:
            with warnings.catch_warnings():  # vLLM's deprecated fields (max_tokens...)
                warnings.simplefilter("ignore", DeprecationWarning)
                return self._types[kind].model_validate(self._local(body))
        except (ValidationError, TypeError) as exc:  # vLLM's validators raise TypeError too
            what = str(exc) if isinstance(exc, ValidationError) else f"{kind} request: {exc}"
            raise ServerError(
                f"the in-process renderer refused the request: {what}",
                server="in-process",
                route=route,
                status=400,
            ) from exc

    async def render(self, route: str, body: Mapping[str, Any]) -> Rendered:
        """The render of ``body`` on ``route`` (a copy of an identical request's, where
        one is in flight or was made in the last ``cache_seconds``)."""
        if self.cache_size == 0:
            self.rendered += 1
            return await self._render(route, body)
        await self.start()  # the template's clock is known from here on
        key = (route, _json.dumps(dict(body)))
        loop = asyncio.get_running_loop()
        held = self._renders.get(key)
        if held is not None:
            if held.task is not None and held.task.get_loop() is loop:
                self.reused += 1
                return _copy(await asyncio.shield(held.task))
            if held.value is not None and time.monotonic() - held.made_at < self.cache_seconds:
                self.reused += 1
                self._renders.move_to_end(key)
                return _copy(held.value)
        self.rendered += 1
        task = loop.create_task(self._render(route, body))
        entry = _Held(time.monotonic(), task, keep=not (self._clock or _CLOCK in key[1]))
        self._renders[key] = entry
        self._renders.move_to_end(key)
        while len(self._renders) > self.cache_size:
            self._renders.popitem(last=False)
        task.add_done_callback(lambda done: self._settle(key, entry, done))
        return _copy(await asyncio.shield(task))

    def _settle(self, key: tuple[str, bytes], entry: _Held, task: asyncio.Task[Rendered]) -> None:
        """A cached render ended: keep its value, or forget it (failed, cancelled, or a
        template that reads the clock)."""
        entry.task = None
        failed = task.cancelled() or task.exception() is not None  # retrieved: no warning
        if not failed and entry.keep:
            entry.value = task.result()
        elif self._renders.get(key) is entry:
            del self._renders[key]

    async def _render(self, route: str, body: Mapping[str, Any]) -> Rendered:
        async def work() -> Rendered:
            serving = self._state.serving_render
            if route.startswith("/v1/messages"):
                request = self._validated("anthropic", body, route)
                result = await serving.render_messages_request(request)
            elif route.startswith("/v1/responses"):
                request = self._validated("responses", body, route)
                result = await serving.render_responses_request(request)
            else:
                request = self._validated("chat", body, route)
                result = await serving.render_chat_request(request)
            self._raise(result, route)
            return parse_rendered(result.model_dump(mode="json"))

        return await self._there(work)

    async def derender(self, body: Mapping[str, Any]) -> dict[str, Any]:
        async def work() -> dict[str, Any]:
            request = self._validated("derender", body, DERENDER_ROUTE)
            result = await self._state.serving_derender.derender_chat_response(request)
            self._raise(result, DERENDER_ROUTE)
            return parse_chat_response(result.model_dump(mode="json"))

        return await self._there(work)

    async def derender_stream(
        self, body: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        async def work() -> tuple[dict[str, Any], dict[str, Any]]:
            request = self._validated("derender_stream", body, DERENDER_ROUTE)
            serving = self._state.serving_derender
            result = await serving.derender_chat_stream_response(request)
            self._raise(result, DERENDER_ROUTE)
            chunk, state = result
            got = parse_derendered_chunk(
                {
                    "chunk": chunk.model_dump(mode="json"),
                    "stream_state": state.model_dump(mode="json"),
                }
            )
            return got.chunk, got.stream_state

        return await self._there(work)

    async def stream_parser(
        self, request: Mapping[str, Any], prompt: Sequence[int]
    ) -> _LocalStream | None:
        """vLLM's own streaming parser kept alive for one sample (no replay per chunk),
        or None where this vLLM's internals differ (the streamed derender then)."""

        async def work() -> _LocalStream | None:
            chat = self._validated("chat", request, DERENDER_ROUTE)
            try:
                return _LocalStream(self._state.online_derenderer, chat, list(prompt))
            except (ImportError, AttributeError, TypeError) as exc:  # another vLLM's
                logger.info("in-process streaming parser unavailable (%s)", exc)
                return None

        return await self._there(work)

    async def feed_local(
        self, stream: _LocalStream, token_ids: Sequence[int], finished: bool
    ) -> dict[str, Any]:
        """One chunk of a `stream_parser`'s sample, parsed on the renderer's thread."""

        async def work() -> dict[str, Any]:
            return stream.feed(token_ids, finished)

        return await self._there(work)

    # ------------------------------------------------------------ checks
    def checked(self, url: str, route: str, body: Mapping[str, Any]) -> bool:
        """Whether this request was already found to render the same on ``url``."""
        return (url, route, _json.dumps(dict(body))) in self._checked

    def mark_checked(self, url: str, route: str, body: Mapping[str, Any]) -> None:
        key = (url, route, _json.dumps(dict(body)))
        self._checked[key] = None
        self._checked.move_to_end(key)
        while len(self._checked) > 1024:
            self._checked.popitem(last=False)


#: what a template that reads the clock calls (transformers' chat-template globals)
_CLOCK = b"strftime_now"


def _reads_clock(state: Any, config: Any) -> bool:
    """Whether a chat template the servers may render with reads the clock: the
    ``--chat-template`` one, the tokenizer's (every named one) and vLLM's resolution of
    them. Unknown (another vLLM's internals): assumed to."""
    try:
        from vllm.renderers.hf import resolve_chat_template

        renderer = state.online_renderer
        tokenizer = renderer.renderer.get_tokenizer()
        texts: list[Any] = [renderer.chat_template]
        own = getattr(tokenizer, "chat_template", None)
        texts.extend(own.values() if isinstance(own, dict) else [own])
        texts.append(
            resolve_chat_template(
                tokenizer, renderer.chat_template, None, model_config=config.model_config
            )
        )
    except Exception as exc:  # another vLLM's internals, or no template to be found
        logger.info("could not read the chat template (%s): renders are not reused", exc)
        return True
    found = [t for t in texts if isinstance(t, str) and t]
    return not found or any(_CLOCK.decode() in t for t in found)


# ------------------------------------------------------------------ streamed parsing
def deltas_of(chunk: Mapping[str, Any]) -> list[ChatDelta]:
    """The message deltas of a streamed derender's chunk."""
    out: list[ChatDelta] = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("reasoning"):
            out.append(ChatDelta("reasoning", str(delta["reasoning"])))
        if delta.get("content"):
            out.append(ChatDelta("text", str(delta["content"])))
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            index = int(call.get("index") or 0)
            if function.get("name"):
                out.append(ChatDelta("tool_call", "", index, call.get("id"), function["name"]))
            if function.get("arguments"):
                out.append(ChatDelta("tool_arguments", str(function["arguments"]), index))
    return out


class _LocalStream:
    """vLLM's incremental detokenizer and parser (tool and reasoning), run in this
    process for one streamed sample: each chunk costs its own tokens, with no replay of
    the earlier ones (which the stateless streamed derender needs)."""

    def __init__(self, derenderer: Any, request: Any, prompt: list[int]) -> None:
        from vllm.renderers import online_derenderer as module

        self._derenderer = derenderer
        self._request = request
        self._prompt = prompt[-DERENDER_PROMPT_TAIL:]
        self._tokenizer = derenderer.renderer.get_tokenizer()
        parser_cls = derenderer.parser
        self._parser = None
        if parser_cls is not None:
            kwargs = derenderer._resolve_chat_template_kwargs(request)
            self._parser = parser_cls(
                self._tokenizer, request.tools, chat_template_kwargs=kwargs,
                model_config=derenderer.model_config,
            )  # fmt: skip
        self._skip, self._spaces = module._decode_params(
            self._tokenizer, request, preserve_special=self._parser is not None
        )
        self._state = module._seed_stream_state(
            self._tokenizer, self._prompt, skip_special_tokens=self._skip
        )

    def feed(self, token_ids: Sequence[int], finished: bool) -> dict[str, Any]:
        """The chunk's delta message (``content``, ``reasoning``, ``tool_calls``)."""
        text, self._state = self._derenderer._detokenize_delta(
            self._tokenizer, list(token_ids), self._state, skip_special_tokens=self._skip,
            spaces_between_special_tokens=self._spaces,
        )  # fmt: skip
        if self._parser is None:
            return {"content": text}
        delta = self._parser.parse_delta(
            text, list(token_ids), self._request, prompt_token_ids=self._prompt,
            finished=finished,
        )  # fmt: skip
        return {} if delta is None else dict(delta.model_dump(mode="json", exclude_none=True))


class StreamParser:
    """Sampled ids into `ChatDelta` objects as they stream, in batches (the ids that
    arrive while one is parsed go together in the next): vLLM's own streaming parser in
    this process with a `ChatRenderer`, else the server's streamed derender, one call
    per batch."""

    def __init__(
        self,
        rendering: Rendering,
        request: Mapping[str, Any],
        prompt: Sequence[int],
        model: str | None,
        request_id: str,
    ) -> None:
        self._rendering = rendering
        self._request = dict(request)
        self._prompt = list(prompt[-DERENDER_PROMPT_TAIL:])
        self._prompt_len = len(prompt)
        self._model = model
        self._id = request_id
        self._state: dict[str, Any] | None = None
        self._local: _LocalStream | None = None
        self._started = False
        self._ids: dict[int, str] = {}  # the ids the stream gave its tool calls
        self.calls = 0  # derender calls made

    async def feed(
        self, token_ids: Sequence[int], finished: tuple[str, int | str | None] | None
    ) -> list[ChatDelta]:
        """The deltas ``token_ids`` add (``finished``: the sample's finish and stop
        reason, with its last ids)."""
        if not token_ids and finished is None:
            return []
        if not self._started:
            self._started = True
            if isinstance(self._rendering, ChatRenderer):
                self._local = await self._rendering.stream_parser(self._request, self._prompt)
        if self._local is not None:
            assert isinstance(self._rendering, ChatRenderer)
            delta = await self._rendering.feed_local(self._local, token_ids, finished is not None)
            return deltas_of({"choices": [{"delta": self._pin(delta)}]})
        body = derender_stream_body(
            token_ids,
            finished=finished,
            request_id=self._id,
            state=self._state,
            request=self._request,
            prompt=self._prompt,
            model=self._model,
        )
        body["prompt_tokens"] = self._prompt_len
        chunk, self._state = await self._rendering.derender_stream(body)
        self.calls += 1
        return deltas_of(chunk)

    def _pin(self, delta: dict[str, Any]) -> dict[str, Any]:
        """Tool-call deltas with their ids (vLLM's parsers give one on a call's first
        delta only)."""
        for call in delta.get("tool_calls") or ():
            index = int(call.get("index") or 0)
            if call.get("id"):
                self._ids.setdefault(index, str(call["id"]))
        return delta

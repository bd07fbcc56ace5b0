"""``ChatSession``: chat turns in any of three dialects in, exact token trajectories out.

A turn arrives as an OpenAI chat request (`ChatSession.create`), an OpenAI Responses
request (`ChatSession.responses_create`) or an Anthropic Messages request
(`ChatSession.messages_create`); each becomes a dialect-neutral `TurnRequest`
(`asyncsync._wire`). Then:

1. The session's message graph (`asyncsync._chat.graph`) says which recorded turn the
   request continues: the last turn of a branch (the branch grows), an earlier turn (a
   new branch sharing that turn's ids), the same request as an earlier turn (a retry: a
   new branch from its prompt), or none (a compaction, a subagent while a tool call is
   pending, a new episode: a new branch from the full render).
2. The prompt is built from exact ids: the branch's ids plus a bridge cut from the
   server's own renders (`asyncsync._chat.prefix`), rendered by the dialect's own
   render route, on the server or in this process (`ChatRenderer`, checked against the
   server).
3. The prompt is generated token-in-token-out through the fleet (session affinity,
   versions, staleness, failover), streamed when the caller streams: sampled ids are
   parsed into message deltas as they come (`StreamParser`).
4. The sampled ids are derendered into the message with the server's parsers, and
   everything is recorded on the branch.

Servers without ``--enable-scale-out`` (render and generate answer 403) are served
through ``/v1/chat/completions`` with ``return_token_ids``: the server renders each
turn itself, so that the prompt extends the session's ids is checked, never assumed; a
warning says so once per server.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncsync._chat.chat_reply import ChatReply, reply_from
from asyncsync._chat.graph import (
    Branch,
    Node,
    common_prefix,
    copy_upto,
    locate,
    pending_call,
)
from asyncsync._chat.prefix import (
    ON_UNSTABLE,
    OnUnstable,
    PrefixReport,
    UnstablePrefixError,
    align_end,
    closing_after,
    first_difference,
    template_closing,
)
from asyncsync._chat.render import (
    ChatDelta,
    ChatRenderer,
    Rendering,
    ServerRendering,
    StreamParser,
)
from asyncsync._chat.servers import LIMITS, SessionRenders, chat_servers
from asyncsync._chat.stream import ChatStream, TurnSink, reconcile, stream_sample
from asyncsync._chat.trajectory import Lineage, Trajectory
from asyncsync._core import encoding as _json
from asyncsync._core.completion import Completion
from asyncsync._core.errors import AsyncSyncError
from asyncsync._wire import anthropic as _anthropic
from asyncsync._wire import responses as _responses
from asyncsync._wire.chat import (
    CHAT_ROUTE,
    RENDER_ROUTE,
    Api,
    ChatRequestError,
    Rendered,
    TurnRequest,
    chat_fallback_body,
    chat_request,
    chat_turn,
    derender_body,
    plan_chat,
)
from asyncsync._wire.control import ModelEntry, plan_models
from asyncsync._wire.generation.bodies import client_spans
from asyncsync._wire.generation.sampling import FIELDS, Sampling

if TYPE_CHECKING:
    from asyncsync.fleet import Fleet

__all__ = [
    "ChatFallbackWarning",
    "ChatSession",
    "ChatStats",
    "ChatTurn",
    "new_reply_id",
]

logger = logging.getLogger("asyncsync.generate")


class ChatFallbackWarning(UserWarning):
    """A server serves chat turns only through ``/v1/chat/completions`` (no
    ``--enable-scale-out``): prompts come from its render each turn and no weight
    versions from the server. Issued once per server."""


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One recorded turn: the messages received, the reply, and its trajectory.

    Attributes:
        messages: the request's messages, in OpenAI chat form (an Anthropic or Responses
            request converted by vLLM's rules).
        reply: the `ChatReply` returned.
        segment: the index of the turn's trajectory in `ChatSession.segments` (and
            `ChatSession.trajectories`).
        api: the dialect the turn came in (``"chat"``, ``"responses"``, ``"anthropic"``).
        recorded: the request's fields accepted that change nothing (``metadata``,
            ``context_management``...), as sent.
    """

    messages: tuple[Mapping[str, Any], ...]
    reply: ChatReply
    segment: int
    api: Api = "chat"
    recorded: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ChatStats:
    """A session's (or a gateway's) branching, counted.

    Attributes:
        turns: turns recorded.
        trajectories: trajectories (branches) recorded.
        branches: trajectories split off a recorded one (compactions, edited or retried
            histories, templates that are not prefix-stable).
        subagents: trajectories opened by a subagent.
        retries: SDK retries answered from their first try (never recorded again).
    """

    turns: int
    trajectories: int
    branches: int
    subagents: int
    retries: int = 0

    @property
    def forks_per_turn(self) -> float:
        """Branches split off per turn after the first of each trajectory: the
        bridge-break rate (0.0 before any turn)."""
        return self.branches / self.turns if self.turns else 0.0

    @property
    def turns_per_trajectory(self) -> float:
        return self.turns / self.trajectories if self.trajectories else 0.0

    def __add__(self, other: ChatStats) -> ChatStats:
        return ChatStats(
            self.turns + other.turns,
            self.trajectories + other.trajectories,
            self.branches + other.branches,
            self.subagents + other.subagents,
            self.retries + other.retries,
        )


@dataclass(slots=True)
class _Plan:
    """A turn ready to generate."""

    prompt: list[int]
    report: PrefixReport
    rendered: Rendered  # the full render (the next turn's "before"; sampling parameters)
    request: dict[str, Any]  # the chat-form request derender gets
    rendering: Rendering
    check: bool  # compare this turn's derender with the server's
    base: Branch | None = None  # the branch the turn appends to
    start: tuple[Branch, int] | None = None  # a new branch: the parent, its segments kept
    lineage: Lineage | None = None  # a new branch's
    bridge: list[int] = field(default_factory=list)


def new_reply_id(api: Api) -> str:
    """A new answer's id in the dialect's own form."""
    token = secrets.token_hex(12)
    return {"chat": "chatcmpl-", "responses": "resp_", "anthropic": "msg_"}[api] + token


#: The parameters of `ChatSession.create` that are no request field.
_NOT_FIELDS = frozenset({"self", "messages", "tools"})


class ChatSession:
    """A multi-turn chat rollout over a fleet, kept as exact token ids, in any of three
    dialects.

    ::

        session = az.ChatSession(fleet, session_id="episode-1", tools=tools)
        reply = await session.create([{"role": "user", "content": "Weather in Paris?"}])
        reply.choices[0].message.tool_calls      # parsed by the server's tool parser
        reply.token_ids, reply.logprobs, reply.weight_versions   # exact, aligned
        messages += [reply.message.to_dict(), tool_result]
        reply = await session.create(messages)    # the whole conversation, as agents do
        session.trajectory.to_lists()             # ids, loss_mask, logprobs, versions

        reply = await session.messages_create(model="m", max_tokens=64, messages=[...])
        reply.to_anthropic()                      # an Anthropic Messages answer
        reply = await session.responses_create(input="Hi", tools=[...])
        reply.to_responses()                      # an OpenAI Responses answer
        session.trajectories()                    # one exact Trajectory per branch

    Every turn goes to the session's server (``session_id`` is the fleet's session
    affinity), sampled ids are never re-tokenized, and each sampled token's logprob is
    recorded whatever the request asked for (unless ``record_logprobs=False``). Turns of
    one session run one at a time. A
    request that does not continue the last turn starts a branch (see the module
    docstring); `trajectories` returns every branch, each exact, with its `Lineage`.

    Args:
        fleet: the `Fleet` to generate on (an open one).
        session_id: the session's id (default: random); also its routing key.
        tools: the default ``tools`` of every OpenAI chat turn (a turn's own ``tools``
            replace them).
        on_unstable: what a turn does when the prompt the template renders for it does
            not extend its branch's ids (a template that strips earlier thinking):
            ``"fork"`` starts a new branch rooted at the full render, ``"raise"`` raises
            `UnstablePrefixError` naming the first differing position, ``"append"``
            bridges anyway.
        renderer: render and parse in this process with vLLM's own code (a
            `ChatRenderer`, checked against the server), instead of on the server.
        record_logprobs: ask the server for each sampled token's logprob on every turn
            (the default). False, for a trainer that computes its own: a turn asks for
            logprobs only when its request does (OpenAI's ``logprobs``), so the servers
            compute none otherwise, as vLLM's own endpoints do; the trajectory's sampled
            tokens then have no logprob (``to_lists(require_logprobs=False)``), and ids,
            loss mask and weight versions are the same.
    """

    def __init__(
        self,
        fleet: Fleet,
        *,
        session_id: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        on_unstable: OnUnstable = "fork",
        renderer: ChatRenderer | None = None,
        record_logprobs: bool = True,
    ) -> None:
        if on_unstable not in ON_UNSTABLE:
            raise ValueError(f"on_unstable must be one of {ON_UNSTABLE}, got {on_unstable!r}")
        if session_id is not None and (not isinstance(session_id, str) or not session_id):
            raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
        if renderer is not None and not isinstance(renderer, ChatRenderer):
            raise TypeError(f"renderer must be a ChatRenderer, got {type(renderer).__name__}")
        if not isinstance(record_logprobs, bool):
            raise TypeError(
                f"record_logprobs must be True or False, got {type(record_logprobs).__name__}"
            )
        self.fleet = fleet
        self.session_id = session_id if session_id is not None else uuid.uuid4().hex
        self.tools = [dict(t) for t in tools] if tools is not None else None
        self.on_unstable: OnUnstable = on_unstable
        self.renderer = renderer
        self.record_logprobs = record_logprobs
        self._chat = chat_servers(fleet)
        self._renders = SessionRenders(fleet, renderer, self.session_id, self._chat)
        self._branches: list[Branch] = []
        self._turns: list[ChatTurn] = []
        self._responses: dict[str, list[dict[str, Any]]] = {}  # Responses items by id
        self._server: str | None = None  # where the last turn ran
        self._lock = asyncio.Lock()
        self.retries = 0  # SDK retries answered from their first try (the gateway's)

    @classmethod
    def of(cls, fleet: Fleet, session_id: str) -> ChatSession:
        """The fleet's own session ``session_id`` (created on first use with the
        defaults): the one ``fleet.openai(session_id)`` talks to."""
        sessions = chat_servers(fleet).sessions
        found = sessions.get(session_id)
        if not isinstance(found, ChatSession):
            found = sessions[session_id] = cls(fleet, session_id=session_id)
        return found

    # ---------------------------------------------------------------- reading
    @property
    def trajectory(self) -> Trajectory:
        """The trajectory of the last turn (a `Trajectory`); ``to_lists()`` gives
        ``token_ids``, ``loss_mask`` (1 exactly on sampled tokens), ``logprobs``,
        ``weight_versions``."""
        if not self._turns:
            raise RuntimeError("the session has no turn yet")
        return self._branches[self._turns[-1].segment].trajectory

    @property
    def segments(self) -> tuple[Trajectory, ...]:
        """Every trajectory in the order they started: one, unless a turn branched."""
        return tuple(b.trajectory for b in self._branches)

    def trajectories(self) -> list[Trajectory]:
        """One exact `Trajectory` per branch of the session, each with its
        ``lineage`` (`Lineage`: root, branch or subagent; parent; shared ids)."""
        return [b.trajectory for b in self._branches]

    @property
    def turns(self) -> tuple[ChatTurn, ...]:
        """Every recorded turn in order."""
        return tuple(self._turns)

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation of the last turn's branch as received and answered (its last
        request's messages and reply's message, in chat form)."""
        if not self._turns:
            return []
        node = self._branches[self._turns[-1].segment].last
        return [dict(m) for m in node.history] if node is not None else []

    @property
    def server(self) -> str | None:
        """The server of the last turn (None before the first)."""
        return self._server

    def stats(self) -> ChatStats:
        """The session's turns, trajectories, branches, subagents and retries."""
        kinds = [b.lineage.kind for b in self._branches]
        return ChatStats(
            len(self._turns),
            len(self._branches),
            kinds.count("branch"),
            kinds.count("subagent"),
            self.retries,
        )

    def __repr__(self) -> str:
        return (
            f"ChatSession({self.session_id!r}, {len(self._turns)} turns, "
            f"{len(self._branches)} trajectories)"
        )

    # ---------------------------------------------------------------- turns
    async def create(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        model: str | None = None,
        n: int | None = None,
        # OpenAI's sampling and output fields
        temperature: float | None = None,
        top_p: float | None = None,
        max_tokens: int | None = None,
        max_completion_tokens: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        frequency_penalty: float | None = None,
        presence_penalty: float | None = None,
        logit_bias: Mapping[str, float] | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        response_format: Mapping[str, Any] | None = None,
        reasoning_effort: str | None = None,
        modalities: Sequence[str] | None = None,
        stream_options: Mapping[str, Any] | None = None,
        # vLLM's own fields
        top_k: int | None = None,
        min_p: float | None = None,
        min_tokens: int | None = None,
        repetition_penalty: float | None = None,
        length_penalty: float | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool | None = None,
        bad_words: Sequence[str] | None = None,
        allowed_token_ids: Sequence[int] | None = None,
        logprob_token_ids: Sequence[int] | None = None,
        structured_outputs: Mapping[str, Any] | None = None,
        thinking_token_budget: int | None = None,
        include_reasoning: bool | None = None,
        include_stop_str_in_output: bool | None = None,
        skip_special_tokens: bool | None = None,
        spaces_between_special_tokens: bool | None = None,
        add_special_tokens: bool | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        cache_salt: str | None = None,
        priority: int | None = None,
        vllm_xargs: Mapping[str, Any] | None = None,
        watermarking: Any = None,
        repetition_detection: Any = None,
        media_io_kwargs: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        mm_payload: Any = None,
        return_mm_kwargs: bool | None = None,
        # accepted and recorded; they change nothing for a session (docs/agents.md)
        user: str | None = None,
        metadata: Mapping[str, str] | None = None,
        store: bool | None = None,
        service_tier: str | None = None,
        prompt_cache_key: str | None = None,
        safety_identifier: str | None = None,
        prompt_cache_retention: str | None = None,
        verbosity: str | None = None,
        return_token_ids: bool | None = None,
        return_tokens_as_token_ids: bool | None = None,
        request_id: str | None = None,
        session_id: str | None = None,
        stream_interval: int | None = None,
        return_prompt_text: bool | None = None,
        return_token_offsets: bool | None = None,
    ) -> ChatReply:
        """One OpenAI chat turn: the whole conversation so far in (the assistant's
        earlier turns as they came back), a `ChatReply` out.

        The keywords are the OpenAI chat-completion fields a session serves and vLLM's
        own ones, passed to the server's render as they are; None (the default) leaves a
        field out. ``n`` must be 1; ``tools`` defaults to the session's. docs/agents.md
        lists every field and what a session does with it. A keyword that is no served
        field (an unknown one, or one a session refuses, such as ``echo``) is a
        TypeError naming it; to stream, use `stream`.

        Raises `ChatRequestError` (naming the field) for a bad value,
        `UnstablePrefixError` with ``on_unstable="raise"``, and the fleet's errors
        (`GenerationError`, `ServerError`...) when a server fails; a failed turn records
        nothing."""
        # Every keyword of this signature is a request field (tests/test_chat.py pins the
        # set to the wire's tables): those given, taken before any other local exists.
        given = {k: v for k, v in locals().items() if k not in _NOT_FIELDS and v is not None}
        turn_tools = [dict(t) for t in tools] if tools is not None else self.tools
        body: dict[str, Any] = {**given, "messages": list(messages)}
        if turn_tools is not None:
            body["tools"] = turn_tools
        return await self.run(chat_turn(body))

    async def responses_create(self, **body: Any) -> ChatReply:
        """One OpenAI Responses turn (``input``, ``instructions``, function ``tools``,
        ``function_call`` / ``function_call_output`` items, ``previous_response_id`` of
        an earlier turn of this session...); `ChatReply.to_responses` is the answer."""
        body.pop("stream", None)
        return await self.run(self.responses_turn(body))

    async def messages_create(self, **body: Any) -> ChatReply:
        """One Anthropic Messages turn (``model``, ``max_tokens``, ``system``,
        ``messages`` of content blocks, ``tools``...); `ChatReply.to_anthropic` is the
        answer."""
        body.pop("stream", None)
        return await self.run(_anthropic.anthropic_turn(body))

    def stream(self, body: Mapping[str, Any], *, api: Api = "chat") -> ChatStream:
        """Stream one turn of ``api``'s dialect: ``async with session.stream(body) as s:
        async for delta in s: ...`` (`ChatDelta` objects as the sampled ids are parsed),
        then ``s.reply``. What is recorded equals a turn that was not streamed."""
        if api == "chat":
            defaults = {"tools": self.tools} if self.tools is not None else {}
            turn = chat_turn({**defaults, **body, "stream": True})
        elif api == "responses":
            turn = self.responses_turn({**body, "stream": True})
        elif api == "anthropic":
            turn = _anthropic.anthropic_turn({**body, "stream": True})
        else:
            raise ValueError(f"api must be 'chat', 'responses' or 'anthropic', got {api!r}")
        return ChatStream(self, turn)

    def responses_turn(self, body: Mapping[str, Any]) -> TurnRequest:
        """A Responses request as a `TurnRequest`, its ``previous_response_id`` (an
        earlier answer of this session) expanded into that turn's items."""
        previous = body.get("previous_response_id") if isinstance(body, Mapping) else None
        if previous is not None:
            items = self._responses.get(previous) if isinstance(previous, str) else None
            if items is None:
                raise ChatRequestError(
                    f"previous_response_id {previous!r} is no response of session "
                    f"{self.session_id!r}",
                    "previous_response_id",
                )
            body = _responses.expand_previous(body, items)
        return _responses.responses_turn(body)

    async def count_tokens(self, body: Mapping[str, Any]) -> int:
        """The prompt tokens of an Anthropic Messages request, as the server's own
        render counts them (Anthropic's ``count_tokens``; nothing is recorded)."""
        turn = _anthropic.anthropic_turn(body, count_tokens=True)
        url = await self._render_server()
        model = await self.served_model(turn.model, url)
        body = await self._render_body(turn, model)
        rendering = self._renders.rendering(url)
        if isinstance(rendering, ChatRenderer):
            rendered = await rendering.render(turn.render_route, body)
        else:
            rendered = await self._renders.server_render(url, turn, body)
        return len(rendered.token_ids)

    async def run(
        self,
        turn: TurnRequest,
        *,
        sink: TurnSink | None = None,
        parent: ChatSession | None = None,
        reply_id: str | None = None,
    ) -> ChatReply:
        """Run one turn (any dialect); stream its pieces to ``sink``. ``parent``: the
        session a new conversation of this one is a subagent of (``x-parent-session``);
        ``reply_id``: the answer's id (a stream announces it before the reply exists)."""
        async with self._lock:
            return await self._turn(turn, sink, parent, reply_id or new_reply_id(turn.api))

    async def _turn(
        self,
        turn: TurnRequest,
        sink: TurnSink | None,
        parent: ChatSession | None,
        reply_id: str,
    ) -> ChatReply:
        url = await self._render_server()
        model = await self.served_model(turn.model, url)
        state = self._chat.of(url)
        if state.render is not False:
            try:
                plan = await self._plan(turn, url, model, parent)
            except AsyncSyncError as err:
                if err.status not in (403, 404) or not _render_route(err.route):
                    raise
                state.render = False
            else:
                if not self._renders.local:
                    state.render = True
                return await self._generate(plan, turn, model, sink, reply_id)
        return await self._fallback_turn(url, turn, model, sink, reply_id)

    async def _render_server(self) -> str:
        """The server a turn's renders go to, admitted like a generation (the fleet's one
        admission rule: a server fit to serve, the session's while it is)."""
        async with self.fleet.admitted(session_id=self.session_id) as client:
            return client.base_url

    async def served_model(self, requested: str | None = None, url: str | None = None) -> str:
        """The served model name a request's ``model`` maps to: itself when the server
        serves it; the one model when it serves only one (any name maps to it)."""
        models = await self._models(url or await self._render_server())
        names = [m.id for m in models]
        if requested in names:
            return str(requested)
        if len(names) == 1:
            return names[0]
        raise ChatRequestError(
            f"model {requested!r} is not served here (served: {names})", "model", status=404
        )

    async def _models(self, url: str) -> list[ModelEntry]:
        state = self._chat.of(url)
        if state.models is None:
            call = plan_models()
            state.models = await self.fleet.client(url)._endpoint.request(call, None)
        return state.models

    async def _limit(self, url: str) -> int | None:
        """The model's context length."""
        limit = self.fleet.max_model_len
        if limit is None:
            lengths = [m.max_model_len for m in await self._models(url)]
            limit = lengths[0] if lengths and lengths[0] is not None else None
        return limit

    async def _render_body(self, turn: TurnRequest, model: str) -> dict[str, Any]:
        """The dialect's render request: the served model, and a ``max_tokens`` the
        server accepts (it refuses more than the context; the session asks generation
        for what fits its own prompt)."""
        body = {**turn.render_body, "model": model}
        limit = await self._limit(await self._render_server())
        key = {"chat": None, "anthropic": "max_tokens", "responses": "max_output_tokens"}[turn.api]
        if turn.api == "chat":
            for name in ("max_tokens", "max_completion_tokens"):
                if limit is not None and isinstance(body.get(name), int) and body[name] > limit:
                    body[name] = limit
        elif key is not None and limit is not None and isinstance(body.get(key), int):
            body[key] = min(body[key], limit)
        return body

    # ---------------------------------------------------------------- planning
    async def _plan(
        self, turn: TurnRequest, url: str, model: str, parent: ChatSession | None
    ) -> _Plan:
        body = await self._render_body(turn, model)
        # the chat-form request of the history renders and of derender (no room asked:
        # the server would hold it against the context)
        request = {k: v for k, v in turn.chat.items() if k not in LIMITS}
        request["model"] = model
        where = locate(self._branches, turn.messages)
        if where.kind in ("extend", "branch"):
            assert where.node is not None
            return await self._bridge_plan(turn, body, request, url, model, where.node)
        full, rendering, check = await self._renders.full(turn, body, url, len(self._turns))
        if where.kind == "retry":
            assert where.node is not None
            node = where.node
            branch = self._branches[node.branch]
            kept = copy_upto(branch.trajectory, node.prompt_segments, self.session_id)
            lineage = self._lineage(
                "branch",
                branch,
                node,
                prefix=len(kept),
                reason=f"asks what turn {node.turn + 1} asked (a retry)",
            )
            report = PrefixReport("forked", None, None, lineage.reason, ())
            return _Plan(
                kept.token_ids,
                report,
                full,
                request,
                rendering,
                check,
                start=(branch, node.prompt_segments),
                lineage=lineage,
            )
        return self._new_branch(full, request, rendering, check, turn, parent)

    def _lineage(
        self,
        kind: str,
        branch: Branch | None,
        node: Node | None,
        *,
        prefix: int,
        reason: str | None,
        session: str | None = None,
        call: str | None = None,
    ) -> Lineage:
        return Lineage(
            session_id=self.session_id,
            branch=len(self._branches),
            kind=kind,  # type: ignore[arg-type]
            parent_branch=None if branch is None else branch.index,
            parent_session=session
            if session is not None
            else (None if branch is None else self.session_id),
            parent_turn=None if node is None else node.turn,
            tool_call_id=call,
            prefix=prefix,
            reason=reason,
        )

    def _new_branch(
        self,
        full: Rendered,
        request: dict[str, Any],
        rendering: Rendering,
        check: bool,
        turn: TurnRequest,
        parent: ChatSession | None,
    ) -> _Plan:
        ids = full.token_ids
        owner = parent if parent is not None else self
        found = pending_call(owner._branches, turn.messages)
        if found is not None and (parent is not None or self._branches):
            node, call = found
            branch = owner._branches[node.branch]
            lineage = self._lineage(
                "subagent",
                branch,
                node,
                prefix=common_prefix(branch.trajectory.token_ids, ids),
                reason=f"a new conversation while tool call {call!r} of turn {node.turn + 1} "
                f"of session {owner.session_id!r} is pending",
                session=owner.session_id,
                call=call,
            )
            report = PrefixReport("first", bridge=tuple(ids))
        elif self._branches:
            branch = max(self._branches, key=lambda b: common_prefix(b.trajectory.token_ids, ids))
            lineage = self._lineage(
                "branch",
                branch,
                branch.last,
                prefix=common_prefix(branch.trajectory.token_ids, ids),
                reason="the request continues no recorded turn (a compaction or a new history)",
            )
            report = PrefixReport("forked", None, None, lineage.reason, tuple(ids))
        else:
            lineage = self._lineage("root", None, None, prefix=0, reason=None)
            report = PrefixReport("first", bridge=tuple(ids))
        return _Plan(ids, report, full, request, rendering, check, lineage=lineage)

    async def _bridge_plan(
        self,
        turn: TurnRequest,
        body: dict[str, Any],
        request: dict[str, Any],
        url: str,
        model: str,
        node: Node,
    ) -> _Plan:
        branch = self._branches[node.branch]
        kept = node.segments
        ids = branch.trajectory.token_ids[: branch.trajectory.segments[kept - 1].end]
        start = None if branch.last is node else (branch, kept)
        lineage = None
        if start is not None:
            lineage = self._lineage(
                "branch",
                branch,
                node,
                prefix=len(ids),
                reason=f"continues turn {node.turn + 1}, not the last turn of its trajectory",
            )
        upto = turn.messages[: len(node.history)]
        opts = {k: v for k, v in request.items() if k not in ("messages", "tools")}
        history_request = chat_request(upto, turn.tools, opts, add_generation_prompt=False)
        history: Rendered | None = None
        if node.calls:  # a sampled tool call is usually re-rendered with other spacing:
            # the history's render will be needed, so it goes beside the full one
            used = self._renders.rendering(url)
            (full, rendering, check), history = await asyncio.gather(
                self._renders.full(turn, body, url, len(self._turns)),
                used.render(RENDER_ROUTE, history_request),
            )
            if rendering.name != used.name:  # the in-process renderer disagreed: the
                history = None  # server renders the history too
        else:
            full, rendering, check = await self._renders.full(turn, body, url, len(self._turns))
        if len(full.token_ids) > len(ids) and full.token_ids[: len(ids)] == ids:
            # the template renders the conversation so far as exactly the ids recorded
            # (the sampled ones included): the server's own prompt extends them, and the
            # bridge is its rest; the history's render is not needed to find it
            bridge = full.token_ids[len(ids) :]
        else:
            if history is None:
                history = await rendering.render(RENDER_ROUTE, history_request)
            d1 = first_difference(node.rendered, history.token_ids)
            d2 = first_difference(history.token_ids, full.token_ids)
            if d1 is not None or d2 is not None:
                position = d1 if d1 is not None else d2
                reason = (
                    "the template renders the earlier turns differently now"
                    if d1 is not None
                    else "the template renders the conversation so far differently once "
                    "new messages follow"
                )
                return self._unstable(
                    branch, node, ids, full, history, request, rendering, check, position,
                    reason, start,
                )  # fmt: skip
            bridge = await self._bridge(branch, node, history.token_ids, upto, turn, opts, url)
            bridge += full.token_ids[len(history.token_ids) :]
        report = PrefixReport("stable", bridge=tuple(bridge))
        if start is not None:
            report = PrefixReport(
                "forked", None, None, lineage.reason if lineage else None, tuple(bridge)
            )
        return _Plan(
            ids + bridge,
            report,
            full,
            request,
            rendering,
            check,
            base=branch if start is None else None,
            start=start,
            lineage=lineage,
            bridge=bridge,
        )

    async def _bridge(
        self,
        branch: Branch,
        node: Node,
        history: list[int],
        upto: list[dict[str, Any]],
        turn: TurnRequest,
        opts: dict[str, Any],
        url: str,
    ) -> list[int]:
        """The template's closing ids of the last assistant turn that follow what was
        sampled (the newline after ``<|im_end|>``, say)."""
        last = _completion_of(branch, node)
        before = node.rendered
        part = history[len(before) :] if len(history) > len(before) else history
        ended_on = _ended_on(last)
        if ended_on is not None and ended_on in part:
            return closing_after(last.token_ids, part, ended_on, ())
        if branch.closing is None:
            empty = [*upto[:-1], {"role": "assistant", "content": ""}]
            probe = await self._renders.rendering(url).render(
                RENDER_ROUTE, chat_request(empty, turn.tools, opts, add_generation_prompt=False)
            )
            limit = max(len(history) - len(before), 0)
            branch.closing = template_closing(history, probe.token_ids)[-limit:] if limit else []
        return closing_after(last.token_ids, part, None, branch.closing)

    def _unstable(
        self,
        branch: Branch,
        node: Node,
        ids: list[int],
        full: Rendered,
        history: Rendered,
        request: dict[str, Any],
        rendering: Rendering,
        check: bool,
        position: int | None,
        reason: str,
        start: tuple[Branch, int] | None,
    ) -> _Plan:
        if self.on_unstable == "raise":
            raise UnstablePrefixError(
                f"turn {len(self._turns) + 1} of session {self.session_id!r} is not an "
                f"extension of the session's tokens at position {position}: {reason}",
                position=position,
            )
        if self.on_unstable == "append":
            hist, full_ids = history.token_ids, full.token_ids
            end = (
                len(hist) if first_difference(hist, full_ids) is None else align_end(hist, full_ids)
            )
            last = _completion_of(branch, node)
            part = hist[position:] if position is not None and position < len(hist) else hist
            bridge = closing_after(last.token_ids, part, _ended_on(last), ()) + full_ids[end:]
            report = PrefixReport("appended", position, None, reason, tuple(bridge))
            return _Plan(
                ids + bridge,
                report,
                full,
                request,
                rendering,
                check,
                base=branch if start is None else None,
                start=start,
                lineage=None
                if start is None
                else self._lineage("branch", branch, node, prefix=len(ids), reason=reason),
                bridge=bridge,
            )
        logger.info("session %s branches: %s", self.session_id, reason)
        lineage = self._lineage(
            "branch",
            branch,
            node,
            prefix=common_prefix(branch.trajectory.token_ids, full.token_ids),
            reason=reason,
        )
        report = PrefixReport("forked", position, None, reason, tuple(full.token_ids))
        return _Plan(full.token_ids, report, full, request, rendering, check, lineage=lineage)

    # ---------------------------------------------------------------- generating
    async def _generate(
        self, plan: _Plan, turn: TurnRequest, model: str, sink: TurnSink | None, reply_id: str
    ) -> ChatReply:
        limit = await self._context(plan.prompt)
        sampling = _sampling(
            plan.rendered.sampling_params,
            turn.max_tokens,
            len(plan.prompt),
            limit,
            record_logprobs=self.record_logprobs,
        )
        streamed: list[ChatDelta] = []
        if sink is None:
            completion = await self.fleet.generate(
                plan.prompt, sampling, session_id=self.session_id
            )
        else:
            completion = await self._stream(plan, sampling, model, sink, streamed)
        body = derender_body(completion, plan.request, model)
        response = await plan.rendering.derender(body)
        if plan.check:
            response = await self._renders.check_derender(
                response, body, completion.server, len(self._turns)
            )
        reply = reply_from(response, completion, plan.report, model, reply_id)
        if sink is not None:
            reply = await reconcile(reply, streamed, sink)
        return self._record(plan, turn, completion, reply)

    async def _stream(
        self,
        plan: _Plan,
        sampling: Sampling,
        model: str,
        sink: TurnSink,
        streamed: list[ChatDelta],
    ) -> Completion:
        """Generate streamed, each batch of sampled ids parsed for ``sink`` as it comes
        (`asyncsync._chat.stream.stream_sample`)."""
        parser = StreamParser(
            plan.rendering, plan.request, plan.prompt, model, new_reply_id("chat")
        )
        server = None if isinstance(plan.rendering, ChatRenderer) else _rendering_server(plan)
        stream = self.fleet.stream(plan.prompt, sampling, session_id=self.session_id)
        state = None if server is None else self._chat.of(server)
        return await stream_sample(stream, plan.prompt, parser, sink, streamed, state, server)

    async def _context(self, prompt: list[int]) -> int | None:
        limit = await self._limit(
            self.fleet.session_server(self.session_id) or await self._render_server()
        )
        if limit is not None and len(prompt) >= limit:
            raise ChatRequestError(
                f"the conversation has {len(prompt)} tokens, which leaves no room for a "
                f"reply in the model's context ({limit}); start a new session",
                "messages",
            )
        return limit

    def _record(
        self, plan: _Plan, turn: TurnRequest, completion: Completion, reply: ChatReply
    ) -> ChatReply:
        if plan.base is not None:
            branch = plan.base
            if plan.bridge:
                branch.trajectory.add_prompt(plan.bridge)
        else:
            assert plan.lineage is not None
            if plan.start is not None:
                parent, kept = plan.start
                trajectory = copy_upto(parent.trajectory, kept, self.session_id)
                if plan.bridge:
                    trajectory.add_prompt(plan.bridge)
            else:
                trajectory = Trajectory(plan.prompt, session_id=self.session_id)
            trajectory.lineage = plan.lineage
            branch = Branch(len(self._branches), trajectory, plan.lineage)
            self._branches.append(branch)
        prompt_segments = len(branch.trajectory.segments)
        branch.trajectory.add_completion(completion)
        message = reply.message.to_dict()
        branch.nodes.append(
            Node(
                turn=len(self._turns),
                branch=branch.index,
                request=list(turn.messages),
                history=[*turn.messages, message],
                rendered=plan.rendered.token_ids,
                prompt_segments=prompt_segments,
                segments=len(branch.trajectory.segments),
                calls=list(reply.parts().tool_calls),
            )
        )
        self._server = completion.server
        self._turns.append(
            ChatTurn(tuple(turn.messages), reply, branch.index, turn.api, dict(turn.recorded))
        )
        if turn.api == "responses":
            items = (
                list(turn.render_body["input"])
                if isinstance(turn.render_body.get("input"), list)
                else [{"role": "user", "content": turn.render_body.get("input")}]
            )
            self._responses[reply.id] = [*items, *_responses.output_items(reply.parts())]
        return reply

    # ---------------------------------------------------------------- fallback
    async def _fallback_turn(
        self, url: str, turn: TurnRequest, model: str, sink: TurnSink | None, reply_id: str
    ) -> ChatReply:
        state = self._chat.of(url)
        if not state.warned:
            state.warned = True
            warnings.warn(
                f"{url} does not serve render/generate (no --enable-scale-out?): chat turns "
                "go through /v1/chat/completions with return_token_ids; the server renders "
                "every prompt, which is checked to extend the session's tokens, and weight "
                "versions are the client's record. Warned once per server.",
                ChatFallbackWarning,
                stacklevel=4,
            )
        request = {**turn.chat, "model": model}
        if turn.max_tokens is not None:
            request["max_completion_tokens"] = turn.max_tokens
            request.pop("max_tokens", None)
        asked = bool(request.get("logprobs"))
        top = int(request.get("top_logprobs") or 0) if asked or self.record_logprobs else None
        body = chat_fallback_body(request, top)
        # admitted like a generation and counted in flight (the fleet's one rule)
        async with self.fleet.admitted(session_id=self.session_id) as client:
            url = client.base_url
            admitted, started = client.weight_version, time.monotonic()
            answer = await client._endpoint.request(plan_chat(), _json.dumps(body))
            completed = client.weight_version
        choice = answer.response["choices"][0]
        completion = Completion(
            prompt_token_ids=answer.prompt_token_ids,
            token_ids=answer.token_ids,
            logprobs=answer.logprobs,
            top_logprobs=None,
            finish_reason=choice.get("finish_reason"),
            stop_reason=choice.get("stop_reason"),
            weight_versions=client_spans(len(answer.token_ids), admitted, completed),
            server=url,
            route=CHAT_ROUTE,
            latency=time.monotonic() - started,
            admitted_version=admitted,
            completed_version=completed,
        )
        rendered = Rendered(answer.prompt_token_ids, {})
        plan = self._fallback_plan(url, answer.prompt_token_ids, rendered, request, turn)
        reply = reply_from(answer.response, completion, plan.report, model, reply_id)
        if sink is not None:
            await sink.started(answer.prompt_token_ids)
            reply = await reconcile(reply, [], sink)
        return self._record(plan, turn, completion, reply)

    def _fallback_plan(
        self,
        url: str,
        prompt: list[int],
        rendered: Rendered,
        request: dict[str, Any],
        turn: TurnRequest,
    ) -> _Plan:
        """The server rendered this turn's prompt itself: it continues the branch it
        belongs to when that branch's ids are a prefix of it (checked)."""
        server = ServerRendering(self.fleet, url)
        where = locate(self._branches, turn.messages)
        if where.kind == "extend" and where.node is not None:
            branch = self._branches[where.node.branch]
            ours = branch.trajectory.token_ids
            position = first_difference(ours, prompt)
            if position is None:
                bridge = prompt[len(ours) :]
                report = PrefixReport("stable", bridge=tuple(bridge))
                return _Plan(
                    prompt, report, rendered, request, server, False, base=branch, bridge=bridge
                )
            reason = "the server's render of this turn does not extend the session's tokens"
            if self.on_unstable == "raise":
                raise UnstablePrefixError(
                    f"session {self.session_id!r}: {reason} (position {position})",
                    position=position,
                )
            lineage = self._lineage(
                "branch", branch, where.node, prefix=common_prefix(ours, prompt), reason=reason
            )
            report = PrefixReport("forked", position, None, reason, tuple(prompt))
            return _Plan(prompt, report, rendered, request, server, False, lineage=lineage)
        return self._new_branch(rendered, request, server, False, turn, None)


def _rendering_server(plan: _Plan) -> str:
    """The server a plan renders on (its streamed derender's)."""
    return str(getattr(plan.rendering, "url", ""))


def _render_route(route: str | None) -> bool:
    return route is not None and route.endswith("/render")


def _completion_of(branch: Branch, node: Node) -> Completion:
    completion = branch.trajectory.segments[node.segments - 1].completion
    assert completion is not None
    return completion


def _ended_on(completion: Completion) -> int | None:
    """The end-of-sequence or stop id a completion stopped on (its last id), if any."""
    if completion.finish_reason != "stop" or not completion.token_ids:
        return None
    if isinstance(completion.stop_reason, str):
        return None  # a stop string: not an id of the template's
    return completion.token_ids[-1]


#: Sampling parameters render returns that generate must not get (or that asyncsync
#: sets itself).
_NOT_SENT = frozenset({"n", "output_kind", "skip_clone", "max_tokens", "logprobs"})


def _sampling(
    params: Mapping[str, Any],
    requested: int | None,
    prompt_len: int,
    limit: int | None,
    *,
    record_logprobs: bool = True,
) -> Sampling:
    """The generation's `Sampling`: render's sampling parameters (the server's defaults
    and the request's own; those `Sampling` has no field for in its ``extra_params``),
    logprobs of every sampled token (with ``record_logprobs``; else only when the
    request asked), and ``max_tokens`` for the session's prompt (which is not the length
    render saw)."""
    out = _sampling_fields(params, requested, prompt_len, limit, record_logprobs)
    other = {k: out.pop(k) for k in list(out) if k not in _FIELD_NAMES}
    return Sampling(**out, extra_params=other or None)


_FIELD_NAMES = frozenset(FIELDS)


def _sampling_fields(
    params: Mapping[str, Any],
    requested: int | None,
    prompt_len: int,
    limit: int | None,
    record_logprobs: bool,
) -> dict[str, Any]:
    out = {k: v for k, v in params.items() if v is not None and k not in _NOT_SENT}
    top = params.get("logprobs")  # an int when the request asked for logprobs, else None
    asked = top if isinstance(top, int) and not isinstance(top, bool) and top >= 0 else None
    if asked is not None or record_logprobs:
        out["logprobs"] = asked or 0
    room = None if limit is None else limit - prompt_len
    if requested is None:
        out["max_tokens"] = room if room is not None else params.get("max_tokens")
    else:
        out["max_tokens"] = int(requested) if room is None else min(int(requested), room)
    if out["max_tokens"] is None:
        out.pop("max_tokens")
    return out

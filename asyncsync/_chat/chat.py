"""``ChatSession``: OpenAI-style chat turns in, the exact token ids of a rollout out.

Each turn (`ChatSession.create`): match the caller's messages against the session's
history; build the prompt from the session's exact ids and a bridge rendered by the
server's own template (`asyncsync._chat.prefix`), or fork when the template is not
prefix-stable there; generate token-in-token-out on the session's server (session
affinity through the fleet: versions, staleness, failover); derender the sampled ids
into an OpenAI message with the server's tool-call parser; record everything in the
current segment (an `Trajectory`).

Servers without ``--enable-scale-out`` (render and the generate route answer 403) are
served through ``/v1/chat/completions`` with ``return_token_ids``: the server renders
each turn itself, so that the prompt extends the session's ids is checked, never
assumed; a warning says so once per server. vLLM 0.27.1 (render and derender without a
flag, no weight versions) takes the same path as 0.32 with client-side versions.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncsync._chat.chat_reply import ChatReply, reply_from
from asyncsync._chat.prefix import (
    ON_UNSTABLE,
    OnUnstable,
    PrefixReport,
    PrefixStatus,
    UnstablePrefixError,
    align_end,
    closing_after,
    first_difference,
    history_mismatch,
    template_closing,
)
from asyncsync._chat.trajectory import Trajectory
from asyncsync._core import encoding as _json
from asyncsync._core.completion import Completion
from asyncsync._core.errors import GenerationError, ServerError
from asyncsync._wire.chat import (
    CHAT_ROUTE,
    ChatRequestError,
    Rendered,
    chat_fallback_body,
    chat_request,
    check_messages,
    derender_body,
    plan_chat,
    plan_derender,
    plan_models,
    plan_render,
)
from asyncsync._wire.control import ModelEntry
from asyncsync._wire.generation import client_spans

if TYPE_CHECKING:
    from asyncsync.fleet import Fleet

__all__ = ["ChatFallbackWarning", "ChatSession", "ChatTurn", "chat_servers"]

logger = logging.getLogger("asyncsync.generate")


class ChatFallbackWarning(UserWarning):
    """A server serves chat turns only through ``/v1/chat/completions`` (no
    ``--enable-scale-out``): prompts come from its render each turn and no weight
    versions from the server. Issued once per server."""


@dataclass(slots=True)
class _ServerChat:
    """What is known about one server's chat routes."""

    models: list[ModelEntry] | None = None
    render: bool | None = None  # None: not tried yet
    warned: bool = False


@dataclass(slots=True)
class FleetChat:
    """Per-fleet chat state shared by its sessions: each server's chat routes (probed
    once) and the sessions `Fleet.openai` hands out."""

    servers: dict[str, _ServerChat] = field(default_factory=dict)
    sessions: dict[str, ChatSession] = field(default_factory=dict)

    def of(self, url: str) -> _ServerChat:
        found = self.servers.get(url)
        if found is None:
            found = self.servers[url] = _ServerChat()
        return found


_FLEETS: weakref.WeakKeyDictionary[Any, FleetChat] = weakref.WeakKeyDictionary()


def chat_servers(fleet: Fleet) -> FleetChat:
    """The chat state of ``fleet`` (created on first use)."""
    found = _FLEETS.get(fleet)
    if found is None:
        found = _FLEETS[fleet] = FleetChat()
    return found


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One recorded turn: the messages received, the reply, and its segment.

    Attributes:
        messages: the request's messages, as received.
        reply: the `ChatReply` returned.
        segment: the index of the turn's segment in `ChatSession.segments`.
    """

    messages: tuple[Mapping[str, Any], ...]
    reply: ChatReply
    segment: int


@dataclass(slots=True)
class _Plan:
    """A turn ready to generate."""

    prompt: list[int]
    report: PrefixReport
    rendered: Rendered
    request: dict[str, Any]
    fork: bool


class ChatSession:
    """A multi-turn chat rollout over a fleet, kept as exact token ids.

    ::

        session = az.ChatSession(fleet, session_id="episode-1", tools=tools)
        reply = await session.create([{"role": "user", "content": "Weather in Paris?"}])
        reply.choices[0].message.tool_calls      # parsed by the server's tool parser
        reply.token_ids, reply.logprobs, reply.weight_versions   # exact, aligned
        messages += [reply.message.to_dict(), tool_result]
        reply = await session.create(messages)    # the whole conversation, as agents do
        session.trajectory.to_lists()             # ids, loss_mask, logprobs, versions

    Every turn goes to the session's server (``session_id`` is the fleet's session
    affinity), sampled ids are never re-tokenized, and each sampled token's logprob is
    recorded whatever the request asked for. Turns of one session run one at a time.

    Args:
        fleet: the `Fleet` to generate on (an open one).
        session_id: the session's id (default: random); also its routing key.
        tools: the default ``tools`` of every turn (a turn's own ``tools`` replace them).
        on_unstable: what a turn does when the prompt the template renders for it does
            not extend the session's ids (a template that strips earlier thinking, a
            history the agent edited): ``"fork"`` starts a new segment rooted at the
            full render, ``"raise"`` raises `UnstablePrefixError` naming the
            first differing position, ``"append"`` bridges anyway.
    """

    def __init__(
        self,
        fleet: Fleet,
        *,
        session_id: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        on_unstable: OnUnstable = "fork",
    ) -> None:
        if on_unstable not in ON_UNSTABLE:
            raise ValueError(f"on_unstable must be one of {ON_UNSTABLE}, got {on_unstable!r}")
        if session_id is not None and (not isinstance(session_id, str) or not session_id):
            raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
        self.fleet = fleet
        self.session_id = session_id if session_id is not None else uuid.uuid4().hex
        self.tools = [dict(t) for t in tools] if tools is not None else None
        self.on_unstable: OnUnstable = on_unstable
        self._chat = chat_servers(fleet)
        self._segments: list[Trajectory] = []
        self._turns: list[ChatTurn] = []
        self._history: list[dict[str, Any]] = []
        self._before: list[int] = []  # the full render of the last turn's request
        self._closing: list[int] | None = None
        self._server: str | None = None  # where the last turn ran
        self._lock = asyncio.Lock()

    @classmethod
    def of(cls, fleet: Fleet, session_id: str) -> ChatSession:
        """The fleet's own session ``session_id`` (created on first use with the
        defaults): the one ``fleet.openai(session_id)`` talks to."""
        sessions = chat_servers(fleet).sessions
        found = sessions.get(session_id)
        if found is None:
            found = sessions[session_id] = cls(fleet, session_id=session_id)
        return found

    # ---------------------------------------------------------------- reading
    @property
    def trajectory(self) -> Trajectory:
        """The current segment (a `Trajectory`); ``to_lists()`` gives ``token_ids``,
        ``loss_mask`` (1 exactly on sampled tokens), ``logprobs``, ``weight_versions``."""
        if not self._segments:
            raise RuntimeError("the session has no turn yet")
        return self._segments[-1]

    @property
    def segments(self) -> tuple[Trajectory, ...]:
        """Every segment in order: one, unless a turn forked."""
        return tuple(self._segments)

    @property
    def turns(self) -> tuple[ChatTurn, ...]:
        """Every recorded turn in order."""
        return tuple(self._turns)

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation as received and answered (the last request's messages and
        the last reply's message)."""
        return [dict(m) for m in self._history]

    @property
    def server(self) -> str | None:
        """The server of the last turn (None before the first)."""
        return self._server

    def __repr__(self) -> str:
        return (
            f"ChatSession({self.session_id!r}, {len(self._turns)} turns, "
            f"{len(self._segments)} segments)"
        )

    # ---------------------------------------------------------------- a turn
    async def create(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **options: Any,
    ) -> ChatReply:
        """One turn: the whole conversation so far in (OpenAI chat messages, the
        assistant's earlier turns as they came back), a `ChatReply` out.

        ``options`` are OpenAI chat-completion fields (``temperature``, ``max_tokens``,
        ``top_p``, ``seed``, ``stop``, ``tool_choice``, ``logprobs``/``top_logprobs``,
        ``model``...) and vLLM's extra ones (``top_k``, ``chat_template_kwargs``...),
        passed to the server's render as they are. ``n`` must be 1.

        Raises `ChatRequestError` (a ValueError naming the field) for a bad request,
        `UnstablePrefixError` with ``on_unstable="raise"``, and the fleet's errors
        (`GenerationError`, `ServerError`...) when a server fails; a failed turn records
        nothing."""
        msgs = check_messages(messages)
        if options.get("n", 1) != 1:
            raise ChatRequestError("n must be 1: a chat session continues one sample", "n")
        options.pop("n", None)
        options.pop("stream", None)
        turn_tools = [dict(t) for t in tools] if tools is not None else self.tools
        async with self._lock:
            return await self._turn(msgs, turn_tools, options)

    async def _turn(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
        options: dict[str, Any],
    ) -> ChatReply:  # fmt: skip
        url = self._render_server()
        model = await self.served_model(options.get("model"), url)
        request = chat_request(messages, tools, {**options, "model": model})
        state = self._chat.of(url)
        if state.render is not False:
            try:
                plan = await self._plan(url, messages, tools, request)
            except ServerError as err:
                if err.status not in (403, 404) or err.route != plan_render().route:
                    raise
                state.render = False
            else:
                state.render = True
                return await self._generate(plan, messages, model, options)
        return await self._fallback_turn(url, messages, request, model, options)

    def _render_server(self) -> str:
        """The server a turn's renders go to: the session's, else one fit to serve."""
        pinned = self.fleet.session_server(self.session_id) or self._server
        if pinned is not None and pinned in self.fleet:
            return pinned
        fit = self.fleet.where(lambda s: s.healthy and not s.dirty)
        if fit:
            return min(fit, key=lambda u: self.fleet.state(u).outstanding)
        urls = list(self.fleet.urls)
        if not urls:
            raise GenerationError("no server to chat with: the fleet is empty")
        return urls[0]

    async def served_model(self, requested: str | None = None, url: str | None = None) -> str:
        """The served model name a request's ``model`` maps to: itself when the server
        serves it; the one model when it serves only one (any name maps to it)."""
        models = await self._models(url or self._render_server())
        names = [m.id for m in models]
        if requested in names:
            return str(requested)
        if len(names) == 1:
            return names[0]
        raise ChatRequestError(f"model {requested!r} is not served here (served: {names})", "model")

    async def _models(self, url: str) -> list[ModelEntry]:
        state = self._chat.of(url)
        if state.models is None:
            call = plan_models()
            state.models = await self.fleet.client(url).endpoint.request(call, None)
        return state.models

    async def _render(self, url: str, request: Mapping[str, Any]) -> Rendered:
        endpoint = self.fleet.client(url).endpoint
        return await endpoint.request(plan_render(), _json.dumps(dict(request)))

    # ---------------------------------------------------------------- planning
    async def _plan(
        self, url: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
        request: dict[str, Any],
    ) -> _Plan:  # fmt: skip
        if not self._segments:
            full = await self._render(url, request)
            return _Plan(full.token_ids, _forked("first", full), full, request, True)
        mismatch = history_mismatch(self._history, messages)
        opts = {k: v for k, v in request.items() if k not in ("messages", "tools")}
        upto = messages[: len(self._history)]
        history_request = chat_request(upto, tools, opts, add_generation_prompt=False)
        full, history = await asyncio.gather(
            self._render(url, request), self._render(url, history_request)
        )
        if mismatch is not None:
            reason = f"message {mismatch} does not match the session's history"
            return await self._unstable(url, full, history, request, None, mismatch, reason)
        d1 = first_difference(self._before, history.token_ids)
        d2 = first_difference(history.token_ids, full.token_ids)
        if d1 is None and d2 is None:
            bridge = await self._bridge(url, history.token_ids, upto, tools, opts)
            bridge += full.token_ids[len(history.token_ids) :]
            prompt = self.trajectory.token_ids + bridge
            return _Plan(prompt, PrefixReport("stable", bridge=tuple(bridge)), full, request, False)
        position = d1 if d1 is not None else d2
        reason = (
            "the template renders the earlier turns differently now"
            if d1 is not None
            else "the template renders the conversation so far differently once new messages follow"
        )
        return await self._unstable(url, full, history, request, position, None, reason)

    async def _bridge(
        self, url: str, history: list[int], upto: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None, opts: dict[str, Any],
    ) -> list[int]:  # fmt: skip
        """The template's closing ids of the last assistant turn that follow what was
        sampled (the newline after ``<|im_end|>``, say)."""
        last = self.trajectory.completions[-1]
        turn = history[len(self._before) :] if len(history) > len(self._before) else history
        ended_on = _ended_on(last)
        if ended_on is not None and ended_on in turn:
            return closing_after(last.token_ids, turn, ended_on, ())
        if self._closing is None:
            empty = [*upto[:-1], {"role": "assistant", "content": ""}]
            probe = await self._render(
                url, chat_request(empty, tools, opts, add_generation_prompt=False)
            )
            limit = max(len(history) - len(self._before), 0)
            self._closing = template_closing(history, probe.token_ids)[-limit:] if limit else []
        return closing_after(last.token_ids, turn, None, self._closing)

    async def _unstable(
        self, url: str, full: Rendered, history: Rendered, request: dict[str, Any],
        position: int | None, message: int | None, reason: str,
    ) -> _Plan:  # fmt: skip
        if self.on_unstable == "raise":
            where = f"at position {position}" if position is not None else f"at message {message}"
            raise UnstablePrefixError(
                f"turn {len(self._turns) + 1} of session {self.session_id!r} is not an "
                f"extension of the session's tokens {where}: {reason}",
                position=position, message_index=message,
            )  # fmt: skip
        if self.on_unstable == "append" and len(request["messages"]) > len(self._history):
            hist, ids = history.token_ids, full.token_ids
            end = len(hist) if first_difference(hist, ids) is None else align_end(hist, ids)
            last = self.trajectory.completions[-1]
            turn = hist[position:] if position is not None and position < len(hist) else hist
            bridge = closing_after(last.token_ids, turn, _ended_on(last), ()) + ids[end:]
            report = PrefixReport("appended", position, message, reason, tuple(bridge))
            return _Plan(self.trajectory.token_ids + bridge, report, full, request, False)
        logger.info("session %s forks: %s", self.session_id, reason)
        report = PrefixReport("forked", position, message, reason, tuple(full.token_ids))
        return _Plan(full.token_ids, report, full, request, True)

    # ---------------------------------------------------------------- generating
    async def _generate(
        self, plan: _Plan, messages: list[dict[str, Any]], model: str, options: Mapping[str, Any]
    ) -> ChatReply:
        limit = await self._context(plan.prompt)
        sampling = _sampling(plan.rendered.sampling_params, options, len(plan.prompt), limit)
        completion = await self.fleet.generate(plan.prompt, session_id=self.session_id, **sampling)
        body = derender_body(completion, plan.request, model)
        endpoint = self.fleet.client(completion.server).endpoint
        response = await endpoint.request(plan_derender(), _json.dumps(body))
        return self._record(plan, messages, completion, response, model)

    async def _context(self, prompt: list[int]) -> int | None:
        limit = self.fleet.max_model_len
        if limit is None:
            url = self.fleet.session_server(self.session_id) or self._render_server()
            lengths = [m.max_model_len for m in await self._models(url)]
            limit = lengths[0] if lengths and lengths[0] is not None else None
        if limit is not None and len(prompt) >= limit:
            raise ChatRequestError(
                f"the conversation has {len(prompt)} tokens, which leaves no room for a "
                f"reply in the model's context ({limit}); start a new session",
                "messages",
            )
        return limit

    def _record(
        self, plan: _Plan, messages: list[dict[str, Any]], completion: Completion,
        response: Mapping[str, Any], model: str,
    ) -> ChatReply:  # fmt: skip
        if plan.fork:
            self._segments.append(Trajectory(plan.prompt, session_id=self.session_id))
        elif plan.report.bridge:
            self.trajectory.add_prompt(plan.report.bridge)
        self.trajectory.add_completion(completion)
        reply = reply_from(response, completion, plan.report, model)
        self._history = [*messages, reply.message.to_dict()]
        self._before = plan.rendered.token_ids
        self._server = completion.server
        self._turns.append(ChatTurn(tuple(messages), reply, len(self._segments) - 1))
        return reply

    # ---------------------------------------------------------------- fallback
    async def _fallback_turn(
        self, url: str, messages: list[dict[str, Any]], request: dict[str, Any], model: str,
        options: Mapping[str, Any],
    ) -> ChatReply:  # fmt: skip
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
        client = self.fleet.client(url)
        top = options.get("top_logprobs") or 0
        body = chat_fallback_body(request, int(top))
        admitted, started = client.server_state.weight_version, time.monotonic()
        answer = await client.endpoint.request(plan_chat(), _json.dumps(body))
        completed = client.server_state.weight_version
        choice = answer.response["choices"][0]
        completion = Completion(
            prompt_token_ids=answer.prompt_token_ids, token_ids=answer.token_ids,
            logprobs=answer.logprobs, top_logprobs=None,
            finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason"),
            weight_versions=client_spans(len(answer.token_ids), admitted, completed),
            server=url, route=CHAT_ROUTE, latency=time.monotonic() - started,
            admitted_version=admitted, completed_version=completed,
        )  # fmt: skip
        rendered = Rendered(answer.prompt_token_ids, {})
        plan = self._fallback_plan(answer.prompt_token_ids, rendered, request)
        return self._record(plan, messages, completion, answer.response, model)

    def _fallback_plan(
        self, prompt: list[int], rendered: Rendered, request: dict[str, Any]
    ) -> _Plan:
        """The server rendered this turn's prompt itself: it continues the session when
        the session's ids are a prefix of it (checked)."""
        if self._segments:
            ours = self.trajectory.token_ids
            position = first_difference(ours, prompt)
            if position is None:
                bridge = prompt[len(ours) :]
                return _Plan(
                    prompt, PrefixReport("stable", bridge=tuple(bridge)), rendered, request, False
                )
            reason = "the server's render of this turn does not extend the session's tokens"
            if self.on_unstable == "raise":
                raise UnstablePrefixError(
                    f"session {self.session_id!r}: {reason} (position {position})",
                    position=position,
                )
            report = PrefixReport("forked", position, None, reason, tuple(prompt))
            return _Plan(prompt, report, rendered, request, True)
        return _Plan(prompt, _forked("first", rendered), rendered, request, True)


def _forked(status: PrefixStatus, rendered: Rendered) -> PrefixReport:
    return PrefixReport(status, bridge=tuple(rendered.token_ids))


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
    params: Mapping[str, Any], options: Mapping[str, Any], prompt_len: int, limit: int | None
) -> dict[str, Any]:
    """The generation's options: render's sampling parameters (the server's defaults
    and the request's own), logprobs of every sampled token, and ``max_tokens`` for the
    session's prompt (which is not the length render saw)."""
    out = {k: v for k, v in params.items() if v is not None and k not in _NOT_SENT}
    top = params.get("logprobs")
    out["logprobs"] = int(top) if isinstance(top, int) and top > 0 else 0
    requested = options.get("max_completion_tokens", options.get("max_tokens"))
    room = None if limit is None else limit - prompt_len
    if requested is None:
        out["max_tokens"] = room if room is not None else params.get("max_tokens")
    else:
        out["max_tokens"] = int(requested) if room is None else min(int(requested), room)
    if out["max_tokens"] is None:
        out.pop("max_tokens")
    return out

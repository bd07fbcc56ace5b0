"""The fake's chat routes, in vLLM 0.32's shapes (checked against a real server by
``tests/test_chat_fake.py``): render of the three dialects, derender (whole and
streamed), and ``/v1/chat/completions`` with ``return_token_ids`` (whole and streamed).

Served when the server has a chat policy (``FakeVLLMServer(chat=...)``): the model then
speaks ChatML with hermes tool calls (`asyncsync.testing._fake._chatlm`). Render and
derender answer 403 without scale-out on vLLM >= 0.30, like generate; the Anthropic and
Responses render routes exist from 0.32 on.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

from aiohttp import web

from asyncsync._wire import anthropic as _anthropic
from asyncsync._wire import responses as _responses
from asyncsync.testing._fake._chatlm import (
    ChatLM,
    HermesStream,
    call_id,
    parse_hermes,
    render_chat,
)
from asyncsync.testing._fake._logprobs import content_logprobs
from asyncsync.testing._fake._responses import bad_request, openai_error, read_json, usage
from asyncsync.testing._fake._routes import RouteGroup, route
from asyncsync.testing._fake._sampling import Job, Sample, SamplingParams
from asyncsync.testing._fake._state import FakeState
from asyncsync.testing._fake._streaming import sse_event

__all__ = ["ChatRoutes"]

_SCALE_OUT_DISABLED = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
)
_NEEDS_CHAT_REQUEST = (
    "chat_request is required when a tool or reasoning parser is configured because plain "
    "detokenization would leak raw parser markup into content."
)


def _version(state: FakeState) -> tuple[int, int]:
    major, minor = (int(x) for x in state.version.split(".")[:2])
    return major, minor


def _chat(state: FakeState) -> bool:
    return state.chat is not None


def _dialect_render(state: FakeState) -> bool:
    return state.chat is not None and _version(state) >= (0, 32)


def _scale_out_refused(state: FakeState) -> web.Response | None:
    if _version(state) >= (0, 30) and not (state.scale_out or state.tokens_only):
        return openai_error(403, _SCALE_OUT_DISABLED, "PermissionDeniedError")
    return None


def _model_error(state: FakeState, model: Any) -> web.Response | None:
    if model is not None and model != state.model:
        return openai_error(
            404, f"The model `{model}` does not exist. Valid aliases: <path>", "NotFoundError",
            "model",
        )  # fmt: skip
    return None


class ChatRoutes(RouteGroup):
    """Render, derender and chat completions over the fake's chat model."""

    @property
    def lm(self) -> ChatLM:
        lm = self.state.lm
        assert isinstance(lm, ChatLM)
        return lm

    # ------------------------------------------------------------------ render
    @route("POST", "/v1/chat/completions/render", served=_chat)
    async def _render_chat(self, request: web.Request) -> web.Response:
        return await self._render(request, "chat")

    @route("POST", "/v1/messages/render", served=_dialect_render)
    async def _render_messages(self, request: web.Request) -> web.Response:
        return await self._render(request, "anthropic")

    @route("POST", "/v1/responses/render", served=_dialect_render)
    async def _render_responses(self, request: web.Request) -> web.Response:
        return await self._render(request, "responses")

    async def _render(self, request: web.Request, api: str) -> web.Response:
        refused = _scale_out_refused(self.state)
        if refused is not None:
            return refused
        ok, body = await read_json(request)
        if not ok or not isinstance(body, dict):
            return bad_request("the request body must be a JSON object")
        converted = self._chat_form(api, body)
        if isinstance(converted, web.Response):
            return converted
        messages, tools, options = converted
        prompt = self._prompt(messages, tools, options)
        if isinstance(prompt, web.Response):
            return prompt
        limit = {"chat": body.get("max_completion_tokens", body.get("max_tokens")),
                 "anthropic": body.get("max_tokens"),
                 "responses": body.get("max_output_tokens")}[api]  # fmt: skip
        params = self._sampling_params(body, prompt, limit, api)
        if isinstance(params, web.Response):
            return params
        prefix = "resp" if api == "responses" else "chatcmpl"
        return web.json_response(
            {
                "request_id": f"{prefix}_{secrets.token_hex(8)}"
                if api == "responses"
                else f"{prefix}-{secrets.token_hex(8)}",
                "token_ids": prompt, "token_offsets": None, "features": None,
                "content_parts": None, "sampling_params": params, "model": self.state.model,
                "reasoning_ended": None, "reasoning_parser_kwargs": None,
                "return_token_ids": None, "output_mode": "tokens", "stream": False,
                "stream_options": None, "cache_salt": None, "priority": 0,
                "kv_transfer_params": None, "ec_transfer_params": None,
            }
        )  # fmt: skip

    def _chat_form(
        self, api: str, body: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]] | web.Response:
        error = _model_error(self.state, body.get("model"))
        if error is not None:
            return error
        try:
            if api == "anthropic":
                return _anthropic.to_chat(body)
            if api == "responses":
                if body.get("previous_response_id") is not None:
                    return openai_error(
                        400, "previous_response_id is not supported by the stateless render "
                        "endpoint.", "invalid_request_error", "previous_response_id",
                    )  # fmt: skip
                return _responses.to_chat(body)
            messages = body["messages"]
            if not isinstance(messages, list) or not messages:
                raise TypeError("messages")
            tools = body.get("tools")
            options = {k: v for k, v in body.items() if k not in ("messages", "tools")}
            return list(messages), tools, options
        except (KeyError, TypeError, AttributeError, IndexError) as exc:
            return bad_request(f"1 validation error: {type(exc).__name__}: {exc}")

    def _prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
        options: Mapping[str, Any],
    ) -> list[int] | web.Response:  # fmt: skip
        if options.get("tool_choice") == "none":
            tools = None
        add = options.get("add_generation_prompt", True) is not False
        try:
            text = render_chat(messages, tools, add_generation_prompt=add)
        except (AttributeError, TypeError) as exc:
            return bad_request(f"the chat template failed: {exc}")
        return self.lm.tokenizer.encode(text)

    def _sampling_params(
        self, body: Mapping[str, Any], prompt: list[int], limit: Any, api: str
    ) -> dict[str, Any] | web.Response:
        state = self.state
        if limit is not None and (not isinstance(limit, int) or limit > state.max_model_len):
            name = {"chat": "max_tokens", "anthropic": "max_completion_tokens",
                    "responses": "max_output_tokens"}[api]  # fmt: skip
            return openai_error(
                400, f"{name}={limit} cannot be greater than max_model_len="
                f"{state.max_model_len}. Please request fewer output tokens. "
                f"(parameter={name}, value={limit})", "BadRequestError", name,
            )  # fmt: skip
        temperature = body.get("temperature", 1.0)
        params: dict[str, Any] = {
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
            "temperature": float(temperature if temperature is not None else 1.0),
        }  # fmt: skip
        if params["temperature"] != 0.0:
            params["top_p"] = float(body.get("top_p") or 1.0)
            params["min_p"] = 0.0
        if body.get("top_k") is not None:
            params["top_k"] = body["top_k"]
        if body.get("seed") is not None:
            params["seed"] = body["seed"]
        params["stop"] = list(body.get("stop") or body.get("stop_sequences") or [])
        params["stop_token_ids"] = list(body.get("stop_token_ids") or [])
        params["max_tokens"] = limit if limit is not None else state.max_model_len - len(prompt)
        if body.get("logprobs") is True or body.get("top_logprobs") is not None:
            params["logprobs"] = int(body.get("top_logprobs") or 0)
        params.update({"skip_special_tokens": False, "output_kind": 2, "skip_clone": True})
        if api == "responses":
            params["extra_args"] = {}
        params.update({"bad_words": [], "skip_reading_prefix_cache": False})
        return params

    # ------------------------------------------------------------------ derender
    @route("POST", "/v1/chat/completions/derender", served=_chat)
    async def _derender(self, request: web.Request) -> web.Response:
        refused = _scale_out_refused(self.state)
        if refused is not None:
            return refused
        ok, body = await read_json(request)
        if not ok or not isinstance(body, dict):
            return bad_request("the request body must be a JSON object")
        error = _model_error(self.state, body.get("model"))
        if error is not None:
            return error
        if body.get("chat_request") is None:
            return bad_request(_NEEDS_CHAT_REQUEST)
        if body.get("stream"):
            return self._derender_chunk(body)
        response = body.get("generate_response")
        if not isinstance(response, dict) or not isinstance(response.get("choices"), list):
            return bad_request("1 validation error: generate_response is required")
        choices = []
        for choice in response["choices"]:
            ids = choice.get("token_ids")
            if not ids:
                return bad_request(f"choice {choice.get('index', 0)} has empty or null token_ids")
            message, _ = self._message(ids, body["chat_request"])
            choices.append(
                {"index": choice.get("index", 0), "message": message,
                 "logprobs": self._logprobs(choice.get("logprobs")),
                 "finish_reason": choice.get("finish_reason"),
                 "stop_reason": choice.get("stop_reason"), "token_ids": None,
                 "routed_experts": None}
            )  # fmt: skip
        prompt_tokens = body.get("prompt_tokens") or 0
        completion = sum(len(c.get("token_ids") or []) for c in response["choices"])
        return web.json_response(
            {
                "id": response.get("request_id"), "object": "chat.completion",
                "created": int(time.time()), "model": body.get("model") or self.state.model,
                "choices": choices, "service_tier": None, "system_fingerprint": None,
                "usage": usage(prompt_tokens, completion), "prompt_logprobs": None,
                "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": None,
                "ec_transfer_params": None, "metrics": None,
            }
        )  # fmt: skip

    def _message(
        self, ids: Sequence[int], chat_request: Mapping[str, Any]
    ) -> tuple[dict[str, Any], bool]:
        """The assistant message of sampled ``ids`` (hermes-parsed when the request has
        tools), and whether it calls tools."""
        text = self.lm.tokenizer.decode([t for t in ids if t != self.state.eos_token_id])
        content: str | None = text
        calls: list[dict[str, Any]] = []
        if chat_request.get("tools") and chat_request.get("tool_choice") != "none":
            content, calls = parse_hermes(text)
        message: dict[str, Any] = {
            "role": "assistant", "content": content, "refusal": None, "annotations": None,
            "audio": None, "function_call": None,
        }  # fmt: skip
        if calls:
            message["tool_calls"] = calls
        message["reasoning"] = None
        return message, bool(calls)

    def _logprobs(self, logprobs: Any) -> dict[str, Any] | None:
        if not isinstance(logprobs, dict) or not isinstance(logprobs.get("content"), list):
            return None
        decode = self.lm.tokenizer.decode

        def one(entry: Mapping[str, Any]) -> dict[str, Any]:
            text = decode([entry["token_id"]])
            return {"token": text, "logprob": entry["logprob"], "bytes": list(text.encode())}

        return {
            "content": [
                {**one(e), "top_logprobs": [one(t) for t in e.get("top_logprobs") or []]}
                for e in logprobs["content"]
            ]
        }

    def _derender_chunk(self, body: dict[str, Any]) -> web.Response:
        chunk = body.get("generate_chunk")
        if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
            return bad_request("1 validation error: generate_chunk is required")
        if len(chunk["choices"]) > 1:
            return bad_request(
                f"derender_chat_stream expects at most one choice per chunk (got "
                f"{len(chunk['choices'])})."
            )
        if body.get("prompt_token_ids") is None:
            return bad_request(
                "prompt_token_ids is required when a tool or reasoning parser is configured."
            )
        state = dict(body.get("stream_state") or _fresh_state())
        out_ids, lens = list(state["output_token_ids"]), list(state["output_chunk_lens"])
        parser = HermesStream()
        decode = self.lm.tokenizer.decode
        tools = bool(body["chat_request"].get("tools"))
        start = 0
        for n in lens:  # replay the earlier chunks: the parser's state is not carried
            start += n
            if tools:
                parser.feed(decode(out_ids[:start]))
        delta: dict[str, Any] = {"role": None, "content": None, "reasoning": None}
        choices = []
        if chunk["choices"]:
            choice = chunk["choices"][0]
            new = list(choice.get("token_ids") or [])
            if new:
                before = decode(out_ids)
                out_ids += new
                lens.append(len(new))
                text = decode(out_ids)
                if tools:
                    found = parser.feed(text)
                    if found is not None:
                        delta["content"] = found.get("content")
                        if found.get("tool_calls"):
                            calls = _pinned(found["tool_calls"], state)
                            delta["tool_calls"] = [_full(c) for c in calls]
                else:
                    delta["content"] = text[len(before) :] or None
            if not state["role_sent"]:
                delta["role"] = "assistant"
                state["role_sent"] = True
            finish = choice.get("finish_reason")
            if finish is not None and state["tools_streamed"]:
                finish = "tool_calls"
            choices.append(
                {"index": choice.get("index", 0), "delta": delta, "logprobs": None,
                 "finish_reason": finish, "stop_reason": choice.get("stop_reason"),
                 "token_ids": None}
            )  # fmt: skip
        state["output_token_ids"], state["output_chunk_lens"] = out_ids, lens
        answer = {
            "id": chunk.get("request_id"), "object": "chat.completion.chunk",
            "created": int(time.time()), "model": body.get("model") or self.state.model,
            "choices": choices, "usage": None, "system_fingerprint": None,
            "prompt_token_ids": None, "prompt_text": None, "metrics": None,
        }  # fmt: skip
        return web.json_response({"chunk": answer, "stream_state": state})

    # ------------------------------------------------------------------ chat completions
    @route("POST", "/v1/chat/completions", served=_chat)
    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        ok, body = await read_json(request)
        if not ok or not isinstance(body, dict):
            return bad_request("the request body must be a JSON object")
        converted = self._chat_form("chat", body)
        if isinstance(converted, web.Response):
            return converted
        messages, tools, options = converted
        prompt = self._prompt(messages, tools, options)
        if isinstance(prompt, web.Response):
            return prompt
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        rendered = self._sampling_params(body, prompt, limit, "chat")
        if isinstance(rendered, web.Response):
            return rendered
        params = SamplingParams.parse(rendered, prompt, self.state.max_model_len)
        if isinstance(params, str):
            return bad_request(params)
        rid = f"chatcmpl-{secrets.token_hex(8)}"
        job = Job(self.state, prompt, params, rid, await self.state._admit())
        if body.get("stream"):
            return await self._chat_stream(request, body, job)
        sample = await job.sample(0)
        return web.json_response(self._chat_answer(body, job, sample))

    def _chat_answer(self, body: dict[str, Any], job: Job, sample: Sample) -> dict[str, Any]:
        message, called = self._message(sample.token_ids, body)
        finish = "tool_calls" if called and sample.finish_reason == "stop" else sample.finish_reason
        ids = body.get("return_token_ids")
        logprobs = None
        if body.get("logprobs"):
            k = int(body.get("top_logprobs") or 0)
            logprobs = self._logprobs(content_logprobs(self.lm, sample, k, "0.32"))
            if logprobs is not None and k == 0:
                for entry in logprobs["content"]:
                    entry["top_logprobs"] = []
        return {
            "id": job.request_id, "object": "chat.completion", "created": int(time.time()),
            "model": self.state.model,
            "choices": [
                {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish,
                 "stop_reason": sample.stop_reason,
                 "token_ids": sample.token_ids if ids else None, "routed_experts": None}
            ],
            "service_tier": None, "system_fingerprint": "vllm-fake",
            "usage": usage(len(job.prompt), len(sample.token_ids)), "prompt_logprobs": None,
            "prompt_token_ids": job.prompt if ids else None, "prompt_text": None,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
        }  # fmt: skip

    async def _chat_stream(
        self, request: web.Request, body: dict[str, Any], job: Job
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        head = {"id": job.request_id, "object": "chat.completion.chunk",
                "created": int(time.time()), "model": self.state.model}  # fmt: skip
        ids = bool(body.get("return_token_ids"))
        first: dict[str, Any] = {
            **head,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}],
        }  # fmt: skip
        if ids:
            first.update({"prompt_token_ids": job.prompt, "prompt_text": None})
        await response.write(sse_event(first))
        parser = HermesStream()
        tools = bool(body.get("tools")) and body.get("tool_choice") != "none"
        decode = self.lm.tokenizer.decode
        called = False

        async def on_token(sample: Sample, pos: int) -> None:
            nonlocal called
            text = decode([t for t in sample.token_ids if t != self.state.eos_token_id])
            before = decode([t for t in sample.token_ids[:pos] if t != self.state.eos_token_id])
            delta: dict[str, Any] = {}
            if tools:
                found = parser.feed(text)
                if found is not None:
                    delta = {"content": found.get("content")}
                    if found.get("tool_calls"):
                        delta["tool_calls"] = found["tool_calls"]
                        called = True
            elif len(text) > len(before):
                delta = {"content": text[len(before) :]}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": None}  # fmt: skip
            last = job.params.stops(sample.token_ids[pos], self.state.eos_token_id) or (
                pos + 1 == job.params.max_tokens
            )
            if last:
                return  # sent with the finish reason
            if ids:
                choice["token_ids"] = [sample.token_ids[pos]]
            await response.write(sse_event({**head, "choices": [choice]}))

        sample = await job.sample(0, on_token)
        finish = "tool_calls" if called and sample.finish_reason == "stop" else sample.finish_reason
        last: dict[str, Any] = {
            "index": 0, "delta": {}, "logprobs": None, "finish_reason": finish,
            "stop_reason": sample.stop_reason,
        }  # fmt: skip
        if ids:
            last["token_ids"] = sample.token_ids[-1:]
        await response.write(sse_event({**head, "choices": [last]}))
        if (body.get("stream_options") or {}).get("include_usage"):
            counts = usage(len(job.prompt), len(sample.token_ids))
            counts = {k: counts[k] for k in ("prompt_tokens", "total_tokens", "completion_tokens")}
            usage_event = {
                **head,
                "choices": [],
                "usage": counts,
                "system_fingerprint": "vllm-fake",
            }
            await response.write(sse_event(usage_event))
        await response.write(b"data: [DONE]\n\n")
        return response


def _fresh_state() -> dict[str, Any]:
    """vLLM's ``DerenderStreamState`` before the first call."""
    return {
        "prev_tokens": [], "prefix_offset": 0, "read_offset": 0, "role_sent": False,
        "logprob_context_token_ids": [], "logprob_text_offset": 0, "output_token_ids": [],
        "output_chunk_lens": [], "tools_streamed": False, "last_tool_call_ids": [],
    }  # fmt: skip


def _full(call: Mapping[str, Any]) -> dict[str, Any]:
    """A tool-call delta as derender's pydantic model dumps it (every field, None too)."""
    function = call.get("function") or {}
    return {
        "id": call.get("id"), "type": call.get("type"), "index": call["index"],
        "function": {"name": function.get("name"), "arguments": function.get("arguments")},
    }  # fmt: skip


def _pinned(calls: list[dict[str, Any]], state: dict[str, Any]) -> list[dict[str, Any]]:
    """Tool-call deltas with the ids already sent kept (a replay makes new ones)."""
    state["tools_streamed"] = True
    ids: list[str] = state["last_tool_call_ids"]
    out = []
    for delta in calls:
        call = dict(delta)
        if "id" in call:
            if call["index"] < len(ids):
                call["id"] = ids[call["index"]]
            else:
                ids.append(call["id"] or call_id())
        out.append(call)
    return out

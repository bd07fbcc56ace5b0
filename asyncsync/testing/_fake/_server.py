"""FakeVLLMServer (see the package docstring); being split into modules."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import random
import secrets
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from aiohttp import web

from asyncsync import _json
from asyncsync.testing._fake._control import ControlRoutes
from asyncsync.testing._fake._faults import Fault, error_response
from asyncsync.testing._fake._lm import FakeLM, token_text
from asyncsync.testing._fake._recording import RecordedRequest
from asyncsync.testing._fake._responses import (
    ClosingResponse,
    Routes,
    bad_request,
    method_not_allowed,
    not_found,
    openai_error,
    read_json,
    usage,
    validation_error,
)
from asyncsync.testing._fake._state import FakeState
from asyncsync.testing._fake._weights import WeightRoutes

__all__ = ["FakeLM", "FakeVLLMServer", "Fault", "RecordedRequest"]


@dataclass(slots=True)
class _Sample:
    token_ids: list[int]
    contexts: list[list[int]]
    generations: list[int]
    versions: list[str]
    finish_reason: str = "length"
    stop_reason: int | None = None


def _spans(versions: Sequence[str]) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans


class FakeVLLMServer(FakeState):
    """An aiohttp server speaking vLLM's RL protocol (0.23 or 0.32), with fault injection.

    Args:
        version: the vLLM version it claims (``GET /version``); ``"0.23.x"`` selects the
            0.23 protocol, ``"0.32.x"`` (default) the current one.
        backend: the weight-transfer backend name; ``None`` behaves like a server started
            without ``--weight-transfer-config`` (weight routes answer 500).
        tokens_only: like ``--tokens-only`` (0.23 serves ``/abort_requests`` only then).
        delay: seconds every request waits before it is handled (a slow server).
        world_size: answered by ``/get_world_size``.
        params: parameter names the weight checker reports.
        host, port: where to listen (port 0: a free one).
        reject_update_keys: ``update_info`` keys the fake engine refuses with a worker
            failure (default: ``packed`` on 0.32, like the IPC engine).
        update_hook: called with each accepted ``update_info``; raising fails the update
            like a worker error (and vLLM then drops its active update).
        scale_out: like ``--enable-scale-out``: vLLM 0.32 serves ``/inference/v1/generate``
            only then (or with ``tokens_only``), else 403.
        tokenizer: False behaves like ``--skip-tokenizer-init`` (empty text; legacy
            logprobs only with ``return_tokens_as_token_ids``).
        return_token_ids: False emulates a server that ignores ``return_token_ids`` on
            ``/v1/completions`` (no token ids: the re-tokenize fallback case).
        token_delay: seconds per generated token (to pause or abort mid-generation).
        vocab_size, max_model_len, model: of the fake model (:class:`FakeLM`).

    Generation follows :class:`FakeLM` (deterministic, closed-form logprobs). Pausing
    behaves like vLLM: new requests wait until resume; ``mode="abort"`` ends in-flight
    ones with ``finish_reason="abort"`` and the tokens so far; ``"keep"`` freezes them
    (tokens after a weight update carry the new version: two spans); ``"wait"`` lets
    them run on.
    """

    _runner: web.AppRunner | None = None
    _site: web.SockSite | None = None
    _alive = False
    _routes: Routes  # set by start()

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        if self._site is None:
            raise RuntimeError("FakeVLLMServer is not started")
        return f"http://{self.host}:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    @property
    def alive(self) -> bool:
        """False once stopped or killed by a ``die`` fault."""
        return self._alive

    async def start(self) -> FakeVLLMServer:
        self._routes = {
            **ControlRoutes(self).routes(),
            **WeightRoutes(self).routes(),
            "/inference/v1/generate": ("POST", self._inference_generate),
            "/v1/completions": ("POST", self._completions),
        }
        app = web.Application(middlewares=[self._middleware])
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        # handler_cancellation: a hung handler is cancelled when the client goes away,
        # so tests can see that a cancelled client closed its connection.
        runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.1
        )
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self._port))
            self._port = int(sock.getsockname()[1])
            # uvicorn's (vLLM's) listen backlog; aiohttp's default of 128 drops SYNs when
            # hundreds of clients connect at once, and each drop costs a 1 s retransmit.
            site = web.SockSite(runner, sock, backlog=2048)
            await site.start()
        except BaseException:
            sock.close()
            await runner.cleanup()
            raise
        self._runner, self._site = runner, site
        self._alive = True
        return self

    async def stop(self) -> None:
        self._alive = False
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> FakeVLLMServer:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def _die(self) -> None:
        self._alive = False
        if self._site is not None:
            server = self._site._server  # the listening asyncio.Server
            if server is not None:
                server.close()
        if self._runner is not None and self._runner.server is not None:
            for proto in list(self._runner.server.connections):
                if proto.transport is not None:
                    proto.transport.abort()

    @property
    def open_connections(self) -> int:
        """Client connections currently open on this server."""
        if self._runner is None or self._runner.server is None:
            return 0
        return len(self._runner.server.connections)

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        body = await request.read()
        self.requests.append(RecordedRequest.of(request, body))
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            fault = self._faults.take(request.path)
            result: web.StreamResponse | None = None
            if fault is not None:
                result = await self._apply(fault, request)
            if result is None:
                result = await handler(request)
            if isinstance(result, ClosingResponse):
                # Close once this response is sent, without a "Connection: close" header.
                request.protocol.close()
            return result
        except asyncio.CancelledError:
            self.cancelled.append(request.path)
            raise

    async def _apply(self, fault: Fault, request: web.Request) -> web.StreamResponse | None:
        if fault.kind == "delay":
            await asyncio.sleep(fault.seconds)
            return None
        if fault.kind == "hang":
            await asyncio.Event().wait()  # never set: until the handler is cancelled
        if fault.kind == "error":
            if fault.shape == "collective" and request.path == "/update_weights":
                self.update_active = False  # as vLLM does after a worker failure there
            return error_response(fault)
        if fault.kind == "malformed":
            return web.Response(status=200, body=fault.body, content_type=fault.content_type)
        if fault.kind in ("drop", "die"):
            if request.transport is not None:
                request.transport.abort()
            if fault.kind == "die":
                await self._die()
            raise asyncio.CancelledError  # nothing more to send on a cut connection
        raise AssertionError(fault.kind)  # pragma: no cover

    # ------------------------------------------------------------------ routes
    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        entry = self._routes.get(request.path)
        if entry is None:
            return not_found()
        method, handler = entry
        if request.method != method:
            return method_not_allowed()
        result: web.StreamResponse = await handler(request)
        return result

    # ------------------------------------------------------------ generation
    def _sampling(self, raw: Any, prompt: list[int]) -> tuple[dict[str, Any] | None, str | None]:
        """Checked sampling parameters, or an error message (400)."""
        if not isinstance(raw, dict):
            return None, "sampling parameters must be an object"
        n = raw.get("n", 1)
        max_tokens = raw.get("max_tokens")
        logprobs = raw.get("logprobs")
        prompt_logprobs = raw.get("prompt_logprobs")
        for name, value in (("n", n), ("max_tokens", max_tokens), ("logprobs", logprobs)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                return None, f"{name} must be an integer"
        if n < 1:
            return None, "n must be at least 1, got 0."
        if max_tokens is None:
            max_tokens = max(1, self.max_model_len - len(prompt))
        if max_tokens < 1:
            return None, f"max_tokens must be at least 1, got {max_tokens}."
        if len(prompt) + max_tokens > self.max_model_len:
            return None, (
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {len(prompt)} input tokens and requested {max_tokens} "
                "output tokens."
            )
        stop = raw.get("stop_token_ids") or []
        if not isinstance(stop, list) or not all(isinstance(t, int) for t in stop):
            return None, "stop_token_ids must be a list of integers"
        return {
            "n": n,
            "max_tokens": max_tokens,
            "temperature": raw.get("temperature", 1.0),
            "seed": raw.get("seed"),
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "stop_token_ids": set(stop),
        }, None

    def _check_tokens(self, ids: Any, where: str) -> str | None:
        if not isinstance(ids, list) or not ids:
            return f"{where} must be a non-empty list of token ids"
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                return f"{where} must contain non-negative integers"
            if t >= self.lm.vocab_size:
                return f"Token id {t} is out of vocabulary"
        return None

    async def _sample(
        self,
        prompt: list[int],
        sp: dict[str, Any],
        index: int,
        request_id: str,
        epoch: int,
        on_token: Callable[[_Sample, int], Awaitable[None]] | None = None,
    ) -> _Sample:
        seed = sp["seed"]
        rng = random.Random(f"{seed}:{index}" if seed is not None else f"{request_id}:{index}")
        greedy = not sp["temperature"]
        context = list(prompt)
        sample = _Sample([], [], [], [])
        for _ in range(sp["max_tokens"]):
            if not await self.gate(epoch):
                sample.finish_reason = "abort"
                break
            gen = self._generation
            token = self.lm.greedy(context, gen) if greedy else self.lm.sample(context, rng, gen)
            sample.contexts.append(context)  # never mutated: each step builds a new list
            sample.token_ids.append(token)
            sample.generations.append(gen)
            sample.versions.append(self.weight_version)
            context = [*context, token]
            if on_token is not None:
                await on_token(sample, len(sample.token_ids) - 1)
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
            if token in sp["stop_token_ids"]:
                sample.finish_reason, sample.stop_reason = "stop", token
                break
        return sample

    def _top_ids(self, context: list[int], token: int, k: int, gen: int) -> list[int]:
        """vLLM's order: the sampled token first, then the top-k others, cut to max(k, 1)."""
        ids = [token] + [t for t in self.lm.top(context, k, gen) if t != token]
        return ids[: max(k, 1)]

    def _content_logprobs(self, sample: _Sample, k: int, start: int = 0) -> dict[str, Any]:
        content = []
        for i in range(start, len(sample.token_ids)):
            ctx, tok, gen = sample.contexts[i], sample.token_ids[i], sample.generations[i]
            if self.protocol == "0.23":
                content.append(
                    {
                        "token": f"token_id:{tok}",
                        "logprob": self.lm.logprob(ctx, tok, gen),
                        "bytes": None,
                        "top_logprobs": [
                            {
                                "token": f"token_id:{t}",
                                "logprob": self.lm.logprob(ctx, t, gen),
                                "bytes": None,
                            }
                            for t in self._top_ids(ctx, tok, k, gen)
                        ],
                    }
                )
                continue
            content.append(
                {
                    "token_id": tok,
                    "logprob": self.lm.logprob(ctx, tok, gen),
                    "rank": self.lm.rank(ctx, tok, gen),
                    "top_logprobs": [
                        {
                            "token_id": t,
                            "logprob": self.lm.logprob(ctx, t, gen),
                            "rank": self.lm.rank(ctx, t, gen),
                        }
                        for t in self._top_ids(ctx, tok, k, gen)
                    ],
                }
            )
        return {"content": content}

    def _legacy_logprobs(self, sample: _Sample, k: int, as_ids: bool, start: int = 0) -> Any:
        def key(t: int) -> str:
            return f"token_id:{t}" if as_ids else token_text(t).strip()

        tokens, lps, tops, offsets = [], [], [], []
        for i in range(start, len(sample.token_ids)):
            ctx, tok, gen = sample.contexts[i], sample.token_ids[i], sample.generations[i]
            tokens.append(key(tok))
            lps.append(self.lm.logprob(ctx, tok, gen))
            tops.append(
                {key(t): self.lm.logprob(ctx, t, gen) for t in self._top_ids(ctx, tok, k, gen)}
            )
            offsets.append(sum(len(token_text(t)) for t in sample.token_ids[:i]))
        return {
            "text_offset": offsets,
            "token_logprobs": lps,
            "tokens": tokens,
            "top_logprobs": tops,
        }

    def _prompt_logprobs(self, prompt: list[int], k: int) -> list[Any]:
        gen = self._generation
        out: list[Any] = [None]
        for pos in range(1, len(prompt)):
            ctx, tok = prompt[:pos], prompt[pos]
            entry: dict[str, Any] = {}
            for t in [tok, *[t for t in self.lm.top(ctx, k, gen) if t != tok][:k]]:
                entry[str(t)] = {
                    "logprob": self.lm.logprob(ctx, t, gen),
                    "rank": self.lm.rank(ctx, t, gen),
                    "decoded_token": token_text(t).strip() if self.tokenizer else None,
                }
            out.append(entry)
        return out

    async def _inference_generate(self, request: web.Request) -> web.StreamResponse:
        if self.protocol == "0.32" and not (self.scale_out or self.tokens_only):
            return openai_error(
                403,
                "Scale-out endpoints are disabled. Restart vllm serve with "
                "--enable-scale-out to enable them.",
                "PermissionDeniedError",
            )
        ok, body = await read_json(request)
        if not ok or not isinstance(body, dict):
            return validation_error("body", "missing", "Field required", "None")
        prompt = body.get("token_ids")
        if not isinstance(prompt, list) or not prompt:
            return openai_error(
                400,
                "1 validation error:\n  {'type': 'too_short', 'loc': 'body.token_ids', 'msg': "
                "'List should have at least 1 item after validation, not 0', 'input': "
                "'<list of 0 items>', 'ctx': {'field_type': 'List', 'min_length': 1, "
                "'actual_length': 0}}",
                "Bad Request",
                "body.token_ids",
            )
        if (error := self._check_tokens(prompt, "token_ids")) is not None:
            return bad_request(error)
        if "sampling_params" not in body:
            return validation_error("body.sampling_params", "missing", "Field required", "None")
        sp, error = self._sampling(body["sampling_params"], prompt)
        if error is not None or sp is None:
            return bad_request(error or "bad sampling parameters")
        rid = f"generate-tokens-{body.get('request_id') or secrets.token_hex(8)}"
        epoch = await self.admit()
        if body.get("stream"):
            return await self._stream_generate(request, prompt, sp, rid, epoch)
        samples = [await self._sample(prompt, sp, i, rid, epoch) for i in range(sp["n"])]
        k = sp["logprobs"]
        choices: list[dict[str, Any]] = []
        for i, s in enumerate(samples):
            if self.protocol == "0.23":
                choices.append(
                    {
                        "index": i,
                        "logprobs": None if k is None else self._content_logprobs(s, k),
                        "finish_reason": s.finish_reason,
                        "token_ids": s.token_ids,
                    }
                )
                continue
            choices.append(
                {
                    "index": i,
                    "finish_reason": s.finish_reason,
                    "stop_reason": s.stop_reason,
                    "token_ids": s.token_ids,
                    "routed_experts": None,
                    "sampling_mask": None,
                    "weight_versions": _spans(s.versions),
                    "logprobs": None if k is None else self._content_logprobs(s, k),
                }
            )
        prompt_lps = (
            None
            if sp["prompt_logprobs"] is None
            else self._prompt_logprobs(prompt, sp["prompt_logprobs"])
        )
        if self.protocol == "0.23":
            return web.json_response(
                {
                    "request_id": rid,
                    "choices": choices,
                    "prompt_logprobs": prompt_lps,
                    "kv_transfer_params": None,
                }
            )
        completion_tokens = sum(len(s.token_ids) for s in samples)
        return web.json_response(
            {
                "request_id": rid,
                "model": self.model,
                "created": int(time.time()),
                "usage": usage(len(prompt), completion_tokens),
                "prompt_logprobs": prompt_lps,
                "prompt_token_id_logprobs": None,
                "prompt_token_ids": prompt if body.get("return_token_ids") else None,
                "mm_placeholders": None,
                "metrics": None,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "output_mode": "tokens",
                "choices": choices,
            }
        )

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        return resp

    async def _stream_generate(
        self, request: web.Request, prompt: list[int], sp: dict[str, Any], rid: str, epoch: int
    ) -> web.StreamResponse:
        """SSE like vLLM: one event per token, the last token's event carries the finish
        reason (and, on 0.32, the weight-version spans); an abort with no new token gets
        an event of its own; then ``data: [DONE]``."""
        resp = await self._sse(request)
        k = sp["logprobs"]
        for index in range(sp["n"]):
            pending: list[int] = []

            async def on_token(
                sample: _Sample, pos: int, index: int = index, pending: list[int] = pending
            ) -> None:
                if pending:
                    chunk = self._gen_chunk(rid, index, sample, pending.pop(), k, final=False)
                    await resp.write(b"data: " + _json.dumps(chunk) + b"\n\n")
                pending.append(pos)

            done = await self._sample(prompt, sp, index, rid, epoch, on_token=on_token)
            last = self._gen_chunk(
                rid, index, done, pending.pop() if pending else None, k, final=True
            )
            await resp.write(b"data: " + _json.dumps(last) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def _gen_chunk(
        self,
        rid: str,
        index: int,
        sample: _Sample,
        pos: int | None,
        k: int | None,
        *,
        final: bool,
    ) -> dict[str, Any]:
        """One SSE event of ``/inference/v1/generate``: token ``pos`` (None: no token)."""
        tokens = [] if pos is None else [sample.token_ids[pos]]
        logprobs = None
        if k is not None:
            one = _Sample([], [], [], [])
            if pos is not None:
                one = _Sample(
                    sample.token_ids[pos : pos + 1],
                    sample.contexts[pos : pos + 1],
                    sample.generations[pos : pos + 1],
                    sample.versions[pos : pos + 1],
                )
            logprobs = self._content_logprobs(one, k)
        spans = _spans(sample.versions) if final and self.protocol == "0.32" else None
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": sample.finish_reason if final else None,
            "stop_reason": sample.stop_reason if final else None,
            "token_ids": tokens,
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": spans,
            "logprobs": logprobs,
        }
        return {"request_id": rid, "usage": None, "output_mode": "tokens", "choices": [choice]}

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        ok, body = await read_json(request)
        if not ok or not isinstance(body, dict):
            return openai_error(400, "Invalid JSON body", "Bad Request")
        prompt = body.get("prompt")
        prompts: list[Any] = (
            prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], list)
            else [prompt]
        )
        for p in prompts:
            if isinstance(p, str):
                return bad_request("this fake serves token-id prompts only")
            if (error := self._check_tokens(p, "prompt")) is not None:
                return bad_request(error)
        k = body.get("logprobs")
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        return_ids = bool(body.get("return_token_ids")) and self.return_token_ids
        if (k is not None or body.get("echo")) and not as_ids and not self.tokenizer:
            return bad_request("Unable to get tokenizer because `skip_tokenizer_init=True`")
        sp_raw = {key: body[key] for key in body if key not in ("prompt", "model", "stream")}
        sp_raw.setdefault("max_tokens", 16)
        checked = []
        for p in prompts:
            sp, error = self._sampling(sp_raw, p)
            if error is not None or sp is None:
                return bad_request(error or "bad sampling parameters")
            checked.append(sp)
        if body.get("stream") and checked[0]["prompt_logprobs"]:
            return bad_request("`prompt_logprobs` are not available when `stream=True`.")
        rid = f"cmpl-{secrets.token_hex(8)}"
        epoch = await self.admit()
        if body.get("stream"):
            return await self._stream_completions(
                request, prompts[0], checked[0], rid, epoch, k, as_ids, return_ids
            )
        choices = []
        completion_tokens = 0
        for p_index, (p, sp) in enumerate(zip(prompts, checked, strict=True)):
            for i in range(sp["n"]):
                s = await self._sample(p, sp, i, rid, epoch)
                completion_tokens += len(s.token_ids)
                choices.append(
                    {
                        "index": p_index * sp["n"] + i,
                        "text": self._text(s.token_ids),
                        "logprobs": None if k is None else self._legacy_logprobs(s, k, as_ids),
                        "finish_reason": s.finish_reason,
                        "stop_reason": s.stop_reason,
                        "token_ids": s.token_ids if return_ids else None,
                        "prompt_logprobs": None
                        if sp["prompt_logprobs"] is None
                        else self._prompt_logprobs(p, sp["prompt_logprobs"]),
                        "prompt_token_ids": p if return_ids else None,
                        "routed_experts": None,
                    }
                )
        response: dict[str, Any] = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": f"vllm-{self.version}-fake",
            "usage": usage(sum(len(p) for p in prompts), completion_tokens),
        }
        if self.protocol == "0.32":
            response.update(
                {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
            )
        return web.json_response(response)

    def _text(self, token_ids: Sequence[int]) -> str:
        return "".join(token_text(t) for t in token_ids) if self.tokenizer else ""

    async def _stream_completions(
        self,
        request: web.Request,
        prompt: list[int],
        sp: dict[str, Any],
        rid: str,
        epoch: int,
        k: int | None,
        as_ids: bool,
        return_ids: bool,
    ) -> web.StreamResponse:
        resp = await self._sse(request)
        created = int(time.time())
        first = [True]

        def chunk(index: int, sample: _Sample, pos: int | None, final: bool) -> bytes:
            one = _Sample([], [], [], [])
            if pos is not None:
                one = _Sample(
                    sample.token_ids[pos : pos + 1],
                    sample.contexts[pos : pos + 1],
                    sample.generations[pos : pos + 1],
                    sample.versions[pos : pos + 1],
                )
            event: dict[str, Any] = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model,
                "choices": [
                    {
                        "index": index,
                        "text": self._text(one.token_ids),
                        "logprobs": None if k is None else self._legacy_logprobs(one, k, as_ids),
                        "finish_reason": sample.finish_reason if final else None,
                        "stop_reason": sample.stop_reason if final else None,
                        "prompt_token_ids": prompt if return_ids and first[0] else None,
                        "token_ids": one.token_ids if return_ids else None,
                    }
                ],
            }
            if final:
                event["system_fingerprint"] = f"vllm-{self.version}-fake"
            first[0] = False
            return b"data: " + _json.dumps(event) + b"\n\n"

        for index in range(sp["n"]):
            first[0] = True
            pending: list[int] = []

            async def on_token(
                sample: _Sample, pos: int, index: int = index, pending: list[int] = pending
            ) -> None:
                if pending:
                    await resp.write(chunk(index, sample, pending.pop(), False))
                pending.append(pos)

            done = await self._sample(prompt, sp, index, rid, epoch, on_token=on_token)
            await resp.write(chunk(index, done, pending.pop() if pending else None, True))
        await resp.write(b"data: [DONE]\n\n")
        return resp


# ------------------------------------------------------------ separate process
async def _serve(args: argparse.Namespace) -> None:
    servers = [
        FakeVLLMServer(
            version=args.version,
            backend=None if args.no_backend else "fake",
            delay=args.delay,
            scale_out=not args.no_scale_out,
            tokenizer=not args.no_tokenizer,
            host=args.host,
            port=args.port + i if args.port else 0,
        )
        for i in range(args.count)
    ]
    for server in servers:
        await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # A serving process for benchmarks: what it holds after start-up lives until it
    # exits (frozen out of every collection), and it makes no reference cycles worth
    # collecting often. Parsing a large update_info allocates thousands of lists, and
    # the default gen-0 threshold (700) collects many times per request: these two
    # lines cut the fakes' CPU per bench_fanout round by ~15%.
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    print(json.dumps({"urls": [s.url for s in servers]}), flush=True)
    try:
        await stop.wait()
    finally:
        for server in servers:
            await server.stop()


def main(argv: Sequence[str] | None = None) -> None:
    """Serve ``--count`` fake servers in this process until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m asyncsync.testing._fake_cli")
    parser.add_argument("--count", type=int, default=1, help="servers in this process")
    parser.add_argument("--port", type=int, default=0, help="first port (0: free ports)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds per request")
    parser.add_argument("--version", default="0.32.0", help="vLLM version to claim")
    parser.add_argument("--no-backend", action="store_true", help="no weight-transfer engine")
    parser.add_argument("--uvloop", action="store_true", help="serve on uvloop")
    parser.add_argument(
        "--no-scale-out", action="store_true", help="403 on /inference/v1/generate (vLLM 0.32)"
    )
    parser.add_argument("--no-tokenizer", action="store_true", help="like --skip-tokenizer-init")
    args = parser.parse_args(argv)
    runner_loop: Mapping[str, Any] = {}
    if args.uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            runner_loop = {"loop_factory": uvloop.new_event_loop}
    with asyncio.Runner(**runner_loop) as runner:
        runner.run(_serve(args))


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])

"""``POST /inference/v1/generate``: vLLM's token-in-token-out route, plain or streamed."""

from __future__ import annotations

import asyncio
import secrets
import time
from functools import partial
from typing import Any

from aiohttp import web

from asyncsync.testing._fake._logprobs import content_logprobs, prompt_logprobs
from asyncsync.testing._fake._responses import (
    bad_request,
    openai_error,
    read_json,
    usage,
    validation_error,
)
from asyncsync.testing._fake._routes import RouteGroup, route
from asyncsync.testing._fake._sampling import Job, Sample, SamplingParams, check_token_ids
from asyncsync.testing._fake._streaming import stream

_SCALE_OUT_DISABLED = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
)
_NO_TOKEN_IDS = (
    "1 validation error:\n  {'type': 'too_short', 'loc': 'body.token_ids', 'msg': "
    "'List should have at least 1 item after validation, not 0', 'input': "
    "'<list of 0 items>', 'ctx': {'field_type': 'List', 'min_length': 1, "
    "'actual_length': 0}}"
)


class GenerateRoute(RouteGroup):
    """``/inference/v1/generate`` {token_ids, sampling_params, request_id?, stream?}.

    vLLM 0.32 serves it with ``--enable-scale-out`` or ``--tokens-only`` (else 403),
    reports usage and, per choice, the weight-version spans of its tokens; 0.23 always
    serves it, in a shorter shape.
    """

    @route("POST", "/inference/v1/generate")
    async def _generate(self, request: web.Request) -> web.StreamResponse:
        state = self.state
        if state.protocol == "0.32" and not (state.scale_out or state.tokens_only):
            return openai_error(403, _SCALE_OUT_DISABLED, "PermissionDeniedError")
        parsed = await self._parse(request)
        if isinstance(parsed, web.Response):
            return parsed
        body, prompt, params = parsed
        rid = f"generate-tokens-{body.get('request_id') or secrets.token_hex(8)}"
        job = Job(state, prompt, params, rid, await state._admit())
        if body.get("stream"):
            # vLLM < 0.32 drops a choice's last event when it brings no tokens (an abort
            # between two tokens): its stream ends with [DONE] and no finish reason.
            empty_final = state.protocol == "0.32"
            return await stream(request, job, partial(self._event, job), empty_final=empty_final)
        # vLLM steps a request's samples together: a pause lands on all of them at once
        samples = await asyncio.gather(*(job.sample(i) for i in range(params.n)))
        return web.json_response(self._answer(body, job, samples))

    async def _parse(
        self, request: web.Request
    ) -> tuple[dict[str, Any], list[int], SamplingParams] | web.Response:
        """The body, its prompt and its checked sampling parameters, or vLLM's refusal."""
        ok, body = await read_json(request)
        if not ok or not isinstance(body, dict):
            return validation_error("body", "missing", "Field required", "None")
        prompt = body.get("token_ids")
        if not isinstance(prompt, list) or not prompt:
            return openai_error(400, _NO_TOKEN_IDS, "Bad Request", "body.token_ids")
        error = check_token_ids(prompt, "token_ids", self.state.lm.vocab_size)
        if error is not None:
            return bad_request(error)
        if "sampling_params" not in body:
            return validation_error("body.sampling_params", "missing", "Field required", "None")
        params = SamplingParams.parse(body["sampling_params"], prompt, self.state.max_model_len)
        if isinstance(params, str):
            return bad_request(params)
        return body, prompt, params

    def _answer(self, body: dict[str, Any], job: Job, samples: list[Sample]) -> dict[str, Any]:
        state, k = self.state, job.params.logprobs
        if state.protocol == "0.23":
            choices = [self._choice_023(i, s, k) for i, s in enumerate(samples)]
        else:
            choices = [self._choice(i, s, k, end=s) for i, s in enumerate(samples)]
        prompt_k = job.params.prompt_logprobs
        prompt_lps = None if prompt_k is None else prompt_logprobs(state, job.prompt, prompt_k)
        if state.protocol == "0.23":
            return {
                "request_id": job.request_id,
                "choices": choices,
                "prompt_logprobs": prompt_lps,
                "kv_transfer_params": None,
            }
        completion_tokens = sum(len(s.token_ids) for s in samples)
        return {
            "request_id": job.request_id,
            "model": state.model,
            "created": int(time.time()),
            "usage": usage(len(job.prompt), completion_tokens),
            "prompt_logprobs": prompt_lps,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": job.prompt if body.get("return_token_ids") else None,
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "output_mode": "tokens",
            "choices": choices,
        }

    def _choice_023(self, index: int, sample: Sample, k: int | None) -> dict[str, Any]:
        return {
            "index": index,
            "logprobs": self._logprobs(sample, k),
            "finish_reason": sample.finish_reason,
            "token_ids": sample.token_ids,
        }

    def _choice(
        self, index: int, tokens: Sample, k: int | None, *, end: Sample | None
    ) -> dict[str, Any]:
        """A choice with the tokens of ``tokens`` in the shape of 0.32 (and of the events
        of both versions); ``end``: the finished sample, None for an event mid-stream."""
        spans = end.weight_versions() if end is not None and self.state.protocol == "0.32" else None
        return {
            "index": index,
            "finish_reason": None if end is None else end.finish_reason,
            "stop_reason": None if end is None else end.stop_reason,
            "token_ids": tokens.token_ids,
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": spans,
            "logprobs": self._logprobs(tokens, k),
        }

    def _event(
        self, job: Job, index: int, sample: Sample, start: int, stop: int, final: bool
    ) -> dict[str, Any]:
        """A streamed event of ``job`` (an ``EventBody``, see ``_streaming``)."""
        tokens = sample.window(start, stop)
        choice = self._choice(index, tokens, job.params.logprobs, end=sample if final else None)
        return {
            "request_id": job.request_id,
            "usage": None,
            "output_mode": "tokens",
            "choices": [choice],
        }

    def _logprobs(self, tokens: Sample, k: int | None) -> dict[str, Any] | None:
        return (
            None if k is None else content_logprobs(self.state.lm, tokens, k, self.state.protocol)
        )

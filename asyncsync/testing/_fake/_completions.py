"""``POST /v1/completions`` with token-id prompts, plain or streamed."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiohttp import web

from asyncsync.testing._fake._lm import token_text
from asyncsync.testing._fake._logprobs import legacy_logprobs, prompt_logprobs
from asyncsync.testing._fake._responses import bad_request, openai_error, read_json, usage
from asyncsync.testing._fake._routes import RouteGroup, route
from asyncsync.testing._fake._sampling import Job, Sample, SamplingParams, check_token_ids
from asyncsync.testing._fake._streaming import stream


@dataclass(frozen=True, slots=True)
class _Completion:
    """A checked ``/v1/completions`` request: its prompts, each with its parameters."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    k: int | None  # legacy logprobs
    as_ids: bool  # return_tokens_as_token_ids
    return_ids: bool  # token ids asked for, and this server returns them
    stream: bool


class CompletionsRoute(RouteGroup):
    """``/v1/completions``: one prompt or a batch (``n`` choices each), token ids in,
    text (``"t<id> "`` per token), legacy logprobs and, with ``return_token_ids``, token
    ids out. Streams only the first prompt of a batch."""

    @route("POST", "/v1/completions")
    async def _complete(self, request: web.Request) -> web.StreamResponse:
        parsed = await self._parse(request)
        if isinstance(parsed, web.Response):
            return parsed
        rid = f"cmpl-{secrets.token_hex(8)}"
        epoch = await self.state._admit()
        jobs = [
            Job(self.state, prompt, params, rid, epoch)
            for prompt, params in zip(parsed.prompts, parsed.params, strict=True)
        ]
        if parsed.stream:
            created = int(time.time())
            return await stream(request, jobs[0], partial(self._event, parsed, jobs[0], created))
        return web.json_response(await self._answer(parsed, jobs))

    async def _parse(self, request: web.Request) -> _Completion | web.Response:
        """The checked request, or vLLM's refusal."""
        ok, body = await read_json(request)
        if not ok or not isinstance(body, dict):
            return openai_error(400, "Invalid JSON body", "Bad Request")
        prompt = body.get("prompt")
        prompts: list[Any] = (  # a batch is a list of token-id lists
            prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], list)
            else [prompt]
        )
        for p in prompts:
            if isinstance(p, str):
                return bad_request("this fake serves token-id prompts only")
            if (error := check_token_ids(p, "prompt", self.state.lm.vocab_size)) is not None:
                return bad_request(error)
        k = body.get("logprobs")
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        return_ids = bool(body.get("return_token_ids")) and self.state.return_token_ids
        if (k is not None or body.get("echo")) and not as_ids and not self.state.tokenizer:
            return bad_request("Unable to get tokenizer because `skip_tokenizer_init=True`")
        raw = {key: body[key] for key in body if key not in ("prompt", "model", "stream")}
        raw.setdefault("max_tokens", 16)
        checked = []
        for p in prompts:
            params = SamplingParams.parse(raw, p, self.state.max_model_len)
            if isinstance(params, str):
                return bad_request(params)
            checked.append(params)
        streamed = bool(body.get("stream"))
        if streamed and checked[0].prompt_logprobs:
            return bad_request("`prompt_logprobs` are not available when `stream=True`.")
        return _Completion(prompts, checked, k, as_ids, return_ids, streamed)

    async def _answer(self, completion: _Completion, jobs: list[Job]) -> dict[str, Any]:
        state = self.state
        # vLLM steps every sample of every prompt together: a pause lands on all at once
        slots = [(p_index, job, i) for p_index, job in enumerate(jobs) for i in range(job.params.n)]
        samples = await asyncio.gather(*(job.sample(i) for _, job, i in slots))
        completion_tokens = sum(len(sample.token_ids) for sample in samples)
        choices = [
            self._choice(completion, job, p_index * job.params.n + i, sample)
            for (p_index, job, i), sample in zip(slots, samples, strict=True)
        ]
        answer: dict[str, Any] = {
            "id": jobs[0].request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": state.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": f"vllm-{state.version}-fake",
            "usage": usage(sum(len(p) for p in completion.prompts), completion_tokens),
        }
        if state.protocol == "0.32":
            answer.update({"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None})
        return answer

    def _choice(
        self, completion: _Completion, job: Job, index: int, sample: Sample
    ) -> dict[str, Any]:
        return_ids, prompt_k = completion.return_ids, job.params.prompt_logprobs
        prompt_lps = None if prompt_k is None else prompt_logprobs(self.state, job.prompt, prompt_k)
        return {
            "index": index,
            "text": self._text(sample),
            "logprobs": self._logprobs(completion, sample),
            "finish_reason": sample.finish_reason,
            "stop_reason": sample.stop_reason,
            "token_ids": sample.token_ids if return_ids else None,
            "prompt_logprobs": prompt_lps,
            "prompt_token_ids": job.prompt if return_ids else None,
            "routed_experts": None,
        }

    def _event(
        self,
        completion: _Completion,
        job: Job,
        created: int,
        index: int,
        sample: Sample,
        start: int,
        stop: int,
        final: bool,
    ) -> dict[str, Any]:
        """A streamed event (an ``EventBody``, see ``_streaming``): tokens ``start:stop``;
        the first event of a choice also carries the prompt's token ids."""
        tokens = sample.window(start, stop)
        return_ids = completion.return_ids
        event: dict[str, Any] = {
            "id": job.request_id,
            "object": "text_completion",
            "created": created,
            "model": self.state.model,
            "choices": [
                {
                    "index": index,
                    "text": self._text(tokens),
                    "logprobs": self._logprobs(completion, tokens),
                    "finish_reason": sample.finish_reason if final else None,
                    "stop_reason": sample.stop_reason if final else None,
                    "prompt_token_ids": job.prompt if return_ids and start == 0 else None,
                    "token_ids": tokens.token_ids if return_ids else None,
                }
            ],
        }
        if final:
            event["system_fingerprint"] = f"vllm-{self.state.version}-fake"
        return event

    def _text(self, sample: Sample) -> str:
        return "".join(token_text(t) for t in sample.token_ids) if self.state.tokenizer else ""

    def _logprobs(self, completion: _Completion, tokens: Sample) -> dict[str, Any] | None:
        k = completion.k
        return None if k is None else legacy_logprobs(self.state.lm, tokens, k, completion.as_ids)

"""What a generation returns: exact token ids, aligned logprobs, weight versions.

Plain data, no I/O; built by `asyncsync._wire.generation` from vLLM's responses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Completion", "PromptScores", "RetokenizedWarning", "TokenDelta", "WeightVersionSpan"]


class RetokenizedWarning(UserWarning):
    """A server returned text without token ids and asyncsync re-tokenized it with the
    caller's tokenizer (lossy: the ids may differ from what was sampled)."""


# ---------------------------------------------------------------------- results
@dataclass(frozen=True, slots=True)
class WeightVersionSpan:
    """Output tokens ``[start, end)`` were produced by weights ``version``.

    Attributes:
        version: the weight version; ``None`` when unknown (client-side record only,
            and the server's version changed while the request was in flight).
        start, end: output-token indices, end exclusive.
        source: ``"server"`` (reported by vLLM >= 0.32's ``/inference/v1/generate``,
            exact per token) or ``"client"`` (the fleet's record of the server's version
            at admission and at completion; exact only when both agree).
    """

    version: str | None
    start: int
    end: int
    source: Literal["server", "client"] = "server"

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(slots=True)
class Completion:
    """One generated sample: exact token ids, aligned logprobs, weight versions.

    Attributes:
        prompt_token_ids: the prompt as the server saw it.
        token_ids: the sampled token ids, exactly as the server produced them (EOS and
            stop tokens included when sampled).
        logprobs: one float per generated token (aligned with ``token_ids``) when
            logprobs were requested, else None. vLLM sends ``-9999.0`` for a sampled
            token it has no logprob for.
        top_logprobs: per generated token, ``{token_id: logprob}`` of the top-k
            candidates (k = the ``logprobs`` request; the sampled token included).
        top_logprobs_text: only from servers that key legacy logprobs by decoded
            strings (ids cannot be recovered from those): ``{text: logprob}``.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``...
        stop_reason: the stop token id or string that ended generation, if any.
        weight_versions: spans over output tokens (see `WeightVersionSpan`). Before
            the first publish a vLLM >= 0.32 server names its start-up weights
            ``"default"``; client-side spans say None until a version is known.
        server: base URL of the server that generated it.
        route: ``/inference/v1/generate`` or ``/v1/completions``.
        latency: seconds from sending the request to the parsed response.
        index: the sample's index among ``n``.
        retokenized: the token ids come from re-tokenizing text (lossy; see the module
            docstring). Never set silently.
        text: decoded text when the server sent it (``/v1/completions`` with a tokenizer).
        request_id: the server's request id, when reported.
        admitted_version / completed_version: the caller's record of the server's weight
            version when the request was sent and when it completed.
        staleness: versions behind the fleet's newest version at completion (the oldest
            version among this completion's tokens); None when unknown, not via a
            fleet, or before anything was published through the fleet.
        lora: the LoRA adapter it was generated with (``Fleet.generate(..., lora=...)``),
            None for the base model.
        lora_versions: spans over output tokens of the adapter's version (exact: each
            adapter version is a model of its own on the server); empty without one.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    weight_versions: tuple[WeightVersionSpan, ...]
    server: str
    route: str
    latency: float
    index: int = 0
    stop_reason: int | str | None = None
    retokenized: bool = False
    top_logprobs_text: list[dict[str, float]] | None = None
    text: str | None = None
    request_id: str | None = None
    admitted_version: str | None = None
    completed_version: str | None = None
    staleness: int | None = None
    lora: str | None = None
    lora_versions: tuple[WeightVersionSpan, ...] = ()

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def versions_source(self) -> Literal["server", "client"]:
        """Where `weight_versions` come from (``"client"`` when no tokens)."""
        if self.weight_versions and all(s.source == "server" for s in self.weight_versions):
            return "server"
        return "client"

    @property
    def token_versions(self) -> list[str | None]:
        """The weight version of each generated token (None where unknown)."""
        out: list[str | None] = [None] * len(self.token_ids)
        for span in self.weight_versions:
            for i in range(max(span.start, 0), min(span.end, len(out))):
                out[i] = span.version
        return out

    @property
    def version(self) -> str | None:
        """The single weight version of every token, or None when there are several or
        it is unknown (see `weight_versions`)."""
        versions = {s.version for s in self.weight_versions if s.end > s.start}
        if len(versions) == 1:
            return versions.pop()
        if not versions and not self.token_ids:
            return self.completed_version
        return None

    @property
    def lora_token_versions(self) -> list[str | None]:
        """The adapter version of each generated token (None without an adapter)."""
        out: list[str | None] = [None] * len(self.token_ids)
        for span in self.lora_versions:
            for i in range(max(span.start, 0), min(span.end, len(out))):
                out[i] = span.version
        return out

    @property
    def aborted(self) -> bool:
        """The server aborted this sample (e.g. a pause with ``mode="abort"``)."""
        return self.finish_reason == "abort"


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """One streamed increment of one sample.

    Attributes:
        index: the sample's index among ``n``.
        token_ids: the new token ids (may be empty on the final event).
        logprobs: their logprobs when requested.
        top_logprobs: their top-k candidates by token id when requested.
        finish_reason: set on the sample's last delta.
        weight_versions: server-side spans over the whole output, on the final delta of
            ``/inference/v1/generate`` (vLLM >= 0.32); otherwise empty.
    """

    index: int
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    weight_versions: tuple[WeightVersionSpan, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptScores:
    """Per-position logprobs of a given token sequence (prompt scoring).

    Attributes:
        token_ids: the scored sequence.
        logprobs: ``logprobs[i]`` is log p(token_ids[i] | token_ids[:i]); position 0 has
            no prefix and is None.
        top_logprobs: per position, ``{token_id: logprob}`` of the top-k candidates
            (plus the given token); None at position 0.
        ranks: the given token's rank at each position (1 = most likely), where reported.
        server: the server that scored it.
        weight_version: the caller's record of that server's weight version.
        latency: seconds for the request.
    """

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]
    ranks: list[int | None]
    server: str
    weight_version: str | None
    latency: float

    def __len__(self) -> int:
        return len(self.token_ids)

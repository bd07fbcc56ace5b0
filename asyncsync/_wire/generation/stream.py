"""A streamed generation's server-sent events, assembled: `StreamAssembler` yields a
`TokenDelta` per piece as it arrives and the whole completions at the end; an error
event is `StreamFailed`. Each piece is read by the one choice parser
(`asyncsync._wire.generation.bodies.parse_choice`). Pure, no I/O: the caller feeds the
lines it read.
"""

from __future__ import annotations

from typing import Any

from asyncsync._core import encoding as _json
from asyncsync._core.completion import Completion, TokenDelta
from asyncsync._wire.control import Malformed
from asyncsync._wire.generation.bodies import ABSENT, int_list, is_int, parse_choice

__all__ = ["StreamAssembler", "StreamFailed"]


class StreamAssembler:
    """Server-sent events of a streamed generation -> `TokenDelta`
    objects as they arrive, and the whole completions at the end.

    Any split of the tokens across events is accepted (vLLM coalesces tokens into fewer
    events when its engine outpaces the HTTP writer).
    """

    def __init__(self, n: int, logprobs: int | None, path: str) -> None:
        self.path = path
        self._want_logprobs = logprobs is not None
        self._samples = {i: _empty(i, path) for i in range(n)}
        self._prompt: list[int] | None = None
        self._request_id: str | None = None
        self.done = False
        #: the server ended the stream itself (``data: [DONE]``), not a closed connection
        self.ended = False

    def feed(self, line: bytes) -> list[TokenDelta]:
        """The deltas carried by one SSE line (none for separators, comments, other
        fields); ``data: [DONE]`` ends the stream. Raises `Malformed`, or
        `StreamFailed` for an error event."""
        if not line.startswith(b"data:"):
            return []
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = self.ended = True
            return []
        try:
            event = _json.loads(data)
        except ValueError as exc:
            raise Malformed(f"an event is not JSON: {data[:120]!r}") from exc
        if isinstance(event, dict) and "error" in event:
            raise StreamFailed(data)
        if not isinstance(event, dict) or not isinstance(event.get("choices"), list):
            raise Malformed("event without a 'choices' list")
        if event.get("prompt_token_ids") is not None:
            self._prompt = int_list(event["prompt_token_ids"], "prompt_token_ids")
        rid = event.get("request_id", event.get("id"))
        if isinstance(rid, str):
            self._request_id = rid
        return [d for d in map(self._add, event["choices"]) if d is not None]

    def _add(self, raw: Any) -> TokenDelta | None:
        index = raw.get("index", 0) if isinstance(raw, dict) else None
        acc = self._samples.get(index) if is_int(index) else None
        if acc is None:
            raise Malformed(f"choice index {index!r} out of range")
        piece = parse_choice(raw, self._want_logprobs, "delta", self.path, len(acc.token_ids))
        _accumulate(acc, piece)
        if piece.prompt_token_ids is not ABSENT:
            self._prompt = piece.prompt_token_ids
        if not piece.token_ids and piece.finish_reason is None:
            return None
        return TokenDelta(
            index=piece.index,
            token_ids=piece.token_ids,
            logprobs=piece.logprobs,
            top_logprobs=piece.top_logprobs,
            finish_reason=piece.finish_reason,
            weight_versions=piece.weight_versions,
        )

    @property
    def finished(self) -> bool:
        """Whether every sample has its finish reason."""
        return all(c.finish_reason is not None for c in self._samples.values())

    def completions(self, prompt: list[int], *, silent_abort: bool = False) -> list[Completion]:
        """The assembled completions (``prompt``: what was sent, when the server did not
        echo it); Malformed if a sample never finished.

        ``silent_abort``: this is a generate stream of a server that drops an aborted
        sample's last event when it carries no new tokens (vLLM < 0.32 skips every event
        without token ids, the abort's finish reason with it); there a sample left
        unfinished by a stream the server ended itself (``[DONE]``) was aborted, and is
        marked so. A stream that broke off without ``[DONE]`` is never read that way."""
        samples = [self._samples[i] for i in sorted(self._samples)]
        unfinished = [c for c in samples if c.finish_reason is None]
        if unfinished and silent_abort and self.ended:
            for c in unfinished:
                c.finish_reason = "abort"
        elif unfinished:
            how = "ended (data: [DONE])" if self.ended else "closed without data: [DONE]"
            raise Malformed(
                f"the stream {how} before every sample finished "
                f"(unfinished: {[c.index for c in unfinished]})"
            )
        sent = self._prompt or prompt
        for c in samples:
            c.request_id = self._request_id
            c.prompt_token_ids = sent if c.index == 0 else [*sent]
        return samples


class StreamFailed(Exception):
    """A stream carried an error event (its raw JSON is the argument)."""


def _empty(index: int, path: str) -> Completion:
    # Positional, in field order (see parse_choice).
    return Completion(ABSENT, [], None, None, None, (), "", path, 0.0, index)


def _accumulate(acc: Completion, piece: Completion) -> None:
    acc.token_ids.extend(piece.token_ids)
    if piece.logprobs is not None:
        acc.logprobs = (acc.logprobs or []) + piece.logprobs
        acc.top_logprobs = (acc.top_logprobs or []) + (
            piece.top_logprobs or [{} for _ in piece.logprobs]
        )
    if piece.text is not None:
        acc.text = (acc.text or "") + piece.text
    if piece.finish_reason is not None:
        acc.finish_reason, acc.stop_reason = piece.finish_reason, piece.stop_reason
    if piece.weight_versions:
        acc.weight_versions = piece.weight_versions

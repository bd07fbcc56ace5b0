"""What a fake vLLM server is configured with and what it holds, shared by its route
handlers, with the pausing rules that generation follows."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from asyncsync._core import encoding as _json
from asyncsync.testing._fake._chatlm import IM_END, ChatLM, ChatPolicy
from asyncsync.testing._fake._faults import Fault, FaultQueue
from asyncsync.testing._fake._lm import FakeLM
from asyncsync.testing._fake._recording import RecordedRequest

ProtocolVersion = Literal["0.23", "0.32"]
PAUSE_MODES = ("abort", "wait", "keep")
#: The default context of a chatting fake (its tokens are bytes).
CHAT_MAX_MODEL_LEN = 16384
DEFAULT_PARAMS = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
)


def protocol_of(version: str) -> ProtocolVersion:
    """The RL protocol a vLLM version speaks: 0.32's from 0.32 on, 0.23's before."""
    major, minor = (int(x) for x in version.split(".")[:2])
    return "0.32" if (major, minor) >= (0, 32) else "0.23"


class FakeState:
    """The configuration and the state of one fake server, shared by its route handlers.

    `FakeVLLMServer` (a subclass) documents the arguments and
    serves this state over HTTP: tests read, and may change, these attributes on it.
    The methods with a leading underscore are the state's transitions, for the route
    handlers of this package, not for tests.
    """

    def __init__(
        self,
        *,
        version: str = "0.32.0",
        backend: str | None = "fake",
        tokens_only: bool = False,
        delay: float = 0.0,
        world_size: int = 1,
        params: Sequence[str] = DEFAULT_PARAMS,
        host: str = "127.0.0.1",
        port: int = 0,
        reject_update_keys: Sequence[str] | None = None,
        update_hook: Callable[[Any], None] | None = None,
        on_request: Callable[[RecordedRequest], None] | None = None,
        checksum_hook: Callable[[], Mapping[str, str]] | None = None,
        scale_out: bool = True,
        tokenizer: bool = True,
        return_token_ids: bool = True,
        token_delay: float = 0.0,
        tokens_per_event: int | Sequence[int] = 1,
        vocab_size: int = 512,
        max_model_len: int | None = None,
        model: str = "fake-model",
        max_recorded: int | None = 10_000,
        checkpoint: Mapping[str, tuple[str, Sequence[int]]] | None = None,
        dtype: str = "float32",
        server_info: bool = False,
        chat: ChatPolicy | None = None,
    ) -> None:
        if max_recorded is not None and max_recorded < 0:
            raise ValueError(f"max_recorded must be >= 0 or None, got {max_recorded}")
        self.version = version
        self.protocol = protocol_of(version)
        self.host, self._port = host, port
        self.delay, self.token_delay = delay, token_delay
        # The weight-transfer engine.
        self.backend = backend
        self.world_size = world_size
        self._params = tuple(params)
        if reject_update_keys is None:
            reject_update_keys = ("packed",) if self.protocol == "0.32" else ()
        self.reject_update_keys = frozenset(reject_update_keys)
        self.update_hook = update_hook
        self.on_request = on_request
        self.checksum_hook = checksum_hook
        # Generation.
        self.tokens_only = tokens_only
        self.scale_out = scale_out
        self.tokenizer = tokenizer
        self.return_token_ids = return_token_ids
        self.tokens_per_event = tokens_per_event
        sizes = [tokens_per_event] if isinstance(tokens_per_event, int) else tokens_per_event
        for event in range(max(len(sizes), 1)):
            self._event_size(event)  # a bad setting fails here, not mid-stream
        #: The chat policy (`FakeVLLMServer`'s ``chat``): with one, the model chats and
        #: the chat routes are served.
        self.chat = chat
        self.lm: FakeLM = FakeLM(vocab_size) if chat is None else ChatLM(chat, vocab_size)
        #: The id that ends a sample (vLLM's EOS): the chat model's ``<|im_end|>``.
        self.eos_token_id: int | None = None if chat is None else IM_END
        if max_model_len is None:  # a byte-level chat model's prompts are long
            max_model_len = 256 if chat is None else CHAT_MAX_MODEL_LEN
        self.max_model_len = max_model_len
        self.model = model
        # What asyncsync's engine (backend asyncsync_shm/asyncsync_gloo) describes.
        self.checkpoint = checkpoint
        self.dtype = dtype
        # Dev mode's /server_info, with vLLM's instance_id (its process identity).
        self.server_info = server_info
        self.instance_id = _instance_id()
        self._hold_nothing_yet(max_recorded)

    def _event_size(self, event: int) -> int:
        """Tokens in a streamed sample's ``event``-th event (see ``tokens_per_event``)."""
        sizes = self.tokens_per_event
        if isinstance(sizes, int):
            size = sizes
        elif sizes:
            size = sizes[min(event, len(sizes) - 1)]
        else:
            raise ValueError("tokens_per_event must not be empty")
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"tokens_per_event sizes must be ints >= 1, got {sizes!r}")
        return size

    def _hold_nothing_yet(self, max_recorded: int | None) -> None:
        """What a server holds before its first request."""
        # Pausing (see _pause(), _admit() and _gate()).
        self._paused = False
        self.pause_modes: list[str] = []
        self._pause_mode = "abort"
        self._abort_epoch = 0  # pause(mode="abort") ends the requests of earlier epochs
        self._resumed = asyncio.Event()
        self._resumed.set()
        # Weights and their updates.
        self._weight_version = "default"
        self.update_active = False
        self.init_infos: list[Any] = []
        self.start_bodies: list[Any] = []
        # Accepted updates are kept as their raw bodies: parsed update_infos (thousands
        # of small objects each) would make every GC pass of a long benchmark slower.
        self._update_bodies: deque[bytes] = deque(maxlen=max_recorded)
        self.finished = 0
        self._generation = 0  # the model's weights: FakeLM's output changes with it
        self._zeroed = False  # weight_checker "reset" zeroed the weights
        # What tests injected and what the server saw.
        self._faults = FaultQueue()
        self._recorded: deque[RecordedRequest] = deque(maxlen=max_recorded)
        self.cancelled: list[str] = []
        #: the engine died (`Fault.engine_dies`): /health 503, the engine's routes 500
        self.engine_dead = False
        self.generation_requests = 0
        #: tokens sampled so far, every request's together (a test waits for the k-th)
        self.tokens_generated = 0

    # ------------------------------------------------------------ what it holds
    @property
    def weight_version(self) -> str:
        """The version it reports (``/weight_info``, generation spans): ``"default"``
        until a finish or a version update sets one. A test may set it to make the
        server report something else (a server whose version goes backwards, or lies)."""
        return self._weight_version

    @weight_version.setter
    def weight_version(self, version: str) -> None:
        self._weight_version = version

    @property
    def paused(self) -> bool:
        """Paused (``/pause``) and not resumed since."""
        return self._paused

    def _restarted(self) -> None:
        """A new process at the same address: a new identity, the checkpoint's weights
        (version ``"default"``), nothing paused, no update, no fault, nothing recorded."""
        self.instance_id = _instance_id()
        self._hold_nothing_yet(self.max_recorded)

    # ------------------------------------------------------------ faults and history
    def inject(self, route: str, fault: Fault, *, times: int | None = 1) -> None:
        """Apply ``fault`` to the next ``times`` requests on ``route`` (``None``: all of
        them; route ``"*"``: every route)."""
        self._faults.inject(route, fault, times)

    def clear_faults(self) -> None:
        self._faults.clear()

    @property
    def max_recorded(self) -> int | None:
        """How many requests, and accepted updates, are kept (``None``: all)."""
        return self._recorded.maxlen

    def _record(self, request: RecordedRequest) -> None:
        """Keeps ``request``, dropping the oldest beyond ``max_recorded``, and tells
        ``on_request``."""
        self._recorded.append(request)
        if self.on_request is not None:
            self.on_request(request)

    @property
    def requests(self) -> list[RecordedRequest]:
        """The last ``max_recorded`` requests received, oldest first (a copy)."""
        return list(self._recorded)

    def requests_to(self, path: str) -> list[RecordedRequest]:
        """The recorded requests on ``path``."""
        return [r for r in self._recorded if r.path == path]

    @property
    def updates(self) -> list[Any]:
        """The last ``max_recorded`` accepted ``update_info``, oldest first (parsed from
        the request bodies)."""
        return [_json.loads(body)["update_info"] for body in self._update_bodies]

    # ------------------------------------------------------------ weights
    def _accept_update(self, body: bytes) -> None:
        """Keeps the body of an accepted ``/update_weights`` (see `updates`)."""
        self._update_bodies.append(body)

    def _finish_update(self, version: str | None) -> None:
        """The active update finished: new weights, and their version when given."""
        self.update_active = False
        self.finished += 1
        self._generation += 1
        self._zeroed = False
        if version is not None:
            self._weight_version = version

    def _finish_version(self, version: str) -> None:
        """``/update_weight_version``: the version changes, the weights do not."""
        self._weight_version = version

    def _zero_weights(self) -> None:
        """``/weight_checker`` ``reset``: the checksums are of zeroed weights until the
        next finished update."""
        self._zeroed = True

    def checksums(self) -> dict[str, str]:
        """What ``/weight_checker`` reports now: ``checksum_hook``'s digests when given
        (by parameter name), else digests that change with every finished update."""
        if self.checksum_hook is not None:
            return {f"dp0:pp0:pcp0:tp0:{n}": d for n, d in self.checksum_hook().items()}
        seed = "zero" if self._zeroed else f"gen{self._generation}"
        return {f"dp0:pp0:pcp0:tp0:{p}": _checksum(f"{seed}:{p}") for p in self._params}

    # ------------------------------------------------------------ pausing
    def _pause(self, mode: str) -> None:
        """Like vLLM: new requests wait until resume; ``"abort"`` ends in-flight ones,
        ``"keep"`` freezes them, ``"wait"`` lets them run on."""
        self._paused = True
        self.pause_modes.append(mode)
        self._pause_mode = mode
        self._resumed.clear()
        if mode == "abort":
            self._abort_epoch += 1  # in-flight generations end with "abort"

    def _resume(self) -> None:
        self._paused = False
        self._resumed.set()

    async def _admit(self) -> int:
        """New requests wait while paused (as vLLM holds them); returns the abort epoch."""
        while self.paused:
            await self._resumed.wait()
        self.generation_requests += 1
        return self._abort_epoch

    async def _gate(self, epoch: int) -> bool:
        """Before each token: False when a pause (mode="abort") ended the request; waits
        while paused with "keep" (frozen) and runs on with "wait" (draining)."""
        while True:
            if self._abort_epoch != epoch:
                return False
            if not self.paused or self._pause_mode == "wait":
                return True
            await self._resumed.wait()


def _instance_id() -> str:
    """What vLLM's config sets as ``instance_id``: the clock, in ns, when built."""
    return str(time.time_ns())


def _checksum(seed: str) -> str:
    return hashlib.sha256(seed.encode()).hexdigest()

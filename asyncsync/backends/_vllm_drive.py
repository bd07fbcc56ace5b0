"""What the ``"nccl"`` and ``"ipc"`` backends share: vLLM's own trainer engines, driven
through asyncsync's thread-to-loop bridge.

vLLM's trainer engines (0.28 and later) talk to the servers through a synchronous
``VLLMWeightSyncClient``; the 0.23-0.27 static ``trainer_send_weights`` leaves the HTTP
calls to its caller. Either way the calls land here, on an `EngineClient` over the
round's `SyncFleetClient`, which adds what vLLM's engines do not
know about a fleet:

- each server's own init info (NCCL rank offsets: vLLM sends ``rank_offset=1`` to
  every server; a fleet is one group, so each server needs 1 + the world sizes of the
  servers before it);
- the round's version on finish (vLLM's engines call ``finish_weight_update()``
  without one; the `SyncFleetClient` adds it);
- cancellation at the boundaries where the transport can stop, progress per update;
- the encoding of an update for HTTP (a hook: IPC handles are pickled by
  `asyncsync.backends._ipc_handles`, the one module that pickles);
- the first failed fan-out, signalled to `run_guarded`, which stops waiting for an
  engine call stuck in a collective whose peers will never come.

`VllmSource` gives asyncsync's normalized weights the shape of vLLM's
``WeightSource``. Nothing here imports vLLM at module level.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from asyncsync._core.errors import ProtocolError
from asyncsync._vllm.caps import installed_trainer_api
from asyncsync.backends.contract import RoundCancelled, SendControl, TrainerApi, TrainerBackend

if TYPE_CHECKING:
    from asyncsync.backends.contract import InitInfo, SyncFleetClient, WeightSource

__all__ = [
    "EngineClient",
    "VllmEngineBackend",
    "VllmSource",
    "checked_pairs",
    "payload_bytes",
    "run_guarded",
]

logger = logging.getLogger("asyncsync.publish")

T = TypeVar("T")

#: Turns vLLM's init info (one dict for every server) into asyncsync's (per server).
PerServer = Callable[[dict[str, Any]], "InitInfo"]
#: Turns a fan-out's error into a clearer one (or None to keep it).
Explain = Callable[[BaseException], BaseException | None]


class VllmEngineBackend(TrainerBackend):
    """A backend that drives one of vLLM's built-in trainer engines (`name` is
    vLLM's backend name). Which of vLLM's trainer APIs runs is the installed vLLM's
    (`installed_trainer_api`), read on first use, in the
    publisher's worker thread: importing vLLM takes seconds, and constructing a
    publisher must not block the event loop. The ``api`` argument is not consulted."""

    _api: TrainerApi | None = None

    @property
    def api(self) -> TrainerApi:
        if self._api is None:
            self._api = installed_trainer_api(self.name)
        return self._api

    @api.setter
    def api(self, value: TrainerApi) -> None:
        del value  # the installed vLLM decides

    @contextlib.contextmanager
    def cuda_errors(self) -> Iterator[None]:
        """Re-raise vLLM's engine error about a missing CUDA device as a clearer one."""
        try:
            yield
        except (RuntimeError, AssertionError) as exc:
            if not any(word in str(exc) for word in ("CUDA", "accelerator")):
                raise
            raise RuntimeError(
                f"backend {self.name!r} needs a CUDA device in the trainer process (vLLM's "
                f"{self.name} engine works on the current device): {exc}"
            ) from exc

    def factory_init(self, info: Any, client: EngineClient) -> Any:
        """vLLM's ``WeightTransferTrainerFactory.trainer_init(info)`` over ``client``,
        with an empty source (each round sets its own)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        with self.cuda_errors():
            return WeightTransferTrainerFactory.trainer_init(
                info, client=client, source=VllmSource(None)
            )


class VllmSource:
    """asyncsync's normalized weights in the shape of vLLM's ``WeightSource``:
    ``metadata()`` as vLLM's ``ParamMeta`` list, and iteration of detached tensors (a
    fresh pass each time). ``None`` is the empty source an engine is built with before
    its first round."""

    def __init__(self, source: WeightSource | None) -> None:
        self.source = source

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, d, s) for n, d, s in self.described()]

    def described(self) -> list[tuple[str, Any, tuple[int, ...]]]:
        """``(name, dtype, shape)`` of every parameter (TypeError for a stream)."""
        if self.source is None:
            return []
        meta = self.source.metadata()
        if meta is None:
            raise TypeError(
                "these weights cannot describe themselves (a one-shot stream): vLLM's "
                "NCCL engine announces every name, dtype and shape before the first "
                "byte. Pass a module, a mapping, a list of pairs, or an object with "
                "metadata()"
            )
        return [(n, d, tuple(int(x) for x in s)) for n, d, s in meta]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        if self.source is None:
            return
        for name, tensor in self.source:  # detached: vLLM's engines read them as data
            yield name, (tensor.detach() if getattr(tensor, "requires_grad", False) else tensor)


def checked_pairs(
    pairs: Iterator[tuple[str, Any]], meta: list[tuple[str, Any, tuple[int, ...]]]
) -> Iterator[tuple[str, Any]]:
    """``pairs``, each checked against what the servers were told to expect (a
    mismatch would split the broadcast differently on each side: a hang or garbage).
    vLLM 0.28+'s NCCL engine checks this itself; the static API of 0.23-0.27 does not."""
    sent = 0
    for name, tensor in pairs:
        if sent >= len(meta):
            raise ValueError(f"the weights yielded {name!r} after the {len(meta)} announced")
        want_name, want_dtype, want_shape = meta[sent]
        if name != want_name or tensor.dtype != want_dtype or tuple(tensor.shape) != want_shape:
            raise ValueError(
                f"weight {sent} is {name!r} {tensor.dtype} {tuple(tensor.shape)}, but "
                f"{want_name!r} {want_dtype} {want_shape} was announced"
            )
        sent += 1
        # NCCL sends numel elements from data_ptr(): a view must be made contiguous.
        yield name, (tensor if tensor.is_contiguous() else tensor.contiguous())
    if sent != len(meta):
        raise ValueError(f"the weights ended after {sent} of {len(meta)} announced tensors")


def payload_bytes(update_info: Any) -> int:
    """The tensor bytes one update info announces (its ``tensor_sizes`` when it has
    them, else its shapes and dtypes)."""
    if isinstance(update_info, list):
        return payload_bytes(update_info[0]) if update_info else 0
    if not isinstance(update_info, Mapping):
        return 0
    sizes = update_info.get("tensor_sizes")
    if sizes:
        return int(sum(sizes))
    import torch

    total = 0
    for dtype_name, shape in zip(
        update_info.get("dtype_names") or (), update_info.get("shapes") or (), strict=False
    ):
        dtype = getattr(torch, str(dtype_name), None)
        itemsize = int(getattr(dtype, "itemsize", 0))
        total += math.prod(int(x) for x in shape) * itemsize
    return total


def _failure(future: Future[Any]) -> BaseException | None:
    if future.cancelled():
        return None
    return future.exception()


class EngineClient:
    """vLLM's synchronous ``VLLMWeightSyncClient`` over asyncsync's bridge, for one
    init or one round (see the module docstring). ``client`` is None on trainer ranks
    other than 0: vLLM's engines never call it there, and a call raises.

    Args:
        per_server: turns vLLM's init info into one per server (rank offsets).
        control: the round's cancel event and progress callback.
        encode: turns an update info into what HTTP carries (IPC handles pickled).
        cancel_updates: whether an update may be refused once the round is cancelled
            (IPC: the engine waits for each update; NCCL: no, the servers' workers are
            already in the broadcast, so the round stops at finish instead).
        explain: a clearer error for a failed fan-out, raised from it.
    """

    def __init__(
        self,
        client: SyncFleetClient | None,
        *,
        per_server: PerServer | None = None,
        control: SendControl | None = None,
        encode: Callable[[Any], Any] | None = None,
        cancel_updates: bool = False,
        explain: Explain | None = None,
    ) -> None:
        self.client = client
        self.per_server = per_server
        self.control = control
        self.encode = encode
        self.cancel_updates = cancel_updates
        self.explain = explain
        self.updates = 0
        self.bytes = 0
        #: the first fan-out that failed (its future), for `run_guarded`
        self.failed: Future[Any] | None = None
        #: `run_guarded` left a call blocked in a collective
        self.stuck = False
        self._wake: list[threading.Event] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ vLLM's four calls
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.begin_init(init_info).result()

    def start_weight_update(self) -> None:
        self._check_cancel("start")
        self._call(lambda c: c.start_weight_update())

    def update_weights(self, update_info: Any) -> None:
        self.begin_update(update_info).result()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        # vLLM's engines pass no version: the SyncFleetClient adds the round's.
        self._check_cancel("finish")
        self._call(lambda c: c.finish_weight_update(weight_version))

    # ------------------------------------------------------------------ started, not awaited
    def begin_init(self, init_info: Mapping[str, Any]) -> Future[None]:
        """Start ``/init_weight_transfer_engine`` everywhere (each server's own info)."""
        info = dict(init_info)
        per_server = self.per_server(info) if self.per_server is not None else info
        return self._watch(self._sender().begin_init(per_server))

    def begin_update(self, update_info: Any) -> Future[None]:
        """Start ``/update_weights`` everywhere; the returned future reports progress and
        raises the explained error."""
        if self.cancel_updates:
            self._check_cancel("update")
        payload = self.encode(update_info) if self.encode is not None else update_info
        size = payload_bytes(update_info)
        done: Future[None] = Future()
        pending = self._watch(self._sender().begin_update(payload))

        def settle(future: Future[None]) -> None:
            error = _failure(future)
            if future.cancelled():
                done.cancel()
            elif error is not None:
                done.set_exception(self._explained(error))
            else:
                self._progress(size)
                done.set_result(None)

        pending.add_done_callback(settle)
        return done

    # ------------------------------------------------------------------ helpers
    def _sender(self) -> SyncFleetClient:
        if self.client is None:
            raise RuntimeError(
                "vLLM's trainer engine called the servers from a trainer rank other than "
                "0; only rank 0 talks to them"
            )
        return self.client

    def _call(self, call: Callable[[SyncFleetClient], None]) -> None:
        try:
            call(self._sender())
        except Exception as exc:
            explained = self._explained(exc)
            if explained is exc:
                raise
            raise explained from exc

    def _explained(self, error: BaseException) -> BaseException:
        better = self.explain(error) if self.explain is not None else None
        if better is None:
            return error
        better.__cause__ = error
        return better

    def _check_cancel(self, where: str) -> None:
        if self.control is not None and self.control.cancel.is_set():
            raise RoundCancelled(f"the round was cancelled before {where}")

    def _progress(self, size: int) -> None:
        with self._lock:
            self.updates += 1
            self.bytes += size
            updates, sent = self.updates, self.bytes
        if self.control is not None and self.control.on_chunk is not None:
            self.control.on_chunk(updates, sent)

    def _watch(self, future: Future[T]) -> Future[T]:
        def noted(f: Future[T]) -> None:
            if _failure(f) is None:
                return
            with self._lock:
                if self.failed is None:
                    self.failed = f
                wake = list(self._wake)
            for event in wake:
                event.set()

        future.add_done_callback(noted)
        return future

    def on_failure(self, event: threading.Event) -> None:
        """Set ``event`` when a fan-out fails (at once if one already has)."""
        with self._lock:
            self._wake.append(event)
            failed = self.failed is not None
        if failed:
            event.set()


def run_guarded(call: Callable[[], T], client: EngineClient, *, name: str) -> T:
    """``call()`` in a thread of its own; its result or its error, or, as soon as one of
    ``client``'s fan-outs failed while ``call`` is still blocked (an NCCL rendezvous or
    broadcast whose peers refused the HTTP call never completes), that fan-out's error,
    with ``client.stuck`` set. The stuck thread is left behind (a daemon): the caller
    must not reuse what it holds."""
    result: Future[T] = Future()
    wake = threading.Event()

    def target() -> None:
        try:
            result.set_result(call())
        except BaseException as exc:  # delivered to the waiting caller
            result.set_exception(exc)
        finally:
            wake.set()

    client.on_failure(wake)
    thread = threading.Thread(target=target, name=f"asyncsync-{name}", daemon=True)
    thread.start()
    wake.wait()
    if result.done():
        return result.result()
    failed = client.failed
    assert failed is not None
    error = _failure(failed)
    assert error is not None
    client.stuck = True
    logger.warning(
        "%s: a call to the servers failed while vLLM's engine was blocked in the "
        "collective; that thread is left behind and its group never reused (%s)",
        name,
        error,
    )
    error.add_note(
        f"asyncsync: {name} was left blocked in the collective; the next round builds a new group"
    )
    raise error


def explain_insecure_serialization(error: BaseException) -> BaseException | None:
    """A clear error when servers refused pickled IPC handles (their environment lacks
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``)."""
    texts = [str(error)] + [str(e) for e in getattr(error, "exceptions", ())]
    if not any("VLLM_ALLOW_INSECURE_SERIALIZATION" in t for t in texts):
        return None
    return ProtocolError(
        "the servers refused the pickled CUDA IPC handles: vLLM unpickles "
        "ipc_handles_pickled only when the server runs with "
        "VLLM_ALLOW_INSECURE_SERIALIZATION=1 in its environment. Restart every server "
        "with it (and keep their RL routes off any network others can reach: the flag "
        f"lets whoever reaches /update_weights run code in the server). Server said: {error}"
    )

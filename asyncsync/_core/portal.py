"""The portal thread behind `asyncsync.blocking`: one event loop of its own, on a
daemon thread, that runs the async objects while the calling thread blocks.

The calling thread may itself be running an event loop (a Jupyter cell): it blocks on
a future while the portal's loop, on another thread, does the work, so nothing nests.
anyio's `BlockingPortal` does the thread-to-loop hand-off;
the thread is a daemon and is stopped at interpreter exit, so an unclosed facade never
keeps the process alive.

`blocking_method` turns an async (or loop-bound) method of the async class into
a blocking method of a facade class, keeping its signature, overloads and docstring for
mypy, IDEs and `help`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import inspect
import logging
import queue
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

import anyio
from anyio.from_thread import BlockingPortal

from asyncsync._core.loop import uvloop_enabled

__all__ = [
    "Facade",
    "PortalThread",
    "blocking_method",
    "loop_method",
    "shared_portal",
    "wrapping_method",
]

logger = logging.getLogger("asyncsync.blocking")

P = ParamSpec("P")
R = TypeVar("R")
A_co = TypeVar("A_co", covariant=True)
W = TypeVar("W")

#: Seconds the portal thread gets to stop at interpreter exit.
_STOP_TIMEOUT = 5.0


class PortalThread:
    """A `BlockingPortal` served by a daemon thread, started on first use."""

    def __init__(self, name: str = "asyncsync-portal") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._portal: BlockingPortal | None = None
        self._thread: threading.Thread | None = None
        self._open: weakref.WeakSet[Any] = weakref.WeakSet()

    def track(self, obj: Any) -> None:
        """Close ``obj`` (its ``aclose``) when the portal stops, if it is still around."""
        self._open.add(obj)

    @property
    def thread(self) -> threading.Thread | None:
        """The thread running the portal's loop (None before first use)."""
        return self._thread

    def portal(self) -> BlockingPortal:
        """The running portal; starts the thread the first time."""
        with self._lock:
            if self._portal is None or self._thread is None or not self._thread.is_alive():
                self._portal, self._thread = self._start()
            return self._portal

    def _start(self) -> tuple[BlockingPortal, threading.Thread]:
        ready: queue.SimpleQueue[BlockingPortal | BaseException] = queue.SimpleQueue()
        thread = threading.Thread(target=_serve, args=(ready,), name=self._name, daemon=True)
        thread.start()
        got = ready.get()
        if isinstance(got, BaseException):
            raise RuntimeError("the asyncsync portal thread did not start") from got
        logger.debug("portal thread %s started", thread.name)
        return got, thread

    @overload
    def call(self, func: Callable[..., Awaitable[R]], *args: Any) -> R: ...

    @overload
    def call(self, func: Callable[..., R], *args: Any) -> R: ...

    def call(self, func: Callable[..., Any], *args: Any) -> Any:
        """Run ``func(*args)`` on the portal's loop (awaited when it returns an
        awaitable) and block until it is done. Its exception is raised here as it is.
        An interrupt of the waiting thread (Ctrl-C) cancels the call on the loop."""
        portal = self.portal()
        if threading.current_thread() is self._thread:
            raise RuntimeError(
                "asyncsync.blocking called from its own portal thread: await the async "
                "object instead"
            )
        # Ours, made before anything is scheduled: an interrupt that lands while anyio
        # is still handing the task over (its start_task_soon waits for the loop to
        # spawn it, and the task may already be talking to a server by then) has no
        # future of anyio's to cancel, but always has this one.
        interrupted: Future[None] = Future()
        try:
            future: Future[Any] = portal.start_task_soon(
                _until_interrupted, interrupted, func, *args
            )
            return future.result()
        except BaseException:
            interrupted.cancel()  # cancels the task on the portal's loop, now or once it starts
            raise

    def stop(self) -> None:
        """Close the tracked objects still open, then stop the loop, cancelling what
        still runs on it (at interpreter exit)."""
        with self._lock:
            portal, thread, self._portal, self._thread = self._portal, self._thread, None, None
        if portal is None or thread is None or not thread.is_alive():
            return
        for obj in list(self._open):  # what the program left open (a notebook's objects)
            try:
                portal.call(obj.aclose)
            except Exception:  # at exit: report it, go on closing the rest
                logger.exception("closing %r at exit failed", obj)
        try:
            portal.call(portal.stop, True)
        except RuntimeError:  # the loop already stopped
            return
        thread.join(_STOP_TIMEOUT)


async def _until_interrupted(
    interrupted: Future[None], func: Callable[..., Any], *args: Any
) -> Any:
    """``func(*args)`` on the portal's loop (awaited when it returns an awaitable),
    cancelled as soon as the calling thread cancels ``interrupted``."""
    loop = asyncio.get_running_loop()
    with anyio.CancelScope() as scope:

        def cancel(_: Future[None]) -> None:  # on the interrupted thread, or here
            with contextlib.suppress(RuntimeError):  # a closed loop: nothing to cancel
                loop.call_soon_threadsafe(scope.cancel)

        interrupted.add_done_callback(cancel)
        result = func(*args)
        if inspect.isawaitable(result):
            result = await result
        return result
    return None  # cancelled: the caller has already raised its interrupt


def _serve(ready: queue.SimpleQueue[BlockingPortal | BaseException]) -> None:
    async def main() -> None:
        async with BlockingPortal() as portal:
            ready.put(portal)
            await portal.sleep_until_stopped()

    try:
        anyio.run(main, backend="asyncio", backend_options={"use_uvloop": uvloop_enabled()})
    except BaseException as exc:  # reported to the thread that waits for the start
        ready.put(exc)
        raise


_SHARED = PortalThread()
atexit.register(_SHARED.stop)


def shared_portal() -> PortalThread:
    """The portal every facade object uses (one loop: objects can be combined)."""
    return _SHARED


class Facade(Generic[A_co]):
    """A blocking object in front of an async one that lives on the portal's loop."""

    _async: A_co
    _portal: PortalThread

    @overload
    def _call(self, func: Callable[..., Awaitable[R]], *args: Any) -> R: ...

    @overload
    def _call(self, func: Callable[..., R], *args: Any) -> R: ...

    def _call(self, func: Callable[..., Any], *args: Any) -> Any:
        return self._portal.call(func, *args)


def blocking_method(
    method: Callable[Concatenate[A_co, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[Facade[A_co], P], R]:
    """A facade method that awaits ``method`` of the wrapped async object on the
    portal's loop and returns its result. Signature, overloads and docstring are the
    async method's."""
    return wrapping_method(method, _same)


def loop_method(
    method: Callable[Concatenate[A_co, P], R],
) -> Callable[Concatenate[Facade[A_co], P], R]:
    """A facade method for a plain method of the async object that reads or changes
    loop-side state (routing, versions): it runs on the portal's loop too, so the async
    objects are only ever touched from their own loop's thread."""
    return wrapping_method(method, _same)


def wrapping_method(
    method: Callable[Concatenate[A_co, P], Any], wrap: Callable[[Any], W]
) -> Callable[Concatenate[Facade[A_co], P], W]:
    """Like `blocking_method`, for a method whose result is itself an async
    object: ``wrap`` turns it into its facade (a stream, a client)."""

    def call(self: Facade[A_co], /, *args: P.args, **kwargs: P.kwargs) -> W:
        return wrap(self._portal.call(functools.partial(method, self._async, *args, **kwargs)))

    functools.update_wrapper(call, method)
    return call


def _same(value: R) -> R:
    return value

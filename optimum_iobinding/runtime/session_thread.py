"""The one thread that makes and runs a model's CUDA sessions.

ONNX Runtime's CUDA provider keeps a context for each thread that makes or runs one of its sessions (its cuBLAS,
cuBLASLt and cuDNN handles and what they allocate, tens to hundreds of MiB of device memory, and that thread's CUDA
graphs), for as long as the session lives. A pipeline makes its sessions in background threads while it loads and
runs them from the caller's thread (and from a server's worker threads): each session would hold a context per thread
that ever touched it. A :class:`SessionThread` makes every ORT call of a model's sessions (creating one, running one)
on one thread of its own: one context per session, whichever threads build, warm up and call the model, and one
captured graph per input signature for all of them. Only the ORT call goes there: its caller binds the inputs and
outputs, takes the locks and the device gate (:data:`~.cuda_policy.DEVICE_SETUP`) and waits for the call's host part
(a run's kernels are enqueued on the model's stream; nothing waits for the device). The call it hands over takes no
lock of the project's, so handing over can never deadlock."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, List, Optional, TypeVar

T = TypeVar("T")


class SessionThread:
    """Runs the calls given to :meth:`call` on one thread, started by the first call and ended when this object is
    garbage-collected (or the interpreter exits, after the calls under way).

    Args:
        name: the thread's name after ``"ort "`` (the model file).
    """

    def __init__(self, name: str):
        self.name = f"ort {name}"
        self._lock = threading.Lock()
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        # the thread's identifier, written by the thread: a list the worker holds, not this object (a worker holding
        # its executor through us would keep both alive for ever)
        self._ident: List[Optional[int]] = [None]

    @property
    def ident(self) -> Optional[int]:
        """The thread's identifier, once a call has started it."""
        return self._ident[0]

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the thread; the caller waits for it and gets its result or its exception. Called on the
        thread itself, it runs at once; once the interpreter is shutting down (the main thread has ended, and the
        thread no longer takes calls), in the caller's thread.

        An interrupt (Ctrl-C) while the call runs reaches the caller once the call has ended, as it would in ORT's own
        call: the caller's clean-up (freeing the tensors a run reads and writes, ending a device gate) never runs
        beside it."""
        if threading.get_ident() == self._ident[0]:
            return fn(*args)
        with self._lock:
            if self._executor is None:
                # one worker, made once and kept: the same thread for every call
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=self.name, initializer=_record_ident, initargs=(self._ident,)
                )
            executor = self._executor
        try:
            future = executor.submit(fn, *args)
        except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
            return fn(*args)
        try:
            return future.result()
        except BaseException:
            while not future.done():  # interrupted while ORT works: wait for it, however often interrupted again
                try:
                    concurrent.futures.wait([future])
                except BaseException:
                    pass
            raise


def _record_ident(box: List[Optional[int]]) -> None:
    box[0] = threading.get_ident()

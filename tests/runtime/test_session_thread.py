"""The session thread: every ORT call of a model's CUDA sessions on one thread of its own, whichever thread asks."""

import gc
import threading

import pytest

from optimum_iobinding.runtime.session_thread import SessionThread


def test_every_call_runs_on_one_thread_that_is_not_the_callers():
    worker = SessionThread("model.onnx")
    seen = []

    def record(tag):
        seen.append((tag, threading.get_ident(), threading.current_thread().name))
        return tag * 2

    assert worker.ident is None  # started by the first call
    assert worker.call(record, 1) == 2
    callers = [threading.Thread(target=worker.call, args=(record, tag)) for tag in (2, 3, 4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(60)
    assert worker.call(record, 5) == 10
    assert sorted(tag for tag, _, _ in seen) == [1, 2, 3, 4, 5]
    assert {ident for _, ident, _ in seen} == {worker.ident} and worker.ident != threading.get_ident()
    assert {name for _, _, name in seen} == {f"{worker.name}_0"} and worker.name == "ort model.onnx"


def test_a_call_made_on_the_thread_runs_at_once_and_an_error_reaches_the_caller():
    worker = SessionThread("model.onnx")

    def nested():
        return worker.call(threading.get_ident)  # queued behind itself, it would never run

    assert worker.call(nested) == worker.ident

    def fails():
        raise ValueError("onnxruntime refused it")

    with pytest.raises(ValueError, match="onnxruntime refused it"):
        worker.call(fails)
    assert worker.call(lambda: "still there") == "still there"


def test_the_thread_ends_when_its_owner_is_dropped():
    worker = SessionThread("model.onnx")
    worker.call(lambda: None)
    ident = worker.ident
    (thread,) = [thread for thread in threading.enumerate() if thread.ident == ident]
    del worker
    gc.collect()
    thread.join(60)
    assert not thread.is_alive()

"""An opt-in record of the runtime's set-up work, for whoever measures a cold start: each model file parsed, each
set of owned weights loaded, each session made (or refused), and each model's first runs, with host times and the
thread that did it. Nothing is recorded (and nothing is paid beyond one check) unless :func:`recording` is active.

    from optimum_iobinding.runtime import timeline

    with timeline.recording() as record:
        image = pipe(prompt).images[0]
    for step in record.steps:   # Step(begin, end, what, thread), host clock (time.perf_counter)
        ...
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

# the runs of a model that are recorded: ORT makes one regular run, then captures a graph, then replays it
RECORDED_RUNS = 3


@dataclass
class Step:
    """One piece of work: host seconds from ``begin`` to ``end`` (``time.perf_counter``), what it was, and the thread
    that did it. ``what`` ends with ``failed`` where the work raised."""

    begin: float
    end: float
    what: str
    thread: str


@dataclass
class Recording:
    """What :func:`recording` collects. ``on_run(model, index)`` (if set) is called right after each recorded run
    returns, on the calling thread: a measurement can enqueue a CUDA event on ``model.stream`` there."""

    steps: List[Step] = field(default_factory=list)
    on_run: Optional[Callable[[Any, int], None]] = None
    runs: Dict[int, int] = field(default_factory=dict)  # id(model) → runs seen
    lock: threading.Lock = field(default_factory=threading.Lock)


_active: Optional[Recording] = None


@contextlib.contextmanager
def recording(on_run: Optional[Callable[[Any, int], None]] = None) -> Iterator[Recording]:
    """Records the runtime's set-up work while the block runs (one recording at a time, process-wide)."""
    global _active
    if _active is not None:
        raise RuntimeError("timeline.recording: a recording is active already")
    _active = Recording(on_run=on_run)
    try:
        yield _active
    finally:
        _active = None


@contextlib.contextmanager
def step(what: str) -> Iterator[None]:
    """Times the block as one step where a recording is active (the runtime calls it; it does nothing otherwise)."""
    active = _active
    if active is None:
        yield
        return
    begin, outcome = time.perf_counter(), " failed"
    try:
        yield
        outcome = ""
    finally:
        entry = Step(begin, time.perf_counter(), what + outcome, threading.current_thread().name)
        with active.lock:
            active.steps.append(entry)


def run_index(model: Any) -> Optional[int]:
    """The number of this run of ``model`` (1, 2, …) where a recording is active and it is among the first
    :data:`RECORDED_RUNS`; ``None`` otherwise."""
    active = _active
    if active is None:
        return None
    with active.lock:
        index = active.runs.get(id(model), 0) + 1
        active.runs[id(model)] = index
    return index if index <= RECORDED_RUNS else None


def ran(model: Any, index: int) -> None:
    """Called after a recorded run: hands it to the recording's ``on_run``."""
    active = _active
    if active is not None and active.on_run is not None:
        active.on_run(model, index)

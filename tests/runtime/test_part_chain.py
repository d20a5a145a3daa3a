"""The order in which a model's cold-start parts make a signature's first runs: side by side for the first signature
(the cold start), one part after another for every later one (first runs side by side hold the sum of the parts'
activations in the arena they share)."""

from __future__ import annotations

import threading

from optimum_iobinding.runtime.part_chain import PartChain

GUARD_S = 120  # a hang turned into a failure: never reached where the chain behaves


class FirstRun(threading.Thread):
    """A part's first run: waits for the test's release; a join of it is told to ``joined`` first."""

    def __init__(self, released, joined):
        super().__init__(target=released.wait)
        self.joined = joined

    def join(self, timeout=None):
        self.joined.set()
        super().join(timeout)


class Part:
    """A part of a chain, ``x`` → ``y<number>``. Asked for a signature (a batch size), it records whether the part
    before it was still making that signature's first run; the last part tells ``progress`` it was asked."""

    def __init__(self, number, last, before, released, progress, log):
        self.number, self.last, self.before, self.log = number, last, before, log
        self.released, self.progress = released, progress
        self.input_names = ["x"] if number == 0 else [f"y{number - 1}"]
        self.output_names = [f"y{number}"]
        self.input_dims = {name: ["batch"] for name in self.input_names}
        self.threads = {}

    def shape_inferencer(self, inputs):
        return {self.output_names[0]: next(iter(inputs.values()))}

    def prepare_signature(self, inputs):
        batch = next(iter(inputs.values()))[0]
        previous = self.before[0].threads.get(batch) if self.before else None
        self.log.append((batch, self.number, previous is not None and previous.is_alive()))
        thread = self.threads[batch] = FirstRun(self.released[batch], self.progress[batch])
        thread.start()
        if self.last:
            self.progress[batch].set()
        return thread


def test_the_first_signature_is_made_by_every_part_at_once_and_a_later_one_part_after_part():
    released = {1: threading.Event(), 4: threading.Event()}
    progress = {1: threading.Event(), 4: threading.Event()}  # the last part asked, or a first run joined
    log, parts = [], []
    for number in range(3):
        parts.append(Part(number, number == 2, parts[-1:], released, progress, log))
    chain = PartChain(["p0", "p1", "p2"], lambda path, shared: parts[int(path[1])], shared=False)

    try:
        for batch in (1, 4):
            thread = chain.prepare_signature({"x": (batch,)})
            # no first run ends before the chain has asked every part or waits for a part's first run
            assert progress[batch].wait(GUARD_S)
            released[batch].set()
            thread.join()
    finally:  # nothing left waiting where an assertion failed
        for event in released.values():
            event.set()
    # the first signature: every part asked while the parts before it were making their first runs
    assert [entry for entry in log if entry[0] == 1] == [(1, 0, False), (1, 1, True), (1, 2, True)]
    # a later one: each part asked only once the part before it had made its first run
    assert [entry for entry in log if entry[0] == 4] == [(4, 0, False), (4, 1, False), (4, 2, False)]

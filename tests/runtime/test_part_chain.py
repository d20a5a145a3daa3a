"""How a model's cold-start parts make a signature's graphs and first runs: each part's graph reading the buffers the
graphs of the parts before it write; the first runs side by side for the first signature (the cold start), one part
after another for every later one (first runs side by side hold the sum of the parts' activations in the arena they
share)."""

from __future__ import annotations

import threading

import pytest
import torch

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

    # no graphs: the parts' graphs linked to each other are another test's
    def adopt_graph_inputs(self, shapes, buffers):
        return False

    def graph_runner(self, shapes):
        return None

    def prepare(self, wait):
        return None

    @property
    def signatures(self):
        return [{"x": (batch,)} for batch in self.threads]

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


class Runner:
    """A part's graph of one signature: the buffers it reads its inputs from and writes its outputs to."""

    def __init__(self, input_buffers, outputs):
        self.input_buffers = dict(input_buffers)
        self.output_buffers = {name: torch.full(shape, float(len(name))) for name, shape in outputs.items()}


class GraphPart:
    """A part of a chain whose graphs are made on first use (a call, or ``adopt_graph_inputs`` ahead of it): ``x`` and
    ``y<k>`` of every part before it → ``y<number>``, a graph per batch size, outputs written into its buffers."""

    def __init__(self, number):
        self.number = number
        self.input_names = ["x", *[f"y{k}" for k in range(number)]]
        self.output_names = [f"y{number}"]
        self.input_dims = {name: ["batch"] for name in self.input_names}
        self.model_path = f"p{number}"
        self.graphs, self.adopted = {}, []

    def shape_inferencer(self, inputs):
        return {self.output_names[0]: inputs["x"]}

    def adopt_graph_inputs(self, shapes, buffers):
        self.adopted.append(dict(buffers))
        if shapes["x"] in self.graphs:
            return False
        self.graphs[shapes["x"]] = Runner(buffers, self.shape_inferencer(shapes))
        return True

    def graph_runner(self, shapes):
        return self.graphs.get(shapes["x"])

    def prepare_signature(self, inputs):
        return None

    def prepare(self, wait):
        return None

    @property
    def signatures(self):
        return [{"x": shape} for shape in self.graphs]

    def __call__(self, **inputs):
        shape = tuple(inputs["x"].shape)
        runner = self.graphs.get(shape) or self.graphs.setdefault(shape, Runner({}, {self.output_names[0]: shape}))
        for name, tensor in inputs.items():  # as a graph runner: a given tensor copied unless it is the buffer
            buffer = runner.input_buffers.setdefault(name, torch.empty_like(tensor))
            if buffer.data_ptr() != tensor.data_ptr():
                buffer.copy_(tensor)
        (name,) = self.output_names
        runner.output_buffers[name].copy_(sum(runner.input_buffers.values()))
        return [runner.output_buffers[name]]


@pytest.mark.parametrize("prepared", [True, False])
def test_each_parts_graph_reads_the_buffers_the_parts_before_it_write(prepared):
    parts = [GraphPart(number) for number in range(3)]
    chain = PartChain(["p0", "p1", "p2"], lambda path, shared: parts[int(path[1])], shared=False)
    x = torch.ones(2)
    if prepared:  # the graphs made ahead of the call, in a thread, linked there
        chain.prepare_signature({"x": (2,)}).join()
        assert [len(part.adopted) for part in parts] == [1, 1, 1]
    for _ in range(2):  # the second call makes nothing again
        (out,) = chain.run({"x": x})
    for part in parts:  # linked once, by the prepare or by the first call
        assert len(part.adopted) == 1
    graphs = [part.graphs[(2,)] for part in parts]
    # every value that crosses a cut is one tensor: the buffer its maker writes is the one each later part reads
    for later in (1, 2):
        for earlier in range(later):
            name = f"y{earlier}"
            assert graphs[later].input_buffers[name] is graphs[earlier].output_buffers[name]
    # and the chain computes through them: y0 = x, y1 = x + y0, y2 = x + y0 + y1
    assert torch.equal(out, torch.full((2,), 4.0))
    assert out is graphs[2].output_buffers["y2"]


def test_parts_made_again_are_linked_again_and_a_link_that_fails_leaves_the_parts_running():
    made = []

    def make(path, shared):
        made.append(GraphPart(int(path[1])))
        return made[-1]

    chain = PartChain(["p0", "p1"], make, shared=False)
    x = torch.ones(2)
    chain.run({"x": x})
    chain.share_weights()  # new parts (reading the owned weights): their graphs are linked again on their first call
    (out,) = chain.run({"x": x})
    first, second = made[2:]
    assert len(first.adopted) == len(second.adopted) == 1
    assert second.graphs[(2,)].input_buffers["y0"] is first.graphs[(2,)].output_buffers["y0"]
    assert torch.equal(out, torch.full((2,), 2.0))

    class Unsized(GraphPart):  # a part whose output shape is not known before it runs: nothing to link from it
        def shape_inferencer(self, inputs):
            return {}

    parts = [Unsized(0), GraphPart(1)]
    chain = PartChain(["p0", "p1"], lambda path, shared: parts[int(path[1])], shared=False)
    for _ in range(2):
        (out,) = chain.run({"x": x})
        assert torch.equal(out, torch.full((2,), 2.0))  # computed all the same, the second part copying its inputs
    assert parts[1].adopted == []  # and not asked again on the second call

"""Whether a model's first run in ONNX Runtime's CUDA provider shortens when the model is cut into parts whose first
runs go side by side in threads: the question behind the cold start's longest step, the UNet's first run, where ORT
sets cuDNN up per node (each convolution's heuristics query, each attention shape's graph), in one thread, one node
after another (``benchmarks/results/h200/``: 1.0–1.7 s of SD 1.5's cold start, after a 0.7–1.1 s session).

The model is cut between its nodes (in their stored order, each after the makers of its inputs) into ``K`` parts of as many convolutions and
attention nodes each; every tensor that crosses a cut becomes an output of the part that makes it and an input of the
parts that use it. One process runs the whole model once with those tensors as extra outputs (their types and shapes),
writes each part into ``OUT/parts-K/`` (the part's weights in a file beside it), and checks that the parts, run one
after another on random inputs, give the whole model's outputs. Then each variant runs in a fresh process:

- ``whole``: the model's session, its first run, its second run (every run in the main thread);
- ``parts-K:serial``: the parts' sessions made side by side (a thread each), their first runs one after another;
- ``parts-K:threads``: the same sessions, their first runs side by side (a thread each); their second runs in the
  main thread, new to the sessions: what a run in another thread sets up again (ORT keeps cuDNN's attention graphs per
  thread).

The timed runs read zeros (a first run sets up what it meets, whatever the values), but for the shapes, indices and
scales that cross a cut, which keep the values the whole model's run gave them.

A ``threads`` first run far under ``serial``'s says the set-up goes in parallel; both alike says it is serialised
(a lock in the driver or cuDNN). Inputs are the model's with ``--dims`` for their free dimensions.

    python benchmarks/split_first_run.py --model WORK/sd15-fp16-optimized/unet/model.onnx --out OUT/split \\
        [--parts 2,4] [--dims batch=2,height=64,width=64,sequence=77,timestep_batch=1] [--provider cpu]

``--provider cpu`` checks the script on a machine without CUDA (a model exported for the CPU): its seconds mean
nothing. Writes ``split-first-run.json`` into ``--out`` and prints each variant's row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

# nodes whose first run sets cuDNN up: what the cuts balance
SETUP_OPS = {"Conv", "NhwcConv", "MultiHeadAttention", "Attention", "GroupQueryAttention"}
DEFAULT_DIMS = "batch=2,height=64,width=64,sequence=77,timestep_batch=1"
ORT_TYPES = {
    "tensor(float16)": "float16",
    "tensor(float)": "float32",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
}


def providers_of(provider: str) -> Tuple[List[str], List[Dict[str, str]]]:
    if provider == "cpu":
        return ["CPUExecutionProvider"], [{}]
    from optimum_iobinding.runtime.cuda_policy import CUDA_DIFFUSION_DEFAULTS

    return ["CUDAExecutionProvider"], [dict(CUDA_DIFFUSION_DEFAULTS)]


def parse_dims(text: str) -> Dict[str, int]:
    dims = {}
    for item in filter(None, text.split(",")):
        name, _, size = item.partition("=")
        if not size.isdigit():
            raise SystemExit(f"--dims: expected name=size items separated by commas, got {item!r}")
        dims[name.strip()] = int(size)
    return dims


def feed_for(inputs: Sequence[Any], dims: Dict[str, int], random: bool) -> Dict[str, Any]:
    """A value for each of a session's inputs: ``dims`` for their free dimensions; random or zeros."""
    import numpy as np

    rng = np.random.default_rng(0)
    feed = {}
    for value in inputs:
        shape = []
        for dim in value.shape:
            if isinstance(dim, int):
                shape.append(dim)
            elif dim in dims:
                shape.append(dims[dim])
            else:
                raise SystemExit(f"--dims: the input {value.name!r} has the free dimension {dim!r}, which it lacks")
        dtype = ORT_TYPES.get(value.type)
        if dtype is None:
            raise SystemExit(f"the input {value.name!r} is of type {value.type}, which this script does not feed")
        if not random:
            feed[value.name] = np.zeros(shape, dtype)
        elif dtype.startswith("int"):
            feed[value.name] = rng.integers(0, 999, size=shape).astype(dtype)
        else:
            feed[value.name] = rng.standard_normal(shape).astype(dtype)
    return feed


def cut_points(nodes: Sequence[Any], parts: int) -> List[int]:
    """Node indices at which the ``parts`` parts start (after the first), each part with about as many set-up nodes."""
    setup = [i for i, node in enumerate(nodes) if node.op_type in SETUP_OPS]
    if len(setup) < parts:
        raise SystemExit(
            f"--parts: the model has {len(setup)} convolution or attention nodes, fewer than {parts} parts"
        )
    return [setup[len(setup) * k // parts] for k in range(1, parts)]


def crossing(nodes: Sequence[Any], starts: List[int], graph_outputs: Sequence[str]) -> List[List[str]]:
    """For each part, the tensors it makes that a later part uses (or that are the model's outputs)."""
    bounds = [0, *starts, len(nodes)]
    part_of = {}
    for part in range(len(bounds) - 1):
        for node in nodes[bounds[part] : bounds[part + 1]]:
            for name in node.output:
                part_of[name] = part
    outs: List[List[str]] = [[] for _ in range(len(bounds) - 1)]
    for part in range(len(bounds) - 1):
        for node in nodes[bounds[part] : bounds[part + 1]]:
            for name in node.input:
                maker = part_of.get(name)
                if maker is not None and maker < part and name not in outs[maker]:
                    outs[maker].append(name)
    for name in graph_outputs:
        if name not in outs[part_of[name]]:
            outs[part_of[name]].append(name)
    return outs


def prepare(model_path: str, out: Path, parts: int, dims: Dict[str, int], provider: str) -> Dict[str, Any]:
    """Writes the parts of the model into ``out/parts-K`` and checks them against the whole model."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import helper

    from optimum_iobinding.errors import ArgumentError
    from optimum_iobinding.export.cold_parts import graph_order

    providers, options = providers_of(provider)
    model = onnx.load(model_path)
    graph = model.graph
    try:  # stored order, each node after the makers of its inputs: the order the export's cuts use
        nodes = [graph.node[position] for position in graph_order(graph)]
    except ArgumentError as error:
        raise SystemExit(f"--model: {error.reason}") from error
    starts = cut_points(nodes, parts)
    made = crossing(nodes, starts, [value.name for value in graph.output])
    extra = [name for names in made for name in names if name not in {value.name for value in graph.output}]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.ValueInfoProto(name=name) for name in extra)
    whole = ort.InferenceSession(probe.SerializeToString(), providers=providers, provider_options=options)
    feed = feed_for(whole.get_inputs(), dims, random=True)
    names = [value.name for value in whole.get_outputs()]
    values = dict(zip(names, whole.run(None, feed)))
    del whole, probe
    # each tensor's type and shape, from the run
    known = {name: (helper.np_dtype_to_tensor_dtype(value.dtype), list(value.shape)) for name, value in values.items()}
    known.update(
        {name: (helper.np_dtype_to_tensor_dtype(value.dtype), list(value.shape)) for name, value in feed.items()}
    )
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    bounds = [0, *starts, len(nodes)]
    folder = out / f"parts-{parts}"
    folder.mkdir(parents=True, exist_ok=True)
    # integer and small tensors (shapes, indices, a resize's scales) crossing a cut keep their values in the timed
    # runs: zeros could be no shape
    np.savez(folder / "kept-values.npz", **{n: v for n, v in values.items() if v.dtype.kind in "iu" or v.size <= 64})
    paths = []
    for part in range(parts):
        part_nodes = nodes[bounds[part] : bounds[part + 1]]
        made_here = {name for node in part_nodes for name in node.output}
        used = []
        for node in part_nodes:
            for name in node.input:
                if name and name not in made_here and name not in used:
                    used.append(name)
        inputs = [name for name in used if name not in initializers]
        weights = [initializers[name] for name in used if name in initializers]
        sub = helper.make_graph(
            part_nodes,
            f"part-{part}",
            [helper.make_tensor_value_info(name, *known[name]) for name in inputs],
            [helper.make_tensor_value_info(name, *known[name]) for name in made[part]],
            weights,
        )
        part_model = helper.make_model(sub, opset_imports=list(model.opset_import))
        part_model.ir_version = model.ir_version
        path = folder / f"part-{part}.onnx"
        onnx.save_model(
            part_model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=f"part-{part}.data",
        )
        paths.append(str(path))
    # the parts in turn on the same inputs give the whole model's outputs
    chained = dict(feed)
    for path in paths:
        session = ort.InferenceSession(path, providers=providers, provider_options=options)
        outputs = [value.name for value in session.get_outputs()]
        chained.update(
            zip(outputs, session.run(None, {value.name: chained[value.name] for value in session.get_inputs()}))
        )
    differences = {
        value.name: float(
            np.max(np.abs(chained[value.name].astype(np.float64) - values[value.name].astype(np.float64)))
        )
        for value in graph.output
    }
    return {
        "parts": parts,
        "paths": paths,
        "cut_nodes": starts,
        "crossing_tensors": [len(names) for names in made],
        "max_abs_difference": differences,
    }


def timed(work: Callable[[], Any]) -> Tuple[Any, float]:
    start = time.perf_counter()
    result = work()
    return result, time.perf_counter() - start


def side_by_side(works: Sequence[Callable[[], Any]]) -> List[Any]:
    """Each work in a thread of its own, all started together; their results in order (an exception raised here)."""
    outcomes: List[Dict[str, Any]] = [{} for _ in works]

    def run(work: Callable[[], Any], outcome: Dict[str, Any]) -> None:
        try:
            outcome["result"] = work()
        except BaseException as error:  # raised in the caller below
            outcome["error"] = error

    threads = [threading.Thread(target=run, args=pair, name="split-first-run") for pair in zip(works, outcomes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for outcome in outcomes:
        if "error" in outcome:
            raise outcome["error"]
    return [outcome["result"] for outcome in outcomes]


class Bound:
    """A session bound on its device to zeros, or to ``kept``'s values (an ``.npz``) for the inputs it holds: the inputs
    once, the outputs to the device (ORT allocates them)."""

    def __init__(self, session: Any, dims: Dict[str, int], provider: str, kept: Any = None):
        import numpy as np
        import onnxruntime as ort

        device = "cpu" if provider == "cpu" else "cuda"
        self.session = session
        feed = feed_for(session.get_inputs(), dims, random=False)
        if kept is not None:
            with np.load(kept) as stored:
                feed.update({name: stored[name] for name in feed if name in stored.files})
        self.binding = session.io_binding()
        self.values = [ort.OrtValue.ortvalue_from_numpy(array, device, 0) for array in feed.values()]
        for value, spec in zip(self.values, session.get_inputs()):
            self.binding.bind_ortvalue_input(spec.name, value)
        for spec in session.get_outputs():
            self.binding.bind_output(spec.name, device)

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)
        self.binding.synchronize_outputs()


def measure(variant: str, models: List[str], dims: Dict[str, int], provider: str) -> Dict[str, Any]:
    start = time.perf_counter()
    import onnxruntime as ort

    import_s = time.perf_counter() - start
    providers, options = providers_of(provider)

    def made(path: str) -> Tuple[Any, float]:
        return timed(lambda: ort.InferenceSession(path, providers=providers, provider_options=options))

    sessions_and_s, sessions_s = timed(lambda: side_by_side([lambda p=p: made(p) for p in models]))
    stored = Path(models[0]).parent / "kept-values.npz"
    kept = stored if variant != "whole" and stored.is_file() else None
    bound = [Bound(session, dims, provider, kept) for session, _ in sessions_and_s]
    if variant.endswith(":threads"):
        runs, first_s = timed(lambda: side_by_side([lambda b=b: timed(b.run)[1] for b in bound]))
    else:
        runs, first_s = timed(lambda: [timed(b.run)[1] for b in bound])
    _, second_s = timed(lambda: [b.run() for b in bound])
    return {
        "variant": variant,
        "import_s": import_s,
        "sessions_s": sessions_s,
        "each_session_s": [s for _, s in sessions_and_s],
        "first_run_s": first_s,
        "each_first_run_s": runs,
        "second_run_s": second_s,
        "session_plus_first_s": sessions_s + first_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the .onnx model to cut (a UNet)")
    parser.add_argument("--out", type=Path, required=True, help="where the parts and split-first-run.json go")
    parser.add_argument("--parts", default="2,4", help="part counts, comma-separated")
    parser.add_argument("--dims", default=DEFAULT_DIMS, help="the inputs' free dimensions, name=size,…")
    parser.add_argument("--provider", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--models", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    dims = parse_dims(args.dims)
    if args.one:
        print(json.dumps(measure(args.one, args.models.split(","), dims, args.provider)))
        return 0
    counts = [int(count) for count in args.parts.split(",") if count]
    if any(count < 2 for count in counts):
        raise SystemExit(f"--parts: expected counts of 2 or more, got {args.parts!r}")
    args.out.mkdir(parents=True, exist_ok=True)
    split = [prepare(args.model, args.out, count, dims, args.provider) for count in counts]
    for entry in split:
        print({key: entry[key] for key in ("parts", "cut_nodes", "crossing_tensors", "max_abs_difference")}, flush=True)
    variants = [("whole", [args.model])]
    for entry in split:
        variants += [
            (f"parts-{entry['parts']}:serial", entry["paths"]),
            (f"parts-{entry['parts']}:threads", entry["paths"]),
        ]
    rows = []
    for variant, models in variants * 2:  # each twice, in turn
        done = subprocess.run(
            [sys.executable, __file__, "--model", args.model, "--out", str(args.out), "--dims", args.dims]
            + ["--provider", args.provider, "--one", variant, "--models", ",".join(models)],
            capture_output=True,
            text=True,
        )
        row = (
            json.loads(done.stdout.strip().splitlines()[-1])
            if done.returncode == 0
            else {"variant": variant, "error": done.stderr[-1500:]}
        )
        rows.append(row)
        print(row, flush=True)
    (args.out / "split-first-run.json").write_text(
        json.dumps({"command": " ".join(["python", *sys.argv]), "split": split, "rows": rows}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

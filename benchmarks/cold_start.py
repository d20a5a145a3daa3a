"""Cold start of the default pipeline against diffusers' numpy pipeline: imports, load, first image, steady image.

Each variant runs in a fresh process (nothing cached between them but the OS's file cache: run the script once
before the run you keep): the imports timed, ``from_pretrained`` timed, then the first ``--steps``-step image at
batch 1 (sessions created, algorithms searched, graphs captured), then the median of three more (the steady state).
Variants: diffusers' ``OnnxStableDiffusionPipeline`` (numpy; what it creates at load is its sessions), ours with
each cuDNN algorithm search, ours with ORT's graph optimizations at the basic level (the export is already fused
offline), ours after ``pipe.warmup(...)``, ours with the bench's memory sampler running through the load and the
first image (the sources of ``optimum_iobinding.bench.probes.PeakMemory``: ``sampled-cudart``, a thread calling
cudaMemGetInfo every 2 ms, the bench's only source before the sampling process; ``sampled-nvml``, a thread reading
NVML; ``sampled-process``, a child process reading NVML, what the bench does now), ours after one Conv has run through
ONNX Runtime before the load (``conv-preloaded``: cuDNN already loaded), and ours cold again with the first image's
work timed piece by piece (``first_image_timeline``: model parses, weight loading, session creations, each model's
first runs on the host and on the GPU, from the runtime's opt-in timeline), ours with a thread started with the load
that runs one small graph of a Conv, a MatMul and an attention through ONNX Runtime (``prewarm``: cuDNN, cuBLAS and
the attention kernels loaded beside the sessions being made), ours with ORT's graph optimizations at the basic level
at load (``basic``: the fused export was optimized at export), and ours with ONNX Runtime's profiler on every session
(``profile``: each session's load and initialization, its first runs, the first run's slowest nodes and op types
against the second run's, from the profiles written into ``--out``), and ours with ORT's attention kernels chosen by
its ``sdpa_kernel`` provider option (``sdpa-N``: ``sdpa-1`` flash attention, ``sdpa-2`` memory-efficient, ``sdpa-8``
cuDNN's: the first image's cuDNN attention plans against each kernel's steady image), ours with every session made and
first run in the calling thread (``calling-thread``: ``prepare_in_background=False``, no set-up threads), and ours with
the text encoder alone on other attention kernels (``te-sdpa-N``, N as for ``sdpa-N``), and ours with a thread started
with the load that runs torch's own convolution, matrix product and attention (``torch-prewarm``: the CUDA libraries
ORT shares with torch set up beside the sessions being made, no ORT run beside them), and ours with the UNet's
attention shapes set up beside its first run (``attention-prewarm``: :class:`AttentionPrewarm`; whether that can
save anything, ``attention_setup.py`` measures). A variant is
``SEARCH:WARM`` followed by any of these, each once, in any order (``HEURISTIC:cold:calling-thread:timeline``).
For ours, each component's session creations are listed with their seconds (``session_creation_log``).

    python benchmarks/cold_start.py --folder WORK/sd15-fp16-optimized --out OUT/cold-start
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

VARIANTS = (
    "numpy",
    "HEURISTIC:cold",
    "HEURISTIC:cold:sampled-cudart",
    "HEURISTIC:cold:sampled-process",
    "HEURISTIC:cold:conv-preloaded",
    "HEURISTIC:warm",
    "HEURISTIC:cold:timeline",
    "HEURISTIC:cold:prewarm",
    "HEURISTIC:cold:basic",
    "HEURISTIC:cold:profile",
)
# also measured in earlier runs (benchmarks/results/h100/), and still accepted by --variants: EXHAUSTIVE:cold,
# EXHAUSTIVE:warm, HEURISTIC:cold:sampled-nvml, HEURISTIC:cold:unet-native (the UNet's weights
# never owned), HEURISTIC:cold:unet-owned (its weights owned from the start, what the runtime did before it owned
# them only where a second session or LoRA needs them; benchmarks/results/h100/2026-11-24-8b781aa)


def conv_session_run(ort, search: str) -> None:
    """An experiment (the variant ``conv-preloaded``): one fp16 Conv through ONNX Runtime's CUDA provider, run once
    before the timed load, so that cuDNN's libraries and handle are loaded when the pipeline's first UNet run comes.
    The difference to ``HEURISTIC:cold`` bounds what loading them beside the UNet's weights could save."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.random.RandomState(0).randn(320, 4, 3, 3).astype(np.float16), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 4, 64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 320, 64, 64])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # what every ONNX Runtime since 1.10 reads (onnx's newest IR may be newer than ORT's)
    session = ort.InferenceSession(
        model.SerializeToString(), providers=[("CUDAExecutionProvider", {"cudnn_conv_algo_search": search})]
    )
    session.run(None, {"x": np.ones((1, 4, 64, 64), np.float16)})


def library_model() -> bytes:
    """One small fp16 graph of a Conv, a MatMul and a MultiHeadAttention (cuDNN, cuBLAS and the attention kernels)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.RandomState(0)
    weights = [
        numpy_helper.from_array(rng.randn(320, 4, 3, 3).astype(np.float16), "w"),
        numpy_helper.from_array(rng.randn(320, 960).astype(np.float16), "m"),
        numpy_helper.from_array(np.array([1, 4096, 320], np.int64), "shape"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["c", "shape"], ["t"]),
        helper.make_node("MatMul", ["t", "m"], ["qkv"]),
        helper.make_node("Split", ["qkv"], ["q", "k", "v"], axis=2, num_outputs=3),
        helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["y"], domain="com.microsoft", num_heads=8),
    ]
    graph = helper.make_graph(
        nodes,
        "libraries",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 4, 64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 4096, 320])],
        weights,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 8
    return model.SerializeToString()


def library_session_run(ort) -> None:
    """An experiment (the variant ``prewarm``): :func:`library_model` run once through ONNX Runtime's CUDA provider in a
    thread started with the load, so that cuDNN, cuBLAS and the attention kernels' modules are loaded while the
    pipeline's sessions are made, not in the UNet's first run."""
    import numpy as np

    session = ort.InferenceSession(
        library_model(), providers=[("CUDAExecutionProvider", {"cudnn_conv_algo_search": "HEURISTIC"})]
    )
    session.run(None, {"x": np.ones((1, 4, 64, 64), np.float16)})


class AttentionPrewarm:
    """An experiment (the variant ``attention-prewarm``): each attention shape of SD 1.5's UNet at 512² with guidance
    (``attention_setup.py``'s graphs) run once, each in a session and a thread of its own, under the runtime's device
    gate: the sessions made beside the pipeline's sessions being made, their runs beside the UNet's first run (ORT's
    CUDA provider crashed with a session made beside a run). What cuDNN keeps between sessions, if anything, is then
    there when the UNet's attention nodes come. The threads stay until :meth:`close`: a thread that ends frees its
    CUDA context, and a free beside a capture would fail it."""

    def __init__(self, ort, providers, packed: bool = True):
        import threading

        self._ort, self._providers, self._packed = ort, providers, packed
        self._done = threading.Event()
        self.threads: list = []
        self.ran: list = []  # (kind, tokens, head size) of each shape run
        self.errors: list = []  # what a thread raised: the row says it

    def start(self) -> None:
        import threading

        from attention_setup import SHAPES, attention_model, feed_of

        from optimum_iobinding.runtime.cuda_policy import DEVICE_SETUP

        def one(kind: str, tokens: int, head_size: int) -> None:
            try:
                with DEVICE_SETUP.build():
                    model = attention_model(kind, tokens, head_size, self._packed)
                    session = self._ort.InferenceSession(model, providers=self._providers)
                with DEVICE_SETUP.first_run():
                    session.run(None, feed_of(session))
                self.ran.append((kind, tokens, head_size))
            except Exception as error:  # an experiment's failure is reported, not raised into the load
                self.errors.append(f"{kind} {tokens}×{head_size}: {error}")
            self._done.wait()  # the session and this thread's CUDA context live until close()

        for tokens, head_size in SHAPES:
            for kind in ("self", "cross"):
                thread = threading.Thread(
                    target=one, args=(kind, tokens, head_size), name=f"attention-prewarm {kind} {tokens}", daemon=True
                )
                thread.start()
                self.threads.append(thread)

    def close(self) -> None:
        self._done.set()
        for thread in self.threads:
            thread.join()


def torch_libraries_run(torch) -> None:
    """An experiment (the variant ``torch-prewarm``): torch's own float16 convolution (cuDNN), matrix product (cuBLAS)
    and attention run once in a thread beside the load, no ONNX Runtime session involved: the CUDA libraries that ORT's
    provider shares with torch (the same cuDNN and cuBLAS files) loaded and set up before the first run needs them."""
    device = torch.device("cuda", 0)
    x = torch.randn(2, 64, 64, 64, device=device, dtype=torch.float16).to(memory_format=torch.channels_last)
    w = torch.randn(64, 64, 3, 3, device=device, dtype=torch.float16).to(memory_format=torch.channels_last)
    torch.nn.functional.conv2d(x, w, padding=1)
    a = torch.randn(512, 512, device=device, dtype=torch.float16)
    a @ a
    q = torch.randn(2, 8, 1024, 64, device=device, dtype=torch.float16)
    torch.nn.functional.scaled_dot_product_attention(q, q, q)
    torch.cuda.synchronize(device)


def profile_summary(path: str) -> dict:
    """What ONNX Runtime's profile of one session says about its start: the model's loading and the session's
    initialization, its first and second runs, and the first run's slowest nodes and op types (host time: a node's
    first launch includes what loading its kernels and libraries costs) beside the second run's."""
    import collections

    events = json.loads(Path(path).read_text())
    # the model: the first segment most of its node names start with (``/unet/…``, ``/text_encoder/…``, ``/decoder/…``)
    segments = collections.Counter(
        e["name"].split("/")[1] for e in events if e.get("cat") == "Node" and e.get("name", "").startswith("/")
    )
    session = {e["name"]: e["dur"] / 1e6 for e in events if e.get("cat") == "Session" and "dur" in e}
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    summary = {
        "file": Path(path).name,
        "model": segments.most_common(1)[0][0] if segments else None,
        "session_s": session,
        "runs_s": [(end - ts) / 1e6 for ts, end in runs[:4]],
    }
    nodes = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    for index, label in ((0, "first_run"), (1, "second_run")):
        if len(runs) <= index:
            break
        begin, end = runs[index]
        inside = [e for e in nodes if begin <= e["ts"] <= end]
        by_op = collections.Counter()
        for e in inside:
            by_op[e.get("args", {}).get("op_name", "?")] += e["dur"] / 1e6
        summary[label] = {
            "nodes_s": sum(e["dur"] for e in inside) / 1e6,
            "by_op_s": dict(by_op.most_common(12)),
            "slowest": [
                (e["name"][: -len("_kernel_time")], e["dur"] / 1e6)
                for e in sorted(inside, key=lambda e: -e["dur"])[:12]
            ],
        }
    return summary


# a timeline step's label: what, the model's path, and what follows it (see optimum_iobinding.runtime.timeline)
STEP_LABEL = re.compile(
    r"(?P<what>parse|weights|session|run \d+) (?P<path>.+?)"
    r"(?P<rest>(?: \(declared inputs\)| \(host\))?(?: graph)?(?: fixed dims)?(?: failed)?)$"
)


def component(path) -> str:
    """A model's component folder (``unet`` for ``…/unet/model.onnx``): how the timeline's rows name it."""
    return Path(str(path)).parent.name or str(path)


def short_label(what: str) -> str:
    """A timeline step's label with the model's path shortened to its component folder."""
    match = STEP_LABEL.match(what)
    return f"{match['what']} {component(match['path'])}{match['rest']}" if match else what


def record_timeline(torch) -> tuple:
    """Records the runtime's set-up work on the host clock, without adding a wait, through its opt-in timeline
    (``optimum_iobinding.runtime.timeline``): parsing a model file, weight loading, session creation (made or
    refused), and each model's first three runs (host return, and when the GPU finished them, from CUDA events
    enqueued on the model's stream after each run and read after the image). The recording starts here. Returns
    ``(start, finish)``: ``start()`` at the image's start, ``finish()`` after it (it ends the recording), giving the
    rows ``[from s, to s, what, thread]`` (each model named by its component folder), sorted by their end."""
    import contextlib

    from optimum_iobinding.runtime import timeline

    events, origin = [], {}

    def on_run(model, index: int) -> None:
        if model.stream is not None:
            done = torch.cuda.Event(enable_timing=True)
            done.record(model.stream)
            events.append((done, f"run {index} {component(model.model_path)} (GPU done)"))

    recording = contextlib.ExitStack()
    record = recording.enter_context(timeline.recording(on_run=on_run))

    def start():
        origin["t"] = time.perf_counter()
        if torch.cuda.is_available():
            origin["event"] = torch.cuda.Event(enable_timing=True)
            origin["event"].record()

    def finish():
        recording.close()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = origin["t"]
        table = [
            [round(step.begin - t0, 4), round(step.end - t0, 4), short_label(step.what), step.thread]
            for step in record.steps
        ]
        table += [[None, round(origin["event"].elapsed_time(event) / 1000, 4), what, "GPU"] for event, what in events]
        return sorted(table, key=lambda row: row[1])

    return start, finish


PROFILE_FOLDER = "."  # where the variant ``profile`` writes ONNX Runtime's profiles (``--out``)


def measure(folder: str, variant: str, steps: int, size: int) -> dict:
    start = time.perf_counter()
    import onnxruntime as ort
    import torch

    from optimum_iobinding import OnnxStableDiffusionPipeline

    if variant == "numpy":
        from optimum_iobinding.pipelines import load_numpy_pipeline
    import_s = time.perf_counter() - start
    torch.cuda.init()
    start = time.perf_counter()
    timeline = sampler = preload_s = attention = None
    profiled = False
    if variant == "numpy":
        pipe = load_numpy_pipeline(folder)
        search = warm = None
    else:
        search, warm, *level = variant.split(":")  # then any of the levels below, each once, in any order

        def take(name: str) -> bool:
            if name in level:
                level.remove(name)
                return True
            return False

        def take_prefixed(prefix: str) -> Optional[str]:
            for given in level:
                if given.startswith(prefix):
                    level.remove(given)
                    return given[len(prefix) :]
            return None

        if take("timeline"):
            timeline = record_timeline(torch)
        if take("conv-preloaded"):
            begin = time.perf_counter()
            conv_session_run(ort, search)
            preload_s = time.perf_counter() - begin
        source = take_prefixed("sampled-")
        if source is not None:
            # the bench's memory sampler running through the load and the first image, as in a bench
            from optimum_iobinding.bench.probes import PeakMemory

            sampler = PeakMemory(torch.device("cuda", 0), source=source)
            sampler.__enter__()
        options = component_options = prewarm = None
        provider_options = {"cudnn_conv_algo_search": search}
        kernels = take_prefixed("sdpa-")
        if kernels is not None:
            # ORT's attention kernels for MultiHeadAttention (its sdpa_kernel bits: 1 flash, 2 memory-efficient, 8
            # cuDNN's flash, 16 unfused), instead of ORT's own choice
            provider_options["sdpa_kernel"] = kernels
        if take("prewarm"):
            import threading

            prewarm = threading.Thread(target=library_session_run, args=(ort,), name="prewarm")
        if take("torch-prewarm"):
            import threading

            prewarm = threading.Thread(target=torch_libraries_run, args=(torch,), name="torch-prewarm")
        if take("attention-prewarm"):
            attention = AttentionPrewarm(ort, [("CUDAExecutionProvider", provider_options)])
        if take("profile"):
            options = ort.SessionOptions()
            options.enable_profiling = True
            options.profile_file_prefix = str(Path(PROFILE_FOLDER) / "ort-profile")
            profiled = True
        if take("basic"):
            options = options or ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        if take("unet-native"):
            # the UNet's one session made by ORT from the file, its weights never owned (the default makes the same
            # session, and owns the weights only when a second session or LoRA needs them)
            component_options = {"unet": {"share_weights": False}}
        if take("unet-owned"):
            # the runtime's earlier default: the UNet's weights parsed and uploaded by the project, then handed to ORT
            component_options = {"unet": {"share_weights": True}}
        # every session made, and first run, in the calling thread: no set-up threads
        in_background = not take("calling-thread")
        text_encoder_kernels = take_prefixed("te-sdpa-")
        if level:
            raise ValueError(f"variant: unknown {variant!r}")
        start = time.perf_counter()  # what a variant does before (the experiment's preload) is not the load
        if prewarm is not None:
            prewarm.start()
        pipe = OnnxStableDiffusionPipeline.from_pretrained(
            folder,
            provider="CUDAExecutionProvider",
            provider_options=provider_options,
            sess_options=options,
            component_options=component_options,
            prepare_in_background=in_background,
        )
        if attention is not None:  # once the load has started the UNet's session: beside it, not before it
            attention.start()
        if text_encoder_kernels is not None:
            # the text encoder alone with other attention kernels: a pipeline on the loaded components with another
            # text encoder (the loaded one's session, started by the load, is dropped; the comparison is pessimistic)
            from optimum_iobinding import IOBindingORTModel

            text_encoder = IOBindingORTModel.from_pretrained(
                Path(folder) / "text_encoder",
                provider="CUDAExecutionProvider",
                provider_options={**provider_options, "sdpa_kernel": text_encoder_kernels},
                sess_options=options,
            )
            if in_background:
                text_encoder.prepare(wait=False)
            pipe = OnnxStableDiffusionPipeline(**{**pipe.components, "text_encoder": text_encoder})
            pipe.prepare_in_background = in_background
    pipe.set_progress_bar_config(disable=True)
    load_s = time.perf_counter() - start
    warmup_s = None
    if warm == "warm":
        start = time.perf_counter()
        pipe.warmup(heights=size, batch_sizes=1)
        torch.cuda.synchronize()
        warmup_s = time.perf_counter() - start

    def image() -> float:
        start = time.perf_counter()
        pipe("a photo of an astronaut", height=size, width=size, num_inference_steps=steps, output_type="np")
        torch.cuda.synchronize()
        return time.perf_counter() - start

    if timeline is not None:
        timeline[0]()
    first_s = image()
    if sampler is not None:
        sampler.__exit__(None, None, None)
    steady_s = statistics.median(image() for _ in range(3))
    if attention is not None:
        attention.close()
    row = {
        "variant": variant,
        "search": search,
        "warmup": warm == "warm",
        "import_s": import_s,
        "load_s": load_s,
        "warmup_s": warmup_s,
        "first_image_s": first_s,
        "steady_image_s": steady_s,
        "load_plus_first_s": load_s + first_s,
        "first_over_steady": first_s / steady_s,
    }
    if sampler is not None:
        row["memory_sampled_through"] = sampler.source
        row["sampled_peak_mib"] = sampler.peak / 2**20
    if attention is not None:
        row["attention_prewarm_errors"] = attention.errors
    if preload_s is not None:
        row["conv_preload_s"] = preload_s
    if variant != "numpy":
        row["sessions_created"] = pipe.sessions_created
        row["session_creation_log"] = {name: model.session_creation_log for name, model in pipe.onnx_models.items()}
    if timeline is not None:
        row["first_image_timeline"] = timeline[1]()
    if profiled:
        # ORT writes a session's profile when the session goes: the pipeline's sessions end here
        import gc

        del pipe
        gc.collect()
        row["profiles"] = [profile_summary(path) for path in sorted(Path(PROFILE_FOLDER).glob("ort-profile*.json"))]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        global PROFILE_FOLDER
        PROFILE_FOLDER = args.out
        Path(args.out).mkdir(parents=True, exist_ok=True)
        print(json.dumps(measure(args.folder, args.one, args.steps, args.size)))
        return 0
    rows = []
    for variant in args.variants.split(","):
        done = subprocess.run(
            [
                sys.executable,
                __file__,
                "--folder",
                args.folder,
                "--out",
                args.out,
                "--steps",
                str(args.steps),
                "--size",
                str(args.size),
                "--one",
                variant,
            ],
            capture_output=True,
            text=True,
        )
        rows.append(
            json.loads(done.stdout.strip().splitlines()[-1])
            if done.returncode == 0
            else {"variant": variant, "error": done.stderr[-1500:]}
        )
        print(rows[-1], flush=True)
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cold-start.json").write_text(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(0),
                "command": " ".join(["python", *sys.argv]),
                "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                "rows": rows,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the host's time goes in one step of the default (graph) loop, and what makes whole calls scatter.

On the GPU machine, from the project root (after .device/w/install.sh):
    python3 benchmarks/host_path.py --model small --work /tmp/bench-work --out OUT

For the model's fp16 ORT-fused export (made with the bench's export if missing) and the default pipeline (no graph
argument), it writes OUT/host-path-<model>.json and prints:
  * the denoising loop's per-step ms: how long the host takes to enqueue a step and when the GPU is done;
  * the host µs of each piece of a step, each timed as 20 back-to-back enqueues without a wait: our UNet call, the
    captured graph's bare ``run_with_iobinding`` (ORT's own cost), the scheduler step, the guidance arithmetic, the
    ``torch.cat`` of the guidance batch and an empty kernel (this host's launch cost). Twenty UNet graphs outrun
    the GPU: their figure includes the host's wait for room in the launch queue (a 2-step loop shows the unhindered
    cost);
  * the CUDA runtime calls of one loop by host time (``cudaGraphLaunch``, ``cudaLaunchKernel`` … from the
    profiler), and the Python functions of three loops by own time (cProfile);
  * 40 whole pipeline calls with the garbage collector's collections during each (generation, ms), then 40 with
    it off, interleaved in blocks of 10: whether the scatter of whole calls follows the collector;
  * with ``--threads``: 60 whole calls of the default pipeline against 60 of one made with ORT's intra-op pool at
    one thread (``SessionOptions.intra_op_num_threads = 1``: no worker threads spinning after each run), in
    interleaved blocks of 10, each call split at the first and last step (host clock and CUDA events), and the
    process's thread count with each;
  * with ``--split``: whole pipeline calls against bare ``denoise`` loops, interleaved in one process (20 rounds of
    30 and 2 steps each): the per-step ms by difference of medians, as the bench takes it, and the GPU's own per-step
    ms inside each call (CUDA events after the first and the last step, (last − first) / (steps − 1)), which has no
    difference of two noisy medians in it; then one of each under torch's profiler: the GPU's busy time, its idle
    gaps (the longest with the work around them) and the kernels both run, by name, with their µs in each.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from few_step_loop import bare_loop  # noqa: E402 — this folder is the script's own, first on sys.path


def host_us(run, count: int = 20) -> float:
    """Host µs per call of ``count`` back-to-back calls, the GPU drained before and after (not counted)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        run()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / count * 1e6


def main() -> None:
    from optimum_iobinding import OnnxStableDiffusionPipeline
    from optimum_iobinding.bench.zoo import MODEL_SIZES, PROMPT, ensure_export, recipe_of, set_recipe_scheduler

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=("tiny", "small", "sd15"))
    parser.add_argument("--work", default="/tmp/bench-work")
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", action="store_true", help="also compare ORT's intra-op pool at one thread")
    parser.add_argument("--split", action="store_true", help="also compare whole calls with bare loops per step")
    args = parser.parse_args()

    folder = ensure_export(args.model, "fp16", "optimized", Path(args.work))
    recipe = recipe_of(args.model)
    steps = recipe["steps"] or 30
    size = MODEL_SIZES[args.model]
    guidance = recipe["guidance"]
    pipe = OnnxStableDiffusionPipeline.from_pretrained(folder, provider="CUDAExecutionProvider")
    set_recipe_scheduler(pipe, args.model)
    pipe.set_progress_bar_config(disable=True)

    def whole() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            pipe(
                PROMPT,
                height=size,
                width=size,
                num_inference_steps=steps,
                guidance_scale=guidance,
                generator=torch.Generator("cuda").manual_seed(0),
                output_type="np",
            )
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1000

    whole()  # captures, cuDNN algorithm search
    result: dict = {
        "model": args.model,
        "steps": steps,
        "size": size,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    import onnxruntime as ort

    result["onnxruntime"] = ort.__version__

    embeds, latents0, loop, timed = bare_loop(pipe, PROMPT, guidance, size)
    with torch.cuda.stream(pipe.stream), torch.inference_mode():
        loop(steps)
        long_runs = [timed(steps) for _ in range(7)]
        short_runs = [timed(2) for _ in range(7)]
        result["loop_per_step_ms"] = {
            label: (statistics.median(r[i] for r in long_runs) - statistics.median(r[i] for r in short_runs))
            / (steps - 2)
            for i, label in enumerate(("host_enqueue", "gpu_done"))
        }
        result["loop_ms"] = {"long": long_runs, "short": short_runs}

        # the pieces of one step, on the loop's own inputs
        batch = embeds.shape[0]
        timesteps = pipe.set_timesteps(steps)
        t = timesteps[0]
        timestep = pipe.timestep_inputs(timesteps, batch)[0]
        latents = latents0.clone()
        model_input = torch.cat([latents] * batch)
        unet_inputs = {"sample": model_input, "timestep": timestep, "encoder_hidden_states": embeds}
        noise = pipe.unet(**unet_inputs)[0].clone()
        runner = pipe.unet.graph_runner({name: tuple(v.shape) for name, v in unet_inputs.items()})
        pieces = {}
        pieces["unet_call"] = host_us(lambda: pipe.unet(**unet_inputs))
        if runner is not None:
            pieces["graph_run_with_iobinding"] = host_us(
                lambda: runner.session.run_with_iobinding(runner.binding, runner.run_options)
            )
            pieces["graph_runner_run"] = host_us(lambda: runner.run(unet_inputs))
        step_kwargs = pipe.scheduler_step_kwargs(None, 0.0)
        pieces["scheduler_step"] = host_us(
            lambda: pipe.scheduler.step(noise[:1], t, latents, **step_kwargs, return_dict=False)
        )

        def cfg():
            uncond, text = noise.chunk(2)
            return uncond + guidance * (text - uncond)

        pieces["guidance_arithmetic"] = host_us(cfg)
        pieces["cat_guidance_batch"] = host_us(lambda: torch.cat([latents] * 2))
        one = torch.zeros(1, device="cuda")
        pieces["empty_kernel"] = host_us(lambda: one.add_(0))
        pieces["stream_wait_pair"] = host_us(
            lambda: (
                pipe.stream.wait_stream(torch.cuda.current_stream()),
                torch.cuda.current_stream().wait_stream(pipe.stream),
            )
        )
        result["host_us_per_call"] = pieces

        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            loop(steps)
            torch.cuda.synchronize()
        runtime: dict = {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CPU and event.name.startswith(("cuda", "cu")):
                total, count = runtime.get(event.name, (0.0, 0))
                runtime[event.name] = (total + event.time_range.elapsed_us(), count + 1)
        result["cuda_runtime_host_us_one_loop"] = {
            name: {"us": round(us, 1), "count": count, "us_per_step": round(us / steps, 1)}
            for name, (us, count) in sorted(runtime.items(), key=lambda item: -item[1][0])[:15]
        }

        profiler = cProfile.Profile()
        torch.cuda.synchronize()
        profiler.enable()
        for _ in range(3):
            loop(steps)
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        result["cprofile_three_loops"] = text.getvalue()

    # the scatter of whole calls, and whether the garbage collector explains it
    collections: list = []
    started: dict = {}

    def watch(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            collections.append(
                (info["generation"], (time.perf_counter() - started.pop("t", time.perf_counter())) * 1000)
            )

    gc.callbacks.append(watch)
    calls = {"gc_on": [], "gc_off": []}
    try:
        for block in range(8):
            label = "gc_on" if block % 2 == 0 else "gc_off"
            if label == "gc_off":
                gc.disable()
            for _ in range(10):
                collections.clear()
                ms = whole()
                calls[label].append({"ms": ms, "collections": list(collections)})
            gc.enable()
    finally:
        gc.callbacks.remove(watch)
    result["whole_calls"] = calls
    result["whole_calls_summary"] = {
        label: {
            "median_ms": statistics.median(c["ms"] for c in rows),
            "min_ms": min(c["ms"] for c in rows),
            "max_ms": max(c["ms"] for c in rows),
            "calls_with_collection": sum(1 for c in rows if c["collections"]),
        }
        for label, rows in calls.items()
    }

    if args.split:
        result["split"] = split_whole_and_loop(pipe, steps, size, guidance, loop)
    if args.threads:
        result["threads"] = compare_threads(pipe, folder, args.model, steps, size, guidance)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"host-path-{args.model}.json").write_text(json.dumps(result, indent=2))
    shown = {
        k: v
        for k, v in result.items()
        if k not in ("loop_ms", "cprofile_three_loops", "whole_calls", "threads", "split")
    }
    if "threads" in result:
        shown["threads"] = {k: v for k, v in result["threads"].items() if k != "calls"}
    if "split" in result:
        shown["split"] = result["split"]["summary"]
    print(json.dumps(shown, indent=2))
    print(result["cprofile_three_loops"])


def split_whole_and_loop(pipe, steps: int, size: int, guidance: float, bare, rounds: int = 20) -> dict:
    """Per-step ms of whole calls and of bare loops, in one process, interleaved (see the module's docstring)."""
    from optimum_iobinding.bench.zoo import PROMPT

    def events_at_steps(n: int):
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def on_step(_pipe, i, _t, tensors):
            if i == 0:
                first.record(pipe.stream)
            if i == n - 1:
                last.record(pipe.stream)
            return tensors

        return on_step, first, last

    def call_whole(n: int, on_step) -> None:
        with torch.inference_mode():
            pipe(
                PROMPT,
                height=size,
                width=size,
                num_inference_steps=n,
                guidance_scale=guidance,
                generator=torch.Generator("cuda").manual_seed(0),
                output_type="np",
                callback_on_step_end=on_step,
            )

    def measured(run):
        """``run(n, on_step)`` timed: (ms of the call, the GPU's ms per step between the first and last step)."""

        def timed(n: int):
            on_step, first, last = events_at_steps(n)
            torch.cuda.synchronize()
            start = time.perf_counter()
            run(n, on_step)
            torch.cuda.synchronize()
            return (time.perf_counter() - start) * 1000, first.elapsed_time(last) / (n - 1)

        return timed

    whole = measured(call_whole)
    loop = measured(lambda n, on_step: bare(n, callback_on_step_end=on_step))

    runs: dict = {"whole": {steps: [], 2: []}, "loop": {steps: [], 2: []}}
    for run in (whole, loop):
        run(steps)
    for _ in range(rounds):
        for label, run in (("whole", whole), ("loop", loop)):
            for n in (steps, 2):
                runs[label][n].append(run(n))
    summary = {}
    timelines = {"whole": gpu_timeline(lambda: whole(steps)), "loop": gpu_timeline(lambda: loop(steps))}
    for label, by_steps in runs.items():
        long_ms = statistics.median(ms for ms, _ in by_steps[steps])
        short_ms = statistics.median(ms for ms, _ in by_steps[2])
        summary[label] = {
            "per_step_by_difference_ms": (long_ms - short_ms) / (steps - 2),
            "per_step_gpu_events_ms": statistics.median(gpu for _, gpu in by_steps[steps]),
            "median_ms": {steps: long_ms, 2: short_ms},
        }
        summary[label]["gpu_timeline"] = {k: v for k, v in timelines[label].items() if k != "by_kernel"}
    whole_kernels, loop_kernels = (timelines[label].get("by_kernel", {}) for label in ("whole", "loop"))
    # the kernels both run (the UNet graph's, the step's): (µs, count) in each, the largest differences first
    summary["shared_kernels_us"] = sorted(
        ((name, whole_kernels[name], loop_kernels[name]) for name in set(whole_kernels) & set(loop_kernels)),
        key=lambda row: -abs(row[1][0] - row[2][0]),
    )[:15]
    return {
        "summary": summary,
        "runs": {label: {str(n): rows for n, rows in by_steps.items()} for label, by_steps in runs.items()},
        "timelines": timelines,
    }


def gpu_timeline(run) -> dict:
    """One ``run()`` under torch's profiler: what the GPU did, from its first to its last kernel or copy. Busy and
    span ms, the idle gaps over 2 µs (count, total, the 8 longest with the work before and after them) and, by
    kernel name, (total µs, count)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    work = sorted(
        (event.time_range.start, event.time_range.end, event.name)
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    )
    if not work:
        return {"error": "the profiler saw no GPU work"}
    busy, gaps, by_kernel = 0.0, [], {}
    reach = work[0][0]
    for index, (start, end, name) in enumerate(work):
        if start > reach + 2:
            gaps.append((start - reach, work[index - 1][2][:70], name[:70]))
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
        total, count = by_kernel.get(name[:90], (0.0, 0))
        by_kernel[name[:90]] = (total + end - start, count + 1)
    return {
        "busy_ms": busy / 1000,
        "span_ms": (reach - work[0][0]) / 1000,
        "gaps": len(gaps),
        "gaps_ms": sum(gap for gap, _, _ in gaps) / 1000,
        "longest_gaps_us": sorted(gaps, key=lambda gap: -gap[0])[:8],
        "by_kernel": by_kernel,
    }


def compare_threads(pipe, folder, model: str, steps: int, size: int, guidance: float) -> dict:
    """Whole calls of ``pipe`` (default options) and of the same pipeline with one intra-op thread, interleaved."""
    import os

    import onnxruntime as ort

    from optimum_iobinding import OnnxStableDiffusionPipeline
    from optimum_iobinding.bench.zoo import PROMPT, set_recipe_scheduler

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    before = threads()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    single = OnnxStableDiffusionPipeline.from_pretrained(folder, provider="CUDAExecutionProvider", sess_options=options)
    set_recipe_scheduler(single, model)
    single.set_progress_bar_config(disable=True)
    pipes = {"default": pipe, "one_thread": single}

    def call(p) -> dict:
        marks = {}
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]

        def on_step(_pipe, i, _t, tensors):
            if i in (0, steps - 1):
                marks[i] = time.perf_counter()
                events[1 if i == 0 else 2].record(p.stream)
            return tensors

        torch.cuda.synchronize()
        start = time.perf_counter()
        events[0].record(p.stream)
        with torch.inference_mode():
            p(
                PROMPT,
                height=size,
                width=size,
                num_inference_steps=steps,
                guidance_scale=guidance,
                generator=torch.Generator("cuda").manual_seed(0),
                output_type="np",
                callback_on_step_end=on_step,
            )
        events[3].record(p.stream)
        torch.cuda.synchronize()
        end = time.perf_counter()
        return {
            "ms": (end - start) * 1000,
            "host_ms": [
                (marks[0] - start) * 1000,
                (marks[steps - 1] - marks[0]) * 1000,
                (end - marks[steps - 1]) * 1000,
            ],
            "gpu_ms": [
                events[0].elapsed_time(events[1]),
                events[1].elapsed_time(events[2]),
                events[2].elapsed_time(events[3]),
            ],
        }

    for p in pipes.values():
        call(p)
    calls = {label: [] for label in pipes}
    for block in range(12):
        label = ("default", "one_thread")[block % 2]
        calls[label] += [call(pipes[label]) for _ in range(10)]
    summary = {
        label: {
            "median_ms": statistics.median(c["ms"] for c in rows),
            "min_ms": min(c["ms"] for c in rows),
            "max_ms": max(c["ms"] for c in rows),
            "over_1.1x_median": sum(1 for c in rows if c["ms"] > 1.1 * statistics.median(r["ms"] for r in rows)),
        }
        for label, rows in calls.items()
    }
    return {
        "threads_before_second_pipeline": before,
        "threads_with_both": threads(),
        "summary": summary,
        "calls": calls,
    }


if __name__ == "__main__":
    main()

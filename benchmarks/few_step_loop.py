"""Where a few-step graph loop spends the time above its GPU floor.

On the GPU machine, from the project root (after .device/w/install.sh):
    python3 benchmarks/few_step_loop.py --model turbo --work /tmp/bench-work --out OUT

For the model's fp16 ``--optimize cuda`` export (made by optimum_iobinding.bench.zoo's export cache if missing),
with the model's bench recipe (scheduler, guidance, steps) and ``cuda_graph=True``, it writes
OUT/few-step-<model>.json with:
  * per-step ms of the denoising loop alone (``pipe.denoise``; (N-step − 1-step) / (N − 1), median of 5), both the
    time the host takes to enqueue it and the time until the GPU is done,
  * the UNet's own floor (back-to-back calls of the graph model on the same inputs),
  * per-step ms of the whole pipeline as the bench times it, over 20 interleaved N-step and 1-step calls each,
  * the host waits inside one loop (CUDA sync calls and synchronous copies, with the Python frames behind them),
  * the GPU kernels of one loop by total time (CUPTI sees ORT's kernels and those of the captured graphs).
Its SD-Turbo results: benchmarks/results/h100/2026-11-22-589dfef (the gap it looks into: 2026-11-22-619b03d).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def bare_loop(pipe, prompt: str, guidance: float, size: int):
    """The denoising loop alone, on prompt embeddings and initial latents made once here (on the pipeline's stream).

    Returns ``(embeds, latents, loop, timed)``: ``loop(n, callback_on_step_end=None)`` runs ``n`` DDIM-style steps
    of ``pipe.denoise``; ``timed(n)`` runs it once, the GPU drained before, and returns (ms until the host had
    enqueued it, ms until the GPU was done)."""
    with torch.cuda.stream(pipe.stream), torch.inference_mode():
        embeds = pipe.encode_prompt(prompt, 1, guidance > 1)
        latents = pipe.prepare_latents((1, 4, size // 8, size // 8), embeds.dtype, np.random.RandomState(0))

    def loop(n: int, callback_on_step_end=None):
        with torch.cuda.stream(pipe.stream), torch.inference_mode():
            timesteps = pipe.set_timesteps(n)
            kwargs = pipe.scheduler_step_kwargs(torch.Generator("cuda").manual_seed(0), 0.0)
            return pipe.denoise(latents, timesteps, embeds, guidance, kwargs, callback_on_step_end=callback_on_step_end)

    def timed(n: int):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loop(n)
        enqueued = time.perf_counter()
        torch.cuda.synchronize()
        return (enqueued - start) * 1000, (time.perf_counter() - start) * 1000

    return embeds, latents, loop, timed


def main() -> None:
    from optimum_iobinding import OnnxStableDiffusionPipeline
    from optimum_iobinding.bench.probes import host_waits
    from optimum_iobinding.bench.zoo import MODEL_SIZES, PROMPT, ensure_export, recipe_of, set_recipe_scheduler

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="turbo", choices=("turbo", "tiny", "small", "sd15"))
    parser.add_argument("--work", default="/tmp/bench-work")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    folder = ensure_export(args.model, "fp16", "optimized", Path(args.work))
    recipe = recipe_of(args.model)
    steps = recipe["steps"] or 30
    size = MODEL_SIZES[args.model]
    pipe = OnnxStableDiffusionPipeline.from_pretrained(folder, provider="CUDAExecutionProvider", cuda_graph=True)
    set_recipe_scheduler(pipe, args.model)
    pipe.set_progress_bar_config(disable=True)
    guidance = recipe["guidance"]
    # the whole pipeline once, decoder included: captures, cuDNN algorithm search
    pipe(
        PROMPT,
        height=size,
        width=size,
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=torch.Generator("cuda").manual_seed(0),
        output_type="np",
    )

    embeds, _, loop, timed = bare_loop(pipe, PROMPT, guidance, size)
    with torch.cuda.stream(pipe.stream), torch.inference_mode():
        loop(steps)
        long_runs = [timed(steps) for _ in range(5)]
        short_runs = [timed(1) for _ in range(5)]

        def per_step(index: int) -> float:
            return (
                statistics.median(r[index] for r in long_runs) - statistics.median(r[index] for r in short_runs)
            ) / (steps - 1)

        # the UNet alone, back to back on the loop's inputs
        batch = embeds.shape[0]
        sample = torch.randn(batch, 4, size // 8, size // 8, device="cuda", dtype=embeds.dtype)
        timestep = pipe.timestep_inputs(pipe.set_timesteps(steps), batch)[0]
        for _ in range(3):
            pipe.unet(sample=sample, timestep=timestep, encoder_hidden_states=embeds)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            pipe.unet(sample=sample, timestep=timestep, encoder_hidden_states=embeds)
        torch.cuda.synchronize()
        unet_ms = (time.perf_counter() - start) * 1000 / 50

        def whole(n: int) -> float:  # the whole pipeline, as the bench times it
            torch.cuda.synchronize()
            start = time.perf_counter()
            pipe(
                PROMPT,
                height=size,
                width=size,
                num_inference_steps=n,
                guidance_scale=guidance,
                generator=torch.Generator("cuda").manual_seed(0),
                output_type="np",
            )
            torch.cuda.synchronize()
            return (time.perf_counter() - start) * 1000

        whole_runs: dict = {steps: [], 1: []}
        for _ in range(2):  # interleaved, so that a drift of the clocks hits both
            for n in (steps, 1):
                whole_runs[n] += [whole(n) for _ in range(10)]

        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        waits = host_waits(lambda: loop(steps))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            loop(steps)
            torch.cuda.synchronize()
    events = prof.events()
    kernels: dict = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total, count = kernels.get(e.name, (0.0, 0))
            kernels[e.name] = (total + e.time_range.elapsed_us() / 1000, count + 1)
    top = sorted(kernels.items(), key=lambda item: -item[1][0])[:25]
    result = {
        "model": args.model,
        "recipe": recipe,
        "steps": steps,
        "size": size,
        "device": torch.cuda.get_device_name(0),
        "loop_ms_per_step_gpu_done": per_step(1),
        "loop_ms_per_step_host_enqueue": per_step(0),
        "loop_ms": {"long": long_runs, "short": short_runs},
        "unet_back_to_back_ms": unet_ms,
        "pipeline_ms_median": {n: statistics.median(r) for n, r in whole_runs.items()},
        "pipeline_ms_per_step": (statistics.median(whole_runs[steps]) - statistics.median(whole_runs[1])) / (steps - 1),
        "pipeline_ms": whole_runs,
        "host_waits_in_one_loop": waits,
        "gpu_kernel_ms_one_loop": {name: {"ms": round(ms, 4), "count": n} for name, (ms, n) in top},
        "gpu_kernel_ms_one_loop_total": round(sum(ms for ms, _ in kernels.values()), 3),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"few-step-{args.model}.json").write_text(json.dumps(result, indent=2))
    print(
        json.dumps(
            {k: v for k, v in result.items() if k not in ("loop_ms", "gpu_kernel_ms_one_loop", "pipeline_ms")}, indent=2
        )
    )
    for name, (ms, n) in top[:15]:
        print(f"{ms:9.3f} ms {n:5d}×  {name[:110]}")


if __name__ == "__main__":
    main()

"""First-Block Cache on Wan text to video: what skipping steps gives end to end, on one GPU.

Our OnnxWanPipeline (CUDA graphs, IO binding: its defaults) at the video scenario's recipe (Wan 2.1 T2V 1.3B's
architecture, 480 × 832, 81 frames, guidance 5, UMT5's 512 tokens: :data:`optimum_iobinding.bench.zoo.VIDEO_RECIPES`)
on an export with First-Block Cache's parts (made under ``--work`` unless ``--folder`` names one), the latents only
(the VAE decode is the same with and without the cache). Rows, each the median of ``--runs`` timed calls after one
untimed call (the CUDA graphs' capture):

  - uncached;
  - cached at each ``--thresholds`` value (diffusers' rule; the steps it skipped);
  - cached with the decision fixed to a pattern (``every-other``: steps 1, 3, 5 … skipped; ``two-of-three``: two of
    every three steps after the first skipped; ``first-only``: every step but the first), the rule's decision still
    computed and read back: a pattern's time is what a threshold skipping those steps costs.

Random weights make a threshold's skip count arbitrary (a real model's first-block residual changes otherwise): the
patterns give the speed-up at a known share of skipped steps, which is what the target is checked at.

    python3 benchmarks/wan_step_cache_probe.py --work WORK --out OUT [--steps 50] [--blocks N] [--dtype fp16]
        [--thresholds 0.05,0.1] [--runs 2] [--folder EXPORT] [--model tiny-wan --device cpu] [--export-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from diffusers.hooks import FirstBlockCacheConfig

from optimum_iobinding import OnnxWanPipeline
from optimum_iobinding.bench.probes import environment
from optimum_iobinding.bench.video_peers import initial_video_latents
from optimum_iobinding.bench.zoo import PROMPT, VIDEO_RECIPES, build_video_pipeline, wan_blocks

PATTERNS: Dict[str, Callable[[int], bool]] = {
    "every-other": lambda step: step % 2 == 0,
    "two-of-three": lambda step: step % 3 == 0,
    "first-only": lambda step: step == 0,
}


def fixed(cache: Any, pattern: Optional[Callable[[int], bool]]) -> None:
    """Makes ``cache``'s decisions follow ``pattern`` (step → compute?) for every group, while still computing the
    rule's decision and reading it back (``None``: the rule decides again)."""
    if pattern is None:
        cache.__dict__.pop("should_compute", None)
        return
    rule = type(cache).should_compute

    def should_compute(exceeded: torch.Tensor) -> Tuple[bool, ...]:
        rule(cache, exceeded)
        return (pattern(len(cache.computed)),) * cache.groups

    cache.should_compute = should_compute


def export_folder(args: argparse.Namespace) -> Path:
    """The export the probe runs: ``--folder``, or the recipe's random-weights pipeline exported with the parts under
    ``--work`` (once: a folder there is reused)."""
    if args.folder is not None:
        return args.folder
    from optimum_iobinding.export import export_pipeline

    depth = wan_blocks(args.model, args.blocks)
    folder = args.work / (f"wan-step-cache-{args.model}-{args.dtype}" + (f"-blocks{depth}" if depth else ""))
    if not (folder / "model_index.json").is_file():
        export_pipeline(
            None,
            folder,
            torch_pipeline=build_video_pipeline(args.model, args.blocks),
            components=["text_encoder", "transformer"],
            dtype=args.dtype,
            optimize="cuda" if args.device == "cuda" else "cpu",
            step_cache=True,
            progress=False,
        )
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/wan-step-cache"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--folder", type=Path, default=None, help="an export with the parts (--step-cache)")
    parser.add_argument("--model", default="wan2.1-t2v-1.3b", choices=sorted(VIDEO_RECIPES))
    parser.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"))
    parser.add_argument("--blocks", type=int, default=None, help="the transformer's depth (default: the model's)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the recipe's 50)")
    parser.add_argument("--thresholds", default="0.05,0.1")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--export-only", action="store_true", help="make the export under --work, run nothing")
    args = parser.parse_args()
    recipe = VIDEO_RECIPES[args.model]
    steps = args.steps or recipe["recipe_steps"]
    folder = export_folder(args)
    if args.export_only:
        print(f"exported {folder}")
        return
    provider = "CUDAExecutionProvider" if args.device == "cuda" else "CPUExecutionProvider"
    pipe = OnnxWanPipeline.from_pretrained(folder, provider=provider)
    pipe.set_progress_bar_config(disable=True)
    latents = torch.from_numpy(initial_video_latents(recipe))

    def call() -> None:
        with torch.inference_mode():
            pipe(
                PROMPT,
                height=recipe["height"],
                width=recipe["width"],
                num_frames=recipe["num_frames"],
                num_inference_steps=steps,
                guidance_scale=recipe["guidance"],
                latents=latents.clone(),
                max_sequence_length=recipe["max_sequence_length"],
                output_type="latent",
            )
        if args.device == "cuda":
            torch.cuda.synchronize()

    def timed() -> Dict[str, Any]:
        call()  # the first call captures the graphs of what it runs
        seconds = []
        for _ in range(args.runs):
            start = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - start)
        cache = pipe.step_cache
        row: Dict[str, Any] = {"seconds": statistics.median(seconds), "runs": seconds}
        if cache is not None:
            row.update(skipped_steps=cache.skipped_steps, computed_by_group=cache.computed_by_group)
        return row

    rows: Dict[str, Dict[str, Any]] = {"uncached": timed()}
    for threshold in (float(value) for value in args.thresholds.split(",") if value):
        pipe.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        rows[f"fbc:{threshold}"] = timed()
    pipe.enable_cache(FirstBlockCacheConfig(threshold=0.0))
    for name, pattern in PATTERNS.items():
        fixed(pipe.step_cache, pattern)
        rows[f"pattern {name}"] = timed()
    fixed(pipe.step_cache, None)
    pipe.disable_cache()
    uncached = rows["uncached"]["seconds"]
    for row in rows.values():
        row["speedup"] = uncached / row["seconds"]
    result = {
        "environment": environment(),
        "folder": str(folder),
        "model": args.model,
        "dtype": args.dtype,
        "steps": steps,
        "recipe": recipe,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"wan_step_cache-{args.model}.json"
    path.write_text(json.dumps(result, indent=1))
    for name, row in rows.items():
        skipped = f", {row['skipped_steps']} of {steps} steps skipped" if "skipped_steps" in row else ""
        print(f"{name}: {row['seconds']:.2f} s, {row['speedup']:.2f}×{skipped}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""First-Block Cache on one GPU: what a skipped step costs, and what skipping gives end to end.

On a transformer export with its parts (``export --step-cache``; the bench's transformer exports have them), our
pipeline (CUDA graphs, the recipe's size, steps, guidance and latents of ``--scenario transformer``):
  - end to end: uncached; cached at each ``--thresholds`` value (the steps it skipped); cached with the decision's
    outcome fixed to a pattern (``every-other``: steps 1, 3, 5 … skipped; ``first-only``: every step but the first),
    the decision still computed and read back, so a pattern's time is what a threshold skipping those steps costs;
    and each pattern again without the read-back (the host never waits: the difference is what the read costs);
  - per step, from the last call's inputs (each mean of ``--repeats`` back-to-back calls, the host waiting at the
    end): the uncached transformer, a cached step that runs every block, one that skips (with and without the
    read-back), the head alone called the same way; and each part's CUDA graph replayed alone (the head is the
    embeddings and the first block: "the first block alone");
  - per step inside the loop, as the bench counts a step (the call at the recipe's steps minus one at
    ``--short-steps``, over the steps between): uncached, and skipped (every step but the first, with and without
    the read-back).
Random weights make a threshold's skip count arbitrary: the patterns are what the targets are measured at.

    python3 benchmarks/step_cache_probe.py --folder WORK/flux-schnell-fp16-optimized-blocks2x4-… --kind flux-schnell \
        --out OUT [--thresholds 0.08,0.2] [--runs 3] [--repeats 20] [--short-steps N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import torch
from diffusers.hooks import FirstBlockCacheConfig

from optimum_iobinding.bench.peers import step_cache_row
from optimum_iobinding.bench.probes import environment, graph_floor_ms
from optimum_iobinding.bench.transformer_peers import load_transformer_peer
from optimum_iobinding.bench.zoo import PROMPT, TRANSFORMER_RECIPES

PATTERNS: Dict[str, Callable[[int], bool]] = {
    "every-other": lambda step: step % 2 == 0,
    "first-only": lambda step: step == 0,
}


def fixed(cache: Any, pattern: Optional[Callable[[int], bool]], read: bool = True) -> None:
    """Makes ``cache``'s decisions follow ``pattern`` (step → compute?) while still computing the rule's scalar and,
    with ``read``, reading it back (``None``: the rule decides again). Without ``read`` the host never waits for
    the GPU inside a call: the difference is what the read-back costs."""
    if pattern is None:
        cache.__dict__.pop("should_compute", None)
        return
    rule = type(cache).should_compute

    def should_compute(residual: torch.Tensor) -> Tuple[bool, ...]:
        if read:
            rule(cache, residual)
        return (pattern(len(cache.computed)),) * cache.groups  # the same for every group of the batch

    cache.should_compute = should_compute


def per_call_ms(run: Callable[[], Any], stream: Any, repeats: int) -> float:
    with torch.cuda.stream(stream):
        run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.cuda.stream(stream):
        for _ in range(repeats):
            run()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--kind", choices=sorted(TRANSFORMER_RECIPES), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--thresholds", default="0.08,0.2")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--short-steps",
        type=int,
        default=None,
        help="the short call of the in-loop per-step costs (fewer than the recipe's steps; default: "
        "the recipe's, as the bench's per-step time)",
    )
    args = parser.parse_args()
    recipe = TRANSFORMER_RECIPES[args.kind]
    short = recipe["short_steps"] if args.short_steps is None else args.short_steps
    if not 1 <= short < recipe["steps"]:
        parser.error(f"--short-steps: expected 1 ≤ N < {recipe['steps']} ({args.kind}'s steps), got {short}")
    pipe, latents, _ = load_transformer_peer("ours", args.folder, args.kind, None, None, "cuda")
    pipe.set_progress_bar_config(disable=True)

    def call(steps: int = recipe["steps"]) -> np.ndarray:
        with torch.inference_mode():
            images = pipe(
                PROMPT,
                height=recipe["size"],
                width=recipe["size"],
                num_inference_steps=steps,
                guidance_scale=recipe["guidance"],
                latents=latents.clone(),
                max_sequence_length=recipe["max_sequence_length"],
                output_type="np",
            ).images
        torch.cuda.synchronize()
        return np.asarray(images)

    def timed(steps: int = recipe["steps"]) -> Dict[str, Any]:
        return step_cache_row(pipe, lambda: call(steps), args.runs)[0]

    result: Dict[str, Any] = {
        "environment": environment(),
        "folder": str(args.folder),
        "kind": args.kind,
        "steps": recipe["steps"],
        "rows": {},
    }
    rows = result["rows"]
    rows["uncached"] = timed()
    # a step inside the loop, as the bench counts it: (steps-step call − short-step call) / the steps between
    between = recipe["steps"] - short
    short_rows = {"uncached": timed(short)}
    stream = pipe.transformer.stream
    recorded: Dict[str, torch.Tensor] = {}
    transformer = pipe.transformer
    for threshold in [float(value) for value in args.thresholds.split(",") if value]:
        pipe.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        rows[f"threshold {threshold}"] = timed()
    pipe.enable_cache(FirstBlockCacheConfig(threshold=0.0))
    cache = pipe.step_cache
    step_of_cache = type(cache).__call__

    def recording(instance: Any, step: int, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        recorded.clear()
        recorded.update({name: value.clone() for name, value in inputs.items()})
        return step_of_cache(instance, step, inputs)

    for name, pattern in PATTERNS.items():
        fixed(cache, pattern)
        rows[f"pattern {name}"] = timed()
        fixed(cache, pattern, read=False)
        rows[f"pattern {name}, no read-back"] = timed()
    for suffix, read in (("", True), (", no read-back", False)):
        fixed(cache, PATTERNS["first-only"], read=read)
        short_rows[f"pattern first-only{suffix}"] = timed(short)
    in_loop = {
        "uncached step": short_rows["uncached"],
        "skipped step": short_rows["pattern first-only"],
        "skipped step, no read-back": short_rows["pattern first-only, no read-back"],
    }
    whole = {
        "uncached step": rows["uncached"],
        "skipped step": rows["pattern first-only"],
        "skipped step, no read-back": rows["pattern first-only, no read-back"],
    }
    result["in_loop_per_step_ms"] = {
        name: (whole[name]["end_to_end_ms"] - row["end_to_end_ms"]) / between for name, row in in_loop.items()
    }
    result["short_call"] = {"steps": short, "rows": short_rows}
    # one more cached call, the last step's inputs recorded (a call goes through the class), for the per-step costs
    original_call = cache.__class__.__call__
    try:
        cache.__class__.__call__ = recording
        call()
    finally:
        cache.__class__.__call__ = original_call
    inputs = dict(recorded)
    steps: Dict[str, float] = {}
    steps["uncached transformer"] = per_call_ms(lambda: transformer(**inputs), stream, args.repeats)
    fixed(cache, lambda step: True)
    cache.start(1)
    cache(0, inputs)
    steps["cached, every block"] = per_call_ms(lambda: cache(1, inputs), stream, args.repeats)
    fixed(cache, lambda step: False)
    steps["cached, skipped"] = per_call_ms(lambda: cache(1, inputs), stream, args.repeats)
    fixed(cache, lambda step: False, read=False)
    steps["cached, skipped, no read-back"] = per_call_ms(lambda: cache(1, inputs), stream, args.repeats)
    # the head called the way the cached steps are (its inputs copied into its graph, the host waiting at the end)
    head_inputs = {name: inputs[name] for name in cache.head.input_names}
    steps["head alone, per call"] = per_call_ms(lambda: cache.head(**head_inputs), stream, args.repeats)
    for part_name, part in zip(("head (first block alone)", "body", "out"), cache.parts):
        steps[f"graph replay: {part_name}"] = graph_floor_ms(part, args.repeats)
    steps["graph replay: uncached transformer"] = graph_floor_ms(transformer, args.repeats)
    result["per_step_ms"] = steps
    # where a part ran without a CUDA graph, ORT's reason
    result["graph_fallbacks"] = {
        name: {str(dict(signature)): reason for signature, reason in model.graph_fallbacks.items()}
        for name, model in zip(("head", "body", "out", "transformer"), [*cache.parts, transformer])
        if model.graph_fallbacks
    }
    head = steps["graph replay: head (first block alone)"]
    result["skipped_step_over_first_block"] = steps["cached, skipped"] / head if head else None
    # the same harness on both sides: a skipped step per call over the head alone per call
    result["skipped_step_over_first_block_per_call"] = steps["cached, skipped"] / steps["head alone, per call"]
    result["in_loop_skipped_step_over_first_block"] = (
        result["in_loop_per_step_ms"]["skipped step"] / head if head else None
    )
    result["every_other_speedup"] = rows["uncached"]["end_to_end_ms"] / rows["pattern every-other"]["end_to_end_ms"]
    # what reading the decision back costs a skipped step: the host waits, then launches the next step's work
    result["read_back_ms_per_skipped_step"] = steps["cached, skipped"] - steps["cached, skipped, no read-back"]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"step_cache-{args.kind}.json"
    path.write_text(json.dumps(result, indent=2))
    print(
        json.dumps(
            {
                key: result[key]
                for key in (
                    "per_step_ms",
                    "in_loop_per_step_ms",
                    "skipped_step_over_first_block",
                    "skipped_step_over_first_block_per_call",
                    "in_loop_skipped_step_over_first_block",
                    "every_other_speedup",
                    "read_back_ms_per_skipped_step",
                    "graph_fallbacks",
                )
            },
            indent=2,
        )
    )
    for name, row in rows.items():
        print(f"{name:24s} {row['end_to_end_ms']:9.1f} ms  skipped {row.get('skipped_steps', 0)}")


if __name__ == "__main__":
    main()

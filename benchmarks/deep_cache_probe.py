"""DeepCache on one GPU: end to end with and without it, and what a full and a shallow step cost.

On the bench's UNet architectures (``sd15``: SD 1.5, 512²; ``sdxl``: SDXL, 1024²; random weights, fp16, ORT-fused,
exported with DeepCache's parts), our pipeline with its defaults (CUDA graphs), batch 1, the recipe's guidance and
DDIM, ``--steps`` steps, the same initial latents for every row:
  - end to end: uncached, then each ``--caches`` config (``INTERVAL:BRANCH``), the steps run whole, then uncached
    again after ``disable_cache()`` (its image against the first uncached one's, and the UNet's sessions made), and
    uncached in a pipeline whose UNet's weights ORT loads itself (``share_weights=False``; the step-cache export's
    pipeline owns them from the load, so that its parts read them);
  - per step: each graph's CUDA-graph replay alone (``model.onnx``; the full part, which also writes the features;
    the shallow part of each branch measured).
The uncached row is the project's loop on the step-cache export's ``model.onnx``, the plain export's graph (the
marks change no fusion: the operators are the same), so it is the uncached speed.

    python3 benchmarks/deep_cache_probe.py --kind sd15 --steps 50 --work WORK --out OUT [--caches 3:0,3:1,2:0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, Tuple

import numpy as np
import torch

from optimum_iobinding import DeepCacheConfig
from optimum_iobinding.bench.peers import step_cache_row
from optimum_iobinding.bench.probes import environment, graph_floor_ms
from optimum_iobinding.bench.zoo import MODEL_SIZES, PROMPT, ensure_export, recipe_of
from optimum_iobinding.pipelines import pipeline_class_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=("sd15", "sdxl"), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--caches", default="3:0")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--export-only", action="store_true")
    args = parser.parse_args()
    folder = ensure_export(args.kind, "fp16", "optimized", args.work, step_cache=True)
    if args.export_only:
        return
    size, guidance = MODEL_SIZES[args.kind], recipe_of(args.kind)["guidance"]
    from diffusers import DDIMScheduler

    def load(**kwargs: Any) -> Any:
        loaded = pipeline_class_for(folder).from_pretrained(folder, provider="CUDAExecutionProvider", **kwargs)
        loaded.set_progress_bar_config(disable=True)
        loaded.scheduler = DDIMScheduler.from_config(loaded.scheduler.config, clip_sample=False)
        return loaded

    pipe = load()
    unet = pipe.unet
    latents = torch.from_numpy(np.random.RandomState(0).randn(1, 4, size // 8, size // 8).astype(np.float32))
    latents = latents.to("cuda", unet.input_dtypes["sample"])

    def call() -> np.ndarray:
        with torch.inference_mode():
            images = pipe(
                PROMPT,
                height=size,
                width=size,
                num_inference_steps=args.steps,
                guidance_scale=guidance,
                latents=latents.clone(),
                output_type="np",
            ).images
        torch.cuda.synchronize()
        return np.asarray(images)

    def timed() -> Tuple[Dict[str, Any], np.ndarray]:
        row, image = step_cache_row(pipe, call, args.runs)
        if "computed" in row:
            row["full_steps"] = len(row["computed"]) - row["skipped_steps"]
        return row, image

    result: Dict[str, Any] = {
        "environment": environment(),
        "folder": str(folder),
        "kind": args.kind,
        "size": size,
        "steps": args.steps,
        "guidance": guidance,
        "rows": {},
        "replays_ms": {},
    }
    result["rows"]["uncached"], uncached_image = timed()
    result["rows"]["uncached"]["sessions_created"] = unet.sessions_created
    result["replays_ms"]["model.onnx"] = graph_floor_ms(unet, args.repeats)
    full = shallow = None
    for spec in [value for value in args.caches.split(",") if value]:
        interval, branch = (int(part) for part in spec.split(":"))
        pipe.enable_cache(DeepCacheConfig(cache_interval=interval, cache_branch_id=branch))
        row, image = timed()
        row["max_abs_diff_to_uncached"] = float(np.abs(image - uncached_image).max())
        result["rows"][f"deepcache {interval}:{branch}"] = row
        full, shallow = pipe.step_cache.parts
        result["replays_ms"].setdefault("full part", graph_floor_ms(full, args.repeats))
        result["replays_ms"][f"shallow part, branch {branch}"] = graph_floor_ms(shallow, args.repeats)
        result["graph_fallbacks"] = {
            name: {str(dict(signature)): reason for signature, reason in model.graph_fallbacks.items()}
            for name, model in (("full", full), ("shallow", shallow), ("unet", unet))
            if model.graph_fallbacks
        }
        pipe.disable_cache()
    # the uncached loop again after the caches ran: as fast as the first time, and the same image
    row, image = timed()
    row["max_abs_diff_to_uncached"] = float(np.abs(image - uncached_image).max())
    row["sessions_created"] = unet.sessions_created
    result["rows"]["uncached after disable_cache"] = row
    # the same loop where ORT loads the UNet's weights itself (what a folder without the parts gets): the owned
    # weights' sessions against ORT's own
    del pipe, unet, full, shallow
    torch.cuda.empty_cache()
    pipe = load(component_options={"unet": {"share_weights": False}})
    row, image = timed()
    row["max_abs_diff_to_uncached"] = float(np.abs(image - uncached_image).max())
    result["rows"]["uncached, weights loaded by ORT"] = row
    uncached_ms = result["rows"]["uncached"]["end_to_end_ms"]
    result["speedup"] = {name: uncached_ms / row["end_to_end_ms"] for name, row in result["rows"].items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"deep_cache-{args.kind}-{args.steps}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({key: result[key] for key in ("replays_ms", "speedup")}, indent=2))
    for name, row in result["rows"].items():
        print(f"{name:18s} {row['end_to_end_ms']:9.1f} ms  full steps {row.get('full_steps', args.steps)}")


if __name__ == "__main__":
    main()

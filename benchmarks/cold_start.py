"""Cold start of the default pipeline, with each cuDNN algorithm search: load, first image, steady image.

Each variant runs in a fresh process (nothing cached between them): ``from_pretrained`` timed, then the first
``--steps``-step image at batch 1 (sessions created, algorithms searched, graphs captured), then the median of three
more (the steady state), and the same once more after ``pipe.warmup(...)`` in another fresh process.

    python benchmarks/cold_start.py --folder WORK/sd15-fp16-optimized --out OUT/cold-start
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(folder: str, search: str, warm: bool, steps: int, size: int) -> dict:
    import torch

    from optimum_iobinding import OnnxStableDiffusionPipeline

    start = time.perf_counter()
    pipe = OnnxStableDiffusionPipeline.from_pretrained(
        folder, provider="CUDAExecutionProvider", provider_options={"cudnn_conv_algo_search": search})
    pipe.set_progress_bar_config(disable=True)
    load_s = time.perf_counter() - start
    warmup_s = None
    if warm:
        start = time.perf_counter()
        pipe.warmup(heights=size, batch_sizes=1)
        torch.cuda.synchronize()
        warmup_s = time.perf_counter() - start

    def image() -> float:
        start = time.perf_counter()
        pipe("a photo of an astronaut", height=size, width=size, num_inference_steps=steps, output_type="np")
        torch.cuda.synchronize()
        return time.perf_counter() - start

    first_s = image()
    steady_s = statistics.median(image() for _ in range(3))
    return {"search": search, "warmup": warm, "load_s": load_s, "warmup_s": warmup_s, "first_image_s": first_s,
            "steady_image_s": steady_s, "first_over_steady": first_s / steady_s,
            "sessions_created": pipe.sessions_created}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        search, warm = args.one.split(":")
        print(json.dumps(measure(args.folder, search, warm == "warm", args.steps, args.size)))
        return 0
    rows = []
    for variant in ("EXHAUSTIVE:cold", "HEURISTIC:cold", "EXHAUSTIVE:warm", "HEURISTIC:warm"):
        done = subprocess.run([sys.executable, __file__, "--folder", args.folder, "--out", args.out, "--steps",
                               str(args.steps), "--size", str(args.size), "--one", variant],
                              capture_output=True, text=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else
                    {"variant": variant, "error": done.stderr[-1500:]})
        print(rows[-1], flush=True)
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cold-start.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0), "command": " ".join(
        ["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

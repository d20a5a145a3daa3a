"""VAE decoder time per call for each tile shape of a tiled decode, under CUDA EP option variants (GPU machine).

A tiled 2048² decode (tile 512 px, overlap 1/4) feeds the decoder latents of four shapes in raster order — 64×64 and
the edge tiles 64×16, 16×64, 16×16 — so the decoder's input shape changes between most calls. This measures, for each
variant of provider options, the decoder's time per call (synchronized) when the shapes alternate as tiling feeds them
and when one shape repeats, after one warm-up cycle.

    python3 benchmarks/vae_shapes.py --work /tmp/bench-work --out /tmp/res/vae-shapes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

VARIANTS = {
    "defaults": {},
    "HEURISTIC": {"cudnn_conv_algo_search": "HEURISTIC"},
    "DEFAULT search": {"cudnn_conv_algo_search": "DEFAULT"},
    "no max workspace": {"cudnn_conv_use_max_workspace": "0"},
    "arena kNextPowerOfTwo": {"arena_extend_strategy": "kNextPowerOfTwo"},
}
SHAPES = [(64, 64), (64, 16), (16, 64), (16, 16)]


def measure(folder: Path, options: dict, cycles: int) -> dict:
    from optimum_iobinding import IOBindingORTModel

    decoder = IOBindingORTModel.from_pretrained(
        folder, subfolder="vae_decoder", provider="CUDAExecutionProvider", provider_options=options
    )
    dtype = decoder.input_dtypes["latent_sample"]
    inputs = {shape: torch.randn(1, 4, *shape, device="cuda").to(dtype) for shape in SHAPES}

    def once(shape) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        decoder(latent_sample=inputs[shape])
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1000

    first = {f"{h}x{w}": once((h, w)) for h, w in SHAPES}
    alternating = {f"{h}x{w}": [] for h, w in SHAPES}
    for _ in range(cycles):
        for h, w in SHAPES:
            alternating[f"{h}x{w}"].append(once((h, w)))
    repeated = {f"{h}x{w}": [once((h, w)) for _ in range(cycles)] for h, w in SHAPES}
    return {
        "first_call_ms": first,
        "alternating_ms": {k: statistics.median(v) for k, v in alternating.items()},
        "repeated_ms": {k: statistics.median(v) for k, v in repeated.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/bench-work")
    parser.add_argument("--out", default="benchmarks/results/latest")
    parser.add_argument("--dtype", default="fp16", choices=("fp16", "fp32"))
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()

    from optimum_iobinding.bench.probes import environment
    from optimum_iobinding.bench.zoo import ensure_export

    folder = ensure_export("sd15", args.dtype, "plain", Path(args.work))
    results = {
        "environment": environment(),
        "command": " ".join(["python3 benchmarks/vae_shapes.py", *sys.argv[1:]]),
        "dtype": args.dtype,
        "variants": {},
    }
    for name in args.variants.split(","):
        try:
            results["variants"][name] = {"options": VARIANTS[name], **measure(folder, VARIANTS[name], args.cycles)}
        except Exception as error:  # one variant failing must not lose the others
            results["variants"][name] = {"options": VARIANTS[name], "error": f"{type(error).__name__}: {error}"[:400]}
        print(name, json.dumps(results["variants"][name]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vae-shapes.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

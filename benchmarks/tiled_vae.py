"""Tiled VAE decode of a large image on the GPU: untiled, tiled with sequential host copies, tiled with each tile's
copy overlapping the next tile's decode (optimum_iobinding.TiledVAE).

On the GPU machine, from the project root (after .device/w/install.sh):
    python3 benchmarks/tiled_vae.py --size 2048 --work /tmp/bench-work --out OUT
Writes OUT/tiled-vae.json and .md: median ms of 3 runs after a warm-up, and the largest difference of each tiled
image from the untiled one (the blending's effect; random weights make seams larger than a trained VAE's).
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


def timed(call, runs: int):
    call()
    torch.cuda.synchronize()
    times, result = [], None
    for _ in range(runs):
        start = time.perf_counter()
        result = call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), times, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--tile", type=int, default=512)
    parser.add_argument("--dtype", default="fp16", choices=("fp16", "fp32"))
    parser.add_argument("--work", default="/tmp/bench-work")
    parser.add_argument("--out", default="benchmarks/results/latest")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    from optimum_iobinding import IOBindingORTModel, TiledVAE
    from optimum_iobinding.bench.probes import environment
    from optimum_iobinding.bench.zoo import ensure_export

    folder = ensure_export("sd15", args.dtype, "plain", Path(args.work))
    decoder = IOBindingORTModel.from_pretrained(folder, subfolder="vae_decoder", provider="CUDAExecutionProvider")
    latents = torch.randn(1, 4, args.size // 8, args.size // 8, generator=torch.Generator().manual_seed(0))
    latents = latents.to("cuda", decoder.input_dtypes["latent_sample"])
    results = {
        "environment": environment(),
        "command": " ".join(["python3 benchmarks/tiled_vae.py", *sys.argv[1:]]),
        "size": args.size,
        "tile": args.tile,
        "dtype": args.dtype,
        "rows": {},
    }
    try:

        def untiled():
            image = (decoder(latent_sample=latents)[0].float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1)
            return image.cpu().numpy()

        ms, all_ms, reference = timed(untiled, args.runs)
        results["rows"]["untiled"] = {"ms": ms, "ms_all": all_ms}
    except Exception as error:  # an untiled 2048² decode may not fit: that is why tiling exists
        reference = None
        results["rows"]["untiled"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    for name, overlap_copies in (("tiled, sequential copies", False), ("tiled, overlapped copies", True)):
        tiler = TiledVAE(decoder, tile_sample_size=args.tile, overlap_copies=overlap_copies)
        ms, all_ms, image = timed(lambda: tiler.decode_to_host(latents), args.runs)
        row = {"ms": ms, "ms_all": all_ms}
        if reference is not None:
            row["max_abs_diff_vs_untiled"] = float(np.abs(image - reference).max())
            row["mean_abs_diff_vs_untiled"] = float(np.abs(image - reference).mean())
        results["rows"][name] = row
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tiled-vae.json").write_text(json.dumps(results, indent=2))
    lines = [
        f"# Tiled VAE decode, {args.size}², {args.dtype}, tile {args.tile} px — {results['environment']['device']}",
        "",
        f"`{results['command']}`",
        "",
        "| decode | ms (median) | max / mean abs diff vs untiled |",
        "|---|---|---|",
    ]
    for name, row in results["rows"].items():
        diff = (
            f"{row['max_abs_diff_vs_untiled']:.3g} / {row['mean_abs_diff_vs_untiled']:.3g}"
            if "max_abs_diff_vs_untiled" in row
            else ""
        )
        lines.append(f"| {name} | {row.get('ms', float('nan')):.1f} | {diff or row.get('error', '')} |")
    (out / "tiled-vae.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

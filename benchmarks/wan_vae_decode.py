"""The decode of one Wan 2.1 video's latents (480×832, 81 frames: 21 latent frames of 60 × 104) by Wan's VAE
(``AutoencoderKLWan`` at Wan 2.1's config, the bench zoo's, random weights from seed 0): diffusers'
``vae.decode`` in float32 (the model cards' precision) and in bfloat16, against ours — the chunk graphs of
:mod:`optimum_iobinding.export.wan_vae` exported in float32 and in float16, run by ``WanVideoCodec`` on the CUDA
provider with their CUDA graphs. Each case in a process of its own: seconds (median of ``--runs`` after one warm-up),
the device's peak memory above the process's idle (sampled by the bench's sampler process, ORT's arenas included) and
torch's ``max_memory_allocated``, and the largest difference of its frames from diffusers' float32 frames.

    python benchmarks/wan_vae_decode.py --work /tmp/wan-vae --out OUT [--kernels]

Writes OUT/wan-vae-decode.json (every case, the command, the versions) and OUT/wan-vae-decode.md; with ``--kernels``
each case also profiles one more decode after its timed runs, and the report gives its GPU kernels by time (where a
decode's time goes, ours beside diffusers').
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

CASES = ("torch-fp32", "torch-bf16", "ours-fp32", "ours-fp16")
# also accepted: any case with "-tiled" (diffusers' tiling, tiles of 256 pixels every 192: vae.enable_tiling() and
# our codec's enable_tiling()), e.g. torch-bf16-tiled, ours-fp16-tiled; and ours with CUDA provider options of
# OPTIONS or settings of SETTINGS after "+", e.g. ours-fp16+no-max-workspace+arena-log (where the device memory of the
# chunk graphs goes)
OPTIONS = {
    "no-max-workspace": {"cudnn_conv_use_max_workspace": "0"},  # cuDNN's algorithms within its default workspace
    "power-of-two": {"arena_extend_strategy": "kNextPowerOfTwo"},  # ORT's own arena growth
}
SETTINGS = (
    "no-graph",  # cuda_graph=False: the chunk graphs run without capture
    "no-mem-pattern",  # session options with ORT's memory pattern off (the user's options: each session its own arena)
    "arena-log",  # ORT's INFO log: every arena extension's bytes, in the case's result
)
SIZES = {"480x832": (60, 104), "720x1280": (90, 160)}  # latent pixels of Wan's 480p and 720p videos
LATENT_SHAPE = (1, 16, 21, 60, 104)


def build_vae():
    import torch

    from optimum_iobinding.bench.zoo import build_wan21_vae

    torch.manual_seed(0)
    return build_wan21_vae()


def export(work: Path, dtype: str) -> Path:
    """The VAE decoder's chunk graphs in ``dtype`` under ``work`` (made once)."""
    from optimum_iobinding.export.wan_vae import export_wan_vae

    folder = work / f"wan21-vae-{dtype}"
    if not (folder / "vae_decoder" / "model.onnx").is_file():
        partial = work / f"wan21-vae-{dtype}.partial"
        partial.mkdir(parents=True, exist_ok=True)
        export_wan_vae(build_vae(), partial, ["vae_decoder"], dtype=dtype)
        partial.rename(folder)
    return folder


def latents(size: str = "480x832"):
    import torch

    return torch.randn((*LATENT_SHAPE[:3], *SIZES[size]), generator=torch.Generator().manual_seed(1))


def kernel_table(decode, top: int = 30) -> dict:
    """The GPU kernels of one ``decode()`` (torch's profiler sees ORT's kernels too, through CUPTI): the GPU time in
    all, and the ``top`` kernels by time, each with its milliseconds and its launches."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiled:
        decode()
        torch.cuda.synchronize()
    rows = sorted(
        ((event.key, event.device_time_total / 1000, event.count) for event in profiled.key_averages()),
        key=lambda row: -row[1],
    )
    return {
        "gpu_ms": round(sum(ms for _, ms, _ in rows), 2),
        "top": [[name[:120], round(ms, 3), count] for name, ms, count in rows[:top]],
    }


def run_case(case: str, work: Path, runs: int, frames_out: Path, size: str = "480x832", kernels: bool = False) -> dict:
    import numpy as np
    import torch

    from optimum_iobinding.bench.probes import PeakMemory

    z = latents(size).cuda()
    base, *extras = case.split("+")
    tiled = base.endswith("-tiled")
    provider_options = {key: value for extra in extras for key, value in OPTIONS.get(extra, {}).items()}
    settings = {}
    if "no-graph" in extras:
        settings["cuda_graph"] = False
    if "no-mem-pattern" in extras:
        import onnxruntime

        settings["sess_options"] = onnxruntime.SessionOptions()
        settings["sess_options"].enable_mem_pattern = False
    if "arena-log" in extras:
        import onnxruntime

        onnxruntime.set_default_logger_severity(1)  # INFO: each arena extension, with its bytes, on stderr
    device = torch.device("cuda", 0)
    idle = PeakMemory(device).used()
    with PeakMemory(device) as peak:
        if case.startswith("torch"):
            if extras:
                raise ValueError(f"--cases: provider options are ours only, got {case!r}")
            dtype = torch.float32 if case.startswith("torch-fp32") else torch.bfloat16
            vae = build_vae().to("cuda", dtype)
            if tiled:
                vae.enable_tiling()

            def decode():
                with torch.inference_mode():
                    return vae.decode(z.to(dtype), return_dict=False)[0]

        else:
            from optimum_iobinding.pipelines.wan_codec import WanVideoCodec

            codec = WanVideoCodec.from_pretrained(
                export(work, base.split("-")[1]),
                encoder=False,
                provider="CUDAExecutionProvider",
                provider_options=provider_options,
                **settings,
            )
            if tiled:
                codec.enable_tiling()

            def decode():
                with torch.inference_mode(), torch.cuda.stream(codec.decoder.first.stream):
                    return codec.decode(z)

        first = time.perf_counter()
        video = decode()
        torch.cuda.synchronize()
        first = time.perf_counter() - first
        seconds = []
        for _ in range(runs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            video = decode()
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
    table = kernel_table(decode) if kernels else None
    frames = video.float().clamp(-1, 1).cpu().numpy()
    np.save(frames_out, frames)
    return {
        **({"kernels": table} if table is not None else {}),
        "case": case,
        "seconds": statistics.median(seconds),
        "all_seconds": seconds,
        "first_seconds": first,
        "peak_mib": (peak.peak - idle) / 2**20,
        "torch_max_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
        "shape": list(frames.shape),
        "non_finite": int((~np.isfinite(frames)).sum()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/wan-vae"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--size", default="480x832", choices=tuple(SIZES), help="the video's height x width")
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="after the timed runs, profile one more decode of each case: its GPU kernels by time (OUT/…md, .json)",
    )
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one:
        frames = args.work / f"frames-{args.size}-{args.one}.npy"
        result = run_case(args.one, args.work, args.runs, frames, args.size, args.kernels)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    import numpy as np

    from optimum_iobinding.bench.probes import environment

    cases = args.cases.split(",")
    for case in cases:
        unknown = [extra for extra in case.split("+")[1:] if extra not in OPTIONS and extra not in SETTINGS]
        if unknown:
            known = ", ".join((*OPTIONS, *SETTINGS))
            parser.error(f"--cases: expected provider options or settings among {known} after '+', got {unknown}")
    for case in cases:  # the exports first, outside the timed processes
        if case.startswith("ours"):
            export(args.work, case.split("+")[0].split("-")[1])
    results = []
    for case in cases:
        done = subprocess.run(
            [sys.executable, __file__, "--work", str(args.work), "--out", str(args.out), "--runs", str(args.runs)]
            + ["--size", args.size, "--one", case]
            + (["--kernels"] if args.kernels else []),
            capture_output=True,
            text=True,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        results.append(json.loads(lines[-1][7:]) if lines else {"case": case, "error": done.stderr[-2000:]})
        if "+arena-log" in case:  # MiB of each arena extension, in order
            extended = [int(n) / 2**20 for n in re.findall(r"Extended allocation by (\d+) bytes", done.stderr)]
            results[-1]["arena_extensions_mib"] = [round(mib, 1) for mib in extended]
            results[-1]["arena_extended_mib"] = round(sum(extended), 1)
    reference = args.work / f"frames-{args.size}-torch-fp32.npy"  # of this run's size (a case of this run or not)
    for result in results:
        frames = args.work / f"frames-{args.size}-{result['case']}.npy"
        if "error" not in result and reference.is_file() and frames.is_file():
            result["max_diff_vs_torch_fp32"] = float(np.abs(np.load(frames) - np.load(reference)).max())
    shape = (*LATENT_SHAPE[:3], *SIZES[args.size])
    report = {"command": " ".join(sys.argv), "environment": environment(), "latents": shape, "cases": results}
    (args.out / "wan-vae-decode.json").write_text(json.dumps(report, indent=2))
    torch_fp32 = next((r["seconds"] for r in results if r["case"] == "torch-fp32" and "seconds" in r), None)
    lines = [
        "| case | decode s | torch fp32 ÷ this | first s | peak GPU MiB | torch max allocated MiB | max diff vs torch fp32 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            why = r["error"].strip().splitlines()[-1][:150] if r["error"].strip() else "?"
            lines.append(f"| {r['case']} | failed: {why} |||||")
            continue
        ratio = f"{torch_fp32 / r['seconds']:.2f}" if torch_fp32 else ""
        lines.append(
            f"| {r['case']} | {r['seconds']:.3f} | {ratio} | {r['first_seconds']:.2f} | {r['peak_mib']:.0f} | "
            f"{r['torch_max_allocated_mib']:.0f} | {r.get('max_diff_vs_torch_fp32', float('nan')):.4f} |"
        )
    for r in results:
        if "arena_extensions_mib" in r:
            sizes = ", ".join(f"{mib:.0f}" for mib in r["arena_extensions_mib"])
            lines += ["", f"{r['case']}: ORT's arenas grew by {r['arena_extended_mib']:.0f} MiB in all, by: {sizes}"]
    for r in results:
        if "kernels" in r:
            lines += ["", f"{r['case']}: {r['kernels']['gpu_ms']} ms of GPU kernels in one decode", ""]
            lines += ["| kernel | ms | launches |", "|---|---|---|"]
            lines += [f"| `{name}` | {ms} | {count} |" for name, ms, count in r["kernels"]["top"][:15]]
    (args.out / "wan-vae-decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

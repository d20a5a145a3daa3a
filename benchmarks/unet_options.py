"""Where the fused UNet's step time goes, and which CUDA EP options move it.

On the GPU machine, from the project root (after .device/w/install.sh):
    python3 benchmarks/unet_options.py --model sd15 --work /tmp/bench-work --out OUT

For the fp16 ``--optimize cuda`` export of the model (made by optimum_iobinding.bench.zoo's export cache if missing)
it writes OUT/unet-options.json and .md:
  * the UNet's operator counts (what the fusions left),
  * the GPU kernel time per kernel name over plain (non-graph) runs, from the torch profiler (CUPTI sees ORT's kernels),
    and which attention kernel ORT picked per node (ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO),
  * the GPU floor (back-to-back CUDA-graph replays of the UNet, CFG batch 2) under each provider-option variant, each
    in its own process (ORT reads the attention-kernel choice once per process).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# name → (provider options on top of the diffusion defaults, environment)
VARIANTS = {
    "defaults": ({}, {}),
    "fuse_conv_bias": ({"fuse_conv_bias": "1"}, {}),
    "sdpa_flash": ({"sdpa_kernel": "1"}, {}),
    "sdpa_efficient": ({"sdpa_kernel": "2"}, {}),
    "sdpa_trt": ({"sdpa_kernel": str(4 | 32 | 64)}, {}),
    "sdpa_cudnn": ({"sdpa_kernel": "8"}, {}),
    "prefer_nhwc": ({"prefer_nhwc": "1"}, {}),
    "conv_heuristic": ({"cudnn_conv_algo_search": "HEURISTIC"}, {}),
}


def floor_in_process(folder: str, model: str, options: dict, repeats: int) -> dict:
    from optimum_iobinding.bench.probes import run_floor

    runs = [run_floor(Path(folder), model, replays=100, provider_options=options) for _ in range(repeats)]
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return {"error": errors[0]}
    times = [r["per_step_ms"] for r in runs]
    return {"per_step_ms": statistics.median(times), "per_step_ms_all": times}


def kernels_in_process(folder: str, model: str, steps: int) -> dict:
    """GPU time per kernel name over ``steps`` plain UNet calls (no graph: the profiler sees each kernel)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from optimum_iobinding.bench.zoo import MODEL_SIZES
    from optimum_iobinding.runtime.model import IOBindingORTModel

    size = MODEL_SIZES[model]
    unet = IOBindingORTModel.from_pretrained(folder, subfolder="unet", provider="CUDAExecutionProvider")
    dtype = unet.input_dtypes["sample"]
    hidden = unet.input_dims["encoder_hidden_states"][2]
    timestep_rank = len(unet.input_dims["timestep"] or [])
    inputs = {
        "sample": torch.randn(2, 4, size // 8, size // 8, device=unet.device, dtype=dtype),
        "timestep": torch.full(
            [2] if timestep_rank else [], 500, device=unet.device, dtype=unet.input_dtypes["timestep"]
        ),
        "encoder_hidden_states": torch.randn(2, 77, hidden, device=unet.device, dtype=dtype),
    }
    with torch.cuda.stream(unet.stream):
        for _ in range(3):
            unet(**inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                unet(**inputs)
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as scratch:
        trace = Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    per_kernel = collections.Counter()
    calls = collections.Counter()
    for event in events:
        if event.get("cat") == "kernel":
            per_kernel[event["name"]] += float(event.get("dur", 0)) / 1000 / steps
            calls[event["name"]] += 1
    total = sum(per_kernel.values())
    top = [
        {"kernel": name[:160], "ms_per_step": round(ms, 4), "calls_per_step": calls[name] // steps}
        for name, ms in per_kernel.most_common(40)
    ]
    return {
        "kernel_ms_per_step": total,
        "kernels_per_step": sum(calls.values()) // steps,
        "top": top,
        "by_family": _families(per_kernel),
    }


def _families(per_kernel: collections.Counter) -> dict:
    rules = [
        ("attention", ("fmha", "flash", "attention", "Attention", "cudnn_generated_fort_native_sdpa")),
        ("convolution", ("conv", "Conv", "fprop", "implicit", "xmma", "winograd", "dgrad")),
        ("gemm", ("gemm", "Gemm", "cutlass", "sm90_xmma", "cublas")),
        ("group norm", ("GroupNorm", "groupNorm", "group_norm")),
        ("layer norm", ("LayerNorm", "layerNorm", "SkipLayerNorm")),
        ("transpose", ("ranspose",)),
        ("gelu/split", ("Gelu", "gelu", "Split", "split")),
        ("bias/add", ("BiasAdd", "Add", "add", "Bias")),
    ]
    families = collections.Counter()
    for name, ms in per_kernel.items():
        family = next((fam for fam, keys in rules if any(key in name for key in keys)), "other")
        families[family] += ms
    return {name: round(ms, 4) for name, ms in families.most_common()}


def op_counts(folder: Path) -> dict:
    import onnx

    model = onnx.load(str(folder / "unet" / "model.onnx"), load_external_data=False)
    return dict(collections.Counter(node.op_type for node in model.graph.node).most_common())


def _child(mode: str, folder: Path, model: str, payload: dict, env: dict, timeout: int = 900) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        result_path = handle.name
    command = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--folder",
        str(folder),
        "--model",
        model,
        "--payload",
        json.dumps(payload),
        "--result",
        result_path,
    ]
    completed = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    try:
        if completed.returncode != 0:
            return {"error": (completed.stderr or completed.stdout)[-1500:]}
        result = json.loads(Path(result_path).read_text())
        result["log"] = completed.stdout[-20000:] + completed.stderr[-20000:]
        return result
    finally:
        os.unlink(result_path)


def attention_choices(log: str) -> dict:
    """Counts of ORT's per-node attention-kernel report lines ("... SdpaKernel=..." in ORT's debug output)."""
    lines = [line.strip() for line in log.splitlines() if "SdpaKernel" in line or "sdpa_kernel" in line.lower()]
    return dict(
        collections.Counter(
            line.split("SdpaKernel=")[-1] if "SdpaKernel=" in line else line for line in lines
        ).most_common(10)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sd15")
    parser.add_argument("--work", default="/tmp/bench-work")
    parser.add_argument("--out", default="benchmarks/results/latest")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--payload", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        payload = json.loads(args.payload)
        if args.child == "floor":
            result = floor_in_process(args.folder, args.model, payload["options"], payload["repeats"])
        else:
            result = kernels_in_process(args.folder, args.model, payload["steps"])
        Path(args.result).write_text(json.dumps(result))
        return 0

    from optimum_iobinding.bench.probes import environment
    from optimum_iobinding.bench.zoo import ensure_export

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = ensure_export(args.model, "fp16", "optimized", Path(args.work))
    results = {
        "environment": environment(),
        "model": args.model,
        "folder": str(folder),
        "command": " ".join(["python3 benchmarks/unet_options.py", *sys.argv[1:]]),
        "op_counts": op_counts(folder),
        "variants": {},
    }
    kernels = _child("kernels", folder, args.model, {"steps": 10}, {"ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO": "1"})
    kernels["attention_kernels"] = attention_choices(kernels.pop("log", ""))
    results["kernels"] = kernels
    (out / "unet-options.json").write_text(json.dumps(results, indent=2))
    for name in [v for v in args.variants.split(",") if v]:
        options, env = VARIANTS[name]
        result = _child("floor", folder, args.model, {"options": options, "repeats": args.repeats}, env)
        result.pop("log", None)
        results["variants"][name] = {"provider_options": options, "env": env, **result}
        print(name, result.get("per_step_ms", result.get("error", "")[-300:]), flush=True)
        (out / "unet-options.json").write_text(json.dumps(results, indent=2))
    lines = [
        f"# UNet step time by CUDA EP options — {args.model}, fp16, --optimize cuda",
        "",
        f"`{results['command']}` on {results['environment']['device']}, onnxruntime "
        f"{results['environment']['onnxruntime']}",
        "",
        "| variant | provider options | GPU floor ms/step |",
        "|---|---|---|",
    ]
    for name, row in results["variants"].items():
        value = f"{row['per_step_ms']:.3f}" if "per_step_ms" in row else "error"
        lines.append(f"| {name} | `{json.dumps(row['provider_options'])}` | {value} |")
    if "by_family" in kernels:
        lines += [
            "",
            f"Plain-session kernels: {kernels['kernel_ms_per_step']:.3f} ms/step in "
            f"{kernels['kernels_per_step']} kernels",
            "",
            "| family | ms/step |",
            "|---|---|",
        ]
        lines += [f"| {name} | {ms:.3f} |" for name, ms in kernels["by_family"].items()]
    (out / "unet-options.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

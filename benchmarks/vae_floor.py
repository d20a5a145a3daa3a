"""Where the full VAE's time goes at 512², fp16, batch 1, on a GPU: ONNX Runtime's fused VAE encoder and decoder (the
bench zoo's SD-Turbo export, random weights) against diffusers' torch ``AutoencoderKL`` with the same architecture
and seed, each as back-to-back CUDA-graph replays, with the kernels that take the time (torch's profiler sees ORT's
kernels too: one process, one device).

    python benchmarks/vae_floor.py --work /tmp/bench-work --out /tmp/res/vae

Writes ``vae_floor.json`` (every row, the kernel tables, device, versions, the command) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Dict

import torch

from optimum_iobinding import IOBindingORTModel
from optimum_iobinding.bench.probes import environment, kernel_table, replay_ms
from optimum_iobinding.bench.zoo import build_torch_pipeline, ensure_export


def graph_ms(function: Callable[[], object], replays: int = 30) -> float:
    """ms per replay of ``function`` captured as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            function()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        function()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/bench-work")
    parser.add_argument("--out", default="vae-floor")
    parser.add_argument("--size", type=int, default=512)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size, latent = args.size, args.size // 8
    result: Dict[str, object] = {
        "environment": environment(),
        "command": " ".join(sys.argv),
        "size": size,
        "rows": {},
        "kernels": {},
    }
    rows, kernels = result["rows"], result["kernels"]
    folder = ensure_export("turbo", "fp16", "optimized", Path(args.work))
    shapes = {"vae_encoder": ("sample", (1, 3, size, size)), "vae_decoder": ("latent_sample", (1, 4, latent, latent))}
    for name, (input_name, shape) in shapes.items():
        captured = IOBindingORTModel.from_pretrained(
            folder, subfolder=name, provider="CUDAExecutionProvider", cuda_graph=True
        )
        x = torch.randn(shape, device="cuda").to(captured.input_dtypes[input_name])
        with torch.cuda.stream(captured.stream):
            for _ in range(3):
                captured(**{input_name: x})
            runner = captured.graph_runner({input_name: shape})
        rows[f"ort/{name}"] = (
            replay_ms(runner, captured.stream, 30)
            if runner is not None
            else f"no CUDA graph: {captured.graph_fallbacks}"
        )
        plain = IOBindingORTModel.from_pretrained(
            folder, subfolder=name, provider="CUDAExecutionProvider", cuda_graph=False
        )
        with torch.cuda.stream(plain.stream):
            plain(**{input_name: x})
            kernels[f"ort/{name}"] = kernel_table(lambda: plain(**{input_name: x}))
        print(name, "ort", rows[f"ort/{name}"], flush=True)
        captured = plain = None  # the sessions go before the torch VAE loads
    torch.backends.cudnn.benchmark = True
    vae = build_torch_pipeline("turbo").vae.to("cuda", torch.float16).eval()
    for layout in ("nchw", "channels_last"):
        if layout == "channels_last":
            vae = vae.to(memory_format=torch.channels_last)
        image = torch.randn(1, 3, size, size, device="cuda", dtype=torch.float16)
        z = torch.randn(1, 4, latent, latent, device="cuda", dtype=torch.float16)
        if layout == "channels_last":
            image, z = (
                image.contiguous(memory_format=torch.channels_last),
                z.contiguous(memory_format=torch.channels_last),
            )
        with torch.inference_mode():
            encode = lambda: vae.encode(image).latent_dist.mode()  # noqa: E731
            decode = lambda: vae.decode(z).sample  # noqa: E731
            for name, function in (("vae_encoder", encode), ("vae_decoder", decode)):
                try:
                    rows[f"torch-{layout}/{name}"] = graph_ms(function)
                    kernels[f"torch-{layout}/{name}"] = kernel_table(function)
                except Exception as error:  # a row that failed says why; the others still count
                    rows[f"torch-{layout}/{name}"] = f"{type(error).__name__}: {error}"[:300]
                print(name, layout, rows[f"torch-{layout}/{name}"], flush=True)
    (out / "vae_floor.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""FLUX.1 Kontext, Fill, Control and ControlNet on one GPU: ours against diffusers' torch pipelines (bf16 eager and
``torch.compile`` of the transformer), per step and end to end, at 1024² with random weights.

Each variant is FLUX.1 dev's architecture at ``--blocks N`` (N double-stream and 2 N single-stream blocks, full width;
T5 at ``--text-layers``): Kontext dev's transformer (the reference image's tokens beside the latents'), Fill's
taking 384 values a token, Control's 128, and dev's transformer with one ``FluxControlNetModel`` of N double-stream
and 2 N single-stream blocks (conditioning scale 0.7). Its torch pipeline (``FluxKontextPipeline``,
``FluxFillPipeline``, ``FluxControlPipeline``, ``FluxControlNetPipeline``) is exported once (fused fp16) under
``--work``; ours is the exported folder through ``pipeline_class_for`` (detected from its model_index.json), on CUDA
with its graphs. Inputs: a random RGB image of the size (Kontext's reference, Fill's image with a centred square
mask, the control image), the same prompt and seed. Per peer (each in this process, one after the other): the first
call (load apart), then ``--runs`` calls at ``--steps`` and at 2 steps, to numpy images: per-step ms = the difference
of their medians / (steps − 2); end to end = the median at ``--steps``. For ours also its own floor: back-to-back
replays of the transformer's captured graph, plus each ControlNet's (``graph_floor_ms``), and the step over it (by
the difference of medians, and by CUDA events inside whole calls: ``gpu_step_ms``).
``--device cpu`` with ``--tiny`` is a dry run on the tiny variants.

    python benchmarks/flux_variants.py --work /tmp/bench-work --out OUT/flux-variants --blocks 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import PIL.Image
import torch

# run as a script: benchmarks/ is on the path
from lora_switch import sync

VARIANTS = ("kontext", "fill", "control", "controlnet")


def build(variant: str, blocks: int, text_layers: int, tiny: bool):
    """The variant's torch pipeline (float32 on the host: the exporter's input)."""
    import inspect

    import diffusers
    from diffusers import FluxTransformer2DModel

    from optimum_iobinding.export.tiny import build_tiny_random_flux_variant_pipeline

    if tiny:
        if variant == "controlnet":
            from optimum_iobinding.export.tiny import build_tiny_random_flux_controlnet_pipeline

            return build_tiny_random_flux_controlnet_pipeline()
        return build_tiny_random_flux_variant_pipeline(variant)
    from diffusers import FluxControlNetModel

    from optimum_iobinding.bench.zoo import build_transformer_pipeline

    components = build_transformer_pipeline("flux-dev", blocks, text_layers).components
    if variant == "controlnet":
        components["controlnet"] = FluxControlNetModel.from_transformer(
            components["transformer"],
            num_layers=blocks,
            num_single_layers=2 * blocks,
            load_weights_from_transformer=False,
        )
    width = {"kontext": None, "fill": 384, "control": 128, "controlnet": None}[variant]
    if width is not None:
        config = {k: v for k, v in components["transformer"].config.items() if not k.startswith("_")}
        components["transformer"] = FluxTransformer2DModel(**{**config, "in_channels": width, "out_channels": 64})
    name = {
        "kontext": "FluxKontextPipeline",
        "fill": "FluxFillPipeline",
        "control": "FluxControlPipeline",
        "controlnet": "FluxControlNetPipeline",
    }[variant]
    pipeline_class = getattr(diffusers, name)
    accepted = inspect.signature(pipeline_class.__init__).parameters
    return pipeline_class(**{key: module for key, module in components.items() if key in accepted})


def images_for(variant: str, size: int) -> dict:
    rng = np.random.default_rng(0)
    image = PIL.Image.fromarray((rng.random((size, size, 3)) * 255).astype(np.uint8))
    if variant == "kontext":
        return {"image": image, "max_area": size * size}
    if variant == "control":
        return {"control_image": image}
    if variant == "controlnet":
        return {"control_image": image, "controlnet_conditioning_scale": 0.7}
    mask = np.zeros((size, size), np.uint8)
    mask[size // 4 : 3 * size // 4, size // 4 : 3 * size // 4] = 255
    return {"image": image, "mask_image": PIL.Image.fromarray(mask)}


def call_arguments(variant: str, size: int) -> dict:
    """The variant's call, but for the step count."""
    return {
        "prompt": "a red castle in the forest",
        "height": size,
        "width": size,
        "guidance_scale": 3.5 if variant != "fill" else 30.0,
        "max_sequence_length": 64,
        **images_for(variant, size),
    }


def measure(pipe, arguments: dict, steps: int, runs: int) -> dict:
    """The first call, then ``runs`` calls at ``steps`` and at 2 steps (same seed, numpy images): the first call's
    seconds, the end-to-end median and the per-step ms by difference of medians; on CUDA also the step's GPU time
    inside whole calls (``gpu_step_ms``: CUDA events on the call's stream at the ends of the first and the last step,
    the median over ``runs`` calls), which two noisy medians do not blur. The step-end callback that records them
    makes our loop copy its constant inputs into the graph again each step (a few µs: it may have changed them)."""
    cuda = torch.cuda.is_available() and str(getattr(pipe, "device", "cuda")).startswith("cuda")

    def call(count: int, events: dict = None) -> float:
        extra = {}
        if events is not None:

            def mark(pipeline, step, timestep, tensors):
                if step in (0, count - 1):
                    events[step] = torch.cuda.Event(enable_timing=True)
                    events[step].record()
                return tensors

            extra["callback_on_step_end"] = mark
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            pipe(
                **arguments,
                num_inference_steps=count,
                generator=torch.Generator().manual_seed(0),
                output_type="np",
                **extra,
            )
        sync()
        return time.perf_counter() - start

    def gpu_step_ms() -> float:
        events = {}
        call(steps, events)
        return events[0].elapsed_time(events[steps - 1]) / (steps - 1)

    first = call(steps)
    full = statistics.median(call(steps) for _ in range(runs))
    short = statistics.median(call(2) for _ in range(runs))
    return {
        "first_call_s": first,
        "end_to_end_ms": 1000 * full,
        "per_step_ms": 1000 * (full - short) / (steps - 2),
        "gpu_step_ms": statistics.median(gpu_step_ms() for _ in range(runs)) if cuda else None,
    }


def own_floor(pipe, per_step_ms: float, gpu_step_ms: float = None) -> dict:
    """Our step's floor: back-to-back replays of the denoiser's captured graph (the transformer or the UNet) and of
    each ControlNet's (None where one of them captured none or several), and the step over it."""
    from optimum_iobinding.bench.probes import graph_floor_ms

    name = "transformer" if getattr(pipe, "transformer", None) is not None else "unet"
    parts = {name: graph_floor_ms(getattr(pipe, name))}
    for k, net in enumerate(getattr(pipe, "controlnets", [])):
        parts[f"controlnet_{k}"] = graph_floor_ms(net)
    floor = None if None in parts.values() else sum(parts.values())
    return {
        "own_floor_parts_ms": parts,
        "own_floor_ms": floor,
        "per_step_over_own_floor": per_step_ms / floor if floor else None,
        "gpu_step_over_own_floor": gpu_step_ms / floor if floor and gpu_step_ms else None,
    }


def compare_with_ours(peers: dict) -> None:
    """Each other peer's per-step, GPU-step and end-to-end times over ours (where both were measured), in place."""
    ours = peers.get("ours", {})
    for peer, measured in peers.items():
        if peer != "ours" and "per_step_ms" in measured and "per_step_ms" in ours:
            measured["step_over_ours"] = measured["per_step_ms"] / ours["per_step_ms"]
            if measured.get("gpu_step_ms") and ours.get("gpu_step_ms"):
                measured["gpu_step_over_ours"] = measured["gpu_step_ms"] / ours["gpu_step_ms"]
            measured["end_to_end_over_ours"] = measured["end_to_end_ms"] / ours["end_to_end_ms"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-work"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--text-layers", type=int, default=4)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--peers", default="ours,torch,compile")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="the tiny variants (a dry run, with --device cpu)")
    parser.add_argument("--export-only", action="store_true", help="make the exports, measure nothing")
    args = parser.parse_args()
    variants, peers = args.variants.split(","), args.peers.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: expected names among {', '.join(VARIANTS)}, got {', '.join(unknown)}")

    from optimum_iobinding.bench.probes import environment
    from optimum_iobinding.bench.transformer_peers import weights_made_on
    from optimum_iobinding.export import export_pipeline
    from optimum_iobinding.pipelines import pipeline_class_for

    cuda = args.device == "cuda"
    result = {"environment": environment(), "command": " ".join(["python3", *sys.argv]), "rows": []}
    for variant in variants:
        name = f"flux-{variant}-{'tiny' if args.tiny else f'blocks{args.blocks}-text{args.text_layers}'}"
        folder = args.work / f"{name}-{'fp16-optimized' if cuda else 'fp32'}"
        row = {"variant": variant, "folder": str(folder), "peers": {}}
        if not (folder / "model_index.json").is_file():
            start = time.perf_counter()
            export_pipeline(
                None,
                folder,
                torch_pipeline=build(variant, args.blocks, args.text_layers, args.tiny),
                dtype="fp16" if cuda else "fp32",
                optimize="cuda" if cuda else None,
                progress=False,
            )
            row["export_s"] = time.perf_counter() - start
        if args.export_only:
            continue
        for peer in peers:
            try:
                start = time.perf_counter()
                if peer == "ours":
                    provider = "CUDAExecutionProvider" if cuda else "CPUExecutionProvider"
                    pipe = pipeline_class_for(folder, text_to_image=False).from_pretrained(folder, provider=provider)
                else:
                    dtype = torch.bfloat16 if cuda else torch.float32
                    with weights_made_on(torch.device(args.device), dtype):
                        pipe = build(variant, args.blocks, args.text_layers, args.tiny)
                    pipe = pipe.to(args.device, dtype)
                    if peer == "compile":
                        pipe.transformer = torch.compile(pipe.transformer)
                pipe.set_progress_bar_config(disable=True)
                load_s = time.perf_counter() - start
                row["peers"][peer] = {
                    "load_s": load_s,
                    **measure(pipe, call_arguments(variant, args.size), args.steps, args.runs),
                }
                if peer == "ours" and cuda:
                    measured = row["peers"][peer]
                    measured.update(own_floor(pipe, measured["per_step_ms"], measured["gpu_step_ms"]))
            except Exception as error:  # one peer failing must not lose the others
                row["peers"][peer] = {"error": f"{type(error).__name__}: {error}"[:2000]}
            pipe = None
            if cuda:
                torch.cuda.empty_cache()
        compare_with_ours(row["peers"])
        result["rows"].append(row)
        print(json.dumps(row, indent=1), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "flux-variants.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""SDXL with a ControlNet on one GPU: ours against diffusers' torch ``StableDiffusionXLControlNetPipeline`` in float16
(eager), per step and end to end, at 1024² with random weights.

SDXL base's architecture (:func:`optimum_iobinding.bench.zoo.build_torch_pipeline` ``"sdxl"``: both CLIP text
encoders, the UNet, the VAE) with its UNet's last level at ``--depth`` transformer layers a block (SDXL's is 10; the
export of the whole UNet with ORT's fusions takes longer than a GPU session holds: the depth is said in the result),
and one ``ControlNetModel.from_unet`` of that UNet (conditioning scale 0.7), DDIM, guidance 5 (two rows a step). The
torch pipeline is exported once (fused fp16) under ``--work``; ours is the exported folder through
``pipeline_class_for``, on CUDA with its graphs. Per peer (in this process, one after the other): the first call,
then ``--runs`` calls at ``--steps`` and at 2 steps (numpy images): per-step ms by difference of medians, end to end
the median at ``--steps``; for ours also its own floor (the UNet's and the ControlNet's graphs replayed back to
back). diffusers' float16 SDXL pipeline decodes with its VAE upcast to float32 (``force_upcast``, as it runs SDXL
for users: SDXL's VAE overflows in float16), ours in float16: the end-to-end rows compare the pipelines as shipped.
``--device cpu --tiny`` is a dry run on the tiny SDXL ControlNet pipeline.

    python benchmarks/xl_controlnet.py --work /tmp/bench-work --out OUT/xl-controlnet
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import PIL.Image
import torch

# run as a script: benchmarks/ is on the path
from flux_variants import compare_with_ours, measure, own_floor


def build(depth: int, tiny: bool):
    """The torch pipeline (float32 on the host: the exporter's input)."""
    if tiny:
        from optimum_iobinding.export.tiny import build_tiny_random_xl_controlnet_pipeline

        return build_tiny_random_xl_controlnet_pipeline()
    from diffusers import ControlNetModel, StableDiffusionXLControlNetPipeline, UNet2DConditionModel

    from optimum_iobinding.bench.zoo import build_torch_pipeline

    base = build_torch_pipeline("sdxl")
    config = {k: v for k, v in base.unet.config.items() if not k.startswith("_")}
    layers = tuple(config["transformer_layers_per_block"])
    unet = UNet2DConditionModel(**{**config, "transformer_layers_per_block": (*layers[:-1], depth)})
    components = {**base.components, "unet": unet, "controlnet": ControlNetModel.from_unet(unet)}
    return StableDiffusionXLControlNetPipeline(**components)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-work"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--depth", type=int, default=2, help="transformer layers a block at the UNet's last level")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--peers", default="ours,torch")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="the tiny SDXL ControlNet pipeline (with --device cpu)")
    parser.add_argument("--export-only", action="store_true", help="make the export, measure nothing")
    args = parser.parse_args()

    from optimum_iobinding.bench.probes import environment
    from optimum_iobinding.bench.transformer_peers import weights_made_on
    from optimum_iobinding.export import export_pipeline
    from optimum_iobinding.pipelines import pipeline_class_for

    cuda = args.device == "cuda"
    name = "xl-controlnet-tiny" if args.tiny else f"xl-controlnet-depth{args.depth}"
    folder = args.work / f"{name}-{'fp16-optimized' if cuda else 'fp32'}"
    row = {"folder": str(folder), "depth": None if args.tiny else args.depth, "peers": {}}
    if not (folder / "model_index.json").is_file():
        start = time.perf_counter()
        export_pipeline(
            None,
            folder,
            torch_pipeline=build(args.depth, args.tiny),
            dtype="fp16" if cuda else "fp32",
            optimize="cuda" if cuda else None,
            progress=False,
        )
        row["export_s"] = time.perf_counter() - start
    if args.export_only:
        return 0
    rng = np.random.default_rng(0)
    control = PIL.Image.fromarray((rng.random((args.size, args.size, 3)) * 255).astype(np.uint8))
    arguments = {
        "prompt": "a red castle in the forest",
        "height": args.size,
        "width": args.size,
        "guidance_scale": 5.0,
        "image": control,
        "controlnet_conditioning_scale": 0.7,
    }
    pipe = None
    for peer in args.peers.split(","):
        try:
            start = time.perf_counter()
            if peer == "ours":
                provider = "CUDAExecutionProvider" if cuda else "CPUExecutionProvider"
                pipe = pipeline_class_for(folder, text_to_image=False).from_pretrained(folder, provider=provider)
            elif peer == "torch":
                dtype = torch.float16 if cuda else torch.float32
                with weights_made_on(torch.device(args.device), dtype):
                    pipe = build(args.depth, args.tiny)
                pipe = pipe.to(args.device, dtype)
            else:
                raise ValueError(f"--peers: expected ours or torch, got {peer!r}")
            from diffusers import DDIMScheduler

            pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
            pipe.set_progress_bar_config(disable=True)
            load_s = time.perf_counter() - start
            row["peers"][peer] = {"load_s": load_s, **measure(pipe, arguments, args.steps, args.runs)}
            if peer == "ours" and cuda:
                measured = row["peers"][peer]
                measured.update(own_floor(pipe, measured["per_step_ms"], measured["gpu_step_ms"]))
        except Exception as error:  # one peer failing must not lose the other
            row["peers"][peer] = {"error": f"{type(error).__name__}: {error}"[:2000]}
        pipe = None
        if cuda:
            torch.cuda.empty_cache()
    compare_with_ours(row["peers"])
    result = {"environment": environment(), "command": " ".join(["python3", *sys.argv]), "rows": [row]}
    print(json.dumps(row, indent=1), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "xl-controlnet.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

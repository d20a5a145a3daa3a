"""Runtime LoRA on the GPU: loading, applying and switching adapters against re-creating the sessions,
and the per-step time with a LoRA applied against without one.

On the default pipeline (CUDA graphs captured by ``warmup``) of an export folder, with two random LoRAs made for its
architecture (no LoRA can be downloaded on the GPU machine; ``random_lora_layers`` on a UNet and text encoder built
on the ``meta`` device from the folder's configs):

- ``load_s``: ``load_lora_weights`` of each adapter (read, match to the export's weight map, write W₀ + ΔW);
- ``switch_s``: ``set_adapters`` between the two, alternating, each followed by a device synchronize;
- ``disable_s`` / ``enable_s``; ``recreate_unet_s``: a new UNet session from the folder plus its first CFG call at
  the same size (what applying a LoRA costs where the weights are baked into the session), and
  ``recreate_pipeline_s`` (``from_pretrained`` + ``warmup``);
- ``per_step_ms`` without a LoRA, with adapter A, with A and B mixed, after ``unload_lora_weights``: (median of
  30-step calls − median of 10-step calls) / 20, latents output (no decode); then the same three states again in
  interleaved rounds (``per_step_ms_interleaved``, whose medians the summary compares: the GPU's clocks drift over
  a run, so states measured one after another differ by a few percent whatever they hold);
- ``sessions_created`` before and after all of it, and whether the images changed and came back.

    python benchmarks/lora_switch.py --folder WORK/sd15-fp16-optimized --out OUT/lora-switch
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def make_loras(folder: Path, work: Path) -> dict:
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from optimum_iobinding.export.tiny import random_lora_layers, save_lora

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(json.loads((folder / "unet" / "config.json").read_text()))
        text = CLIPTextModel(CLIPTextConfig(**json.loads((folder / "text_encoder" / "config.json").read_text())))
    attention = ["to_q", "to_k", "to_v", "to_out.0"]
    return {
        # the usual diffusers training targets, rank 8, UNet and text encoder
        "a": save_lora(
            work / "a",
            unet=random_lora_layers(unet, attention, 8, seed=1),
            text_encoder=random_lora_layers(text, ["q_proj", "k_proj", "v_proj", "out_proj"], 8, seed=2),
        ),
        # a wider one: attention, projections, feed-forward and the ResNet convolutions, rank 16
        "b": save_lora(
            work / "b",
            unet=random_lora_layers(
                unet, [*attention, "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2", "conv1", "conv2"], 16, seed=3
            ),
        ),
    }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(action) -> float:
    sync()
    start = time.perf_counter()
    action()
    sync()
    return time.perf_counter() - start


def per_step_ms(pipe, size: int, runs: int = 5) -> float:
    def call(steps):
        return timed(
            lambda: pipe(
                "a photo of a cat",
                height=size,
                width=size,
                num_inference_steps=steps,
                generator=torch.Generator().manual_seed(0),
                output_type="latent",
            )
        )

    call(30)
    full = statistics.median(call(30) for _ in range(runs))
    short = statistics.median(call(10) for _ in range(runs))
    return 1000 * (full - short) / 20


def image(pipe, size: int) -> np.ndarray:
    return pipe(
        "a photo of a cat",
        height=size,
        width=size,
        num_inference_steps=4,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--switches", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds of the per-step measurement")
    parser.add_argument("--provider", default="CUDAExecutionProvider", help="CPUExecutionProvider: a dry run")
    args = parser.parse_args()

    from optimum_iobinding import IOBindingORTModel, OnnxStableDiffusionPipeline
    from optimum_iobinding.bench.probes import environment

    result = {
        **environment(),
        "command": " ".join(["python", *sys.argv]),
        "folder": str(args.folder),
        "size": args.size,
    }
    work = Path(tempfile.mkdtemp())
    loras = make_loras(args.folder, work)
    result["lora_files_mb"] = {
        name: round(sum(f.stat().st_size for f in path.iterdir()) / 2**20, 1) for name, path in loras.items()
    }

    start = time.perf_counter()
    pipe = OnnxStableDiffusionPipeline.from_pretrained(args.folder, provider=args.provider)
    pipe.set_progress_bar_config(disable=True)
    pipe.warmup(heights=args.size, batch_sizes=[1])
    sync()
    result["recreate_pipeline_s"] = time.perf_counter() - start
    result["per_step_ms"] = {"no LoRA": per_step_ms(pipe, args.size)}
    base = image(pipe, args.size)
    created = pipe.sessions_created
    result["sessions_created_before"] = created
    result["graph_signatures_unet"] = len(pipe.unet.graph_signatures)

    result["load_s"] = {"a": timed(lambda: pipe.load_lora_weights(str(loras["a"]), adapter_name="a"))}
    with_a = image(pipe, args.size)
    result["per_step_ms"]["LoRA a"] = per_step_ms(pipe, args.size)
    result["load_s"]["b"] = timed(lambda: pipe.load_lora_weights(str(loras["b"]), adapter_name="b"))
    with_b = image(pipe, args.size)
    switches = []
    for k in range(args.switches):
        name = "a" if k % 2 == 0 else "b"
        switches.append(timed(lambda: pipe.set_adapters([name])))
    result["switch_s"] = {"median": statistics.median(switches), "max": max(switches), "all": switches}
    pipe.set_adapters(["a"])
    again_a = image(pipe, args.size)
    result["mix_s"] = timed(lambda: pipe.set_adapters(["a", "b"], adapter_weights=[0.7, 0.5]))
    result["per_step_ms"]["LoRAs a + b"] = per_step_ms(pipe, args.size)
    result["disable_s"] = timed(pipe.disable_lora)
    disabled = image(pipe, args.size)
    result["enable_s"] = timed(pipe.enable_lora)
    result["fuse_s"] = timed(lambda: pipe.fuse_lora(lora_scale=1.0))
    result["unfuse_s"] = timed(pipe.unfuse_lora)
    result["unload_s"] = timed(pipe.unload_lora_weights)
    unloaded = image(pipe, args.size)
    result["per_step_ms"]["after unload"] = per_step_ms(pipe, args.size)
    # the same states interleaved (clocks drift over a run): rounds of no LoRA, a, a + b
    pipe.load_lora_weights(str(loras["a"]), adapter_name="a")
    pipe.load_lora_weights(str(loras["b"]), adapter_name="b")
    interleaved = {"no LoRA": [], "LoRA a": [], "LoRAs a + b": []}
    for _ in range(args.rounds):
        pipe.disable_lora()
        interleaved["no LoRA"].append(per_step_ms(pipe, args.size))
        pipe.enable_lora()
        pipe.set_adapters(["a"])
        interleaved["LoRA a"].append(per_step_ms(pipe, args.size))
        pipe.set_adapters(["a", "b"], adapter_weights=[0.7, 0.5])
        interleaved["LoRAs a + b"].append(per_step_ms(pipe, args.size))
    result["per_step_ms_interleaved"] = interleaved
    result["sessions_created_after"] = pipe.sessions_created
    result["images"] = {
        "a changed the image (max |Δ|)": float(np.abs(with_a - base).max()),
        "b changed it from a": float(np.abs(with_b - with_a).max()),
        "a again after switches = a": float(np.abs(again_a - with_a).max()),
        "disabled = no LoRA": float(np.abs(disabled - base).max()),
        "unloaded = no LoRA": float(np.abs(unloaded - base).max()),
    }

    # what a LoRA costs where the weights live in the session: a new UNet session and its first call (capture)
    def recreate():
        unet = IOBindingORTModel.from_pretrained(args.folder / "unet", provider=args.provider, stream=pipe.stream)
        dtype, device, latent = unet.input_dtypes["sample"], unet.device, args.size // 8
        unet(
            sample=torch.randn(2, 4, latent, latent, device=device, dtype=dtype),
            timestep=torch.full([2], 500, device=device, dtype=unet.input_dtypes["timestep"]),
            encoder_hidden_states=torch.randn(
                2, 77, unet.input_dims["encoder_hidden_states"][2], device=device, dtype=dtype
            ),
        )
        del unet

    result["recreate_unet_s"] = timed(recreate)
    steps = {state: statistics.median(values) for state, values in interleaved.items()}
    result["summary"] = {
        "switch median s (target < 0.5)": result["switch_s"]["median"],
        "switch max s": result["switch_s"]["max"],
        "recreate UNet session s": result["recreate_unet_s"],
        "per step ms, medians of the interleaved rounds": steps,
        "per step with LoRA a / without (interleaved)": steps["LoRA a"] / steps["no LoRA"],
        "per step with a + b / without (interleaved)": steps["LoRAs a + b"] / steps["no LoRA"],
        "sessions created by LoRA work": result["sessions_created_after"] - created,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lora-switch.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Runtime LoRA on a FLUX.1 transformer: a step with a LoRA against without (ours, whose LoRA is in the weights, and
diffusers' torch pipeline, whose PEFT layers run the LoRA beside each layer at every step), and switching between
two loaded adapters, at two depths of the transformer, with the switch's cost per block scaled to FLUX.1 dev's 57
blocks.

For each ``--blocks N`` (N double-stream and 2 N single-stream blocks, full width; T5 at ``--text-layers``): the bench
zoo's fused fp16 export of FLUX.1 dev's architecture (random weights), two random LoRAs in diffusers' format made
for its transformer (rank ``--rank``, the attention and feed-forward layers, ``random_lora_layers`` on a transformer
built on the ``meta`` device from the folder's config), then:

- ours (``OnnxFluxPipeline``, CUDA graphs): per-step ms without a LoRA, with adapter A, with A and B mixed (the
  difference of the medians of ``--steps`` and 2-step calls, latents out); ``set_adapters`` switching A ↔ B (each
  followed by a device synchronize); the images (a LoRA changes it, ``disable_lora`` gives the base one back);
- diffusers' ``FluxPipeline`` in bf16 (weights drawn on the device) with the same LoRA files through
  ``load_lora_weights`` (PEFT's unfused layers): per-step ms without and with adapter A, each load's seconds, and
  ``set_adapters`` switching A ↔ B.

The switch at 57 blocks is an estimate: the two depths' switch times give a cost per block and a constant, and the
line through them is read at 57 (19 + 38). Writes ``transformer-lora.json`` to ``--out``.

    python benchmarks/transformer_lora.py --work /tmp/bench-work --out OUT/transformer-lora --blocks 2,4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

# run as a script: benchmarks/ is on the path (the runtime LoRA benchmark of the UNets, whose timing helpers these are)
from lora_switch import sync, timed

FULL_BLOCKS = 19 + 38  # FLUX.1 dev's double- and single-stream blocks
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "proj_mlp"]


def make_loras(folder: Path, work: Path, rank: int) -> dict:
    from diffusers import FluxTransformer2DModel

    from optimum_iobinding.export.tiny import random_lora_layers, save_lora

    config = json.loads((folder / "transformer" / "config.json").read_text())
    with torch.device("meta"):
        transformer = FluxTransformer2DModel.from_config(config)
    return {
        name: save_lora(work / name, transformer=random_lora_layers(transformer, TARGETS, rank, seed=seed))
        for name, seed in (("a", 1), ("b", 2))
    }


def call(pipe, size: int, steps: int, output_type: str = "latent"):
    return pipe(
        "a photo of a cat",
        height=size,
        width=size,
        num_inference_steps=steps,
        guidance_scale=3.5,
        max_sequence_length=64,
        generator=torch.Generator().manual_seed(0),
        output_type=output_type,
    )


def per_step_ms(pipe, size: int, steps: int, runs: int) -> float:
    call(pipe, size, steps)
    full = statistics.median(timed(lambda: call(pipe, size, steps)) for _ in range(runs))
    short = statistics.median(timed(lambda: call(pipe, size, 2)) for _ in range(runs))
    return 1000 * (full - short) / (steps - 2)


def image(pipe, size: int) -> np.ndarray:
    images = call(pipe, size, 2, output_type="np").images
    return np.asarray(images, dtype=np.float32)


def ours(folder: Path, loras: dict, args) -> dict:
    from optimum_iobinding import OnnxFluxPipeline

    provider = "CUDAExecutionProvider" if args.device == "cuda" else "CPUExecutionProvider"
    pipe = OnnxFluxPipeline.from_pretrained(folder, provider=provider)
    pipe.set_progress_bar_config(disable=True)
    result = {"per_step_ms": {"no LoRA": per_step_ms(pipe, args.size, args.steps, args.runs)}}
    base = image(pipe, args.size)
    created = pipe.sessions_created
    result["load_s"] = {"a": timed(lambda: pipe.load_lora_weights(str(loras["a"]), adapter_name="a"))}
    with_a = image(pipe, args.size)
    result["per_step_ms"]["LoRA a"] = per_step_ms(pipe, args.size, args.steps, args.runs)
    result["load_s"]["b"] = timed(lambda: pipe.load_lora_weights(str(loras["b"]), adapter_name="b"))
    switches = [timed(lambda k=k: pipe.set_adapters(["a" if k % 2 == 0 else "b"])) for k in range(args.switches)]
    result["switch_s"] = {"median": statistics.median(switches), "max": max(switches), "all": switches}
    pipe.set_adapters(["a", "b"], adapter_weights=[0.7, 0.5])
    result["per_step_ms"]["LoRAs a + b"] = per_step_ms(pipe, args.size, args.steps, args.runs)
    pipe.disable_lora()
    disabled = image(pipe, args.size)
    result["sessions_created_by_lora_work"] = pipe.sessions_created - created
    result["images"] = {
        "a changed the image (max |Δ|)": float(np.abs(with_a - base).max()),
        "disabled = no LoRA (max |Δ|)": float(np.abs(disabled - base).max()),
    }
    steps = result["per_step_ms"]
    result["step_with_a_over_without"] = steps["LoRA a"] / steps["no LoRA"]
    return result


def diffusers_peft(kind: str, blocks: int, text_layers: int, loras: dict, args) -> dict:
    from optimum_iobinding.bench.transformer_peers import weights_made_on
    from optimum_iobinding.bench.zoo import build_transformer_pipeline

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with weights_made_on(device, dtype):
        pipe = build_transformer_pipeline(kind, blocks, text_layers)
    pipe = pipe.to(device, dtype)
    pipe.set_progress_bar_config(disable=True)
    result = {"per_step_ms": {"no LoRA": per_step_ms(pipe, args.size, args.steps, args.runs)}}
    result["load_s"] = {"a": timed(lambda: pipe.load_lora_weights(str(loras["a"]), adapter_name="a"))}
    result["per_step_ms"]["LoRA a"] = per_step_ms(pipe, args.size, args.steps, args.runs)
    result["load_s"]["b"] = timed(lambda: pipe.load_lora_weights(str(loras["b"]), adapter_name="b"))
    switches = [timed(lambda k=k: pipe.set_adapters(["a" if k % 2 == 0 else "b"])) for k in range(args.switches)]
    result["switch_s"] = {"median": statistics.median(switches), "max": max(switches), "all": switches}
    steps = result["per_step_ms"]
    result["step_with_a_over_without"] = steps["LoRA a"] / steps["no LoRA"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-work"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--blocks", default="2,4", help="two depths, comma-separated (N: N double, 2 N single)")
    parser.add_argument("--text-layers", type=int, default=4)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12, help="steps of the long call (the short one has 2)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--switches", type=int, default=10)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--kind", default="flux-dev", help="the bench zoo's model (tiny-flux with --device cpu)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--peers", default="ours,peft")
    args = parser.parse_args()
    depths = [int(n) for n in args.blocks.split(",")]
    if len(depths) != 2 or depths[0] >= depths[1] or min(depths) < 1:
        parser.error(f"--blocks: expected two increasing depths ≥ 1, got {args.blocks!r}")
    peers = args.peers.split(",")

    from optimum_iobinding.bench.probes import environment
    from optimum_iobinding.bench.zoo import ensure_transformer_export, transformer_blocks

    result = {"environment": environment(), "command": " ".join(["python3", *sys.argv]), "rows": []}
    for blocks in depths:
        text_layers = None if args.kind.startswith("tiny") else args.text_layers
        folder = ensure_transformer_export(
            args.kind, "fp16" if args.device == "cuda" else "fp32", "optimized", args.work, blocks, text_layers,
            device=args.device,
        )  # fmt: skip
        double, single = transformer_blocks(args.kind, blocks)
        row = {"blocks": blocks, "transformer_blocks": double + single, "folder": str(folder)}
        loras = make_loras(folder, Path(tempfile.mkdtemp()), args.rank)
        for peer, run in (("ours", lambda: ours(folder, loras, args)), ("peft", lambda: diffusers_peft(
            args.kind, blocks, text_layers, loras, args))):  # fmt: skip
            if peer not in peers:
                continue
            try:
                row[peer] = run()
            except Exception as error:  # one peer failing must not lose the other
                row[peer] = {"error": f"{type(error).__name__}: {error}"[:2000]}
            sync()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        result["rows"].append(row)
        print(json.dumps(row, indent=1), flush=True)
    switched = [(row["transformer_blocks"], row["ours"]["switch_s"]["median"]) for row in result["rows"]
                if "switch_s" in row.get("ours", {})]  # fmt: skip
    if len(switched) == 2 and switched[0][0] != switched[1][0]:  # (a tiny model keeps one depth whatever N)
        (b1, s1), (b2, s2) = switched
        per_block = (s2 - s1) / (b2 - b1)
        result["switch_at_57_blocks_s_estimate"] = {
            "per_block_s": per_block,
            "constant_s": s1 - per_block * b1,
            "at_57_blocks_s": s1 + per_block * (FULL_BLOCKS - b1),
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transformer-lora.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result.get("switch_at_57_blocks_s_estimate"), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where one step of an exported SD3 / FLUX.1 transformer spends its GPU time: the transformer of an export folder
(e.g. one the bench's ``--scenario transformer`` made under ``--work``) run alone at 1024², batch 1 (SD3: the CFG
batch of 2), its kernels grouped by name with torch's profiler (ORT's kernels are in the same process), beside the
CUDA-graph replay time of the same step.

    python benchmarks/transformer_kernels.py --folder /tmp/bench-work/flux-schnell-fp16-optimized-blocks2x4-text4 \
        --out /tmp/res/kernels

Writes ``transformer_kernels-<folder name>.json`` to ``--out`` (with ``--session-config``, the entries' values in the
name too). ``--session-config KEY=VALUE`` (repeatable) puts an ONNX Runtime session config entry on both sessions, e.g.
``optimization.disable_specified_optimizers=MatMulAddFusion`` to keep each bias as its own ``Add`` rather than ORT's
``Gemm`` with a broadcast bias.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from optimum_iobinding import IOBindingORTModel
from optimum_iobinding.bench.probes import environment, kernel_table, replay_ms


def step_inputs(model: IOBindingORTModel, size: int, text_tokens: int) -> dict:
    """One step's inputs at ``size``² with ``text_tokens`` T5 tokens: SD3's (CFG batch 2) or FLUX.1's (batch 1); a Wan
    transformer's at the video scenario's shape (480×832, 81 frames, CFG batch 2, 512 UMT5 tokens) whatever the size."""
    dtypes = model.input_dtypes
    latent = size // 8
    if len(model.input_dims["hidden_states"]) == 5:  # Wan: 81 frames at 480×832 (21 latent frames of 60 × 104), CFG
        shapes = {
            "hidden_states": (2, 16, 21, 60, 104),
            "encoder_hidden_states": (2, 512, 4096),
            "timestep": (2,),
        }
    elif "img_ids" in model.input_names:  # FLUX.1: 2×2-packed latent tokens, one batch
        tokens = (latent // 2) ** 2
        shapes = {
            "hidden_states": (1, tokens, 64),
            "encoder_hidden_states": (1, text_tokens, 4096),
            "pooled_projections": (1, 768),
            "timestep": (1,),
            "img_ids": (tokens, 3),
            "txt_ids": (text_tokens, 3),
            "guidance": (1,),
        }
    else:  # SD3: CLIP's 77 tokens and T5's, CFG batch
        shapes = {
            "hidden_states": (2, 16, latent, latent),
            "encoder_hidden_states": (2, 77 + text_tokens, 4096),
            "pooled_projections": (2, 2048),
            "timestep": (2,),
        }
    scale = 1000 if "img_ids" not in model.input_names else 1  # SD3's timestep in [0, 1000], FLUX.1's sigma in [0, 1]
    return {
        name: (torch.rand(shapes[name], device="cuda") * (scale if name == "timestep" else 1)).to(dtypes[name])
        for name in model.input_names
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", required=True)
    parser.add_argument("--out", default="transformer-kernels")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--text-tokens", type=int, default=256)
    parser.add_argument(
        "--session-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an ONNX Runtime session config entry for both sessions (repeatable)",
    )
    args = parser.parse_args()
    folder, out = Path(args.folder), Path(args.out)
    entries = dict(entry.split("=", 1) for entry in args.session_config)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "environment": environment(),
        "command": " ".join(sys.argv),
        "folder": folder.name,
        "session_config": entries,
    }

    def session_options():  # a fresh object per session: ORT keeps what it is given
        import onnxruntime as ort

        options = ort.SessionOptions()
        for key, value in entries.items():
            options.add_session_config_entry(key, value)
        return options

    captured = IOBindingORTModel.from_pretrained(
        folder,
        subfolder="transformer",
        provider="CUDAExecutionProvider",
        cuda_graph=True,
        sess_options=session_options(),
    )
    inputs = step_inputs(captured, args.size, args.text_tokens)
    with torch.cuda.stream(captured.stream):
        for _ in range(3):
            captured(**inputs)
        runner = captured.graph_runner({name: tuple(value.shape) for name, value in inputs.items()})
    result["graph_fallbacks"] = {str(dict(k)): v for k, v in captured.graph_fallbacks.items()}
    result["graph_replay_ms"] = replay_ms(runner, captured.stream, 10) if runner is not None else None
    del captured, runner
    plain = IOBindingORTModel.from_pretrained(
        folder,
        subfolder="transformer",
        provider="CUDAExecutionProvider",
        cuda_graph=False,
        sess_options=session_options(),
    )
    with torch.cuda.stream(plain.stream):
        plain(**inputs)
        result["kernels"] = kernel_table(lambda: plain(**inputs), calls=3, top=20)
    suffix = "".join(f"-{value.replace(',', '+')}" for value in entries.values())
    (out / f"transformer_kernels-{folder.name}{suffix}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Device memory per captured UNet signature: what one more batch size costs, with the provider options varied.

For each variant, in a fresh process: the UNet of an export alone, then ``warmup`` at each UNet batch in turn (CFG
doubles the image batch), recording device-wide used memory (cudaMemGetInfo, so ORT's arenas count) after loading
and after each signature. Shows how much of a signature is activations versus per-session overhead, and what
``cudnn_conv_use_max_workspace`` adds.

    python benchmarks/signature_memory.py --folder WORK/sd15-fp16-optimized --out OUT/signature-memory
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "defaults": {},
    "no-max-workspace": {"cudnn_conv_use_max_workspace": "0"},
    "no-graph": None,  # cuda_graph=False: fixed-shape sessions without graphs
}


def measure(folder: str, variant: str, batches, size: int) -> dict:
    import torch

    from optimum_iobinding import IOBindingORTModel
    from optimum_iobinding.runtime.weights import load_owned_weights

    def used() -> int:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free

    torch.cuda.init()
    idle = used()
    options = VARIANTS[variant]
    unet = IOBindingORTModel.from_pretrained(
        folder,
        subfolder="unet",
        provider="CUDAExecutionProvider",
        provider_options=options or {},
        cuda_graph=options is not None,
    )
    # the weights' size from the file: by default the one graph session loads them itself (none owned)
    weights = sum(
        w.numel() * w.element_size()
        for w in load_owned_weights(unet.model_path, torch.device("cpu"), min_elements=1).values()
    )
    loaded = used()
    hidden = unet.input_dims["encoder_hidden_states"][2]
    timestep_dims = unet.input_dims["timestep"]
    steps = []
    for batch in batches:
        shapes = {
            "sample": (batch, 4, size // 8, size // 8),
            "encoder_hidden_states": (batch, 77, hidden),
            "timestep": (batch,) if timestep_dims else (),
        }
        start = time.perf_counter()
        unet.warmup(shapes)
        seconds = time.perf_counter() - start
        steps.append({"unet_batch": batch, "used_mib": (used() - idle) / 2**20, "warmup_s": seconds})
    return {
        "variant": variant,
        "weights_mib": weights / 2**20,
        "loaded_mib": (loaded - idle) / 2**20,
        "signatures": steps,
        "sessions_created": unet.sessions_created,
        "graph_signatures": len(unet.graph_signatures),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="2,8,16,4")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.one:
        print(json.dumps(measure(args.folder, args.one, batches, args.size)))
        return 0
    rows = []
    for variant in VARIANTS:
        done = subprocess.run(
            [
                sys.executable,
                __file__,
                "--folder",
                args.folder,
                "--out",
                args.out,
                "--batches",
                args.batches,
                "--size",
                str(args.size),
                "--one",
                variant,
            ],
            capture_output=True,
            text=True,
        )
        rows.append(
            json.loads(done.stdout.strip().splitlines()[-1])
            if done.returncode == 0
            else {"variant": variant, "error": done.stderr[-1500:]}
        )
        print(rows[-1], flush=True)
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "signature-memory.json").write_text(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(0),
                "command": " ".join(["python", *sys.argv]),
                "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                "rows": rows,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

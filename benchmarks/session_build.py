"""Where an ONNX Runtime CUDA session's creation goes, per component of an exported pipeline folder: the seconds
``InferenceSession(...)`` takes in a fresh process, at each of ORT's graph optimization levels, and from an
optimized model written ahead (``optimized_model_filepath`` at the full level, its weights in a file beside it) loaded
with optimizations off, the offline flow ORT documents. Each case also times the session's first run (cuDNN's plans,
the arena's growth) on zero inputs of the folder's example shapes, and says whether the optimized model's outputs equal
the original's.

Each case runs in a process of its own, after one process that only imports onnxruntime and makes a CUDA context
(so the file cache and the driver are warm alike for every case). With the project's CUDA provider defaults, without
a graph (plain ``session.run`` on numpy arrays: the creation is what is measured).

    python benchmarks/session_build.py --folder WORK/sd15-fp16-optimized --out OUT/session-build
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

LEVELS = ("all", "extended", "basic", "disable")
CASES = (*LEVELS, "optimized-file")


def example_feed(session, component: str):
    """Zero inputs for one call of ``component`` at 512² and classifier-free guidance (batch 2)."""
    import torch

    from optimum_iobinding.runtime.dtypes import ORT_TO_TORCH

    sizes = {"batch": 2, "sequence": 77, "channels": 4, "height": 64, "width": 64}
    if component == "vae_decoder":
        sizes["batch"] = 1
    feed = {}
    for value in session.get_inputs():
        shape = []
        for axis, dim in enumerate(value.shape):
            if isinstance(dim, int):
                shape.append(dim)
            elif axis == 0:
                shape.append(sizes["batch"])
            elif value.name == "sample" or value.name == "latent_sample":
                shape.append(sizes["height"])
            else:
                shape.append(sizes["sequence"])
        feed[value.name] = torch.zeros(shape, dtype=ORT_TO_TORCH[value.type]).numpy()
    return feed


def one_case(folder: Path, component: str, case: str, optimized: Path) -> dict:
    import numpy as np
    import onnxruntime as ort

    from optimum_iobinding.runtime.cuda_policy import CUDA_DIFFUSION_DEFAULTS

    options = ort.SessionOptions()
    levels = {
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    }
    path = folder / component / "model.onnx"
    row = {"component": component, "case": case}
    if case == "write-optimized":
        options.graph_optimization_level = levels["all"]
        options.optimized_model_filepath = str(optimized)
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", optimized.name + ".data"
        )
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    elif case == "optimized-file":
        options.graph_optimization_level = levels["disable"]
        path = optimized
    else:
        options.graph_optimization_level = levels[case]
    provider = ("CUDAExecutionProvider", {**CUDA_DIFFUSION_DEFAULTS, "enable_cuda_graph": "0"})
    start = time.perf_counter()
    session = ort.InferenceSession(str(path), sess_options=options, providers=[provider])
    row["session_s"] = round(time.perf_counter() - start, 3)
    if case == "write-optimized":
        return row
    feed = example_feed(session, component)
    for run in ("first_run_s", "second_run_s"):
        start = time.perf_counter()
        outputs = session.run(None, feed)
        row[run] = round(time.perf_counter() - start, 3)
    row["output_sum"] = float(np.abs(outputs[0].astype(np.float64)).sum())
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--components", default="unet,text_encoder,vae_decoder")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--one", nargs=3, metavar=("COMPONENT", "CASE", "OPTIMIZED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        component, case, optimized = args.one
        print(json.dumps(one_case(args.folder, component, case, Path(optimized))))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", "import onnxruntime, torch; torch.zeros(1, device='cuda')"], check=True)
    rows = []
    for component in args.components.split(","):
        optimized = args.out / f"{component}-optimized" / "model.onnx"
        optimized.parent.mkdir(parents=True, exist_ok=True)
        cases = args.cases.split(",")
        if "optimized-file" in cases:
            cases = ["write-optimized", *cases]
        for case in cases:
            done = subprocess.run(
                [sys.executable, __file__, "--folder", str(args.folder), "--out", str(args.out),
                 "--one", component, case, str(optimized)],
                capture_output=True, text=True,
            )  # fmt: skip
            if done.returncode != 0:
                row = {"component": component, "case": case, "error": done.stderr.strip().splitlines()[-1:]}
            else:
                row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
        for path in optimized.parent.iterdir():  # gigabytes of weights: not kept
            path.unlink()
        optimized.parent.rmdir()
    (args.out / "session-build.json").write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

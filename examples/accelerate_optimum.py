"""An optimum-onnx pipeline switched in place to reused buffers, one stream and a CUDA-graph UNet.

Needs the optimum environment (`.venv-optimum` from scripts/test.sh). Offline, the tiny random pipeline is saved
and exported with optimum's exporter; with network pass an ONNX folder or hub id optimum can load.

    .venv-optimum/bin/python examples/accelerate_optimum.py
    .venv-optimum/bin/python examples/accelerate_optimum.py --model sd15-optimum-onnx --provider CUDAExecutionProvider
"""

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

from optimum_iobinding import accelerate
from optimum_iobinding.cli import UsageError, check_image_path, default_provider, run_script
from optimum_iobinding.export.tiny import build_tiny_random_pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="optimum ONNX folder (default: tiny, offline)")
    parser.add_argument("--provider", default=None)
    parser.add_argument("--out", default="accelerated.png")
    args = parser.parse_args()
    check_image_path(args.out)  # before any work: a name PIL writes, in a writable folder
    if importlib.util.find_spec("optimum") is None:  # before any work, in one line
        raise UsageError(
            "this example needs optimum-onnx, which this environment lacks: run it with .venv-optimum/bin/python "
            "(made by scripts/test.sh)"
        )
    from optimum.exporters.onnx import main_export
    from optimum.onnxruntime import ORTStableDiffusionPipeline

    provider = args.provider or default_provider()
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.model
        if folder is None:
            build_tiny_random_pipeline().save_pretrained(Path(scratch) / "torch")
            main_export(str(Path(scratch) / "torch"), output=str(Path(scratch) / "onnx"), task="text-to-image")
            folder = Path(scratch) / "onnx"
        pipe = accelerate(ORTStableDiffusionPipeline.from_pretrained(folder, provider=provider))
        image = pipe(
            "an astronaut riding a horse on mars",
            height=512,
            width=512,
            num_inference_steps=20,
            generator=torch.Generator().manual_seed(0),
        ).images[0]
    image.save(args.out)
    print(f"wrote {args.out} with {type(pipe.unet).__name__} ({provider})")


if __name__ == "__main__":
    sys.exit(run_script(main))

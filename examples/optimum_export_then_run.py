"""The optimum workflow: `optimum-cli export onnx --task text-to-image`, then our pipeline with io_binding=True.

Needs the optimum environment (transformers 4.x: see constraints-optimum.txt / `.venv-optimum` from
scripts/test.sh). With network, pass a hub id; offline, the tiny random torch pipeline is saved and exported.

    .venv-optimum/bin/python examples/optimum_export_then_run.py
    .venv-optimum/bin/python examples/optimum_export_then_run.py --model stable-diffusion-v1-5/stable-diffusion-v1-5 \
        --provider CUDAExecutionProvider
"""

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from optimum_iobinding import OnnxStableDiffusionPipeline
from optimum_iobinding.cli import UsageError, check_image_path, default_provider, run_script
from optimum_iobinding.export.tiny import build_tiny_random_pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="torch diffusers folder or hub id (default: tiny, offline)")
    parser.add_argument("--provider", default=None)
    parser.add_argument("--out", default="optimum.png")
    args = parser.parse_args()
    check_image_path(args.out)  # before any work: a name PIL writes, in a writable folder
    if importlib.util.find_spec("optimum") is None:  # before any work, in one line
        raise UsageError(
            "this example needs optimum-onnx, which this environment lacks: run it with .venv-optimum/bin/python "
            "(made by scripts/test.sh)"
        )

    with tempfile.TemporaryDirectory() as work:
        model = args.model
        if model is None:
            model = str(Path(work) / "torch")
            build_tiny_random_pipeline().save_pretrained(model)
        onnx_folder = Path(work) / "onnx"
        # exactly what a user runs in a shell
        subprocess.run(
            [
                sys.executable,
                "-m",
                "optimum.commands.optimum_cli",
                "export",
                "onnx",
                "--model",
                model,
                "--task",
                "text-to-image",
                str(onnx_folder),
            ],
            check=True,
        )
        pipe = OnnxStableDiffusionPipeline.from_pretrained(
            onnx_folder, provider=args.provider or default_provider(), io_binding=True
        )
        image = pipe(
            "a photo of an astronaut riding a horse", num_inference_steps=30, generator=np.random.RandomState(0)
        ).images[0]
        image.save(args.out)
        print(f"wrote {args.out} from the optimum export of {args.model or 'the tiny random pipeline'}")


if __name__ == "__main__":
    sys.exit(run_script(main))

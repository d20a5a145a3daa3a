"""Text to image with the denoising loop on the device.

python examples/txt2img.py                                   # tiny random model, built offline once
python examples/txt2img.py --model sd15-onnx --provider CUDAExecutionProvider
"""

import argparse
import sys
from pathlib import Path

import numpy as np

from optimum_iobinding import OnnxStableDiffusionPipeline
from optimum_iobinding.cli import check_image_path, default_provider, run_script, tiny_model_folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="ONNX pipeline folder or hub id (default: the tiny model)")
    parser.add_argument("--provider", default=None)
    parser.add_argument("--prompt", default="a photo of an astronaut riding a horse on mars")
    parser.add_argument("--out", default="txt2img.png")
    args = parser.parse_args()
    check_image_path(args.out)  # before any work: a name PIL writes, in a writable folder

    pipe = OnnxStableDiffusionPipeline.from_pretrained(
        args.model or tiny_model_folder(), provider=args.provider or default_provider(), io_binding=True
    )
    image = pipe(args.prompt, num_inference_steps=30, generator=np.random.RandomState(0)).images[0]
    image.save(args.out)
    print(f"wrote {Path(args.out).resolve()}")


if __name__ == "__main__":
    sys.exit(run_script(main))

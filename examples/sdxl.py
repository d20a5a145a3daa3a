"""SDXL text-to-image on ONNX Runtime with the loop on the device (and the UNet as a CUDA graph on CUDA).

    python examples/sdxl.py                                   # tiny random SDXL, built and exported offline
    python examples/sdxl.py --model sdxl-onnx --provider CUDAExecutionProvider --steps 30   # an SDXL ONNX folder
Folders: `optimum-iobinding export stabilityai/stable-diffusion-xl-base-1.0 --output sdxl-onnx --fp16 --vae
madebyollin/sdxl-vae-fp16-fix` (SDXL's own VAE overflows float16), or an `optimum-cli export onnx --task text-to-image`
folder.
"""

import argparse
import sys
import tempfile

import numpy as np

from optimum_iobinding import OnnxStableDiffusionXLPipeline
from optimum_iobinding.cli import check_image_path, default_provider, run_script
from optimum_iobinding.export import export_pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="SDXL ONNX folder or hub id (default: tiny, offline)")
    parser.add_argument("--provider", default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=None, help="height and width (default: the model's, 1024)")
    parser.add_argument("--out", default="sdxl.png")
    args = parser.parse_args()
    check_image_path(args.out)  # before any work: a name PIL writes, in a writable folder
    provider = args.provider or default_provider()
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.model or export_pipeline(None, f"{scratch}/tiny-xl", tiny_random="xl")
        pipe = OnnxStableDiffusionXLPipeline.from_pretrained(
            folder, provider=provider, cuda_graph=provider == "CUDAExecutionProvider"
        )
        size = args.size or (None if args.model else 512)
        image = pipe(
            "an astronaut riding a horse on mars",
            height=size,
            width=size,
            num_inference_steps=args.steps,
            generator=np.random.RandomState(0),
        ).images[0]
    image.save(args.out)
    print(f"wrote {args.out} ({image.size[0]}×{image.size[1]}, {provider})")


if __name__ == "__main__":
    sys.exit(run_script(main))

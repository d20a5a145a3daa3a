"""ControlNet: the layout of a drawn sketch (or your control image) guides the picture.

    python examples/controlnet.py [--model FOLDER] [--provider CUDAExecutionProvider] [--control edges.png]

Without --model it builds the tiny random-weights ControlNet pipeline offline (the image is noise, the plumbing
real). For a real one: optimum-iobinding export stable-diffusion-v1-5/stable-diffusion-v1-5 --controlnet
lllyasviel/sd-controlnet-canny --fp16 --output sd15-canny-onnx, and a Canny edge image as --control.
"""

import argparse
import sys

import numpy as np
import PIL.Image
import PIL.ImageDraw

from optimum_iobinding import OnnxStableDiffusionControlNetPipeline
from optimum_iobinding.cli import check_image_path, default_provider, run_script, tiny_model_folder


def edges(size: int = 512) -> PIL.Image.Image:
    image = PIL.Image.new("RGB", (size, size), (0, 0, 0))
    draw = PIL.ImageDraw.Draw(image)
    draw.ellipse([size // 4, size // 4, size * 3 // 4, size * 3 // 4], outline=(255, 255, 255), width=4)
    draw.line([0, size * 2 // 3, size, size * 2 // 3], fill=(255, 255, 255), width=4)
    return image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--provider", default=None)
    parser.add_argument("--control", default=None, help="control image (default: drawn edges)")
    parser.add_argument("--out", default="controlnet.png")
    args = parser.parse_args()
    check_image_path(args.out)  # before any work: a name PIL writes, in a writable folder

    folder = args.model or tiny_model_folder(kind="controlnet")
    pipe = OnnxStableDiffusionControlNetPipeline.from_pretrained(folder, provider=args.provider or default_provider())
    control = PIL.Image.open(args.control).convert("RGB") if args.control else edges(pipe.default_image_size)
    image = pipe(
        "a full moon over the sea, oil painting",
        image=control,
        controlnet_conditioning_scale=0.9,
        num_inference_steps=30,
        generator=np.random.RandomState(0),
    ).images[0]
    image.save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(run_script(main))

"""Image to image: start from a picture (here, one drawn on the spot) and follow the prompt.

python examples/img2img.py [--model FOLDER] [--provider CUDAExecutionProvider] [--image photo.png]
"""

import argparse
import sys

import numpy as np
import PIL.Image
import PIL.ImageDraw

from optimum_iobinding import OnnxStableDiffusionImg2ImgPipeline
from optimum_iobinding.cli import check_image_path, default_provider, run_script, tiny_model_folder


def sketch(size: int = 512) -> PIL.Image.Image:
    image = PIL.Image.new("RGB", (size, size), (110, 160, 220))
    draw = PIL.ImageDraw.Draw(image)
    draw.rectangle([0, size * 2 // 3, size, size], fill=(70, 130, 60))
    draw.ellipse([size // 3, size // 6, size * 2 // 3, size // 2], fill=(250, 220, 90))
    return image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--provider", default=None)
    parser.add_argument("--image", default=None, help="start image (default: a drawn landscape)")
    parser.add_argument("--out", default="img2img.png")
    args = parser.parse_args()
    check_image_path(args.out)  # before any work: a name PIL writes, in a writable folder

    pipe = OnnxStableDiffusionImg2ImgPipeline.from_pretrained(
        args.model or tiny_model_folder(), provider=args.provider or default_provider()
    )
    start = PIL.Image.open(args.image).convert("RGB") if args.image else sketch()
    image = pipe(
        "a sunny mountain landscape, detailed painting",
        image=start,
        strength=0.75,
        num_inference_steps=30,
        generator=np.random.RandomState(0),
    ).images[0]
    image.save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(run_script(main))

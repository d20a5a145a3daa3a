"""Inpainting: repaint the white part of a mask. Works with an inpainting UNet (9 channels) and, by blending, with
a plain one (the tiny model).

    python examples/inpaint.py [--model FOLDER] [--provider CUDAExecutionProvider]
"""

import argparse
import sys

import numpy as np
import PIL.Image
import PIL.ImageDraw

from optimum_iobinding import OnnxStableDiffusionInpaintPipeline
from optimum_iobinding.cli import check_image_path, default_provider, run_script, tiny_model_folder
from img2img import sketch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--provider", default=None)
    parser.add_argument("--out", default="inpaint.png")
    args = parser.parse_args()
    check_image_path(args.out)  # before any work: a name PIL writes, in a writable folder

    pipe = OnnxStableDiffusionInpaintPipeline.from_pretrained(
        args.model or tiny_model_folder(), provider=args.provider or default_provider()
    )
    image = sketch(512)
    mask = PIL.Image.new("L", image.size, 0)
    PIL.ImageDraw.Draw(mask).ellipse([128, 64, 384, 320], fill=255)  # repaint the sun
    result = pipe(
        "a red hot air balloon",
        image=image,
        mask_image=mask,
        height=512,
        width=512,
        num_inference_steps=30,
        generator=np.random.RandomState(0),
    ).images[0]
    result.save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(run_script(main))

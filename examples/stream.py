"""Real-time image to image: a stream of frames (here, a drawn sun crossing the sky) through a few-step model, one
frame in, one frame out.

    python examples/stream.py [--model FOLDER] [--tiny-vae FOLDER] [--provider CUDAExecutionProvider] [--frames 30]
        [--size 512] [--out stream.png]

For SD-Turbo (``optimum-iobinding export stabilityai/sd-turbo --output sd-turbo-onnx --fp16 --optimize cuda``) the
defaults are its recipe: one UNet step (2 steps at strength 0.5), no guidance, Euler ancestral with trailing
timesteps.
"""

import argparse
import sys
import time

import numpy as np
import PIL.Image
import PIL.ImageDraw
from diffusers import EulerAncestralDiscreteScheduler

from optimum_iobinding import OnnxStreamDiffusionPipeline
from optimum_iobinding.cli import check_image_path, default_provider, run_script, tiny_model_folder


def sketch(index: int, size: int) -> np.ndarray:
    """Frame ``index`` of the input video: a sun moving over a landscape (uint8, height × width × 3)."""
    image = PIL.Image.new("RGB", (size, size), (110, 160, 220))
    draw = PIL.ImageDraw.Draw(image)
    draw.rectangle([0, size * 2 // 3, size, size], fill=(70, 130, 60))
    x = (index * size // 40) % size
    draw.ellipse([x, size // 6, x + size // 4, size // 6 + size // 4], fill=(250, 220, 90))
    return np.asarray(image)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="ONNX folder (default: the tiny random model, built offline)")
    parser.add_argument(
        "--tiny-vae",
        default=None,
        help="folder of an AutoencoderTiny export (vae_encoder/ and vae_decoder/) to use instead of the model's VAE",
    )
    parser.add_argument("--provider", default=None)
    parser.add_argument("--frames", type=int, default=30)
    parser.add_argument("--size", type=int, default=None, help="frame height and width (default: the model's)")
    parser.add_argument("--out", default="stream.png", help="where the last output frame goes")
    args = parser.parse_args()
    check_image_path(args.out)  # before any work: a name PIL writes, in a writable folder
    if args.frames < 1:
        parser.error(f"--frames: expected a positive number of frames, got {args.frames}")

    stream = OnnxStreamDiffusionPipeline.from_pretrained(
        args.model or tiny_model_folder(), provider=args.provider or default_provider(), tiny_vae=args.tiny_vae
    )
    if "timestep_cond" not in stream.unet.input_names:  # LCM folders keep their LCMScheduler
        stream.scheduler = EulerAncestralDiscreteScheduler.from_config(
            stream.scheduler.config, timestep_spacing="trailing"
        )
    size = args.size or stream.default_image_size
    started = time.perf_counter()
    stream.prepare(
        "a watercolor painting of a sunny landscape",
        num_inference_steps=2,
        strength=0.5,
        guidance_scale=0.0,
        seed=0,
        height=size,
        width=size,
    )
    print(f"prepared in {time.perf_counter() - started:.1f} s (prompt encoded, graphs captured)")

    started = time.perf_counter()
    last = None
    for last in stream.frames(sketch(index, size) for index in range(args.frames)):
        pass
    seconds = time.perf_counter() - started
    print(f"{args.frames} frames of {size}×{size} in {seconds:.2f} s: {args.frames / seconds:.1f} frames/s")
    PIL.Image.fromarray(last).save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(run_script(main))

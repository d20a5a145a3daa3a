#!/usr/bin/env python3
"""Export a diffusers Stable Diffusion pipeline (folder or hub id) to the diffusers ONNX layout.

    python scripts/export_models.py stable-diffusion-v1-5/stable-diffusion-v1-5 --output sd15-onnx --fp16
    python scripts/export_models.py --tiny-random --output tiny-onnx

A thin CLI over optimum_iobinding.export.export_pipeline (also `optimum-iobinding export`).
"""

import argparse
import sys

from optimum_iobinding.cli import add_export_arguments, run_export


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_export_arguments(parser)
    return run_export(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Export a diffusers pipeline (folder or hub id) to the ONNX layout the pipelines load.

    python scripts/export_models.py stable-diffusion-v1-5/stable-diffusion-v1-5 --output sd15-onnx --fp16
    python scripts/export_models.py --tiny-random --output tiny-onnx

`optimum-iobinding export` under another name: the same options (`--help`), one-line errors with the same exit
statuses, `--debug` for the traceback; in Python, optimum_iobinding.export.export_pipeline.
"""

import sys
from typing import List, Optional

from optimum_iobinding.cli import main as command_line


def main(argv: Optional[List[str]] = None) -> int:
    return command_line(["export", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())

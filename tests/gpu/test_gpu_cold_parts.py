"""The UNet's cold-start parts on CUDA (skipped without CUDA; run on the GPU machine): each part's session and first
run made in the background side by side, each part captured, the pipeline's images the whole UNet's."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest
import torch

from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.cold_parts import write_cold_start_parts

pytestmark = pytest.mark.gpu

CUDA = "CUDAExecutionProvider"
EXACT = {"use_tf32": "0"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny pipeline fused for CUDA in float16, and a copy whose UNet has three cold-start parts."""
    root = tmp_path_factory.mktemp("cold-gpu")
    whole = export_pipeline(None, root / "whole", tiny_random=True, fp16=True, optimize="cuda", progress=False)
    parted = root / "parted"
    shutil.copytree(whole, parted)
    write_cold_start_parts(parted / "unet", 3)
    return whole, parted


def pipeline(folder):
    from diffusers import DDIMScheduler

    from optimum_iobinding import OnnxStableDiffusionPipeline

    pipe = OnnxStableDiffusionPipeline.from_pretrained(folder, provider=CUDA, provider_options=EXACT)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, seed=0):
    return pipe(
        "a photo of a cat",
        height=64,
        width=64,
        num_inference_steps=5,
        generator=np.random.RandomState(seed),
        output_type="np",
    ).images


def test_the_pipeline_with_the_unets_parts_captures_each_part_and_makes_the_whole_unets_images(folders):
    whole, parted = folders
    reference = generate(pipeline(whole))
    pipe = pipeline(parted)
    first = generate(pipe)
    second = generate(pipe)  # replays
    parts = pipe.unet.cold_start_parts
    assert len(parts) == 3
    # float16: ORT fuses nothing across a cut that it fuses in the whole graph, so the parts round alike
    np.testing.assert_allclose(first, reference, atol=2e-2)
    np.testing.assert_array_equal(first, second)
    for part in parts:
        assert part.graph_signatures and not part.graph_fallbacks
    # the whole UNet's session is never made: one per part (and none again on the second call)
    assert pipe.unet.sessions_created == 3


def test_the_parts_first_runs_are_prepared_side_by_side_before_the_first_step(folders):
    _, parted = folders
    pipe = pipeline(parted)
    unet = pipe.unet
    shapes = {"sample": (2, 4, 8, 8), "timestep": (2,), "encoder_hidden_states": (2, 77, 32)}
    unet.prepare_signature(shapes)
    for thread in [t for t in threading.enumerate() if t.name.startswith("prepare signature")]:
        thread.join(600)
    # every part holds an entry of its signature, made before any call
    for part, part_shapes in zip(unet.cold_start_parts, unet.cold_start_part_shapes(shapes)):
        assert part_shapes in part.signatures
    inputs = {
        "sample": torch.randn(2, 4, 8, 8, device="cuda", dtype=torch.float16),
        "timestep": torch.full((2,), 500.0, device="cuda", dtype=unet.input_dtypes["timestep"]),
        "encoder_hidden_states": torch.randn(2, 77, 32, device="cuda", dtype=torch.float16),
    }
    (first,) = unet(**inputs)
    first = first.clone()
    (again,) = unet(**inputs)
    torch.testing.assert_close(again, first)
    # each value that crosses a cut is one tensor on the device: the buffer an earlier part's graph writes is the one a
    # later part's graph reads (no copy on a call, not held twice)
    written = {}
    for part, part_shapes in zip(unet.cold_start_parts, unet.cold_start_part_shapes(shapes)):
        runner = part.graph_runner(part_shapes)
        assert runner is not None
        for name in part.input_names:
            if name in written:
                assert runner.input_buffers[name] is written[name], name
        written.update(runner.output_buffers)
    assert any(name in written for name in unet.cold_start_parts[-1].input_names)

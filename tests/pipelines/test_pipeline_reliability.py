"""A pipeline's reliability on the CPU (the tiny random export): threads, shape changes mid-session, a failed load."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from optimum_iobinding import OnnxStableDiffusionPipeline

SIZE = 64


# --------------------------------------------------------------------------------------------------------- threads
def test_one_pipeline_called_from_four_threads_gives_the_serial_images(tiny_folder):
    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    pipe.set_progress_bar_config(disable=True)

    def generate(seed):
        return pipe(
            "a photo of a cat",
            height=SIZE,
            width=SIZE,
            num_inference_steps=3,
            generator=np.random.RandomState(seed),
            output_type="np",
        ).images

    serial = [generate(seed) for seed in range(4)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        threaded = list(pool.map(generate, range(4)))
    for expected, got in zip(serial, threaded):
        assert np.array_equal(expected, got)


def test_two_pipelines_run_concurrently_and_correctly(tiny_folder):
    pipes = [OnnxStableDiffusionPipeline.from_pretrained(tiny_folder) for _ in range(2)]
    for pipe in pipes:
        pipe.set_progress_bar_config(disable=True)

    def generate(pipe, seed):
        return pipe(
            "a photo of a dog",
            height=SIZE,
            width=SIZE,
            num_inference_steps=3,
            generator=np.random.RandomState(seed),
            output_type="np",
        ).images

    serial = [generate(pipes[0], seed) for seed in range(4)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        threaded = list(pool.map(lambda seed: generate(pipes[seed % 2], seed), range(4)))
    for expected, got in zip(serial, threaded):
        assert np.array_equal(expected, got)


# ----------------------------------------------------------------------------------------------- shape changes
def test_shape_changes_mid_session_give_what_a_fresh_pipeline_gives(tiny_folder):
    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    pipe.set_progress_bar_config(disable=True)
    configs = [
        dict(prompt="a cat", height=64, width=64),
        dict(prompt="a cat", height=128, width=64),
        dict(prompt=["a cat", "a dog"], height=64, width=128),
        dict(prompt="a cat", height=64, width=64),
    ]
    for config in configs:
        arguments = dict(config, num_inference_steps=2, output_type="np")
        fresh = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
        fresh.set_progress_bar_config(disable=True)
        images = [p(**arguments, generator=np.random.RandomState(0)).images for p in (pipe, fresh)]
        assert images[0].shape[0] == (2 if isinstance(config["prompt"], list) else 1)
        assert np.array_equal(images[0], images[1])


# ------------------------------------------------------------------------------------------------ failed loads
def test_a_failed_from_pretrained_leaves_no_open_session(tiny_folder, tmp_path, live_sessions):
    folder = shutil.copytree(tiny_folder, tmp_path / "broken")
    shutil.rmtree(folder / "vae_decoder")  # the last component: three sessions are open when it fails
    before = live_sessions()
    with pytest.raises(FileNotFoundError, match="vae_decoder"):
        OnnxStableDiffusionPipeline.from_pretrained(folder)
    assert live_sessions() == before

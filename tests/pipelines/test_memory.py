"""The size check asked of a folder before anything loads and of a pipeline on the CPU before any work: what the
call's largest stage holds at once (the denoiser's attention, the VAE decoder), against the memory it would run
in."""

from __future__ import annotations

import json
import re

import pytest

from optimum_iobinding.errors import ArgumentError
from optimum_iobinding.pipelines import memory


def decoder(tmp_path, config):
    folder = tmp_path / "vae_decoder"
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "config, channels",
    [
        ({"_class_name": "AutoencoderKL", "block_out_channels": [128, 256, 512, 512]}, 384),
        ({"_class_name": "AutoencoderKL", "block_out_channels": [32]}, 64),
        ({"_class_name": "AutoencoderTiny", "decoder_block_out_channels": [64, 64, 64, 64]}, 128),
        (None, memory.DEFAULT_FULL_RESOLUTION_CHANNELS),
        ({"block_out_channels": "not a list"}, memory.DEFAULT_FULL_RESOLUTION_CHANNELS),
    ],
    ids=["sd-vae", "one-stage", "tiny-vae", "no-config", "bad-config"],
)
def test_the_full_resolution_channels_come_from_the_decoders_config(tmp_path, config, channels):
    assert memory.full_resolution_channels(decoder(tmp_path, config)) == channels


@pytest.fixture
def host_with(monkeypatch):
    def host(free):
        monkeypatch.setattr(
            memory, "available_memory", lambda provider, device_id=0: (free, "the host's available memory")
        )

    return host


SD_VAE = {"block_out_channels": [128, 256, 512, 512]}
TINY_UNET = {"down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"], "attention_head_dim": 8}


def test_a_size_beyond_the_memory_is_refused_with_a_size_that_fits(host_with):
    vae = memory.CallMemory(SD_VAE)
    host_with(10**9)  # 1 GB: 512×384 needs about 0.15 GB, 1024×768 about 1.4 GB (its mid-block attention)
    memory.check_image_fits(vae, 512, 384, "CPUExecutionProvider")
    with pytest.raises(ArgumentError) as refused:
        memory.check_image_fits(vae, 1024, 768, "CPUExecutionProvider")
    assert refused.value.argument == "height and width"
    found = re.fullmatch(
        r"1024×768 needs about (\d+\.\d) GB at once for the VAE decoder, more than 1\.0 GB, the host's available "
        r"memory; at most about (\d+)×(\d+) fits",
        refused.value.reason,
    )
    assert found, refused.value.reason
    width, height = int(found[2]), int(found[3])
    assert width % 8 == 0 and height % 8 == 0 and abs(width / height - 4 / 3) < 0.03
    memory.check_image_fits(vae, width, height, "CPUExecutionProvider")  # the size it names passes
    with pytest.raises(ArgumentError):
        memory.check_image_fits(vae, width + 64, height + 48, "CPUExecutionProvider")


def test_the_denoisers_attention_counts_on_the_cpu_with_a_row_per_image_and_guidance():
    """Unfused, as ONNX Runtime's CPU kernels compute it, the UNet's attention at its first attending level (here
    the second: 1/16 of the pixels a side) holds rows × heads × tokens² scores; fused on the GPU, none."""
    cpu = memory.CallMemory({}, TINY_UNET, "unet", 8, element_bytes=4, attention=True)
    need, what = cpu.need(1024, 1024, images=1, rows=2)
    tokens = (1024 // 16) ** 2
    assert what == "the UNet's attention" and need == int(2 * 8 * tokens**2 * 4 * memory.DENOISER_ATTENTION_COPIES)
    assert cpu.need(2048, 2048, rows=2)[0] == 16 * need and cpu.need(1024, 1024, rows=4)[0] == 2 * need
    gpu = memory.CallMemory({}, TINY_UNET, "unet", 8, element_bytes=2, attention=False)
    assert gpu.need(1024, 1024, rows=2)[1] == "the VAE decoder"


def test_a_batch_needs_its_images_together(host_with):
    host_with(2 * 10**9)  # 1024×768: about 1.4 GB an image
    memory.check_image_fits(memory.CallMemory(SD_VAE), 1024, 768, "CPUExecutionProvider", images=1)
    with pytest.raises(ArgumentError, match=r"size: 1024×768 × 2 images needs about 2\.7 GB"):
        memory.check_image_fits(memory.CallMemory(SD_VAE), 1024, 768, "CPUExecutionProvider", images=2, argument="size")


def test_a_pipeline_on_the_cpu_refuses_a_call_that_cannot_fit_before_any_work(tiny_folder, host_with):
    from optimum_iobinding import OnnxStableDiffusionPipeline

    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder, provider="CPUExecutionProvider")
    host_with(2 * 10**9)
    with pytest.raises(ArgumentError, match=r"height and width: 2048×2048 needs about .* at most about (\d+)×\1 fits"):
        pipe("a cat", height=2048, width=2048, num_inference_steps=1)
    assert pipe("a cat", height=64, width=64, num_inference_steps=1, output_type="np").images.shape == (1, 64, 64, 3)


def test_nothing_is_refused_where_the_memory_cannot_be_known():
    assert memory.available_memory("NoSuchExecutionProvider") is None
    memory.check_image_fits(memory.CallMemory(SD_VAE), 10**6, 10**6, "NoSuchExecutionProvider")


def test_the_hosts_memory_is_what_the_cpu_provider_is_checked_against():
    free, where = memory.available_memory("CPUExecutionProvider")
    assert free > 0 and where == "the host's available memory"


def test_every_prompt_of_a_call_counts_in_what_it_holds(tiny_folder, host_with):
    """Four prompts make four images: at a size where one fits, four are refused before any work."""
    from optimum_iobinding import OnnxStableDiffusionPipeline

    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder, provider="CPUExecutionProvider")
    host_with(40 * 10**6)  # 256²: about 19 MB for one image's VAE attention, 75 MB for four
    with pytest.raises(ArgumentError, match=r"height and width: 256×256 × 4 images needs about"):
        pipe(["a cat"] * 4, height=256, width=256, num_inference_steps=1, output_type="np")
    pipe.check_fits(256, 256, 1, 7.5)  # one image fits


@pytest.mark.parametrize("family", ["sd", "stream", "xl", "controlnet", "flux"])
def test_a_dropped_pipeline_frees_its_sessions_at_once(request, family):
    # with the garbage collector off, the last reference going frees the pipeline and its models (their sessions, so
    # their device memory): nothing of the pipeline holds it back, so no session waits for a later collection, and none
    # is freed where that collection happens to come (a device synchronization in a stream's frame, for one)
    import gc
    import weakref

    import torch

    import optimum_iobinding as oi

    if family in ("sd", "stream"):
        folder = request.getfixturevalue("tiny_folder")
    elif family == "xl":
        folder = request.getfixturevalue("xl_folder")
    elif family == "controlnet":
        folder = request.getfixturevalue("controlnet_folders")["one"]
    else:
        folder = request.getfixturevalue("schnell")[1]
    gc.collect()
    gc.disable()
    try:
        if family == "stream":
            pipe = oi.OnnxStreamDiffusionPipeline.from_pretrained(folder)
            pipe.prepare("a cat", num_inference_steps=2, strength=0.5, guidance_scale=0.0, height=64, width=64)
            pipe(torch.rand(3, 64, 64) * 2 - 1)
        else:
            cls = {
                "sd": oi.OnnxStableDiffusionPipeline,
                "xl": oi.OnnxStableDiffusionXLPipeline,
                "controlnet": oi.OnnxStableDiffusionControlNetPipeline,
                "flux": oi.OnnxFluxPipeline,
            }[family]
            pipe = cls.from_pretrained(folder)
            extra = {"image": torch.rand(1, 3, 64, 64)} if family == "controlnet" else {}
            pipe("a cat", num_inference_steps=2, height=64, width=64, output_type="np", **extra)
        models = [weakref.ref(model) for model in pipe.onnx_models.values()]
        dropped = weakref.ref(pipe)
        del pipe
        assert dropped() is None and [model() for model in models] == [None] * len(models)
    finally:
        gc.enable()


def test_prepare_in_background_is_checked_kept_and_given_to_the_siblings(tiny_folder):
    import optimum_iobinding as oi
    from optimum_iobinding.errors import ArgumentTypeError

    with pytest.raises(ArgumentTypeError, match=r"^prepare_in_background: expected True or False, got 'no'$"):
        oi.OnnxStableDiffusionPipeline.from_pretrained(tiny_folder, prepare_in_background="no")
    assert oi.OnnxStableDiffusionPipeline.from_pretrained(tiny_folder).prepare_in_background is True
    pipe = oi.OnnxStableDiffusionPipeline.from_pretrained(tiny_folder, prepare_in_background=False)
    assert pipe.prepare_in_background is False
    assert pipe.image_to_image().prepare_in_background is False and pipe.inpainting().prepare_in_background is False
    stream = oi.OnnxStreamDiffusionPipeline.from_pretrained(tiny_folder, prepare_in_background=False)
    assert stream.prepare_in_background is False

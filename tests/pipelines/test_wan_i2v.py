"""Wan image to video on the tiny random Wan image-to-video pipelines, CPU execution provider: our ONNX pipeline against
diffusers' torch ``WanImageToVideoPipeline`` on the same weights (Wan 2.1 I2V with its CLIP image encoder; Wan 2.2 I2V's
two experts, with a last image too); the export's image encoder and processor; First-Block Cache with the image's
states against diffusers' own hook; refusals before any work; detection."""

from __future__ import annotations

import contextlib
import json
import shutil

import numpy as np
import PIL.Image
import pytest
import torch

from optimum_iobinding import OnnxWanImageToVideoPipeline, OnnxWanPipeline
from optimum_iobinding.errors import ArgumentError, ModelFileError
from optimum_iobinding.families import WAN_IMAGE_INPUT, WAN_INPUTS, detect, family
from optimum_iobinding.pipelines import pipeline_class_for
from optimum_iobinding.pipelines.auto import denoiser_inputs

PROMPT = "a photo of a cat"
# fp32 ONNX Runtime vs fp32 torch on the CPU, a few steps: rounding only
TOLERANCE = 1e-4
CALL = dict(height=16, width=32, num_frames=9, num_inference_steps=3, guidance_scale=4.0)
# Wan 2.1 I2V's transformer reads the last 512 tokens of its context as the prompt's (diffusers' attention)
TEXT_CONTEXT = 512


def picture(seed: int, height: int = 24, width: int = 40) -> PIL.Image.Image:
    pixels = np.random.default_rng(seed).random((height, width, 3))
    return PIL.Image.fromarray((pixels * 255).astype(np.uint8))


@pytest.fixture(autouse=True)
def diffusers_cleans_prompts_without_ftfy(monkeypatch):
    """diffusers' WanImageToVideoPipeline calls ftfy, which the test environments lack, whatever is installed (its
    WanPipeline only where ftfy is): the torch pipeline cleans prompts as WanPipeline does, as ours does."""
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

    monkeypatch.setattr(pipeline_wan_i2v, "basic_clean", pipeline_wan.basic_clean)


def export_of(shared_export, name, torch_pipe):
    from optimum_iobinding.export import export_pipeline

    torch_pipe.set_progress_bar_config(disable=True)
    return shared_export(name, lambda target: export_pipeline(None, target, torch_pipeline=torch_pipe, progress=False))


@pytest.fixture(scope="module")
def wan21(shared_export):
    """The tiny random Wan 2.1 I2V pipeline (a CLIP image encoder): diffusers' torch pipeline and its export
    (shared with ``export --tiny-random wan-i2v``'s: the builder is seeded)."""
    from optimum_iobinding.export.tiny import build_tiny_random_wan_i2v_pipeline

    torch_pipe = build_tiny_random_wan_i2v_pipeline()
    return torch_pipe, export_of(shared_export, "tiny-random-wan-i2v", torch_pipe)


@pytest.fixture(scope="module")
def wan22(shared_export):
    """The tiny random Wan 2.2 I2V pipeline (no image encoder, two experts): diffusers' torch pipeline and its export
    (shared with ``export --tiny-random wan2.2-i2v``'s)."""
    from optimum_iobinding.export.tiny import build_tiny_random_wan_i2v_pipeline

    torch_pipe = build_tiny_random_wan_i2v_pipeline(image_encoder=False, two_experts=True)
    return torch_pipe, export_of(shared_export, "tiny-random-wan2.2-i2v", torch_pipe)


def load(folder, **options):
    pipe = OnnxWanImageToVideoPipeline.from_pretrained(folder, **options)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def loaded():
    """``loaded(folder)``: our pipeline of ``folder`` with the default options, one per folder and module (loading
    makes every component's sessions; the calls of these tests change nothing a later call reads)."""
    pipes = {}

    def get(folder):
        if folder not in pipes:
            pipes[folder] = load(folder)
        return pipes[folder]

    return get


def both(torch_pipe, pipe, **kwargs):
    """The frames of the same call of diffusers' torch pipeline and ours."""
    call = dict(CALL, output_type="latent")
    call.update(kwargs)
    theirs = torch_pipe(picture(0), PROMPT, generator=torch.Generator().manual_seed(0), **call).frames
    ours = pipe(picture(0), PROMPT, generator=torch.Generator().manual_seed(0), **call).frames
    return np.asarray(theirs), np.asarray(ours)


# ------------------------------------------------------------------------------------------------------ export
def test_the_export_writes_the_clip_image_encoder_and_its_processor(wan21, loaded):
    _, folder = wan21
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline"
    assert index["image_encoder"] == ["transformers", "CLIPVisionModel"]
    assert index["image_processor"] == ["transformers", "CLIPImageProcessor"]
    pipe = loaded(folder)
    assert pipe.transformer.input_names == [*WAN_INPUTS, WAN_IMAGE_INPUT]
    assert pipe.transformer.input_dims["hidden_states"][1] == 36  # the latents, the first frame's mask and latents
    assert type(pipe.image_processor).__name__.startswith("CLIPImageProcessor")


# -------------------------------------------------------------------------------------------- against diffusers
@pytest.mark.parametrize("output_type", ["latent", "np"])
def test_wan21_image_to_video_matches_diffusers(wan21, output_type, loaded):
    torch_pipe, folder = wan21
    theirs, ours = both(torch_pipe, loaded(folder), output_type=output_type, max_sequence_length=TEXT_CONTEXT)
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE)


@pytest.mark.parametrize("last", [False, True], ids=["first-image", "first-and-last-image"])
def test_wan22_image_to_video_runs_both_experts_as_diffusers_does(wan22, last, loaded):
    torch_pipe, folder = wan22
    pipe = loaded(folder)
    extra = {"last_image": picture(1)} if last else {}
    with pipe.transformer.watch_runs() as high, pipe.transformer_2.watch_runs() as low:
        theirs, ours = both(torch_pipe, pipe, max_sequence_length=16, guidance_scale_2=2.0, **extra)
    assert high and low  # UniPC's timesteps 999, 750, 500 about the boundary of 900
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE)


@pytest.fixture(scope="module")
def flf2v(wan21, shared_export, tmp_path_factory):
    """A tiny random Wan 2.1 FLF2V pipeline: ``wan21``'s with a first-last-frame transformer (``pos_embed_seq_len``:
    the two images' 65 tokens each, a random position embedding) and its export (the other components copied from
    ``wan21``'s)."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

    from optimum_iobinding.export import export_pipeline

    torch_pipe, folder = wan21
    config = {key: value for key, value in torch_pipe.transformer.config.items() if not key.startswith("_")}
    torch.manual_seed(3)
    transformer = WanTransformer3DModel(**{**config, "pos_embed_seq_len": 2 * 65}).eval()
    torch.nn.init.normal_(transformer.condition_embedder.image_embedder.pos_embed)
    components = {**torch_pipe.components, "transformer": transformer}
    flf_pipe = WanImageToVideoPipeline(**components).to(torch.float32)
    flf_pipe.set_progress_bar_config(disable=True)

    def write(target):
        scratch = tmp_path_factory.mktemp("wan-flf2v-transformer") / "out"
        export_pipeline(None, scratch, torch_pipeline=flf_pipe, components=["transformer"], progress=False)
        shutil.copytree(folder, target, ignore=shutil.ignore_patterns("transformer"))
        shutil.copytree(scratch / "transformer", target / "transformer")

    return flf_pipe, shared_export("tiny-random-wan-flf2v", write)


def test_wan21_first_last_frame_to_video_matches_diffusers(flf2v):
    torch_pipe, folder = flf2v
    pipe = load(folder)
    assert pipe.takes_first_and_last_frames
    call = dict(max_sequence_length=TEXT_CONTEXT, num_inference_steps=2, last_image=picture(1))
    theirs, ours = both(torch_pipe, pipe, **call)
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE)
    with pytest.raises(ValueError, match="last_image: expected an image for a first-last-frame transformer"):
        pipe(picture(0), PROMPT, **dict(CALL, max_sequence_length=TEXT_CONTEXT))


def test_a_saved_pipeline_loads_again_with_its_image_encoder_and_gives_the_same_video(wan21, tmp_path, loaded):
    _, folder = wan21
    pipe = loaded(folder)
    call = dict(CALL, max_sequence_length=TEXT_CONTEXT, num_inference_steps=2)
    expected = pipe(picture(0), PROMPT, generator=torch.Generator().manual_seed(0), **call).frames
    pipe.save_pretrained(tmp_path / "saved")
    again = load(tmp_path / "saved")
    assert again.image_encoder is not None and again.image_processor is not None
    got = again(picture(0), PROMPT, generator=torch.Generator().manual_seed(0), **call).frames
    np.testing.assert_array_equal(got, expected)


# ---------------------------------------------------------------------------------------------- First-Block Cache
@pytest.fixture(scope="module")
def wan21_parts(wan21, shared_export, tmp_path_factory):
    """The Wan 2.1 I2V export with First-Block Cache's parts beside its transformer: the export of ``wan21`` with its
    transformer exported again with them (the other components, the slow ones to export, copied from it)."""
    from optimum_iobinding.export import export_pipeline

    torch_pipe, folder = wan21

    def write(target):
        scratch = tmp_path_factory.mktemp("wan-i2v-transformer") / "out"
        export_pipeline(
            None, scratch, torch_pipeline=torch_pipe, components=["transformer"], step_cache=True, progress=False
        )
        shutil.copytree(folder, target, ignore=shutil.ignore_patterns("transformer"))
        shutil.copytree(scratch / "transformer", target / "transformer")

    return torch_pipe, shared_export("wan-i2v-step-cache", write)


def test_first_block_cache_with_the_image_states_skips_the_steps_diffusers_skips_and_gives_its_latents(
    wan21_parts,
):
    from diffusers.hooks import FirstBlockCacheConfig

    from .test_wan import skip_without_diffusers_wan_cache

    skip_without_diffusers_wan_cache()

    torch_pipe, folder = wan21_parts
    pipe = load(folder)
    config = FirstBlockCacheConfig(threshold=0.1)
    pipe.enable_cache(config)
    call = dict(CALL, num_inference_steps=6, max_sequence_length=TEXT_CONTEXT, output_type="latent")
    ours = pipe(picture(0), PROMPT, generator=torch.Generator().manual_seed(0), **call).frames
    calls, ran = [], set()
    transformer = torch_pipe.transformer
    handles = [
        transformer.register_forward_pre_hook(lambda *_: calls.append(len(calls))),
        transformer.blocks[-1].ffn.register_forward_hook(lambda *_: ran.add(len(calls) - 1)),
    ]
    transformer.enable_cache(config)
    try:
        theirs = torch_pipe(picture(0), PROMPT, generator=torch.Generator().manual_seed(0), **call).frames
    finally:
        transformer.disable_cache()
        for handle in handles:
            handle.remove()
    # diffusers calls the prompt's branch, then the negative one's, each with a state of its own
    assert pipe.step_cache.computed_by_group == [(c + 1 in ran, c in ran) for c in calls[::2]]
    assert 0 < pipe.step_cache.skipped_steps < 5
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=TOLERANCE)


# ---------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "call,message",
    [
        (dict(image=None), "image: expected an image to start the video from"),
        (dict(image=np.zeros((16, 32, 3))), "image: expected a PIL image or a torch.Tensor, got ndarray"),
        (dict(image_embeds=torch.zeros(1, 65, 16)), "image and image_embeds: expected one of them, got both"),
        (dict(max_sequence_length=16), "max_sequence_length: expected 512 for a transformer that takes the image"),
        (dict(num_frames=8), "num_frames: expected a positive integer of the form 4k"),
        (dict(last_image="last.png"), "last_image: expected a PIL image or a torch.Tensor, got str"),
        (dict(last_image=picture(1)), r"last_image: expected None for a Wan 2.1 I2V transformer .*FLF2V"),
        (dict(last_image=picture(1), num_frames=1), "num_frames: expected more than 1 with last_image"),
        (
            dict(prompt=None, prompt_embeds=torch.zeros(1, 16, 32), guidance_scale=1.0),
            r"prompt_embeds: expected sequence length 512 .*got shape \(1, 16, 32\)",
        ),
    ],
    ids=[
        "no-image",
        "numpy-image",
        "image-embeds",
        "short-prompt",
        "frames",
        "last-image",
        "last-image-without-flf2v",
        "last-image-of-one-frame",
        "short-prompt-embeds",
    ],
)
def test_a_call_it_cannot_run_is_refused_by_name_before_any_component_runs(wan21, call, message, loaded):
    pipe = loaded(wan21[1])
    arguments = dict(CALL, image=picture(0), prompt=PROMPT, max_sequence_length=TEXT_CONTEXT)
    arguments.update(call)
    with contextlib.ExitStack() as stack:
        runs = [stack.enter_context(model.watch_runs()) for model in pipe.onnx_models.values()]
        with pytest.raises(ValueError, match=message):
            pipe(**arguments)
    assert not any(runs)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(expand_timesteps=True), "model_index.json: expand_timesteps: expected false"),
        (dict(image_encoder=None), "image_encoder: expected a CLIP image encoder and its image_processor"),
        (dict(vae_encoder=None), "vae_encoder: expected the VAE's vae_encoder"),
    ],
    ids=["ti2v", "no-image-encoder", "no-vae-encoder"],
)
def test_a_folder_it_cannot_run_is_a_model_file_error_naming_the_file(wan21, change, message, loaded):
    components = loaded(wan21[1]).components
    with pytest.raises(ModelFileError, match=message):
        OnnxWanImageToVideoPipeline(**{**components, **change})


# --------------------------------------------------------------------------------------------------- detection
def test_an_image_to_video_folder_is_told_from_a_text_to_video_one_and_names_its_pipeline(wan21, wan22):
    for _, folder in (wan21, wan22):
        inputs, channels = denoiser_inputs(folder)
        assert detect("WanImageToVideoPipeline", inputs, channels) is family("wan-i2v")
        assert detect("SomeWanPipeline", inputs, channels) is family("wan-i2v")  # by its 36 channels
        with pytest.raises(ArgumentError, match="is a Wan image-to-video folder .*use OnnxWanImageToVideoPipeline"):
            pipeline_class_for(folder)
    with pytest.raises(ValueError, match="transformer: expected hidden_states of 16 channels .*OnnxWanImageToVideo"):
        OnnxWanPipeline.from_pretrained(wan22[1])

"""The Stable Diffusion pipelines on the tiny random model, CPU execution provider."""

from __future__ import annotations

import json
import shutil

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler, PNDMScheduler

from optimum_iobinding import (
    IOBindingORTModel,
    OnnxStableDiffusionImg2ImgPipeline,
    OnnxStableDiffusionInpaintPipeline,
    OnnxStableDiffusionPipeline,
)
from optimum_iobinding.cli import SCHEDULERS as CLI_SCHEDULERS
from optimum_iobinding.cli import main as cli_main

SIZE = 64  # 8×8 latents: every test runs in well under a second
PROMPT = "a photo of an astronaut riding a horse"
SCHEDULERS = {
    "pndm": PNDMScheduler,
    "ddim": DDIMScheduler,
    "euler": EulerDiscreteScheduler,
    "dpm++": DPMSolverMultistepScheduler,
}


def load(pipeline_class, folder, io_binding=True, scheduler=None):
    pipe = pipeline_class.from_pretrained(folder, io_binding=io_binding)
    if scheduler is not None:
        pipe.scheduler = SCHEDULERS[scheduler].from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def init_image(seed=0):
    pixels = np.random.default_rng(seed).random((SIZE, SIZE, 3))
    return PIL.Image.fromarray((pixels * 255).astype(np.uint8))


def mask_image(size=SIZE):
    mask = np.zeros((size, size), np.uint8)
    mask[size // 4 : 3 * size // 4, size // 4 : 3 * size // 4] = 255
    return PIL.Image.fromarray(mask)


PIPELINES = {
    "txt2img": (OnnxStableDiffusionPipeline, lambda: dict(height=SIZE, width=SIZE)),
    "img2img": (OnnxStableDiffusionImg2ImgPipeline, lambda: dict(image=init_image(), strength=0.75)),
    "inpaint": (
        OnnxStableDiffusionInpaintPipeline,
        lambda: dict(image=init_image(), mask_image=mask_image(), height=SIZE, width=SIZE),
    ),
}


def generate(pipe, kind, **kwargs):
    arguments = dict(PIPELINES[kind][1](), num_inference_steps=4, generator=np.random.RandomState(0), output_type="np")
    arguments.update(kwargs)
    return pipe(PROMPT, **arguments).images


# ------------------------------------------------------------------------------------ io_binding=True vs False
@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
@pytest.mark.parametrize("guidance_scale", [7.5, 1.0])
@pytest.mark.parametrize("kind", sorted(PIPELINES))
def test_io_binding_matches_the_numpy_loop(tiny_folder, kind, guidance_scale, scheduler):
    pipeline_class = PIPELINES[kind][0]
    bound = generate(load(pipeline_class, tiny_folder, True, scheduler), kind, guidance_scale=guidance_scale)
    baseline = generate(load(pipeline_class, tiny_folder, False, scheduler), kind, guidance_scale=guidance_scale)
    assert bound.shape == (1, SIZE, SIZE, 3)
    assert np.abs(bound - baseline).max() <= 1e-4
    assert bound.std() > 0.01  # a real image, not a constant


def test_numpy_loop_matches_diffusers_own_onnx_pipeline(tiny_folder):
    diffusers = pytest.importorskip("diffusers")
    if not hasattr(diffusers, "OnnxStableDiffusionPipeline"):
        pytest.skip("this diffusers no longer ships OnnxStableDiffusionPipeline")
    theirs = diffusers.OnnxStableDiffusionPipeline.from_pretrained(tiny_folder, provider="CPUExecutionProvider")
    theirs.set_progress_bar_config(disable=True)
    expected = theirs(
        PROMPT, height=SIZE, width=SIZE, num_inference_steps=4, generator=np.random.RandomState(0), output_type="np"
    ).images
    ours = generate(load(OnnxStableDiffusionPipeline, tiny_folder, io_binding=False), "txt2img")
    assert np.abs(ours - expected).max() <= 1e-5


def test_same_numpy_seed_gives_the_same_initial_latents_as_diffusers(tiny_folder):
    pipe = load(OnnxStableDiffusionPipeline, tiny_folder)
    latents = pipe.prepare_latents((1, 4, 8, 8), torch.float32, np.random.RandomState(42))
    expected = np.random.RandomState(42).randn(1, 4, 8, 8).astype(np.float32)
    assert torch.equal(latents, torch.from_numpy(expected))


def test_torch_generator_is_deterministic(tiny_folder):
    pipe = load(OnnxStableDiffusionPipeline, tiny_folder)
    first = generate(pipe, "txt2img", generator=torch.Generator().manual_seed(3))
    second = generate(pipe, "txt2img", generator=torch.Generator().manual_seed(3))
    other = generate(pipe, "txt2img", generator=torch.Generator().manual_seed(4))
    assert np.array_equal(first, second) and not np.array_equal(first, other)


# ---------------------------------------------------------------------------------------------- call arguments
def test_output_types_pil_np_pt_and_latent(tiny_folder):
    pipe = load(OnnxStableDiffusionPipeline, tiny_folder)
    as_np = generate(pipe, "txt2img", output_type="np")
    as_pil = generate(pipe, "txt2img", output_type="pil")
    as_pt = generate(pipe, "txt2img", output_type="pt")
    as_latent = generate(pipe, "txt2img", output_type="latent")
    assert isinstance(as_pil[0], PIL.Image.Image) and as_pil[0].size == (SIZE, SIZE)
    assert isinstance(as_pt, torch.Tensor) and as_pt.shape == (1, 3, SIZE, SIZE)
    assert np.allclose(as_pt.permute(0, 2, 3, 1).numpy(), as_np)
    assert as_latent.shape == (1, 4, SIZE // 8, SIZE // 8)


def test_batched_prompts_and_several_images_per_prompt(tiny_folder):
    pipe = load(OnnxStableDiffusionPipeline, tiny_folder)
    images = pipe(
        [PROMPT, "a cat"],
        negative_prompt=["blurry", "dark"],
        num_images_per_prompt=2,
        height=SIZE,
        width=SIZE,
        num_inference_steps=2,
        generator=np.random.RandomState(0),
        output_type="np",
    ).images
    assert images.shape == (4, SIZE, SIZE, 3)
    assert not np.array_equal(images[0], images[2])  # each image decoded on its own, not the last one four times


def test_prompt_embeds_give_the_same_image_as_the_prompt(tiny_folder):
    pipe = load(OnnxStableDiffusionPipeline, tiny_folder)
    embeds = pipe.encode_prompt(PROMPT, 1, False)
    negative = pipe.encode_prompt("", 1, False)
    from_embeds = pipe(
        prompt_embeds=embeds,
        negative_prompt_embeds=negative,
        height=SIZE,
        width=SIZE,
        num_inference_steps=4,
        generator=np.random.RandomState(0),
        output_type="np",
    ).images
    assert np.abs(from_embeds - generate(pipe, "txt2img")).max() <= 1e-6


def test_callbacks_see_every_step_and_may_replace_latents(tiny_folder):
    pipe = load(OnnxStableDiffusionPipeline, tiny_folder, scheduler="ddim")
    old_style, new_style = [], []

    def on_step_end(pipeline, step, timestep, tensors):
        new_style.append(step)
        return {"latents": torch.zeros_like(tensors["latents"])} if step == 3 else tensors

    latents = pipe(
        PROMPT,
        height=SIZE,
        width=SIZE,
        num_inference_steps=4,
        generator=np.random.RandomState(0),
        callback=lambda step, t, lat: old_style.append(step),
        callback_steps=2,
        callback_on_step_end=on_step_end,
        output_type="latent",
    ).images
    assert old_style == [0, 2] and new_style == [0, 1, 2, 3]
    assert torch.count_nonzero(latents) == 0


# -------------------------------------------------------------------------------------------- loading, saving
def test_save_and_load_round_trip(tiny_folder, tmp_path):
    pipe = load(OnnxStableDiffusionPipeline, tiny_folder)
    pipe.save_pretrained(tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert index["unet"] == ["diffusers", "OnnxRuntimeModel"]
    reloaded = load(OnnxStableDiffusionPipeline, tmp_path / "saved")
    assert np.array_equal(generate(reloaded, "txt2img"), generate(pipe, "txt2img"))


def test_saved_folder_loads_in_diffusers_own_onnx_pipeline(tiny_folder, tmp_path):
    diffusers = pytest.importorskip("diffusers")
    if not hasattr(diffusers, "OnnxStableDiffusionPipeline"):
        pytest.skip("this diffusers no longer ships OnnxStableDiffusionPipeline")
    load(OnnxStableDiffusionPipeline, tiny_folder).save_pretrained(tmp_path / "saved")
    theirs = diffusers.OnnxStableDiffusionPipeline.from_pretrained(tmp_path / "saved", provider="CPUExecutionProvider")
    theirs.set_progress_bar_config(disable=True)
    images = theirs(PROMPT, height=SIZE, width=SIZE, num_inference_steps=2, output_type="np").images
    assert images.shape == (1, SIZE, SIZE, 3)


def test_vae_scale_factor_latent_channels_and_scaling_come_from_the_configs(tiny_folder, tmp_path):
    folder = shutil.copytree(tiny_folder, tmp_path / "copy")
    config = json.loads((folder / "vae_decoder" / "config.json").read_text())
    config["scaling_factor"] = 0.5
    (folder / "vae_decoder" / "config.json").write_text(json.dumps(config))
    pipe = load(OnnxStableDiffusionPipeline, folder)
    assert (pipe.vae_scale_factor, pipe.latent_channels, pipe.vae_scaling_factor) == (8, 4, 0.5)


def test_without_configs_the_vae_scale_factor_is_read_from_the_decoder(tiny_folder, tmp_path):
    folder = shutil.copytree(tiny_folder, tmp_path / "copy")
    for component in ("unet", "vae_decoder", "vae_encoder", "text_encoder"):
        (folder / component / "config.json").unlink()
    pipe = load(OnnxStableDiffusionPipeline, folder)
    assert (pipe.vae_scale_factor, pipe.latent_channels, pipe.vae_scaling_factor) == (8, 4, 0.18215)
    assert generate(pipe, "txt2img").shape == (1, SIZE, SIZE, 3)


def test_components_are_iobinding_models_with_the_folders_sessions(tiny_folder):
    pipe = load(OnnxStableDiffusionPipeline, tiny_folder)
    for name in ("text_encoder", "unet", "vae_encoder", "vae_decoder"):
        assert isinstance(getattr(pipe, name), IOBindingORTModel)
    assert pipe.device == torch.device("cpu")
    assert pipe.text_encoder.input_dtypes["input_ids"] == torch.int32


# ----------------------------------------------------------------------------------------------------- errors
def test_missing_component_folder_is_an_error_naming_it(tiny_folder, tmp_path):
    folder = shutil.copytree(tiny_folder, tmp_path / "copy")
    shutil.rmtree(folder / "unet")
    with pytest.raises(FileNotFoundError, match=r"component 'unet' is missing"):
        OnnxStableDiffusionPipeline.from_pretrained(folder)


def test_model_index_with_an_unknown_class_is_an_error(tiny_folder, tmp_path):
    folder = shutil.copytree(tiny_folder, tmp_path / "copy")
    index = json.loads((folder / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", "NoSuchScheduler"]
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"scheduler class 'NoSuchScheduler'"):
        OnnxStableDiffusionPipeline.from_pretrained(folder)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(height=60), r"height and width: expected multiples of 16 \(the VAE.s scale factor 8 × 2\^1"),
        (dict(num_inference_steps=0), r"num_inference_steps: expected a positive integer, got 0"),
        (dict(prompt=["a", "b"], negative_prompt=["c"]), r"negative_prompt: expected a list of 2"),
        (dict(output_type="jpeg"), r"output_type: expected"),
        (dict(callback_steps=0), r"callback_steps: expected a positive integer"),
    ],
)
def test_bad_call_arguments_are_errors(tiny_folder, kwargs, message):
    pipe = load(OnnxStableDiffusionPipeline, tiny_folder)
    arguments = dict(prompt=PROMPT, height=SIZE, width=SIZE, num_inference_steps=2)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        pipe(**arguments)


@pytest.mark.parametrize("strength", [-0.1, 1.5])
def test_strength_outside_zero_one_is_an_error(tiny_folder, strength):
    pipe = load(OnnxStableDiffusionImg2ImgPipeline, tiny_folder)
    with pytest.raises(ValueError, match=rf"strength: expected a value in \[0, 1\], got {strength}"):
        pipe(PROMPT, image=init_image(), strength=strength, num_inference_steps=2)


def test_mask_and_image_of_different_sizes_is_an_error(tiny_folder):
    pipe = load(OnnxStableDiffusionInpaintPipeline, tiny_folder)
    with pytest.raises(ValueError, match=r"mask_image: expected the size of image .*64 × 64.*got 32 × 32$"):
        pipe(PROMPT, image=init_image(), mask_image=mask_image(32), height=SIZE, width=SIZE, num_inference_steps=2)
    with pytest.raises(ValueError, match=r"got 32 × 32 \(shape \(32, 32\)\)$"):  # a 2-d array: its shape alone
        pipe(PROMPT, image=init_image(), mask_image=np.zeros((32, 32), np.float32), height=SIZE, width=SIZE)
    # a 3-d array is read as diffusers reads it, (batch, height, width): its shape says so
    colour_mask = np.zeros((SIZE, SIZE, 3), np.float32)
    with pytest.raises(
        ValueError, match=rf"got {SIZE} × 3 \(shape \({SIZE}, {SIZE}, 3\), read as \(batch, height, width\)"
    ):
        pipe(PROMPT, image=init_image(), mask_image=colour_mask, height=SIZE, width=SIZE, num_inference_steps=2)


@pytest.mark.parametrize("mode", ["L", "RGBA", "P"])
def test_a_pil_image_of_another_mode_starts_as_its_rgb_conversion(tiny_folder, mode):
    """A grayscale or RGBA PIL image was refused as the VAE encoder's input ``sample`` ("expected size 3 in dim 1,
    got 1"): it is made RGB, as diffusers' load_image makes it."""
    pipe = load(OnnxStableDiffusionImg2ImgPipeline, tiny_folder)
    image = init_image().convert(mode)

    def made(start):
        arguments = dict(num_inference_steps=2, generator=np.random.RandomState(0), output_type="np")
        return pipe(PROMPT, image=start, **arguments).images

    assert np.array_equal(made(image), made(image.convert("RGB")))


def test_an_image_batch_that_fits_no_prompt_count_is_named_in_plain_words(tiny_folder):
    """Three start images for one prompt were refused as "expected 1 or 1 images (one per prompt)"."""
    pipe = load(OnnxStableDiffusionImg2ImgPipeline, tiny_folder)
    images = torch.zeros(3, 3, SIZE, SIZE)
    with pytest.raises(ValueError, match=r"^image: expected 1 image \(one prompt\), got 3$"):
        pipe(PROMPT, image=images, num_inference_steps=2)
    with pytest.raises(ValueError, match=r"^image: expected 1 or 2 images \(one per prompt\), got 3$"):
        pipe([PROMPT] * 2, image=images, num_inference_steps=2)


# --------------------------------------------------------------------------------------------------------- CLI
def test_cli_generate_writes_a_png(tiny_folder, tmp_path, capsys):
    out = tmp_path / "image.png"
    assert (
        cli_main(
            [
                "generate",
                "a cat",
                "--model",
                str(tiny_folder),
                "--steps",
                "2",
                "--height",
                "64",
                "--width",
                "64",
                "--out",
                str(out),
                "--provider",
                "CPUExecutionProvider",
            ]
        )
        == 0
    )
    assert PIL.Image.open(out).size == (64, 64)
    assert "ms/step" in capsys.readouterr().out


def test_cli_generate_without_a_model_builds_the_tiny_one_once(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMUM_IOBINDING_CACHE", str(tmp_path / "cache"))
    for name in ("first.png", "second.png"):
        assert (
            cli_main(
                [
                    "generate",
                    "--steps",
                    "1",
                    "--height",
                    "64",
                    "--width",
                    "64",
                    "--no-io-binding",
                    "--out",
                    str(tmp_path / name),
                ]
            )
            == 0
        )
    assert (tmp_path / "cache" / "tiny-random-sd" / "model_index.json").is_file()
    assert (tmp_path / "first.png").read_bytes() == (tmp_path / "second.png").read_bytes()


def test_cli_export_writes_the_onnx_layout(tmp_path):
    assert cli_main(["export", "--tiny-random", "--output", str(tmp_path / "onnx")]) == 0
    for component in ("text_encoder", "unet", "vae_encoder", "vae_decoder"):
        assert (tmp_path / "onnx" / component / "model.onnx").is_file()
    assert (tmp_path / "onnx" / "tokenizer").is_dir() and (tmp_path / "onnx" / "model_index.json").is_file()


# -------------------------------------------------------------------------------------------- export for speed
@pytest.mark.slow
def test_cpu_fused_export_matches_the_unfused_export(tiny_folder, tiny_fused_folder):
    import onnx

    unet_ops = {node.op_type for node in onnx.load(tiny_fused_folder / "unet" / "model.onnx").graph.node}
    assert "MultiHeadAttention" in unet_ops or "Attention" in unet_ops  # the fusion really happened
    images = [
        generate(load(OnnxStableDiffusionPipeline, folder), "txt2img") for folder in (tiny_folder, tiny_fused_folder)
    ]
    assert np.abs(images[0] - images[1]).max() <= 1e-4


def test_exported_tokenizer_has_the_files_transformers_4_reads(tiny_folder):
    assert (tiny_folder / "tokenizer" / "vocab.json").is_file()
    assert (tiny_folder / "tokenizer" / "merges.txt").read_text().startswith("#version: 0.2\n")


@pytest.mark.parametrize(
    "scheduler_name", ["LMSDiscreteScheduler", "UniPCMultistepScheduler", "EulerAncestralDiscreteScheduler"]
)
def test_other_diffusers_schedulers_match_the_numpy_loop_too(tiny_folder, scheduler_name):
    import diffusers

    images = []
    for io_binding in (True, False):
        pipe = load(OnnxStableDiffusionPipeline, tiny_folder, io_binding)
        pipe.scheduler = getattr(diffusers, scheduler_name).from_config(pipe.scheduler.config)
        # a torch generator: Euler ancestral draws fresh noise every step from it
        images.append(generate(pipe, "txt2img", generator=torch.Generator().manual_seed(0)))
    assert np.abs(images[0] - images[1]).max() <= 1e-4 and images[0].std() > 0.01


@pytest.mark.parametrize("scheduler", sorted(CLI_SCHEDULERS))
def test_a_numpy_seed_gives_the_same_image_twice_with_every_scheduler(tiny_folder, scheduler):
    """A stochastic scheduler (Euler ancestral) draws fresh noise every step: from the caller's numpy RandomState
    too, through a torch generator seeded from a copy of its state, which leaves the RandomState where it was."""
    import diffusers

    images = []
    for _ in range(2):
        pipe = load(OnnxStableDiffusionPipeline, tiny_folder)
        pipe.scheduler = getattr(diffusers, CLI_SCHEDULERS[scheduler]).from_config(pipe.scheduler.config)
        images.append(generate(pipe, "txt2img", generator=np.random.RandomState(7)))
    assert np.array_equal(images[0], images[1]) and images[0].std() > 0.01
    generator = np.random.RandomState(7)
    pipe.scheduler_step_kwargs(generator, 0.0)
    assert generator.randint(2**31) == np.random.RandomState(7).randint(2**31)  # not advanced


def test_generate_with_a_seed_and_euler_ancestral_writes_the_same_image_twice(tiny_folder, tmp_path):
    for name in ("first.png", "second.png"):
        argv = ["generate", "a cat", "--model", str(tiny_folder), "--steps", "3", "--height", "64", "--width", "64"]
        assert cli_main([*argv, "--scheduler", "euler-ancestral", "--seed", "3", "--out", str(tmp_path / name)]) == 0
    first, second = (np.asarray(PIL.Image.open(tmp_path / name)) for name in ("first.png", "second.png"))
    assert np.array_equal(first, second)


def test_a_directml_pipeline_with_binding_is_refused_before_anything_loads(tiny_folder):
    with pytest.raises(ValueError, match="DirectML.*io_binding=False"):
        OnnxStableDiffusionPipeline.from_pretrained(tiny_folder, provider="DmlExecutionProvider")


def _has_optimum_onnx() -> bool:
    import importlib.util

    return (
        importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.onnxruntime") is not None
    )


@pytest.mark.skipif(_has_optimum_onnx(), reason="checks the message where optimum-onnx is missing")
def test_accelerate_without_optimum_onnx_says_what_to_install():
    from optimum_iobinding import accelerate

    with pytest.raises(ImportError, match=r"optimum-iobinding\[optimum\]"):
        accelerate(object())


def test_a_normal_generate_run_is_quiet(tmp_path, monkeypatch, capfd):
    import warnings

    monkeypatch.setenv("OPTIMUM_IOBINDING_CACHE", str(tmp_path / "cache"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert (
            cli_main(
                ["generate", "--steps", "1", "--height", "64", "--width", "64", "--out", str(tmp_path / "quiet.png")]
            )
            == 0
        )  # builds the tiny model first: an export
    output = capfd.readouterr()
    assert [str(w.message)[:100] for w in caught] == []
    for notice in ("Warning", "[transformers]", "should be kept in float32", "deprecated"):
        assert notice not in output.err + output.out, output.err

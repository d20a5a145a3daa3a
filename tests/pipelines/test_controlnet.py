"""ControlNet: the export, and images equal to diffusers' torch ControlNet pipelines on the same tiny random weights."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

PROMPT = "a photo of a cat"


@pytest.fixture(scope="module")
def folders(controlnet_folders, tiny_folder):
    """The exports with one ControlNet ("one") and with two ("two"), and the same pipeline without one ("plain")."""
    return {**controlnet_folders, "plain": tiny_folder}


@pytest.fixture
def reference(vae_encodes_its_mode):
    """``reference(controlnets=1, img2img=False)``: diffusers' torch pipeline with the exported weights (the builders
    are seeded)."""

    def build(controlnets: int = 1, img2img: bool = False):
        from diffusers import StableDiffusionControlNetImg2ImgPipeline

        from optimum_iobinding.export.tiny import build_tiny_random_controlnet_pipeline

        pipe = build_tiny_random_controlnet_pipeline(controlnets=controlnets)
        if img2img:
            pipe = vae_encodes_its_mode(StableDiffusionControlNetImg2ImgPipeline(**pipe.components))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    return build


def ours(folder, io_binding=True, img2img=False):
    from optimum_iobinding import OnnxStableDiffusionControlNetImg2ImgPipeline, OnnxStableDiffusionControlNetPipeline

    cls = OnnxStableDiffusionControlNetImg2ImgPipeline if img2img else OnnxStableDiffusionControlNetPipeline
    pipe = cls.from_pretrained(folder, io_binding=io_binding)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def control_image(seed=3, size=64, batch=1):
    return torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def run(pipe, **kwargs):
    kwargs = {"prompt": PROMPT, "num_inference_steps": 4, "output_type": "np", **kwargs}
    return pipe(generator=torch.Generator().manual_seed(0), **kwargs).images


# ------------------------------------------------------------------------------------------------------ export
def test_the_export_writes_the_controlnet_and_a_unet_taking_its_residuals(folders):
    from optimum_iobinding import IOBindingORTModel

    controlnet = IOBindingORTModel.from_pretrained(folders["one"] / "controlnet")
    unet = IOBindingORTModel.from_pretrained(folders["one"] / "unet")
    assert controlnet.input_names == [
        "sample",
        "timestep",
        "encoder_hidden_states",
        "controlnet_cond",
        "conditioning_scale",
    ]
    residuals = controlnet.output_names
    # conv_in's, the first block's layer and downsampler, the last block's layer, then the mid block's
    assert residuals[-1] == "mid_block_res_sample" and len(residuals) == 5
    assert unet.input_names[3:] == [f"down_block_additional_residual_{i}" for i in range(4)] + [
        "mid_block_additional_residual"
    ]
    assert (folders["two"] / "controlnet_1" / "model.onnx").is_file()
    assert not (folders["two"] / "controlnet_2").exists()


@pytest.mark.parametrize("latents", [(8, 8), (18, 10)])
def test_the_residuals_shapes_follow_from_the_declared_dims_alone(folders, latents):
    """A fused export's contrib ops stop ONNX shape inference: the residuals' declared dims must give their shapes
    for any latent size by themselves (a graph whose output shapes are unknown is not captured)."""
    import onnx

    from optimum_iobinding.export.tiny import build_tiny_random_controlnet_pipeline
    from optimum_iobinding.runtime.shapes import ShapeInferencer

    def dims(values):
        return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}

    graph = onnx.load(folders["one"] / "controlnet" / "model.onnx", load_external_data=False).graph
    declared = ShapeInferencer(dims(graph.input), dims(graph.output))  # no graph: ONNX shape inference never runs
    height, width = latents
    shapes = declared(
        {
            "sample": (2, 4, height, width),
            "timestep": (2,),
            "encoder_hidden_states": (2, 7, 32),
            "controlnet_cond": (2, 3, 8 * height, 8 * width),
            "conditioning_scale": (5,),
        }
    )
    controlnet = build_tiny_random_controlnet_pipeline().controlnet
    with torch.no_grad():
        down, mid = controlnet(
            torch.zeros(2, 4, height, width),
            torch.tensor([1.0, 1.0]),
            torch.zeros(2, 7, 32),
            torch.zeros(2, 3, 8 * height, 8 * width),
            return_dict=False,
        )
    assert list(shapes.values()) == [tuple(r.shape) for r in (*down, mid)]


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"fp16": True}, {"optimize": "cpu"}])
def test_fp16_and_fused_exports_run(tmp_path, options, reference):
    from optimum_iobinding.export import export_pipeline

    folder = export_pipeline(None, tmp_path / "x", tiny_random="controlnet", progress=False, **options)
    image = run(ours(folder), image=control_image(), num_inference_steps=2)
    assert image.shape == (1, 64, 64, 3) and np.isfinite(image).all()
    if not options.get("fp16"):  # fused fp32: the fusions only reorder sums
        np.testing.assert_allclose(image, run(reference(), image=control_image(), num_inference_steps=2), atol=1e-4)


# ------------------------------------------------------------------------------------------------ equal images
@pytest.mark.parametrize("io_binding", [True, False])
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"guidance_scale": 1.0},
        {"guidance_scale": 3.0, "controlnet_conditioning_scale": 0.5},
        {"guess_mode": True},
        {"guess_mode": True, "guidance_scale": 1.0},
        {"control_guidance_start": 0.3, "control_guidance_end": 0.7},
        {"control_guidance_start": 0.5},  # the first steps skip the ControlNet
    ],
    ids=["default", "no-guidance", "scale-0.5", "guess", "guess-no-guidance", "window", "late-start"],
)
def test_images_equal_diffusers_controlnet_pipeline(folders, io_binding, kwargs, reference):
    expected = run(reference(), image=control_image(), **kwargs)
    np.testing.assert_allclose(
        run(ours(folders["one"], io_binding), image=control_image(), **kwargs), expected, atol=1e-4
    )


def test_conditioning_scale_zero_equals_the_plain_pipeline(folders, reference):
    from diffusers import StableDiffusionPipeline

    plain = StableDiffusionPipeline(**{k: v for k, v in reference().components.items() if k != "controlnet"})
    plain.set_progress_bar_config(disable=True)
    got = run(ours(folders["one"]), image=control_image(), controlnet_conditioning_scale=0.0)
    np.testing.assert_allclose(got, run(plain, height=64, width=64), atol=1e-4)
    assert np.abs(got - run(ours(folders["one"]), image=control_image())).max() > 1e-3  # the ControlNet matters


def test_batches_and_a_pil_image_of_another_size_equal_diffusers(folders, reference):
    from PIL import Image

    pil = Image.fromarray((control_image(size=96)[0].permute(1, 2, 0).numpy() * 255).astype(np.uint8))
    kwargs = dict(prompt=["a cat", "a dog"], num_images_per_prompt=2, height=64, width=64, image=pil)
    expected = run(reference(), **kwargs)
    got = run(ours(folders["one"]), **kwargs)
    assert got.shape == (4, 64, 64, 3)
    np.testing.assert_allclose(got, expected, atol=1e-4)
    # height and width come from the control image when not given
    assert run(ours(folders["one"]), image=control_image(size=96), num_inference_steps=1).shape == (1, 96, 96, 3)


@pytest.mark.parametrize("io_binding", [True, False])
def test_multi_controlnet_equals_diffusers(folders, io_binding, reference):
    images = [control_image(3), control_image(4)]
    kwargs = dict(
        image=images,
        controlnet_conditioning_scale=[0.7, 1.2],
        control_guidance_start=[0.0, 0.25],
        control_guidance_end=[0.5, 1.0],
    )
    np.testing.assert_allclose(run(ours(folders["two"], io_binding), **kwargs), run(reference(2), **kwargs), atol=1e-4)
    kwargs = dict(image=images, guess_mode=True)
    np.testing.assert_allclose(run(ours(folders["two"], io_binding), **kwargs), run(reference(2), **kwargs), atol=1e-4)


@pytest.mark.parametrize("io_binding", [True, False])
def test_img2img_equals_diffusers(folders, io_binding, reference):
    kwargs = dict(image=control_image(7), control_image=control_image(), strength=0.75)
    expected = run(reference(img2img=True), **kwargs)
    np.testing.assert_allclose(run(ours(folders["one"], io_binding, img2img=True), **kwargs), expected, atol=1e-4)


def test_lora_on_a_controlnet_pipeline_equals_diffusers(folders, tmp_path, reference, make_lora):
    from optimum_iobinding.export.tiny import build_tiny_random_pipeline

    lora = make_lora(build_tiny_random_pipeline(), tmp_path / "lora", 5, ["to_q", "to_v", "conv1"], ["q_proj"])
    expected, got = reference(), ours(folders["one"])
    for pipe in (expected, got):
        pipe.load_lora_weights(lora, adapter_name="a")
        pipe.set_adapters(["a"], adapter_weights=[0.8])
    np.testing.assert_allclose(run(got, image=control_image()), run(expected, image=control_image()), atol=1e-4)


def test_save_and_warmup_keep_the_controlnets(folders, tmp_path):
    pipe = ours(folders["two"])
    pipe.save_pretrained(tmp_path / "saved")
    again = ours(tmp_path / "saved")
    assert [name for name in again.onnx_models if name.startswith("controlnet")] == ["controlnet", "controlnet_1"]
    again.warmup(heights=64, batch_sizes=[1], num_inference_steps=1)
    created = again.sessions_created
    run(again, image=[control_image(3), control_image(4)], num_inference_steps=2)
    assert again.sessions_created == created
    assert set(again.components) >= {"controlnet", "controlnet_1", "unet"}


def test_cli_exports_with_a_controlnet_folder(tmp_path, reference):
    from optimum_iobinding.cli import main
    from optimum_iobinding.export.tiny import build_tiny_random_controlnet, build_tiny_random_pipeline

    build_tiny_random_controlnet(build_tiny_random_pipeline().unet, seed=10).save_pretrained(tmp_path / "net")
    assert (
        main(
            [
                "export",
                "--tiny-random",
                "--controlnet",
                str(tmp_path / "net"),
                "--controlnet",
                str(tmp_path / "net"),
                "--output",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    pipe = ours(tmp_path / "out")
    assert len(pipe.controlnets) == 2
    # the same ControlNet twice at half scale each: the single ControlNet's image
    np.testing.assert_allclose(
        run(pipe, image=[control_image()] * 2, controlnet_conditioning_scale=[0.5, 0.5]),
        run(reference(), image=control_image(), controlnet_conditioning_scale=1.0),
        atol=1e-4,
    )


# ------------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"image": torch.rand(1, 4, 64, 64)}, "image: expected a control image with 3 channels"),
        ({"image": np.random.rand(64, 64, 1)}, "image: expected a control image with 3 channels"),
        ({"image": torch.rand(1, 3, 72, 72)}, "image: a control image of 72 × 72"),
        ({"image": None}, "image: expected a control image"),
        ({"image": control_image(batch=3), "prompt": ["a", "b"]}, "image: expected 1 control image or 2"),
        ({"controlnet_conditioning_scale": [1.0, 1.0]}, "controlnet_conditioning_scale: expected 1 values"),
        ({"controlnet_conditioning_scale": None}, "controlnet_conditioning_scale: expected finite numbers"),
        ({"control_guidance_start": 0.8, "control_guidance_end": 0.2}, "control_guidance_start: expected each start"),
        ({"control_guidance_end": 1.5}, "control_guidance_end: expected numbers in [0, 1]"),
        ({"guess_mode": "yes"}, "guess_mode: expected True or False"),
    ],
)
def test_control_mistakes_are_errors_naming_them(folders, kwargs, message):
    pipe = ours(folders["one"])
    kwargs = {"image": control_image(), **kwargs}
    with pytest.raises((ValueError, TypeError), match=message.replace("[", r"\[").replace("]", r"\]")):
        run(pipe, **kwargs)


def test_multi_controlnet_mistakes_name_the_image(folders):
    pipe = ours(folders["two"])
    with pytest.raises(ValueError, match="image: expected a list of 2 control images"):
        run(pipe, image=control_image())
    with pytest.raises(ValueError, match=r"image\[1\]: expected a control image of 64 × 64 like image\[0\]"):
        run(pipe, image=[control_image(), control_image(size=96)])


def test_a_controlnet_without_its_unet_and_a_folder_without_a_controlnet_are_errors(folders, tmp_path):
    from optimum_iobinding import OnnxStableDiffusionControlNetPipeline, OnnxStableDiffusionPipeline

    mixed = tmp_path / "mixed"
    shutil.copytree(folders["plain"], mixed)
    shutil.copytree(folders["one"] / "controlnet", mixed / "controlnet")
    with pytest.raises(ValueError, match="unet: a ControlNet pipeline needs the UNet exported with its ControlNet"):
        OnnxStableDiffusionControlNetPipeline.from_pretrained(mixed)
    with pytest.raises(FileNotFoundError, match="component 'controlnet' is missing"):
        OnnxStableDiffusionControlNetPipeline.from_pretrained(folders["plain"])
    with pytest.raises(ValueError, match="use OnnxStableDiffusionControlNetPipeline"):
        OnnxStableDiffusionPipeline.from_pretrained(folders["one"])

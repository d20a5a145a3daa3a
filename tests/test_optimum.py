"""An `optimum-cli export onnx --task text-to-image` folder loads and runs unpatched (optimum environment only:
transformers 4.57, diffusers 0.39, optimum 2.1, optimum-onnx 0.1; skipped where optimum-onnx does not import)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("optimum.exporters.onnx", reason="needs the optimum-onnx environment (constraints-optimum.txt)")

from optimum_iobinding import (  # noqa: E402
    OnnxStableDiffusionImg2ImgPipeline,
    OnnxStableDiffusionPipeline,
    infer_output_shapes,
)
from optimum_iobinding.export.tiny import build_tiny_random_pipeline  # noqa: E402

SIZE = 64


def optimum_export(torch_pipeline, root):
    """What `optimum-cli export onnx --task text-to-image` writes for a saved torch pipeline."""
    from optimum.exporters.onnx import main_export

    torch_pipeline.save_pretrained(root / "torch")
    main_export(str(root / "torch"), output=str(root / "onnx"), task="text-to-image")
    return root / "onnx"


@pytest.fixture(scope="module")
def optimum_folder(tmp_path_factory):
    return optimum_export(build_tiny_random_pipeline(), tmp_path_factory.mktemp("optimum"))


def run(pipe, **kwargs):
    pipe.set_progress_bar_config(disable=True)
    arguments = dict(num_inference_steps=3, generator=np.random.RandomState(0), output_type="np")
    arguments.update(kwargs)
    return pipe("a photo of a cat", **arguments).images


def test_optimum_layout_has_what_diffusers_onnx_pipeline_cannot_run(optimum_folder):
    # the reasons diffusers' own pipeline needs patches: torch class names, int64 ids, a scalar timestep
    pipe = OnnxStableDiffusionPipeline.from_pretrained(optimum_folder)
    assert '"UNet2DConditionModel"' in (optimum_folder / "model_index.json").read_text()
    assert pipe.text_encoder.input_dtypes["input_ids"] == torch.int64
    assert pipe.unet.session.get_inputs()[1].shape == []
    assert pipe.vae_encoder.output_names == ["latent_parameters"]


def test_txt2img_on_an_optimum_export_matches_the_numpy_loop(optimum_folder):
    bound = run(OnnxStableDiffusionPipeline.from_pretrained(optimum_folder), height=SIZE, width=SIZE)
    baseline = run(
        OnnxStableDiffusionPipeline.from_pretrained(optimum_folder, io_binding=False), height=SIZE, width=SIZE
    )
    assert bound.shape == (1, SIZE, SIZE, 3) and bound.std() > 0.01
    assert np.abs(bound - baseline).max() <= 1e-4


def test_img2img_samples_the_latent_parameters_of_an_optimum_vae_encoder(optimum_folder):
    image = np.random.default_rng(0).random((SIZE, SIZE, 3)).astype(np.float32)
    pipe = OnnxStableDiffusionImg2ImgPipeline.from_pretrained(optimum_folder)
    bound = run(pipe, image=image, strength=0.7)
    baseline = run(
        OnnxStableDiffusionImg2ImgPipeline.from_pretrained(optimum_folder, io_binding=False), image=image, strength=0.7
    )
    assert np.abs(bound - baseline).max() <= 1e-4
    with_torch_generator = run(pipe, image=image, strength=0.7, generator=torch.Generator().manual_seed(0))
    assert with_torch_generator.shape == bound.shape


def test_expression_dims_of_the_optimum_vae_are_resolved_before_the_run(optimum_folder):
    pipe = OnnxStableDiffusionPipeline.from_pretrained(optimum_folder)
    assert infer_output_shapes(pipe.vae_decoder, {"latent_sample": (1, 4, 8, 16)}) == {"sample": (1, 3, 64, 128)}
    assert infer_output_shapes(pipe.vae_encoder, {"sample": (2, 3, 64, 64)}) == {"latent_parameters": (2, 8, 8, 8)}


def test_same_latents_give_optimum_ort_pipelines_image(optimum_folder):
    from optimum.onnxruntime import ORTStableDiffusionPipeline

    latents = np.random.RandomState(0).randn(1, 4, SIZE // 8, SIZE // 8).astype(np.float32)
    theirs = ORTStableDiffusionPipeline.from_pretrained(optimum_folder, provider="CPUExecutionProvider")
    theirs.set_progress_bar_config(disable=True)
    expected = theirs(
        "a photo of a cat",
        height=SIZE,
        width=SIZE,
        num_inference_steps=3,
        latents=torch.from_numpy(latents),
        output_type="np",
    ).images
    ours = run(OnnxStableDiffusionPipeline.from_pretrained(optimum_folder), height=SIZE, width=SIZE, latents=latents)
    assert np.abs(np.asarray(expected) - ours).max() <= 1e-4


@pytest.fixture(scope="module")
def optimum_xl_folder(tmp_path_factory):
    from optimum_iobinding.export.tiny import build_tiny_random_xl_pipeline

    return optimum_export(build_tiny_random_xl_pipeline(), tmp_path_factory.mktemp("optimum-xl"))


def test_an_optimum_sdxl_export_gives_optimum_ort_sdxl_pipelines_image(optimum_xl_folder):
    from optimum.onnxruntime import ORTStableDiffusionXLPipeline

    from optimum_iobinding import OnnxStableDiffusionXLPipeline

    latents = np.random.RandomState(0).randn(1, 4, SIZE // 8, SIZE // 8).astype(np.float32)
    theirs = ORTStableDiffusionXLPipeline.from_pretrained(optimum_xl_folder, provider="CPUExecutionProvider")
    theirs.set_progress_bar_config(disable=True)
    expected = theirs(
        "a photo of a cat",
        height=SIZE,
        width=SIZE,
        num_inference_steps=3,
        latents=torch.from_numpy(latents),
        output_type="np",
    ).images
    ours = OnnxStableDiffusionXLPipeline.from_pretrained(optimum_xl_folder)
    assert ours.unet.session.get_inputs()[1].shape == []  # optimum's scalar float timestep
    assert np.abs(np.asarray(expected) - run(ours, height=SIZE, width=SIZE, latents=latents)).max() <= 1e-4


def latents_for_run():
    return torch.from_numpy(np.random.RandomState(0).randn(1, 4, SIZE // 8, SIZE // 8).astype(np.float32))


def optimum_images(pipe, **kwargs):
    pipe.set_progress_bar_config(disable=True)
    return np.asarray(
        pipe("a photo of a cat", height=SIZE, width=SIZE, latents=latents_for_run(), output_type="np", **kwargs).images
    )


def test_accelerate_switches_every_part_in_place_and_changes_no_image(optimum_folder):
    from optimum.onnxruntime import ORTStableDiffusionPipeline

    from optimum_iobinding import IOBindingORTModel
    from optimum_iobinding import accelerate

    pipe = ORTStableDiffusionPipeline.from_pretrained(optimum_folder, provider="CPUExecutionProvider")
    before = optimum_images(pipe, num_inference_steps=3)
    assert accelerate(pipe) is pipe
    for part in (pipe.unet, pipe.text_encoder, pipe.vae_encoder, pipe.vae_decoder):
        assert type(part).__name__.startswith("Accelerated") and isinstance(part.fast_model, IOBindingORTModel)
    assert pipe.vae.decoder is pipe.vae_decoder and set(pipe.parts) == {
        pipe.unet,
        pipe.text_encoder,
        pipe.vae_encoder,
        pipe.vae_decoder,
    }
    np.testing.assert_allclose(optimum_images(pipe, num_inference_steps=3), before, atol=1e-5)
    # a multistep scheduler keeps earlier model outputs: they must not be buffers the next step overwrites
    from diffusers import DPMSolverMultistepScheduler

    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    fresh = ORTStableDiffusionPipeline.from_pretrained(optimum_folder, provider="CPUExecutionProvider")
    fresh.scheduler = DPMSolverMultistepScheduler.from_config(fresh.scheduler.config)
    np.testing.assert_allclose(
        optimum_images(pipe, num_inference_steps=4, guidance_scale=1.0),
        optimum_images(fresh, num_inference_steps=4, guidance_scale=1.0),
        atol=1e-5,
    )


def test_accelerate_an_optimum_sdxl_pipeline(optimum_xl_folder):
    from optimum.onnxruntime import ORTStableDiffusionXLPipeline

    from optimum_iobinding import accelerate

    pipe = ORTStableDiffusionXLPipeline.from_pretrained(optimum_xl_folder, provider="CPUExecutionProvider")
    before = optimum_images(pipe, num_inference_steps=3)
    np.testing.assert_allclose(optimum_images(accelerate(pipe), num_inference_steps=3), before, atol=1e-5)


def test_accelerate_refuses_what_is_not_an_optimum_pipeline(optimum_folder):
    from optimum_iobinding import accelerate

    with pytest.raises(TypeError, match="ORTDiffusionPipeline"):
        accelerate(OnnxStableDiffusionPipeline.from_pretrained(optimum_folder))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and onnxruntime-gpu")
def test_accelerated_on_cuda_with_a_graph_matches_optimums_own_binding(optimum_folder):
    from optimum.onnxruntime import ORTStableDiffusionPipeline

    from optimum_iobinding import accelerate

    exact = {"use_tf32": "0"}
    theirs = ORTStableDiffusionPipeline.from_pretrained(
        optimum_folder, provider="CUDAExecutionProvider", provider_options=exact, use_io_binding=True
    )
    expected = optimum_images(theirs, num_inference_steps=4)
    ours = accelerate(
        ORTStableDiffusionPipeline.from_pretrained(
            optimum_folder, provider="CUDAExecutionProvider", provider_options=exact
        ),
        cuda_graph=True,
        provider_options=exact,
    )
    got = optimum_images(ours, num_inference_steps=4)
    assert ours.unet.fast_model.cuda_graph and ours.unet.fast_model.graph_signatures
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_optimums_lcm_pipeline_accelerated_equals_it_and_ours(tmp_path):
    """LCM's scheduler keeps the UNet output and the latents of a step together: outputs must not be reused buffers."""
    from optimum.onnxruntime import ORTLatentConsistencyModelPipeline

    from optimum_iobinding import OnnxLatentConsistencyModelPipeline, accelerate
    from optimum_iobinding.export import export_pipeline

    folder = export_pipeline(None, tmp_path / "lcm", tiny_random="lcm", progress=False)
    noise = lambda: torch.Generator().manual_seed(0)  # noqa: E731  (LCM adds noise before every step but the last)
    pipe = ORTLatentConsistencyModelPipeline.from_pretrained(folder, provider="CPUExecutionProvider")
    theirs = optimum_images(pipe, num_inference_steps=4, generator=noise())
    accelerated = optimum_images(accelerate(pipe), num_inference_steps=4, generator=noise())
    ours = OnnxLatentConsistencyModelPipeline.from_pretrained(folder)
    ours.set_progress_bar_config(disable=True)
    mine = ours(
        "a photo of a cat",
        height=SIZE,
        width=SIZE,
        num_inference_steps=4,
        latents=latents_for_run(),
        generator=noise(),
        output_type="np",
    ).images
    np.testing.assert_allclose(accelerated, theirs, atol=1e-5)
    np.testing.assert_allclose(mine, theirs, atol=1e-5)

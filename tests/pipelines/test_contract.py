"""The behaviour contract every pipeline family keeps, run for each of them on its tiny random export: a refused call
runs no component; each output type; step-end callbacks; a warm-up leaves no session for the next call to make; a
save/load round trip gives the same images; the same generator the same images; and ``cuda_graph=True`` binds the
family's own denoiser, the component that must be captured."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict

import numpy as np
import PIL.Image
import pytest
import torch

import optimum_iobinding as oi

PROMPT = "a photo of an astronaut riding a horse"
SIZE = 64
STEPS = 2


def start_image(height: int = SIZE, width: int = SIZE) -> PIL.Image.Image:
    pixels = np.random.default_rng(0).random((height, width, 3))
    return PIL.Image.fromarray((pixels * 255).astype(np.uint8))


def square_mask() -> PIL.Image.Image:
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[SIZE // 4 : 3 * SIZE // 4, SIZE // 4 : 3 * SIZE // 4] = 255
    return PIL.Image.fromarray(mask)


@dataclass(frozen=True)
class Family:
    """A family under the contract: its class, the tiny export it runs on and a call's size-giving arguments."""

    name: str
    pipeline: str
    export: str  # export_pipeline's tiny_random kind
    arguments: Callable[[], Dict[str, Any]]
    height: int = SIZE
    width: int = SIZE
    warmup: Dict[str, Any] = field(default_factory=dict)  # the call arguments warm-up needs to match a call


T5 = {"max_sequence_length": 16}
FAMILIES = [
    Family("sd", "OnnxStableDiffusionPipeline", "sd", lambda: dict(height=SIZE, width=SIZE)),
    Family("img2img", "OnnxStableDiffusionImg2ImgPipeline", "sd", lambda: dict(image=start_image(), strength=1.0)),
    Family(
        "inpaint",
        "OnnxStableDiffusionInpaintPipeline",
        "sd",
        lambda: dict(image=start_image(), mask_image=square_mask(), height=SIZE, width=SIZE),
    ),
    Family("lcm", "OnnxLatentConsistencyModelPipeline", "lcm", lambda: dict(height=SIZE, width=SIZE)),
    Family("xl", "OnnxStableDiffusionXLPipeline", "xl", lambda: dict(height=SIZE, width=SIZE)),
    Family("xl-img2img", "OnnxStableDiffusionXLImg2ImgPipeline", "xl", lambda: dict(image=start_image(), strength=1.0)),
    Family(
        "controlnet",
        "OnnxStableDiffusionControlNetPipeline",
        "controlnet",
        lambda: dict(image=start_image(), height=SIZE, width=SIZE),
    ),
    Family(
        "controlnet-img2img",
        "OnnxStableDiffusionControlNetImg2ImgPipeline",
        "controlnet",
        lambda: dict(image=start_image(), control_image=start_image(), strength=1.0),
    ),
    Family("sd3", "OnnxStableDiffusion3Pipeline", "sd3", lambda: dict(height=SIZE, width=SIZE, **T5), warmup=T5),
    Family("flux", "OnnxFluxPipeline", "flux", lambda: dict(height=64, width=48, **T5), height=64, width=48, warmup=T5),
]


@pytest.fixture(scope="session")
def exports(shared_export, tiny_folder):
    """Each tiny random export the families run on, made once per test run on first use (shared_export)."""
    from optimum_iobinding.export import export_pipeline

    def folder(kind: str):
        if kind == "sd":
            return tiny_folder
        return shared_export(
            f"tiny-random-{kind}", lambda target: export_pipeline(None, target, tiny_random=kind, progress=False)
        )

    return folder


@pytest.fixture(params=FAMILIES, ids=[family.name for family in FAMILIES])
def family(request):
    return request.param


def load(family: Family, folder, **options):
    pipe = getattr(oi, family.pipeline).from_pretrained(folder, **options)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def pipe(family, exports):
    return load(family, exports(family.export))


def call(family: Family, pipe, seed: int = 0, **overrides):
    arguments = dict(
        family.arguments(), num_inference_steps=STEPS, generator=torch.Generator().manual_seed(seed), output_type="np"
    )
    arguments.update(overrides)
    return pipe(PROMPT, **arguments)


def test_a_refused_call_runs_no_component(family, pipe):
    with contextlib.ExitStack() as stack:
        runs = [stack.enter_context(model.watch_runs()) for model in pipe.onnx_models.values()]
        with pytest.raises(ValueError, match="num_inference_steps: expected a positive integer, got 0"):
            call(family, pipe, num_inference_steps=0)
    assert not any(runs)


def test_each_output_type_is_diffusers(family, pipe):
    images = call(family, pipe).images
    assert isinstance(images, np.ndarray) and images.shape == (1, family.height, family.width, 3)
    assert images.dtype == np.float32 and 0.0 <= images.min() and images.max() <= 1.0
    pil = call(family, pipe, output_type="pil").images
    assert len(pil) == 1 and isinstance(pil[0], PIL.Image.Image) and pil[0].size == (family.width, family.height)
    np.testing.assert_array_equal(np.asarray(pil[0]), pipe.image_processor.numpy_to_pil(images)[0])
    tensor = call(family, pipe, output_type="pt").images
    assert isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == (1, 3, family.height, family.width)
    np.testing.assert_allclose(tensor.permute(0, 2, 3, 1).cpu().numpy(), images, atol=1e-6)
    latents = call(family, pipe, output_type="latent").images
    factor = pipe.vae_scale_factor
    expected = (
        (1, family.height // (2 * factor) * (family.width // (2 * factor)), pipe.latent_channels * 4)
        if pipe.packed_latents
        else (1, pipe.latent_channels, family.height // factor, family.width // factor)
    )
    assert isinstance(latents, torch.Tensor) and tuple(latents.shape) == expected
    as_tuple = call(family, pipe, return_dict=False)
    assert isinstance(as_tuple, tuple)
    np.testing.assert_array_equal(as_tuple[0], images)


def test_a_step_end_callback_sees_every_step_and_its_latents_are_used(family, pipe):
    seen = []

    def watch(pipeline, step, timestep, tensors):
        seen.append((pipeline, step, tuple(tensors)))
        return {}

    plain = call(family, pipe, callback_on_step_end=watch).images
    assert seen == [(pipe, step, ("latents",)) for step in range(len(seen))] and len(seen) >= 1
    np.testing.assert_array_equal(plain, call(family, pipe).images)

    def scramble(pipeline, step, timestep, tensors):
        return {"latents": torch.roll(tensors["latents"], 1, dims=-1)}

    assert not np.array_equal(call(family, pipe, callback_on_step_end=scramble).images, plain)


def test_after_warmup_the_next_call_makes_no_session(family, pipe):
    pipe.warmup(heights=family.height, widths=family.width, batch_sizes=1, num_inference_steps=STEPS, **family.warmup)
    made = pipe.sessions_created
    call(family, pipe)
    assert pipe.sessions_created == made


def test_a_saved_pipeline_loads_again_and_gives_the_same_images(family, pipe, tmp_path):
    expected = call(family, pipe).images
    pipe.save_pretrained(tmp_path / "saved")
    again = load(family, tmp_path / "saved")
    assert type(again) is type(pipe)
    np.testing.assert_allclose(call(family, again).images, expected, atol=1e-6)


def test_the_same_generator_gives_the_same_images_and_another_other_ones(family, pipe):
    first = call(family, pipe, seed=0).images
    np.testing.assert_array_equal(call(family, pipe, seed=0).images, first)
    assert not np.array_equal(call(family, pipe, seed=1).images, first)


def test_cuda_graph_true_binds_the_familys_denoiser(family, exports):
    folder = exports(family.export)
    denoiser = getattr(oi, family.pipeline).denoiser_component()
    assert denoiser == ("transformer" if family.export in ("sd3", "flux") else "unet")
    # on the CPU no graph can be captured: True is an error for the denoiser only
    with pytest.raises(ValueError, match="cuda_graph: needs a CUDA session with io_binding=True, got device cpu"):
        load(family, folder, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph: needs a CUDA session"):
        load(family, folder, cuda_graph=True, component_options={"vae_decoder": {"cuda_graph": "auto"}})
    pipe = load(family, folder, cuda_graph=True, component_options={denoiser: {"cuda_graph": "auto"}})
    assert all(model.cuda_graph is False for model in pipe.onnx_models.values())

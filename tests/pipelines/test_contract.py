"""The behaviour contract every prompt-driven pipeline family keeps, run for each record of the family table
(:data:`optimum_iobinding.families.FAMILIES`) on its tiny random export: a refused call runs no component; each output
type; step-end callbacks; a warm-up leaves no session for the next call to make; a save/load round trip gives the
same images; the same generator the same images; and ``cuda_graph=True`` binds the family's own denoiser, the
component that must be captured. The stream, whose call takes frames, keeps the items that apply to it in
test_stream_contract.py. A record added to the table runs here too, or fails saying what the contract needs for it."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Dict, Tuple

import numpy as np
import PIL.Image
import pytest
import torch

from optimum_iobinding.families import FAMILIES, Family, family, pipeline_class

PROMPT = "a photo of an astronaut riding a horse"
SIZE = 64
STEPS = 2

# The records whose pipeline has no prompt-driven __call__, with where their contract lives.
NOT_PROMPT_DRIVEN = {
    "stream": "tests/pipelines/test_stream_contract.py",
    "stream-xl": "tests/pipelines/test_stream_xl.py",
    "stream-controlnet": "tests/pipelines/test_stream_controlnet.py",
    "stream-xl-controlnet": "tests/pipelines/test_stream_xl_controlnet.py",
}
# The records whose calls make videos (Family.frames), not images, with where their contract lives.
MAKES_VIDEOS = {"wan": "tests/pipelines/test_wan.py", "wan-i2v": "tests/pipelines/test_wan_i2v.py"}
CONTRACT_FAMILIES = [record for record in FAMILIES if record.key not in {**NOT_PROMPT_DRIVEN, **MAKES_VIDEOS}]

# The records that have neither tiny random models of their own nor a family naming them its image-to-image sibling:
# the family whose tiny export they run on.
RUNS_ON_EXPORT_OF = {"inpaint": "sd", "controlnet-img2img": "controlnet"}

# A call's arguments peculiar to one family: FLUX.1 at a size that is not square (its packed latents' rows and
# columns differ), a short T5 prompt, in the call and in the warm-up, for the families with a T5 encoder (whose
# default is 256 or 512 tokens), and FLUX.1 Kontext's output area and reference image at the call's size (diffusers'
# defaults make both about 1024²), in the call and, where it takes them, in the warm-up.
SIZES: Dict[str, Tuple[int, int]] = {"flux": (64, 48)}
T5_LENGTH = 16
EXTRAS: Dict[str, Dict[str, Any]] = {"flux-kontext": dict(max_area=SIZE * SIZE, _auto_resize=False)}


def start_image(height: int = SIZE, width: int = SIZE) -> PIL.Image.Image:
    pixels = np.random.default_rng(0).random((height, width, 3))
    return PIL.Image.fromarray((pixels * 255).astype(np.uint8))


def square_mask() -> PIL.Image.Image:
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[SIZE // 4 : 3 * SIZE // 4, SIZE // 4 : 3 * SIZE // 4] = 255
    return PIL.Image.fromarray(mask)


# The image a call's image argument gets, by the argument's name (Family.image_inputs).
IMAGE_ARGUMENTS = {"image": start_image, "mask_image": square_mask, "control_image": start_image}


def tiny_kind(record: Family) -> str:
    """The tiny random export (``export --tiny-random KIND``) the contract runs ``record`` on: its own, else that of
    the family whose image-to-image sibling it is, else that of the family :data:`RUNS_ON_EXPORT_OF` names."""
    if record.tiny_random:
        return record.tiny_random[0]
    parent = next((other for other in FAMILIES if other.image_to_image == record.key), None)
    if parent is None and record.key in RUNS_ON_EXPORT_OF:
        parent = family(RUNS_ON_EXPORT_OF[record.key])
    if parent is None or not parent.tiny_random:
        pytest.fail(
            f"family {record.key!r} has no tiny random export for the contract: give its record tiny_random, make it "
            f"a family's image_to_image sibling, or name the family whose export it runs on in RUNS_ON_EXPORT_OF"
        )
    return parent.tiny_random[0]


def image_size(record: Family) -> Tuple[int, int]:
    """The (height, width) of the images a call of the contract makes."""
    return SIZES.get(record.key, (SIZE, SIZE))


def t5_length(record: Family) -> Dict[str, Any]:
    return {"max_sequence_length": T5_LENGTH} if record.options.get("t5_tokenizer") else {}


def warmup_extras(record: Family, pipe) -> Dict[str, Any]:
    """The record's :data:`EXTRAS` its warm-up takes (the others its warm-up derives from the size)."""
    return {name: value for name, value in EXTRAS.get(record.key, {}).items() if name in pipe.warmup_arguments()}


def call_arguments(record: Family) -> Dict[str, Any]:
    """A call's image and size arguments: an image for each of the record's image inputs, the family's size where
    the call takes one (else the start image's size is the images'), every step run where it takes a ``strength``,
    and the T5 prompt length where the family has a T5 encoder."""
    unknown = sorted(set(record.image_inputs) - set(IMAGE_ARGUMENTS))
    if unknown:
        pytest.fail(f"family {record.key!r} takes image inputs {unknown} that the contract has no image for")
    parameters = inspect.signature(pipeline_class(record).__call__).parameters
    arguments: Dict[str, Any] = {name: IMAGE_ARGUMENTS[name]() for name in sorted(record.image_inputs)}
    if "height" in parameters:
        arguments["height"], arguments["width"] = image_size(record)
    if "strength" in parameters:
        arguments["strength"] = 1.0
    return {**arguments, **t5_length(record), **EXTRAS.get(record.key, {})}


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


@pytest.fixture(params=CONTRACT_FAMILIES, ids=[record.key for record in CONTRACT_FAMILIES])
def record(request) -> Family:
    return request.param


def load(record: Family, folder, **options):
    pipe = pipeline_class(record).from_pretrained(folder, **options)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def pipe(record, exports):
    return load(record, exports(tiny_kind(record)))


def call(record: Family, pipe, seed: int = 0, **overrides):
    arguments = dict(
        call_arguments(record),
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
    )
    arguments.update(overrides)
    return pipe(prompt=PROMPT, **arguments)


def test_a_refused_call_runs_no_component(record, pipe):
    with contextlib.ExitStack() as stack:
        runs = [stack.enter_context(model.watch_runs()) for model in pipe.onnx_models.values()]
        with pytest.raises(ValueError, match="num_inference_steps: expected a positive integer, got 0"):
            call(record, pipe, num_inference_steps=0)
    assert not any(runs)


def test_a_list_of_generators_not_one_per_image_is_refused_before_any_component_runs(record, pipe):
    """diffusers refuses a list of generators whose length is not the number of images; the UNet families took
    three generators for one image without a word."""
    three = [torch.Generator().manual_seed(seed) for seed in range(3)]
    with contextlib.ExitStack() as stack:
        runs = [stack.enter_context(model.watch_runs()) for model in pipe.onnx_models.values()]
        with pytest.raises(
            ValueError,
            match=r"^generator: expected one torch.Generator per image \(2: 1 prompt × num_images_per_prompt 2\), "
            r"got a list of 3$",
        ):
            call(record, pipe, generator=three, num_images_per_prompt=2)
    assert not any(runs)
    two = call(
        record, pipe, generator=[torch.Generator().manual_seed(seed) for seed in range(2)], num_images_per_prompt=2
    )
    assert two.images.shape[0] == 2


def test_a_generator_of_another_kind_a_step_callback_that_is_not_callable_and_meta_latents_are_refused(record, pipe):
    """Every family refuses them naming the argument, the generator and the callback before any component runs (a
    family whose call forgot to pass them to the shared checks would run); meta latents, where the call takes latents,
    when the initial latents are made."""
    import inspect

    parameters = inspect.signature(type(pipe).__call__).parameters
    refusals = [
        (dict(generator=[np.random.RandomState(0)]), r"^generator: expected a list of torch.Generators"),
        (dict(generator="seed"), r"^generator: expected a numpy RandomState, a torch.Generator or a list"),
    ]
    if "callback" in parameters:
        refusals.append((dict(callback=5), r"^callback: expected a callable"))
    with contextlib.ExitStack() as stack:
        runs = [stack.enter_context(model.watch_runs()) for model in pipe.onnx_models.values()]
        for overrides, message in refusals:
            with pytest.raises(ValueError, match=message):
                call(record, pipe, **overrides)
    assert not any(runs)
    if "latents" in parameters:
        with pytest.raises(
            ValueError, match=r"^latents: expected a tensor holding values, got one on the meta device$"
        ):
            call(record, pipe, latents=torch.empty(1, 4, 8, 8, device="meta"))


def test_each_output_type_is_diffusers(record, pipe):
    height, width = image_size(record)
    images = call(record, pipe).images
    assert isinstance(images, np.ndarray) and images.shape == (1, height, width, 3)
    assert images.dtype == np.float32 and 0.0 <= images.min() and images.max() <= 1.0
    pil = call(record, pipe, output_type="pil").images
    assert len(pil) == 1 and isinstance(pil[0], PIL.Image.Image) and pil[0].size == (width, height)
    np.testing.assert_array_equal(np.asarray(pil[0]), pipe.image_processor.numpy_to_pil(images)[0])
    tensor = call(record, pipe, output_type="pt").images
    assert isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == (1, 3, height, width)
    np.testing.assert_allclose(tensor.permute(0, 2, 3, 1).cpu().numpy(), images, atol=1e-6)
    latents = call(record, pipe, output_type="latent").images
    factor = pipe.vae_scale_factor
    expected = (
        (1, height // (2 * factor) * (width // (2 * factor)), pipe.latent_channels * 4)
        if pipe.packed_latents
        else (1, pipe.latent_channels, height // factor, width // factor)
    )
    assert isinstance(latents, torch.Tensor) and tuple(latents.shape) == expected
    as_tuple = call(record, pipe, return_dict=False)
    assert isinstance(as_tuple, tuple)
    np.testing.assert_array_equal(as_tuple[0], images)


def test_a_step_end_callback_sees_every_step_and_its_latents_are_used(record, pipe):
    seen = []

    def watch(pipeline, step, timestep, tensors):
        seen.append((pipeline, step, tuple(tensors)))
        return {}

    plain = call(record, pipe, callback_on_step_end=watch).images
    assert seen == [(pipe, step, ("latents",)) for step in range(len(seen))] and len(seen) >= 1
    np.testing.assert_array_equal(plain, call(record, pipe).images)

    def scramble(pipeline, step, timestep, tensors):
        return {"latents": torch.roll(tensors["latents"], 1, dims=-1)}

    assert not np.array_equal(call(record, pipe, callback_on_step_end=scramble).images, plain)


def test_after_warmup_the_next_call_makes_no_session(record, pipe):
    height, width = image_size(record)
    pipe.warmup(
        heights=height,
        widths=width,
        batch_sizes=1,
        num_inference_steps=STEPS,
        **t5_length(record),
        **warmup_extras(record, pipe),
    )
    made = pipe.sessions_created
    call(record, pipe)
    assert pipe.sessions_created == made


def test_a_saved_pipeline_loads_again_and_gives_the_same_images(record, pipe, tmp_path):
    expected = call(record, pipe).images
    pipe.save_pretrained(tmp_path / "saved")
    again = load(record, tmp_path / "saved")
    assert type(again) is type(pipe)
    np.testing.assert_allclose(call(record, again).images, expected, atol=1e-6)


def test_the_same_generator_gives_the_same_images_and_another_other_ones(record, pipe):
    first = call(record, pipe, seed=0).images
    np.testing.assert_array_equal(call(record, pipe, seed=0).images, first)
    assert not np.array_equal(call(record, pipe, seed=1).images, first)


def test_cuda_graph_true_binds_the_familys_denoiser(record, exports):
    folder = exports(tiny_kind(record))
    denoiser = pipeline_class(record).denoiser_component()
    assert denoiser == record.denoiser
    # on the CPU no graph can be captured: True is an error for the denoiser only
    with pytest.raises(ValueError, match="cuda_graph: needs a CUDA session with io_binding=True, got device cpu"):
        load(record, folder, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph: needs a CUDA session"):
        load(record, folder, cuda_graph=True, component_options={"vae_decoder": {"cuda_graph": "auto"}})
    pipe = load(record, folder, cuda_graph=True, component_options={denoiser: {"cuda_graph": "auto"}})
    assert all(model.cuda_graph is False for model in pipe.onnx_models.values())

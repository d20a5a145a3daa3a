"""The family table (:mod:`optimum_iobinding.families`) as the one description every layer reads: each record's class
runs it with the record's defaults; detection picks a folder's family by its model_index.json class name first and its
denoiser's ONNX interface otherwise, on made-up interfaces and on the tiny random exports; the one denoising loop is
the only place that steps a scheduler; and classifier-free guidance is on where diffusers turns it on."""

from __future__ import annotations

import dataclasses
import inspect
import json
import shutil
from pathlib import Path

import pytest

import optimum_iobinding
import optimum_iobinding.families
from optimum_iobinding.errors import ArgumentError
from optimum_iobinding.families import (
    FAMILIES,
    FLUX_INPUTS,
    UNET_INPUTS,
    detect,
    family,
    pipeline_class,
    tiny_random_kinds,
)
from optimum_iobinding.pipelines.auto import denoiser_inputs, pipeline_class_for
from optimum_iobinding.pipelines.loop import Guidance

KEYS = [record.key for record in FAMILIES]
# The records whose __call__ is not prompt-driven: it takes a frame, and no steps, guidance scale or image arguments.
FRAME_CALLS = dict.fromkeys(
    ("stream", "stream-xl", "stream-controlnet", "stream-xl-controlnet"),
    "its __call__ takes a frame; prepare(prompt, ...) takes the steps and the guidance scale",
)
SDXL_INPUTS = (*UNET_INPUTS, "text_embeds", "time_ids")
SDXL_FOLDERS = ("unet", "text_encoder", "text_encoder_2", "vae_decoder", "vae_encoder")
REFINER_FOLDERS = ("unet", "text_encoder_2", "vae_decoder", "vae_encoder")


def call_default(record, name):
    return inspect.signature(pipeline_class(record).__call__).parameters[name].default


# ---------------------------------------------------------------------------------------------- the records
@pytest.mark.parametrize("record", FAMILIES, ids=KEYS)
def test_each_records_class_exists_and_carries_that_record(record):
    assert pipeline_class(record).family is record


PROMPT_DRIVEN = [
    pytest.param(record, marks=pytest.mark.skip(reason=FRAME_CALLS[record.key]))
    if record.key in FRAME_CALLS
    else record
    for record in FAMILIES
]


@pytest.mark.parametrize("record", PROMPT_DRIVEN, ids=KEYS)
def test_each_records_defaults_are_its_calls_defaults(record):
    assert call_default(record, "num_inference_steps") == record.defaults.steps
    assert call_default(record, "guidance_scale") == record.defaults.guidance_scale


@pytest.mark.parametrize("record", PROMPT_DRIVEN, ids=KEYS)
def test_each_records_image_inputs_are_arguments_its_call_takes(record):
    parameters = inspect.signature(pipeline_class(record).__call__).parameters
    missing = sorted(record.image_inputs - set(parameters))
    assert not missing, f"{record.key}: image_inputs {missing} are no arguments of {record.class_name}.__call__"


# ---------------------------------------------------------------------------------------------- detection
FLUX_VARIANT = dataclasses.replace(family("flux"), key="flux-variant", index_class_names=("FluxVariantPipeline",))
FLUX_DENOISER = {"transformer": list(FLUX_INPUTS)}
ORDERS = {"variant-first": True, "variant-last": False}


def use_table_with_flux_variant(monkeypatch, first: bool) -> None:
    """The family table with a second record of FLUX.1's interface and another class name, before or after all
    the others."""
    table = (FLUX_VARIANT, *FAMILIES) if first else (*FAMILIES, FLUX_VARIANT)
    monkeypatch.setattr(optimum_iobinding.families, "FAMILIES", table)


@pytest.mark.parametrize("variant_first", list(ORDERS.values()), ids=list(ORDERS))
@pytest.mark.parametrize(
    "index_class_name,expected", [("FluxVariantPipeline", "flux-variant"), ("FluxPipeline", "flux")]
)
def test_detect_picks_the_family_that_model_index_names_wherever_it_stands_in_the_table(
    monkeypatch, variant_first, index_class_name, expected
):
    use_table_with_flux_variant(monkeypatch, variant_first)
    assert detect(index_class_name, FLUX_DENOISER).key == expected


@pytest.mark.parametrize("variant_first,expected", [(True, "flux-variant"), (False, "flux")], ids=list(ORDERS))
def test_detect_without_a_class_name_picks_the_first_record_in_table_order_whose_interface_matches(
    monkeypatch, variant_first, expected
):
    use_table_with_flux_variant(monkeypatch, variant_first)
    assert detect(None, FLUX_DENOISER).key == expected


@pytest.mark.parametrize(
    "index_class_name,inputs,channels,folders,expected",
    [
        ("OnnxStableDiffusionPipeline", (*UNET_INPUTS, "timestep_cond"), 4, ("unet", "text_encoder"), "lcm"),
        ("SomeInpaintingPipeline", UNET_INPUTS, 9, ("unet", "text_encoder"), "inpaint"),
        ("SomeFinetunedPipeline", UNET_INPUTS, 4, ("unet", "text_encoder"), "sd"),
        ("SomeFinetunedXLPipeline", SDXL_INPUTS, 4, SDXL_FOLDERS, "sdxl"),
        ("SomeRefinerPipeline", SDXL_INPUTS, 4, REFINER_FOLDERS, "sdxl-img2img"),
    ],
    ids=["lcm-unet", "nine-channels", "plain-unet", "sdxl-unet", "sdxl-unet-without-text-encoder"],
)
def test_detect_falls_back_to_the_denoisers_interface(index_class_name, inputs, channels, folders, expected):
    assert detect(index_class_name, {"unet": list(inputs)}, channels, folders).key == expected


@pytest.fixture(scope="session")
def tiny_export(shared_export, tiny_folder):
    """``tiny_export(kind)``: the tiny random export of ``export --tiny-random KIND`` (shared with the contract's)."""
    from optimum_iobinding.export import export_pipeline

    def folder(kind: str) -> Path:
        if kind == "sd":
            return tiny_folder
        return shared_export(
            f"tiny-random-{kind}", lambda target: export_pipeline(None, target, tiny_random=kind, progress=False)
        )

    return folder


@pytest.mark.parametrize("kind", ["sd", "lcm", "xl", "sd3", "flux", "wan"])
def test_pipeline_class_for_a_tiny_export_is_its_familys_class(tiny_export, kind):
    (record,) = [record for record in FAMILIES if kind in record.tiny_random]
    assert pipeline_class_for(tiny_export(kind)) is pipeline_class(record)


@pytest.mark.parametrize("kind", tiny_random_kinds())
def test_every_output_dim_of_a_tiny_export_is_known_before_the_run(tiny_export, kind):
    # a number, an input's dim name or an expression of them: a dim the exporter named freely is known only after the
    # run (ONNX shape inference stops at ORT's contrib ops), and a CUDA graph needs the outputs' shapes before it
    import re

    import onnx

    for path in sorted(tiny_export(kind).glob("*/*.onnx")):
        graph = onnx.load(str(path), load_external_data=False).graph
        names = {dim.dim_param for value in graph.input for dim in value.type.tensor_type.shape.dim if dim.dim_param}
        free = [
            (value.name, axis, dim.dim_param)
            for value in graph.output
            for axis, dim in enumerate(value.type.tensor_type.shape.dim)
            if dim.dim_param and dim.dim_param not in names and not re.search(r"[-+*/() ]", dim.dim_param)
        ]
        assert not free, (path.relative_to(path.parents[1]), free)


@pytest.mark.parametrize("kind", ["sd", "controlnet", "xl"])  # the transformers' keep it: ORT's MMDiT fusion reads it
def test_a_plain_exports_attention_computes_no_scale_from_a_shape(tiny_export, kind):
    # the TorchScript exporter writes SDPA's default scale as Shape → … → Sqrt, which ONNX Runtime's CUDA provider
    # computes on the CPU and copies up for the query and key: it then refuses one graph session for every shape
    import onnx

    for path in sorted(tiny_export(kind).glob("*/*.onnx")):
        graph = onnx.load(str(path), load_external_data=False).graph
        producers = {output: node for node in graph.node for output in node.output}

        def from_a_shape(name: str, hops: int = 6) -> bool:
            node = producers.get(name)
            if node is None or hops == 0:
                return False
            return node.op_type == "Shape" or any(from_a_shape(source, hops - 1) for source in node.input)

        roots = [node.name for node in graph.node if node.op_type == "Sqrt" and from_a_shape(node.input[0])]
        assert not roots, (path.relative_to(path.parents[1]), roots[:3])


FLUX_VARIANTS = ["flux-kontext", "flux-fill", "flux-control"]


@pytest.mark.parametrize("kind", FLUX_VARIANTS)
def test_a_flux_variant_folder_is_its_familys_and_generate_is_told_which_pipeline_runs_it(tiny_export, kind):
    folder = tiny_export(kind)
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == family(kind).torch_classes[0]
    inputs, channels = denoiser_inputs(folder)
    assert detect(index["_class_name"], inputs, channels) is family(kind)
    with pytest.raises(ArgumentError, match=f"is a FLUX.1 .*: use {family(kind).class_name} from Python"):
        pipeline_class_for(folder)


@pytest.mark.parametrize(
    "width,expected",
    [(64, "flux"), (384, "flux-fill"), (128, "flux-control"), (None, "flux")],
    ids=["flux-width", "fill-width", "control-width", "unknown-width"],
)
def test_a_flux_transformer_named_by_no_family_is_told_by_its_token_width(width, expected):
    """Fill and Control have FLUX.1's inputs and wider tokens; Kontext has FLUX.1's very interface, so only its
    class name tells it apart (without one its folder runs as FLUX.1's)."""
    assert detect("SomeFluxPipeline", FLUX_DENOISER, {"transformer": width}).key == expected
    assert detect("FluxKontextPipeline", FLUX_DENOISER, {"transformer": width}).key == (
        "flux-kontext" if expected == "flux" else expected
    )


def test_pipeline_class_for_an_sdxl_folder_naming_an_unknown_class_detects_it_by_its_unets_inputs(
    tiny_export, tmp_path
):
    folder = shutil.copytree(tiny_export("xl"), tmp_path / "xl")
    index = json.loads((folder / "model_index.json").read_text())
    index["_class_name"] = "SomeFinetunedXLPipeline"
    (folder / "model_index.json").write_text(json.dumps(index))
    assert not any("SomeFinetunedXLPipeline" in record.index_class_names for record in FAMILIES)
    assert pipeline_class_for(folder) is pipeline_class(family("sdxl"))


# ----------------------------------------------------------------------------------------------- the loop
def test_one_place_in_the_package_steps_the_scheduler():
    """Structural: the package's source names ``scheduler.step(`` once, in the one denoising loop that every family
    runs (:func:`optimum_iobinding.pipelines.loop.denoise`); a family that stepped a scheduler in a loop of its own
    would add another."""
    package = Path(optimum_iobinding.__file__).parent
    places = {
        str(path.relative_to(package)): path.read_text(encoding="utf-8").count("scheduler.step(")
        for path in sorted(package.rglob("*.py"))
    }
    assert {path: count for path, count in places.items() if count} == {"pipelines/loop.py": 1}


def test_guidance_is_classifier_free_above_a_scale_of_one():
    assert Guidance.classifier_free(7.5).batched is True
    assert Guidance.classifier_free(1.0).batched is False


def test_a_guidance_rescale_outside_zero_to_one_is_refused_naming_guidance_rescale():
    with pytest.raises(ArgumentError, match=r"guidance_rescale: expected a number in \[0, 1\], got 2.0") as refused:
        Guidance.classifier_free(5.0, rescale=2.0)
    assert refused.value.argument == "guidance_rescale"


def test_every_tiny_random_model_is_a_familys_and_the_export_command_offers_each():
    from optimum_iobinding.cli import build_parser
    from optimum_iobinding.export.tiny import TINY_RANDOM_KINDS
    from optimum_iobinding.families import tiny_random_kinds

    assert sorted(tiny_random_kinds()) == sorted(TINY_RANDOM_KINDS)
    export = build_parser()._subparsers._group_actions[0].choices["export"]
    (option,) = [action for action in export._actions if "--tiny-random" in action.option_strings]
    assert tuple(option.choices) == tiny_random_kinds()


def test_a_class_name_of_one_family_alone_selects_it_where_the_denoisers_channels_are_unknown():
    from optimum_iobinding.families import FLUX_INPUTS, UNET_INPUTS, detect

    unknown = {"transformer": None}
    assert detect("FluxFillPipeline", {"transformer": list(FLUX_INPUTS)}, unknown).key == "flux-fill"
    assert detect("FluxControlPipeline", {"transformer": list(FLUX_INPUTS)}, unknown).key == "flux-control"
    assert detect(None, {"transformer": list(FLUX_INPUTS)}, unknown).key == "flux"  # no name: FLUX.1's interface
    assert detect("StableDiffusionInpaintPipeline", {"unet": list(UNET_INPUTS)}, None).key == "inpaint"
    # a name several families share (the SD families' ONNX class) still needs the channels to pick inpainting
    assert detect("OnnxStableDiffusionPipeline", {"unet": list(UNET_INPUTS)}, None).key == "sd"

"""A T5 tokenizer that names no ``model_max_length`` (transformers then reports 1e30, as for some Hub tokenizers):
diffusers' SD3 and Flux pipelines run it, since each call gives T5's length (``max_sequence_length``). Its export
loads, saves and loads again, and generates diffusers' images; a CLIP tokenizer without one (its length is the text
encoder's) is refused, by the exporter before any work and by the loader, naming the tokenizer."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from optimum_iobinding import OnnxFluxPipeline, OnnxStableDiffusion3Pipeline
from optimum_iobinding.errors import ArgumentError
from optimum_iobinding.export import export_pipeline

PROMPT = "a photo of an astronaut riding a horse"
# fp32 ONNX Runtime vs fp32 torch on the CPU, a few steps: rounding only
TOLERANCE = 1e-4
# transformers' model_max_length of a tokenizer whose config names none (its VERY_LARGE_INTEGER)
NO_LENGTH = int(1e30)


def without_length(folder, name):
    """Removes ``model_max_length`` from ``folder/name/tokenizer_config.json``."""
    path = folder / name / "tokenizer_config.json"
    config = json.loads(path.read_text())
    del config["model_max_length"]
    path.write_text(json.dumps(config))


def unbounded_tokenizer(folder, name, scratch):
    """``folder``'s tokenizer ``name`` loaded from a copy without ``model_max_length``."""
    shutil.copytree(folder / name, scratch / name)
    without_length(scratch, name)
    tokenizer = type_of(folder, name).from_pretrained(str(scratch / name))
    assert tokenizer.model_max_length == NO_LENGTH
    return tokenizer


def type_of(folder, name):
    import transformers

    return getattr(transformers, json.loads((folder / "model_index.json").read_text())[name][1])


def with_component(torch_pipe, **changes):
    """A new diffusers pipeline of ``torch_pipe``'s class and components but ``changes`` (the fixture's is shared)."""
    pipe = type(torch_pipe)(**{**torch_pipe.components, **changes})
    pipe.set_progress_bar_config(disable=True)
    return pipe


def loaded(pipeline_class, folder):
    pipe = pipeline_class.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sd3_images(pipe):
    latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    return pipe(
        PROMPT,
        negative_prompt="blurry",
        height=64,
        width=64,
        num_inference_steps=3,
        guidance_scale=5.0,
        max_sequence_length=16,
        latents=latents,
        output_type="np",
    ).images


def flux_images(pipe):
    return pipe(
        [PROMPT, "a red castle"],
        height=64,
        width=48,
        num_inference_steps=3,
        max_sequence_length=16,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images


# the fixture, the pipeline class, the T5 tokenizer, the call, the CLIP tokenizers
FAMILIES = {
    "sd3": ("sd3", OnnxStableDiffusion3Pipeline, "tokenizer_3", sd3_images, ("tokenizer", "tokenizer_2")),
    "flux": ("schnell", OnnxFluxPipeline, "tokenizer_2", flux_images, ("tokenizer",)),
}


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    fixture, pipeline_class, t5, images, clips = FAMILIES[request.param]
    torch_pipe, folder = request.getfixturevalue(fixture)
    return torch_pipe, folder, pipeline_class, t5, images, clips


def test_an_export_whose_t5_tokenizer_names_no_length_loads_saves_and_equals_diffusers(family, tmp_path):
    torch_pipe, folder, pipeline_class, t5, images, _ = family
    diffusers_pipe = with_component(torch_pipe, **{t5: unbounded_tokenizer(folder, t5, tmp_path)})
    exported = export_pipeline(None, tmp_path / "onnx", torch_pipeline=diffusers_pipe, progress=False)
    written = json.loads((exported / t5 / "tokenizer_config.json").read_text())
    assert written.get("model_max_length", NO_LENGTH) >= NO_LENGTH  # as the tokenizer was: no length of its own

    pipe = loaded(pipeline_class, exported)
    assert getattr(pipe, t5).model_max_length == NO_LENGTH
    expected = images(diffusers_pipe)
    np.testing.assert_allclose(images(pipe), expected, atol=TOLERANCE)

    pipe.save_pretrained(tmp_path / "saved")
    np.testing.assert_allclose(images(loaded(pipeline_class, tmp_path / "saved")), expected, atol=TOLERANCE)


def test_a_folder_whose_t5_tokenizer_config_names_no_length_equals_diffusers(family, tmp_path):
    torch_pipe, folder, pipeline_class, t5, images, _ = family
    shutil.copytree(folder, tmp_path / "copy")
    without_length(tmp_path / "copy", t5)
    np.testing.assert_allclose(images(loaded(pipeline_class, tmp_path / "copy")), images(torch_pipe), atol=TOLERANCE)


def test_a_clip_tokenizer_that_names_no_length_is_refused_when_loading(family, tmp_path):
    _, folder, pipeline_class, _, _, clips = family
    for clip in clips:
        shutil.copytree(folder, tmp_path / clip)
        without_length(tmp_path / clip, clip)
        with pytest.raises(
            ValueError,
            match=rf"^{clip}: expected a CLIPTokenizer.* its model_max_length is 1e\+30, "
            r"transformers' value for a tokenizer_config.json that names none "
            r"\(CLIP's is 77",
        ):
            pipeline_class.from_pretrained(tmp_path / clip)


def test_the_export_refuses_a_clip_tokenizer_that_names_no_length_before_writing(family, tmp_path):
    torch_pipe, folder, *_ = family
    pipe = with_component(torch_pipe, tokenizer=unbounded_tokenizer(folder, "tokenizer", tmp_path))
    with pytest.raises(
        ArgumentError,
        match=r"^tokenizer: expected a CLIPTokenizer\w* whose model_max_length is the "
        r"length its text encoder is fed \(CLIP's 77\), got one where its "
        r"model_max_length is 1e\+30",
    ) as refused:
        export_pipeline(None, tmp_path / "onnx", torch_pipeline=pipe, progress=False)
    assert refused.value.argument == "tokenizer"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tokenizer"]  # nothing written, no partial folder

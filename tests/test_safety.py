"""Hostile and mistaken inputs (CPU, tiny models): each gets a clear error naming the input, what was expected and
what came — or a correct result — and nothing the user had is lost. Export and save never destroy what they did not
make; no model file can make shape evaluation hang."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from conftest import make_model, make_session
from optimum_iobinding import IOBindingORTModel, OnnxStableDiffusionPipeline, infer_output_shapes
from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.tiny import build_tiny_random_pipeline
from optimum_iobinding.runtime import shapes as shape_module
from optimum_iobinding.runtime.shapes import DimExpressionError, evaluate_dim_expression

PROMPT = "a photo of a cat"


def snapshot(folder: Path) -> dict:
    """Every file under ``folder`` with the hash of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def pipe(tiny_folder):
    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def copy_of(tiny_folder, tmp_path):
    def copy(**config_changes):
        folder = tmp_path / "copy"
        shutil.copytree(tiny_folder, folder)
        for relative, changes in config_changes.items():
            path = folder / relative.replace("__", "/") / "config.json"
            config = json.loads(path.read_text())
            config.update(changes)
            path.write_text(json.dumps(config))
        return folder

    return copy


# ------------------------------------------------------------------------------------------------- data loss
def torch_source(tmp_path) -> Path:
    """A diffusers (torch) folder, as users export from."""
    folder = tmp_path / "source"
    build_tiny_random_pipeline().save_pretrained(folder)
    return folder


def test_export_onto_its_own_source_is_refused_and_the_source_is_untouched(tmp_path):
    source = torch_source(tmp_path)
    before = snapshot(source)
    for output in (source, source / "onnx"):
        with pytest.raises(ValueError, match=r"output_dir: expected a folder outside the source folder"):
            export_pipeline(str(source), output, progress=False, overwrite=True)
    assert snapshot(source) == before


def test_export_onto_a_folder_that_holds_the_source_is_refused(tmp_path):
    source = torch_source(tmp_path)
    before = snapshot(source)
    with pytest.raises(ValueError, match=r"output_dir: expected a folder that does not hold the source folder"):
        export_pipeline(str(source), tmp_path, progress=False, overwrite=True)
    assert snapshot(source) == before


def test_export_into_a_non_empty_folder_is_refused_without_overwrite(tmp_path):
    target = tmp_path / "target"
    (target / "unet").mkdir(parents=True)
    (target / "unet" / "my_notes.txt").write_text("mine")
    (target / "model_index.json").write_text('{"mine": true}')
    before = snapshot(target)
    with pytest.raises(FileExistsError, match=r"output_dir: expected a new or empty folder, got .* holding 2 "
                                              r"entries \(model_index.json, unet\); pass overwrite=True"):
        export_pipeline(None, target, tiny_random=True, progress=False)
    assert snapshot(target) == before


def test_export_with_overwrite_replaces_the_folder_whole(tmp_path):
    target = tmp_path / "target"
    export_pipeline(None, target, tiny_random="xl", progress=False, components=("vae_decoder", "text_encoder_2"))
    (target / "unet").mkdir()
    (target / "unet" / "my_notes.txt").write_text("stale")
    export_pipeline(None, target, tiny_random=True, progress=False, components=("vae_decoder",), overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == ["model_index.json", "scheduler", "tokenizer", "vae_decoder"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch folders left


def pipeline_failing_at_its_vae_encoder(error: type):
    """The tiny torch pipeline, but its VAE encoder raises ``error`` when the export traces it."""
    pipe = build_tiny_random_pipeline()

    def failing(*args, **kwargs):
        raise error("injected")

    pipe.vae.encode = failing
    return pipe


@pytest.mark.parametrize("failure", ["bad opset", "error in the last component", "interrupt"])
def test_a_failed_export_leaves_the_previous_export_exactly_as_it_was(tmp_path, failure):
    target = tmp_path / "target"
    components = ("vae_decoder", "vae_encoder")  # the encoder last: everything before it was written when it fails
    export_pipeline(None, target, tiny_random=True, progress=False, components=components)
    before = snapshot(target)
    arguments = dict(progress=False, overwrite=True, components=components)
    if failure == "bad opset":
        expected = ValueError
        arguments.update(tiny_random=True, opset=1)
    else:
        expected = RuntimeError if failure == "error in the last component" else KeyboardInterrupt
        arguments.update(torch_pipeline=pipeline_failing_at_its_vae_encoder(expected))
    with pytest.raises(expected, match="opset" if failure == "bad opset" else "injected"):
        export_pipeline(None, target, **arguments)
    assert snapshot(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]  # no half-built folder beside it


def test_pipeline_save_pretrained_never_overwrites_unasked(pipe, tmp_path):
    target = tmp_path / "saved"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"save_directory: expected a new or empty folder"):
        pipe.save_pretrained(target)
    assert (target / "keep.txt").read_text() == "mine"
    pipe.save_pretrained(target, overwrite=True)
    assert not (target / "keep.txt").exists() and (target / "unet" / "model.onnx").is_file()
    reloaded = OnnxStableDiffusionPipeline.from_pretrained(target)
    assert reloaded.unet.input_names == pipe.unet.input_names


def test_pipeline_save_pretrained_onto_the_folder_it_was_loaded_from(copy_of):
    folder = copy_of()
    pipe = OnnxStableDiffusionPipeline.from_pretrained(folder)
    before = snapshot(folder)
    pipe.save_pretrained(folder, overwrite=True)  # copies its files out first, then swaps the folder
    assert snapshot(folder)["unet/model.onnx"] == before["unet/model.onnx"]
    pipe.set_progress_bar_config(disable=True)
    assert pipe(PROMPT, height=64, width=64, num_inference_steps=2, output_type="np").images.shape == (1, 64, 64, 3)


def test_model_save_pretrained_refuses_to_overwrite_a_file_unasked(tiny_folder, tmp_path):
    model = IOBindingORTModel.from_pretrained(tiny_folder, subfolder="vae_decoder")
    (tmp_path / "model.onnx").write_bytes(b"mine")
    with pytest.raises(FileExistsError, match=r"save_directory: expected no files named like the model's"):
        model.save_pretrained(tmp_path)
    assert (tmp_path / "model.onnx").read_bytes() == b"mine"
    model.save_pretrained(tmp_path, overwrite=True)
    assert onnx.load(str(tmp_path / "model.onnx")).graph.input[0].name == "latent_sample"
    model.save_pretrained(Path(model.model_path).parent)  # onto its own files: nothing to do, no error


# ---------------------------------------------------------------------------------------------------- hangs
@pytest.mark.parametrize("expression", [
    "(((((h**64)**64)**64)**64)**64)",
    "h**64**64",
    "2**64*2**64*2**64*2**64*2**64",
    "(h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h)**64",
    "max(h**64, h**64)**64",
    "floor(h**64 / 3)**64",
])
def test_a_hostile_dim_expression_is_refused_by_the_value_bound(expression, monkeypatch):
    # the work bound: no intermediate value may pass MAX_VALUE_BITS, checked before every power is computed
    largest = []
    real = shape_module.bounded

    def recording(value, text):
        largest.append(shape_module.value_bits(value))
        return real(value, text)

    monkeypatch.setattr(shape_module, "bounded", recording)
    with pytest.raises(DimExpressionError, match=r"exceeds 256 bits"):
        evaluate_dim_expression(expression, {"h": 1000})
    assert max(largest) <= 2 * shape_module.MAX_VALUE_BITS  # a product of two bounded values at most


def test_a_model_declaring_a_hostile_output_dim_still_runs(tmp_path):
    model_proto = make_model([helper.make_node("Identity", ["x"], ["y"])],
                             [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["h"])],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["(((h**64)**64)**64)"])])
    model = IOBindingORTModel(make_session(model_proto))
    assert infer_output_shapes(model, {"x": (3,)}) == {"y": (3,)}  # ONNX shape inference sizes it instead
    torch.testing.assert_close(model(x=torch.arange(3.0))[0], torch.arange(3.0))


@pytest.mark.parametrize("shape, error, message", [
    ((2, -3), ValueError, r"input 'x': expected non-negative integer sizes below 2\*\*62, got -3 in dim 1"),
    ((2**70, 3), ValueError, r"input 'x': expected non-negative integer sizes below 2\*\*62, got 1180591620717411303424"),
    ((2, 1.5), TypeError, r"input 'x': expected non-negative integer sizes, got 1.5 in dim 1"),
    ((2.0, 3), TypeError, r"input 'x': expected non-negative integer sizes, got 2.0 in dim 0"),
    ((True, 3), TypeError, r"got True in dim 0"),
    ((2, "3"), TypeError, r"got '3' in dim 1"),
    (3, TypeError, r"input 'x': expected a shape \(a sequence of non-negative integers\), got int 3"),
])
def test_infer_output_shapes_refuses_sizes_that_are_not_sizes(concat_model, shape, error, message):
    with pytest.raises(error, match=message):
        infer_output_shapes(concat_model, {"x": shape})


# ------------------------------------------------------------------------------------------------- inputs
@pytest.mark.parametrize("dtype, value, message", [
    (TensorProto.UINT8, torch.tensor([300]), r"input 'x': expected values in \[0, 255\] \(the model's torch.uint8\), "
                                             r"got values in \[300, 300\]"),
    (TensorProto.INT32, np.array([2**40], dtype=np.int64), r"expected values in \[-2147483648, 2147483647\]"),
    (TensorProto.INT8, -200, r"expected values in \[-128, 127\] \(the model.s torch.int8\), got values in \[-200, -200\]"),
])
def test_integers_that_would_wrap_are_refused(dtype, value, message):
    model = IOBindingORTModel(make_session(make_model(
        [helper.make_node("Identity", ["x"], ["y"])], [helper.make_tensor_value_info("x", dtype, ["n"])],
        [helper.make_tensor_value_info("y", dtype, ["n"])])))
    with pytest.raises(ValueError, match=message):
        model(x=value if not isinstance(value, int) else np.array([value]))


def test_integers_that_fit_are_converted(tiny_folder):
    model = IOBindingORTModel(make_session(make_model(
        [helper.make_node("Identity", ["x"], ["y"])], [helper.make_tensor_value_info("x", TensorProto.UINT8, [2])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [2])])))
    assert model(x=torch.tensor([0, 255]))[0].tolist() == [0, 255]


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(num_inference_steps=10**7), ValueError,
     r"num_inference_steps: expected at most 1000 \(the scheduler's num_train_timesteps\), got 10000000"),
    (dict(num_inference_steps=2.5), ValueError, r"num_inference_steps: expected a positive integer, got 2.5"),
    (dict(guidance_scale=float("nan")), ValueError, r"guidance_scale: expected a finite number, got nan"),
    (dict(guidance_scale=float("inf")), ValueError, r"guidance_scale: expected a finite number, got inf"),
    (dict(guidance_scale="7"), ValueError, r"guidance_scale: expected a finite number, got '7'"),
    (dict(height=0), ValueError, r"height: expected a positive integer multiple of 16, got 0"),
    (dict(height=-64), ValueError, r"height: expected a positive integer multiple of 16, got -64"),
    (dict(height=64.0), ValueError, r"height: expected a positive integer multiple of 16, got 64.0"),
    (dict(width=True), ValueError, r"width: expected a positive integer multiple of 16, got True"),
    (dict(height=72), ValueError, r"height and width: expected multiples of 16 .*got 72 and 64; e.g. 80 × 64"),
    (dict(num_images_per_prompt=0), ValueError, r"num_images_per_prompt: expected a positive integer, got 0"),
    (dict(eta=float("nan")), ValueError, r"eta: expected a number in \[0, 1\] \(DDIM's noise share\), got nan"),
    (dict(height="512"), ValueError, r"height: expected a positive integer multiple of 16, got '512'"),
    (dict(num_inference_steps=True), ValueError, r"num_inference_steps: expected a positive integer, got True"),
    (dict(strength=0.5), TypeError, r"unexpected keyword argument 'strength'"),
    (dict(num_images_per_prompt=-1), ValueError, r"num_images_per_prompt: expected a positive integer, got -1"),
    (dict(prompt=["a cat", None]), TypeError, r"prompt\[1\]: expected a str, got NoneType None"),
    (dict(prompt=[]), ValueError, r"prompt: expected a str or a non-empty list of str, got an empty list"),
    (dict(prompt=None, prompt_embeds=torch.ones(1, 77, 32, dtype=torch.int64)), TypeError,
     r"prompt_embeds: expected a float tensor \(the text encoder's output\), got dtype torch.int64"),
    (dict(prompt=None, prompt_embeds=torch.ones(77, 32)), ValueError,
     r"prompt_embeds: expected shape \(batch, sequence, hidden\), got \(77, 32\)"),
])
def test_call_arguments_that_cannot_run_are_refused_before_any_work(pipe, kwargs, error, message):
    arguments = dict(prompt=PROMPT, height=64, width=64, num_inference_steps=2, output_type="np")
    arguments.update(kwargs)
    with pytest.raises(error, match=message):
        pipe(**arguments)


def test_height_none_means_the_default_size(pipe):
    images = pipe(PROMPT, height=None, width=None, num_inference_steps=1, output_type="np").images
    size = pipe.unet.config["sample_size"] * pipe.vae_scale_factor
    assert images.shape == (1, size, size, 3)


def test_a_callback_that_calls_the_pipeline_again_is_refused(pipe):
    def callback(p, step, timestep, tensors):
        p(PROMPT, height=64, width=64, num_inference_steps=1)
        return tensors

    with pytest.raises(RuntimeError, match=r"called again from inside its own call \(a callback\?\)"):
        pipe(PROMPT, height=64, width=64, num_inference_steps=2, callback_on_step_end=callback)
    # the pipeline is not left half-initialised: the next call works
    assert pipe(PROMPT, height=64, width=64, num_inference_steps=1, output_type="np").images.shape == (1, 64, 64, 3)


# ------------------------------------------------------------------------------------------------- loading
@pytest.mark.parametrize("changes, message", [
    (dict(vae_decoder={"scaling_factor": 0}), r"scaling_factor: expected a positive finite number, got 0"),
    (dict(vae_decoder={"scaling_factor": "nan"}), r"scaling_factor: expected a positive finite number, got 'nan'"),
    (dict(vae_decoder={"latent_channels": 16}), r"latent_channels: expected 4 \(the decoder's latent_sample channels\), "
                                                r"got 16"),
    (dict(vae_decoder={"latent_channels": 10**6}), r"latent_channels: expected 4 .*got 1000000"),
    (dict(vae_decoder={"block_out_channels": [32, 64]}), r"block_out_channels: 2 blocks mean a scale factor of 2, "
                                                         r"but the decoder turns 8 latent rows into 64"),
])
def test_vae_configs_that_contradict_the_decoder_are_refused_when_loading(copy_of, changes, message):
    with pytest.raises(ValueError, match=message):
        OnnxStableDiffusionPipeline.from_pretrained(copy_of(**changes))


@pytest.mark.parametrize("arguments, error, message", [
    (dict(provider=123), TypeError, r"provider: expected a provider name, a \(name, options dict\) pair or a list of "
                                    r"them, got int 123"),
    (dict(provider=[]), ValueError, r"provider: expected at least one execution provider, got an empty list"),
    (dict(provider="NoSuchExecutionProvider"), ValueError, r"'NoSuchExecutionProvider' is not available"),
    (dict(provider_options="fast"), TypeError, r"provider_options: expected a dict or a list of dicts, got 'fast'"),
    (dict(sess_options="fast"), TypeError, r"sess_options: expected an onnxruntime.SessionOptions or None, got str"),
    (dict(io_bindng=False), TypeError, r"unexpected keyword argument\(s\) \['io_bindng'\]"),
    (dict(cuda_graph="sometimes"), ValueError, r"cuda_graph: expected 'auto', True or False, got 'sometimes'"),
])
def test_bad_loading_arguments_name_themselves(tiny_folder, arguments, error, message):
    with pytest.raises(error, match=message):
        OnnxStableDiffusionPipeline.from_pretrained(tiny_folder, **arguments)


def test_a_config_value_that_is_not_a_size_is_named(copy_of):
    pipe = OnnxStableDiffusionPipeline.from_pretrained(copy_of(unet={"sample_size": "large"}))
    with pytest.raises(ValueError, match=r"unet config.json: sample_size: expected a positive integer, got 'large'"):
        pipe(PROMPT, height=None, width=None, num_inference_steps=1)


def test_a_broken_config_json_is_named(copy_of):
    folder = copy_of()
    (folder / "unet" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"unet/config.json: expected a JSON object, got a file that does not parse"):
        OnnxStableDiffusionPipeline.from_pretrained(folder)
    (folder / "unet" / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"unet/config.json: expected a JSON object, got a JSON list"):
        OnnxStableDiffusionPipeline.from_pretrained(folder)


def test_a_broken_model_index_is_named(copy_of):
    folder = copy_of()
    (folder / "model_index.json").write_text("")
    with pytest.raises(ValueError, match=r"model_index.json: expected a JSON object, got a file that does not parse"):
        OnnxStableDiffusionPipeline.from_pretrained(folder)


def test_an_empty_tokenizer_folder_is_named(copy_of):
    folder = copy_of()
    shutil.rmtree(folder / "tokenizer")
    (folder / "tokenizer").mkdir()
    with pytest.raises(ValueError, match=r"tokenizer: expected a CLIPTokenizer folder .*holding nothing"):
        OnnxStableDiffusionPipeline.from_pretrained(folder)


@pytest.mark.parametrize("name", ["./no/such/folder", "no-such-folder/../x", "/absolutely/not/here"])
def test_a_missing_local_path_is_reported_as_missing_not_as_a_download_failure(name):
    with pytest.raises(FileNotFoundError, match=r"pretrained_model_name_or_path: expected an existing local folder or "
                                                r"a hub repository id, got .*no such file or folder"):
        OnnxStableDiffusionPipeline.from_pretrained(name)


def test_an_unreachable_hub_id_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"'someone/no-such-model' is not a local folder \(no such path "
                                                r"here\), and the Hugging Face Hub could not provide it"):
        OnnxStableDiffusionPipeline.from_pretrained("someone/no-such-model")


@pytest.mark.parametrize("arguments, message", [
    (dict(overlap=0.9), r"overlap: expected a fraction in \[0, 0.5\]"),
    (dict(tile_sample_size=100), r"tile_sample_size: expected a positive multiple of 8"),
])
def test_tiling_options_are_checked(pipe, arguments, message):
    with pytest.raises(ValueError, match=message):
        pipe.enable_vae_tiling(**arguments)


def test_xl_micro_conditioning_and_clip_skip_are_checked(tmp_path):
    from optimum_iobinding import OnnxStableDiffusionXLPipeline

    folder = export_pipeline(None, tmp_path / "xl", tiny_random="xl", progress=False)
    xl = OnnxStableDiffusionXLPipeline.from_pretrained(folder)
    xl.set_progress_bar_config(disable=True)
    base = dict(prompt=PROMPT, height=64, width=64, num_inference_steps=1, output_type="np")
    with pytest.raises(ValueError, match=r"clip_skip: expected None or an integer in \[0, \d+\], got -5"):
        xl(**base, clip_skip=-5)
    with pytest.raises(ValueError, match=r"original_size: expected \(height, width\): two numbers, got \(1, 2, 3\)"):
        xl(**base, original_size=(1, 2, 3))
    with pytest.raises(ValueError, match=r"height: expected a positive integer multiple of \d+, got 0"):
        xl(**dict(base, height=0))
    with pytest.raises(ValueError, match=r"guidance_rescale: expected a number in \[0, 1\], got nan"):
        xl(**base, guidance_rescale=float("nan"))
    assert math.isfinite(float(xl(**base).images.mean()))

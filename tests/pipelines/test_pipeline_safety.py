"""Hostile and mistaken inputs to the pipelines (CPU, the tiny random exports): each gets a clear error naming
the argument, what was expected and what came — or a correct result — before any component runs; saving never
overwrites a folder unasked."""

from __future__ import annotations

import contextlib
import gc
import json
import math
import shutil

import numpy as np
import PIL.Image
import pytest
import torch

from optimum_iobinding import (
    OnnxStableDiffusionImg2ImgPipeline,
    OnnxStableDiffusionInpaintPipeline,
    OnnxStableDiffusionPipeline,
    OnnxStableDiffusionXLImg2ImgPipeline,
    OnnxStableDiffusionXLPipeline,
)

PROMPT = "a photo of a cat"


@pytest.fixture(scope="module")
def pipe(tiny_folder):
    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def xl(xl_folder):
    pipe = OnnxStableDiffusionXLPipeline.from_pretrained(xl_folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ------------------------------------------------------------------------------------------------- data loss
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


def test_pipeline_save_pretrained_onto_the_folder_it_was_loaded_from(copy_of, snapshot):
    folder = copy_of()
    pipe = OnnxStableDiffusionPipeline.from_pretrained(folder)
    before = snapshot(folder)
    pipe.save_pretrained(folder, overwrite=True)  # copies its files out first, then swaps the folder
    assert snapshot(folder)["unet/model.onnx"] == before["unet/model.onnx"]
    pipe.set_progress_bar_config(disable=True)
    assert pipe(PROMPT, height=64, width=64, num_inference_steps=2, output_type="np").images.shape == (1, 64, 64, 3)


# ------------------------------------------------------------------------------------------------- inputs
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            dict(num_inference_steps=10**7),
            ValueError,
            r"num_inference_steps: expected at most 1000 \(the scheduler's num_train_timesteps\), got 10000000",
        ),
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
        (
            dict(generator=[np.random.RandomState(0)]),
            TypeError,
            r"generator: expected a list of torch.Generators \(one per image; a numpy RandomState is given alone\), "
            r"got a list holding RandomState",
        ),
        (dict(generator="seed"), TypeError, r"generator: expected a numpy RandomState, a torch.Generator or a list"),
        (dict(callback=5), TypeError, r"callback: expected a callable, callback\(step, timestep, latents\), got int"),
        (
            dict(prompt=None, prompt_embeds=torch.empty(1, 77, 32, device="meta")),
            ValueError,
            r"^prompt_embeds: expected a tensor holding values, got one on the meta device$",
        ),
        (
            dict(latents=torch.empty(1, 4, 8, 8, device="meta")),
            ValueError,
            r"^latents: expected a tensor holding values, got one on the meta device$",
        ),
        (dict(height="512"), ValueError, r"height: expected a positive integer multiple of 16, got '512'"),
        (dict(num_inference_steps=True), ValueError, r"num_inference_steps: expected a positive integer, got True"),
        (dict(strength=0.5), TypeError, r"unexpected keyword argument 'strength'"),
        (dict(num_images_per_prompt=-1), ValueError, r"num_images_per_prompt: expected a positive integer, got -1"),
        (dict(prompt=["a cat", None]), TypeError, r"prompt\[1\]: expected a str, got NoneType None"),
        (dict(prompt=[]), ValueError, r"prompt: expected a str or a non-empty list of str, got an empty list"),
        (
            dict(prompt=None, prompt_embeds=torch.ones(1, 77, 32, dtype=torch.int64)),
            TypeError,
            r"prompt_embeds: expected a float tensor \(the text encoder's output\), got dtype torch.int64",
        ),
        (
            dict(prompt=None, prompt_embeds=torch.ones(77, 32)),
            ValueError,
            r"prompt_embeds: expected shape \(batch, sequence, hidden\), got \(77, 32\)",
        ),
    ],
)
def test_call_arguments_that_cannot_run_are_refused_before_any_work(pipe, kwargs, error, message):
    arguments = dict(prompt=PROMPT, height=64, width=64, num_inference_steps=2, output_type="np")
    arguments.update(kwargs)
    with pytest.raises(error, match=message):
        pipe(**arguments)


def test_to_returns_the_pipeline_where_it_already_is_and_refuses_a_move_saying_how(pipe):
    """``pipe.to("cuda")`` on a pipeline loaded for the CPU did nothing, silently (diffusers' ``to`` moves torch
    modules, and the pipeline has none); ``to("tpu")`` raised torch's own parsing error."""
    assert pipe.device == torch.device("cpu")
    for arguments, keywords in [(("cpu",), {}), (("cpu:0", torch.float32), {}), ((), dict(device="cpu"))]:
        assert pipe.to(*arguments, **keywords) is pipe
    with pytest.raises(ValueError, match=r"^device: expected 'cpu', .*provider='CUDAExecutionProvider'.*got 'cuda'$"):
        pipe.to("cuda")
    with pytest.raises(ValueError, match=r"^device: expected a device such as 'cuda' or 'cpu', got 'tpu'$"):
        pipe.to("tpu")
    with pytest.raises(
        ValueError, match=r"^dtype: expected torch.float32 \(the precision of the export; .*--dtype fp16"
    ):
        pipe.to(torch.float16)
    with pytest.raises(TypeError, match=r"^non_blocking: unexpected arguments of to: expected device and dtype"):
        pipe.to("cpu", non_blocking=True)
    with pytest.raises(TypeError, match=r"^dtype: expected a torch.dtype such as torch.float16, got 'float16'$"):
        pipe.to(dtype="float16")
    with pytest.raises(TypeError, match=r"^dtype: expected it once, got it twice$"):
        pipe.to(torch.float32, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"^to: expected at most a device and a dtype, got 3 positional arguments$"):
        pipe.to("cpu", torch.float32, None)
    assert pipe.to("cpu", device=None, dtype=None) is pipe  # None: not given, as diffusers' to takes it
    for method in ("enable_model_cpu_offload", "enable_sequential_cpu_offload", "enable_group_offload"):
        with pytest.raises(NotImplementedError, match=rf"^{method}: expected a pipeline of torch modules"):
            getattr(pipe, method)()
    assert pipe(PROMPT, height=64, width=64, num_inference_steps=1, output_type="np").images.shape == (1, 64, 64, 3)


def test_a_float16_export_says_its_dtype_and_from_pipe_keeps_it(shared_export):
    """diffusers' ``dtype`` said float32 for a float16 export (it reads torch modules), and its ``from_pipe`` asks
    for float32 unless told: the export's precision is the pipeline's, which ``from_pipe`` keeps."""
    from optimum_iobinding import OnnxStableDiffusionImg2ImgPipeline
    from optimum_iobinding.export import export_pipeline

    folder = shared_export(
        "tiny-sd-fp16", lambda target: export_pipeline(None, target, tiny_random=True, fp16=True, progress=False)
    )
    half = OnnxStableDiffusionPipeline.from_pretrained(folder)
    assert half.dtype == torch.float16 and half.to(torch.float16) is half
    with pytest.raises(ValueError, match=r"^dtype: expected torch.float16 .*export it with --dtype fp32"):
        half.to(torch.float32)
    image_to_image = OnnxStableDiffusionImg2ImgPipeline.from_pipe(half)
    assert image_to_image.dtype == torch.float16 and image_to_image.unet is half.unet
    with pytest.raises(ValueError, match=r"^dtype: expected torch.float16"):
        OnnxStableDiffusionImg2ImgPipeline.from_pipe(half, dtype=torch.float32)


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
@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(vae_decoder={"scaling_factor": 0}), r"scaling_factor: expected a positive finite number, got 0"),
        (dict(vae_decoder={"scaling_factor": "nan"}), r"scaling_factor: expected a positive finite number, got 'nan'"),
        (
            dict(vae_decoder={"latent_channels": 16}),
            r"latent_channels: expected 4 \(the decoder's latent_sample channels\), "
            r"got 16",
        ),
        (dict(vae_decoder={"latent_channels": 10**6}), r"latent_channels: expected 4 .*got 1000000"),
        (
            dict(vae_decoder={"block_out_channels": [32, 64]}),
            r"block_out_channels: 2 blocks mean a scale factor of 2, "
            r"but the decoder turns 8 latent rows into 64",
        ),
    ],
)
def test_vae_configs_that_contradict_the_decoder_are_refused_when_loading(copy_of, changes, message):
    with pytest.raises(ValueError, match=message):
        OnnxStableDiffusionPipeline.from_pretrained(copy_of(**changes))


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        (
            dict(provider=123),
            TypeError,
            r"provider: expected a provider name, a \(name, options dict\) pair or a list of "
            r"them, got int 123",
        ),
        (dict(provider=[]), ValueError, r"provider: expected at least one execution provider, got an empty list"),
        (dict(provider="NoSuchExecutionProvider"), ValueError, r"'NoSuchExecutionProvider' is not available"),
        (dict(provider_options="fast"), TypeError, r"provider_options: expected a dict or a list of dicts, got 'fast'"),
        (
            dict(sess_options="fast"),
            TypeError,
            r"sess_options: expected an onnxruntime.SessionOptions or None, got str",
        ),
        (dict(io_bindng=False), TypeError, r"unexpected keyword argument\(s\) \['io_bindng'\]"),
        (dict(cuda_graph="sometimes"), ValueError, r"cuda_graph: expected 'auto', True or False, got 'sometimes'"),
    ],
)
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
    with pytest.raises(
        FileNotFoundError,
        match=r"pretrained_model_name_or_path: expected an existing local folder or "
        r"a hub repository id, got .*no such file or folder",
    ):
        OnnxStableDiffusionPipeline.from_pretrained(name)


def test_an_unreachable_hub_id_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        FileNotFoundError,
        match=r"'someone/no-such-model' is not a local folder \(no such path "
        r"here\), and the Hugging Face Hub could not provide it",
    ):
        OnnxStableDiffusionPipeline.from_pretrained("someone/no-such-model")


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(overlap=0.9), r"overlap: expected a fraction in \[0, 0.5\]"),
        (dict(tile_sample_size=100), r"tile_sample_size: expected a positive multiple of 8"),
    ],
)
def test_tiling_options_are_checked(pipe, arguments, message):
    with pytest.raises(ValueError, match=message):
        pipe.enable_vae_tiling(**arguments)


def test_xl_micro_conditioning_and_clip_skip_are_checked(xl):
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


# ------------------------------------------------------------------------------------- components of the wrong kind
@pytest.mark.parametrize(
    "source, target, message",
    [
        (
            "vae_encoder",
            "vae_decoder",
            r"vae_decoder: expected a VAE decoder \(inputs \['latent_sample'\]\), got a model "
            r"with inputs \['sample'\] and outputs \['latent_sample'\]: '.*vae_decoder/model"
            r"\.onnx' is a VAE encoder, not a VAE decoder",
        ),
        (
            "vae_decoder",
            "vae_encoder",
            r"vae_encoder: expected a VAE encoder \(inputs \['sample'\]\), got a model with "
            r"inputs \['latent_sample'\] .* is a VAE decoder, not a VAE encoder",
        ),
        (
            "unet",
            "text_encoder",
            r"text_encoder: expected a text encoder \(inputs \['input_ids'\]\), got a model with "
            r"inputs \['sample', 'timestep', 'encoder_hidden_states'\] .* is a UNet, not a text "
            r"encoder",
        ),
        (
            "text_encoder",
            "unet",
            r"unet: expected a UNet \(inputs \['sample', 'timestep', 'encoder_hidden_states'\] and "
            r"more\), got a model with inputs \['input_ids'\] .* is a text encoder, not a UNet",
        ),
        ("unet", "vae_decoder", r"vae_decoder: expected a VAE decoder .* is a UNet, not a VAE decoder"),
    ],
)
def test_a_component_of_the_wrong_kind_names_its_folder(copy_of, source, target, message, live_sessions):
    folder = copy_of()
    shutil.copyfile(folder / source / "model.onnx", folder / target / "model.onnx")
    gc.collect()
    before = live_sessions()
    with pytest.raises(ValueError, match=message):
        OnnxStableDiffusionPipeline.from_pretrained(folder)
    assert live_sessions() == before  # the components loaded before it are released


def test_an_sdxl_text_encoder_without_hidden_states_is_refused_when_loading(xl_folder, tiny_folder, tmp_path):
    folder = shutil.copytree(xl_folder, tmp_path / "xl")
    shutil.copyfile(tiny_folder / "text_encoder" / "model.onnx", folder / "text_encoder_2" / "model.onnx")
    with pytest.raises(
        ValueError,
        match=r"text_encoder_2: expected an SDXL text encoder with outputs hidden_states.0 "
        r"… hidden_states.N and text_embeds .*got outputs \['last_hidden_state', "
        r"'pooler_output'\]",
    ):
        OnnxStableDiffusionXLPipeline.from_pretrained(folder)


@pytest.mark.parametrize(
    "class_name, message",
    [
        (
            "CLIPTextModel",
            r"model_index.json: tokenizer: expected a transformers tokenizer class \(CLIPTokenizer, "
            r"CLIPTokenizerFast, AutoTokenizer …\), got the class 'CLIPTextModel', which is not a tokenizer",
        ),
        ("AutoConfig", r"tokenizer: expected a transformers tokenizer class .*got the class 'AutoConfig'"),
        ("pipeline", r"tokenizer: expected a transformers tokenizer class .*got the function 'pipeline'"),
        ("__version__", r"tokenizer: expected a transformers tokenizer class .*got the str '__version__'"),
        (5, r"model_index.json: tokenizer: expected a class name, got int 5"),
    ],
)
def test_a_tokenizer_class_that_is_not_a_tokenizer_is_named(copy_of, class_name, message):
    folder = copy_of()
    index = json.loads((folder / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", class_name]
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=message):
        OnnxStableDiffusionPipeline.from_pretrained(folder)


def test_a_tokenizer_or_scheduler_argument_of_the_wrong_kind_is_named(tiny_folder):
    with pytest.raises(
        TypeError,
        match=r"tokenizer: expected a transformers tokenizer \(callable, with a "
        r"model_max_length\), got str 'openai/clip-vit-large-patch14'",
    ):
        OnnxStableDiffusionPipeline.from_pretrained(tiny_folder, tokenizer="openai/clip-vit-large-patch14")
    with pytest.raises(
        TypeError,
        match=r"scheduler: expected a diffusers scheduler \(with set_timesteps and step\), "
        r"got str 'ddim'",
    ):
        OnnxStableDiffusionPipeline.from_pretrained(tiny_folder, scheduler="ddim")


# --------------------------------------------------------------------------------------------- step-end callbacks
def no_model_runs(pipe):
    """A context that records every run of the pipeline's text encoder and UNet (to show a refusal came first)."""
    stack = contextlib.ExitStack()
    runs = [stack.enter_context(pipe.text_encoder.watch_runs()), stack.enter_context(pipe.unet.watch_runs())]
    return stack, runs


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        (
            dict(callback_on_step_end_tensor_inputs=["latents", "noise_pred"]),
            ValueError,
            r"callback_on_step_end_tensor_inputs: expected names among \['latents', 'prompt_embeds'\], got \['noise_pred'\]",
        ),
        (dict(callback_on_step_end_tensor_inputs=["add_text_embeds"]), ValueError, r"got \['add_text_embeds'\]"),
        (
            dict(callback_on_step_end_tensor_inputs="latents"),
            TypeError,
            r"callback_on_step_end_tensor_inputs: expected a list of tensor names among \['latents', 'prompt_embeds'\], "
            r"got str 'latents'",
        ),
        (
            dict(callback_on_step_end="print"),
            TypeError,
            r"callback_on_step_end: expected a callable \(pipe, step, timestep, tensors\) -> dict, got str 'print'",
        ),
    ],
)
def test_step_end_callback_arguments_are_refused_before_any_work(pipe, arguments, error, message):
    arguments.setdefault("callback_on_step_end", lambda p, i, t, tensors: tensors)
    stack, runs = no_model_runs(pipe)
    with stack, pytest.raises(error, match=message):
        pipe(PROMPT, height=64, width=64, num_inference_steps=2, output_type="np", **arguments)
    assert runs == [[], []]


def returns_a_list(pipe, step, timestep, tensors):
    return [tensors["latents"]]


@pytest.mark.parametrize(
    "callback, error, message",
    [
        (
            returns_a_list,
            TypeError,
            r"callback_on_step_end: expected returns_a_list to return a dict of tensors \(or "
            r"None\), got list at step 0",
        ),
        (
            lambda p, i, t, tensors: {"latents": tensors["latents"].numpy()},
            TypeError,
            r"callback_on_step_end: .*<lambda> returned 'latents' as ndarray at step 0, expected a float torch.Tensor of "
            r"shape \(1, 4, 8, 8\)",
        ),
        (
            lambda p, i, t, tensors: {"latents": tensors["latents"][:, :2]},
            ValueError,
            r"returned 'latents' of shape \(1, 2, 8, 8\) at step 0, expected a float torch.Tensor of shape \(1, 4, 8, 8\)",
        ),
        (
            lambda p, i, t, tensors: {"prompt_embeds": tensors["prompt_embeds"][..., :16]},
            ValueError,
            r"returned 'prompt_embeds' of shape \(2, 77, 16\) at step 0, expected a float torch.Tensor of shape "
            r"\(2, 77, 32\)",
        ),
        (
            lambda p, i, t, tensors: {"latents": tensors["latents"].to(torch.int64)},
            TypeError,
            r"returned 'latents' of dtype torch.int64 .*expected a float torch.Tensor",
        ),
        (
            lambda p, i, t, tensors: {"latent": tensors["latents"]},
            ValueError,
            r"callback_on_step_end: expected .*<lambda> to return keys among \['latents', 'prompt_embeds'\], got "
            r"\['latent'\] at step 0",
        ),
    ],
)
def test_what_a_step_end_callback_returns_is_checked_naming_it_and_the_key(pipe, callback, error, message):
    with pytest.raises(error, match=message):
        pipe(
            PROMPT,
            height=64,
            width=64,
            num_inference_steps=2,
            output_type="np",
            callback_on_step_end=callback,
            callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"],
        )
    # the pipeline is not left half-initialised: the next call works
    assert pipe(PROMPT, height=64, width=64, num_inference_steps=1, output_type="np").images.shape == (1, 64, 64, 3)


def test_latents_a_callback_returns_in_another_float_dtype_are_cast_back(pipe):
    def run(callback):
        return pipe(
            PROMPT,
            height=64,
            width=64,
            num_inference_steps=2,
            output_type="latent",
            callback_on_step_end=callback,
            generator=np.random.RandomState(0),
        ).images

    unchanged = run(lambda p, i, t, tensors: tensors)
    as_double = run(lambda p, i, t, tensors: {"latents": tensors["latents"].double()})
    returned_none = run(lambda p, i, t, tensors: None)
    assert as_double.dtype == unchanged.dtype == torch.float32
    torch.testing.assert_close(as_double, unchanged)
    torch.testing.assert_close(returned_none, unchanged)


# ------------------------------------------------------------------------------------------- embeddings' widths
@pytest.mark.parametrize(
    "arguments, message",
    [
        (
            dict(prompt=None, prompt_embeds=torch.ones(1, 77, 16)),
            r"prompt_embeds: expected hidden size 32 \(the width of the UNet's encoder_hidden_states\), got 16 \(shape "
            r"\(1, 77, 16\)\)",
        ),
        (
            dict(prompt=None, prompt_embeds=np.ones((1, 77, 768), np.float32)),
            r"prompt_embeds: expected hidden size 32 .*got 768",
        ),
        (
            dict(negative_prompt_embeds=torch.ones(1, 77, 64)),
            r"negative_prompt_embeds: expected hidden size 32 \(the width of the UNet's encoder_hidden_states\), got 64",
        ),
        (
            dict(prompt=["a cat", "a dog"], negative_prompt_embeds=torch.ones(1, 77, 32)),
            r"negative_prompt_embeds: expected 2 rows \(one per prompt\), got shape \(1, 77, 32\)",
        ),
        (dict(prompt=None, prompt_embeds=torch.ones(1, 0, 32)), r"prompt_embeds: expected a non-empty tensor"),
        (
            dict(prompt=None, prompt_embeds=torch.ones(1, 77, 32).to_sparse()),
            r"prompt_embeds: expected a dense torch.Tensor or numpy array \(batch, sequence, hidden\), got a sparse_coo "
            r"tensor",
        ),
        (
            dict(prompt=None, prompt_embeds=[[[0.0] * 32] * 77]),
            r"prompt_embeds: expected a dense torch.Tensor or numpy array \(batch, sequence, hidden\), got list",
        ),
    ],
)
def test_embeddings_of_the_wrong_width_are_refused_before_any_work(pipe, arguments, message):
    stack, runs = no_model_runs(pipe)
    with stack, pytest.raises((ValueError, TypeError), match=message):
        pipe(**{**dict(prompt=PROMPT, height=64, width=64, num_inference_steps=1, output_type="np"), **arguments})
    assert runs == [[], []]


def test_big_endian_embeddings_give_the_same_image(pipe):
    embeds = pipe.encode_prompt([PROMPT], 1, False).numpy()
    arguments = dict(
        prompt=None,
        height=64,
        width=64,
        num_inference_steps=1,
        output_type="np",
        guidance_scale=1.0,
        generator=np.random.RandomState(0),
    )
    native = pipe(prompt_embeds=embeds, **arguments).images
    arguments["generator"] = np.random.RandomState(0)
    np.testing.assert_array_equal(pipe(prompt_embeds=embeds.astype(">f4"), **arguments).images, native)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (
            dict(prompt_embeds=torch.ones(1, 77, 32), pooled_prompt_embeds=torch.ones(1, 32)),
            r"prompt_embeds: expected hidden size 64 \(the width of the UNet's encoder_hidden_states\), got 32",
        ),
        (
            dict(prompt_embeds=torch.ones(1, 77, 64), pooled_prompt_embeds=torch.ones(1, 7)),
            r"pooled_prompt_embeds: expected hidden size 32 \(the width of the UNet's text_embeds\), got 7 \(shape \(1, 7\)\)",
        ),
        (
            dict(prompt_embeds=torch.ones(1, 77, 64), pooled_prompt_embeds=torch.ones(32)),
            r"pooled_prompt_embeds: expected shape \(batch, width\), got \(32,\)",
        ),
        (
            dict(prompt_embeds=torch.ones(1, 77, 64), pooled_prompt_embeds=torch.ones(2, 32)),
            r"pooled_prompt_embeds: expected 1 rows like prompt_embeds, got shape \(2, 32\)",
        ),
        (
            dict(
                prompt_embeds=torch.ones(1, 77, 64),
                pooled_prompt_embeds=torch.ones(1, 32),
                negative_prompt_embeds=torch.ones(1, 77, 64),
                negative_pooled_prompt_embeds=torch.ones(1, 16),
            ),
            r"negative_pooled_prompt_embeds: expected hidden size 32 \(the width of the UNet's text_embeds\), got 16",
        ),
        (
            dict(prompt_embeds=torch.ones(1, 77, 64)),
            r"pooled_prompt_embeds: expected them with prompt_embeds \(SDXL's UNet takes both\), got None",
        ),
    ],
)
def test_sdxl_embeddings_of_the_wrong_width_are_refused_before_any_work(xl, arguments, message):
    with (
        xl.text_encoder_2.watch_runs() as runs,
        xl.unet.watch_runs() as unet_runs,
        pytest.raises(ValueError, match=message),
    ):
        xl(prompt=None, height=64, width=64, num_inference_steps=1, output_type="np", **arguments)
    assert runs == [] and unet_runs == []


# ------------------------------------------------------------------------------------ images that are no picture
EMPTY_IMAGES = {
    "0x0 array": (np.zeros((0, 0, 3), np.float32), r"image: expected a non-empty image, got shape \(0, 0, 3\)"),
    "0-wide tensor": (torch.zeros(1, 3, 64, 0), r"image: expected a non-empty image, got shape \(1, 3, 64, 0\)"),
    "empty batch": (torch.zeros(0, 3, 64, 64), r"image: expected a non-empty image, got shape \(0, 3, 64, 64\)"),
    "0x0 PIL": (PIL.Image.new("RGB", (0, 0)), r"image: expected a non-empty image, got 0 × 0 pixels"),
    "empty list": ([], r"image: expected an image or a non-empty list of images, got an empty list"),
    "1-d array": (
        np.zeros(5, np.float32),
        r"image: expected an image of shape \(height, width, channels\).*, or a "
        r"batch of them, got shape \(5,\)",
    ),
    "4 channels": (
        torch.zeros(1, 4, 64, 64),
        r"image: expected 3 channels in the layout \(channels, height, width\), "
        r"got shape \(1, 4, 64, 64\)",
    ),
    "a file name": (
        "cat.png",
        r"image: expected a PIL image, a numpy array or a torch tensor \(or a list of them\), "
        r"got str",
    ),
}
TINY_IMAGES = {
    "4x4 PIL": (
        PIL.Image.new("RGB", (4, 4)),
        r"image: expected at least 8 × 8 pixels \(one latent pixel: the VAE's "
        r"scale factor\), got 4 × 4",
    ),
    "1x64 array": (np.zeros((1, 64, 3), np.float32), r"image: expected at least 8 × 8 pixels .*got 1 × 64"),
    "72x64 tensor": (
        torch.zeros(1, 3, 72, 64),
        r"image: a 72 × 64 image \(after rounding down to the VAE factor 8\) "
        r"cannot be used: height and width: expected multiples of 16",
    ),
}


@pytest.fixture(scope="module")
def img2img(tiny_folder):
    pipe = OnnxStableDiffusionImg2ImgPipeline.from_pretrained(tiny_folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def inpaint(tiny_folder):
    pipe = OnnxStableDiffusionInpaintPipeline.from_pretrained(tiny_folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("name", [*EMPTY_IMAGES, *TINY_IMAGES])
def test_img2img_refuses_an_empty_or_tiny_image_before_any_work(img2img, name):
    image, message = {**EMPTY_IMAGES, **TINY_IMAGES}[name]
    stack, runs = no_model_runs(img2img)
    with stack, pytest.raises((ValueError, TypeError), match=message):
        img2img(PROMPT, image=image, num_inference_steps=2, output_type="np")
    assert runs == [[], []]


@pytest.mark.parametrize("name", list(EMPTY_IMAGES))
def test_inpainting_refuses_an_empty_image_or_mask_before_any_work(inpaint, name):
    image, message = EMPTY_IMAGES[name]
    good = torch.zeros(1, 3, 64, 64)
    mask = torch.ones(1, 1, 64, 64)
    stack, runs = no_model_runs(inpaint)
    with stack:
        with pytest.raises((ValueError, TypeError), match=message):
            inpaint(PROMPT, image=image, mask_image=mask, height=64, width=64, num_inference_steps=2, output_type="np")
        if name != "4 channels":  # a mask may have any channels: it is made grayscale
            with pytest.raises((ValueError, TypeError), match=message.replace("image", "mask_image", 1)):
                inpaint(
                    PROMPT, image=good, mask_image=image, height=64, width=64, num_inference_steps=2, output_type="np"
                )
    assert runs == [[], []]


def test_inpainting_resizes_a_tiny_image_to_the_size_asked_for(inpaint):
    # with height and width given, a 4 × 4 image and mask are resized to them: small, but not empty
    images = inpaint(
        PROMPT,
        image=PIL.Image.new("RGB", (4, 4)),
        mask_image=np.ones((4, 4), np.float32),
        height=64,
        width=64,
        num_inference_steps=1,
        output_type="np",
    ).images
    assert images.shape == (1, 64, 64, 3)


def test_sdxl_img2img_refuses_an_empty_image_before_any_work(xl_folder):
    pipe = OnnxStableDiffusionXLImg2ImgPipeline.from_pretrained(xl_folder)
    with pytest.raises(ValueError, match=r"image: expected a non-empty image, got shape \(0, 0, 3\)"):
        pipe(PROMPT, image=np.zeros((0, 0, 3), np.float32), num_inference_steps=2, output_type="np")
    with pytest.raises(ValueError, match=r"image: expected at least 8 × 8 pixels .*got 4 × 4"):
        pipe(PROMPT, image=PIL.Image.new("RGB", (4, 4)), num_inference_steps=2, output_type="np")


# ------------------------------------------------------------------------------------------------------ tile sizes
@pytest.mark.parametrize(
    "size, message",
    [
        (0, r"tile_sample_size: expected a positive multiple of 8 \(the VAE's scale factor\), got 0"),
        (-64, r"tile_sample_size: expected a positive multiple of 8 .*got -64"),
        (64.0, r"tile_sample_size: expected a positive multiple of 8 .*got 64.0"),
        (True, r"tile_sample_size: expected a positive multiple of 8 .*got True"),
        ("64", r"tile_sample_size: expected a positive multiple of 8 .*got '64'"),
        (12, r"tile_sample_size: expected a positive multiple of 8 .*got 12"),
    ],
)
def test_a_tile_size_that_is_no_size_is_refused_not_read_as_the_default(pipe, size, message):
    from optimum_iobinding.pipelines.tiling import TiledVAE

    with pytest.raises(ValueError, match=message):
        pipe.enable_vae_tiling(tile_sample_size=size)
    assert pipe.vae_tiler is None  # nothing half set up
    with pytest.raises(ValueError, match=message):
        TiledVAE(pipe.vae_decoder, pipe.vae_encoder, tile_sample_size=size)


def test_tiling_defaults_and_numpy_sizes(pipe):
    from optimum_iobinding.pipelines.tiling import TiledVAE

    pipe.enable_vae_tiling()
    assert pipe.vae_tiler.tile_sample_size == pipe.vae_decoder.config.get("sample_size", 512)
    pipe.enable_vae_tiling(tile_sample_size=np.int64(32))
    assert pipe.vae_tiler.tile_sample_size == 32 and pipe.vae_tiler.tile_latent_size == 4
    pipe.disable_vae_tiling()
    with pytest.raises(
        ValueError,
        match=r"scale_factor: expected a positive integer \(pixels per latent, 8 for "
        r"Stable Diffusion\), got 0",
    ):
        TiledVAE(pipe.vae_decoder, tile_sample_size=64, scale_factor=0)
    with pytest.raises(ValueError, match=r"max_tile_sessions: expected an integer ≥ 1, got True"):
        TiledVAE(pipe.vae_decoder, tile_sample_size=64, max_tile_sessions=True)


# ------------------------------------------------------------------------------------------- SDXL's second prompts
@pytest.mark.parametrize(
    "arguments, error, message",
    [
        (dict(prompt_2=5), TypeError, r"prompt_2: expected a str or a list of str, got int 5"),
        (dict(prompt_2=["a", 7]), TypeError, r"prompt_2\[1\]: expected a str, got int 7"),
        (dict(prompt_2=[]), ValueError, r"prompt_2: expected a str or a non-empty list of str, got an empty list"),
        (
            dict(prompt=["a cat", "a dog"], prompt_2=["a painting"]),
            ValueError,
            r"prompt_2: expected 2 prompts \(as many as prompt\), got 1",
        ),
        (
            dict(prompt_2=["a painting", "a photo"]),
            ValueError,
            r"prompt_2: expected 1 prompt \(as many as prompt\), got 2",
        ),
        (dict(negative_prompt_2=3.5), TypeError, r"negative_prompt_2: expected a str or a list of str, got float 3.5"),
        (dict(negative_prompt_2=[None]), TypeError, r"negative_prompt_2\[0\]: expected a str, got NoneType None"),
        (
            dict(prompt=["a cat", "a dog"], negative_prompt_2=["blurry"] * 3),
            ValueError,
            r"negative_prompt_2: expected 2 prompts \(as many as prompt\), got 3",
        ),
        (
            dict(
                prompt=None,
                prompt_2="a painting",
                prompt_embeds=torch.ones(1, 77, 64),
                pooled_prompt_embeds=torch.ones(1, 32),
            ),
            ValueError,
            r"prompt_2 and prompt_embeds: expected at most one of them, got both",
        ),
    ],
)
def test_sdxl_second_prompts_of_the_wrong_kind_are_refused_before_any_work(xl, arguments, error, message):
    call = dict(prompt=PROMPT, height=64, width=64, num_inference_steps=1, output_type="np")
    call.update(arguments)
    with (
        xl.text_encoder.watch_runs() as runs,
        xl.text_encoder_2.watch_runs() as runs_2,
        pytest.raises(error, match=message),
    ):
        xl(**call)
    assert runs == [] and runs_2 == []


def test_sdxl_one_negative_prompt_2_serves_every_prompt(xl):
    images = xl(
        ["a cat", "a dog"], negative_prompt_2="blurry", height=64, width=64, num_inference_steps=1, output_type="np"
    ).images
    assert images.shape == (2, 64, 64, 3)


def test_a_generator_refusal_speaks_of_what_the_call_makes():
    from optimum_iobinding.pipelines.arguments import check_generator

    with pytest.raises(TypeError, match=r"^generator: expected .*list of torch.Generators \(one per video\), got str$"):
        check_generator("seed", 1, 1, "video")
    with pytest.raises(
        ValueError,
        match=r"^generator: expected one torch.Generator per video \(2: 1 prompt × num_videos_per_prompt 2\), got a "
        r"list of 1$",
    ):
        check_generator([torch.Generator()], 1, 2, "video")
    assert check_generator(None, 2, 3) == 6 and check_generator([torch.Generator()] * 6, 2, 3) == 6

"""Stable Diffusion 3 on the tiny random SD3 pipeline, CPU execution provider: our ONNX pipeline against diffusers'
torch ``StableDiffusion3Pipeline`` on the same weights (exported here), with and without binding; the export's
layout, precision and external data; loading optimum's export and being loaded by optimum's pipeline."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import onnx
import PIL.Image
import pytest
import torch

from optimum_iobinding import OnnxStableDiffusion3Pipeline
from optimum_iobinding.cli import main
from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.transformer import export_sd3_pipeline
from optimum_iobinding.pipelines import pipeline_class_for
from optimum_iobinding.pipelines.stable_diffusion_3 import SD3_VAE_SCALING_FACTOR, SD3_VAE_SHIFT_FACTOR

SIZE = 64
PROMPT = "a photo of an astronaut riding a horse"
SEQUENCE = 16  # T5 tokens: small, to keep the tests fast
# fp32 ONNX Runtime vs fp32 torch on the CPU, a few steps: rounding only
TOLERANCE = 1e-4


def load(folder, io_binding=True, **kwargs):
    pipe = OnnxStableDiffusion3Pipeline.from_pretrained(folder, io_binding=io_binding, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def initial_latents(rows=1, height=SIZE, width=SIZE, seed=0):
    return torch.randn(rows, 16, height // 8, width // 8, generator=torch.Generator().manual_seed(seed))


def both(torch_pipe, pipe, *args, **kwargs):
    """The same call on diffusers' torch pipeline and ours."""
    call = dict(height=SIZE, width=SIZE, num_inference_steps=3, max_sequence_length=SEQUENCE, output_type="np")
    call.update(kwargs)
    return torch_pipe(*args, **call).images, pipe(*args, **call).images


# ------------------------------------------------------------------------------------------------------ export
def test_the_export_has_optimums_sd3_layout_and_names(sd3):
    _, folder = sd3
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["transformer"] == ["diffusers", "SD3Transformer2DModel"]
    assert index["text_encoder_3"] == ["transformers", "T5EncoderModel"]
    assert index["tokenizer_3"] == ["transformers", "T5TokenizerFast"]
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae_encoder", "vae_decoder"):
        assert (folder / name / "model.onnx").is_file() and (folder / name / "config.json").is_file()
    for name in ("tokenizer", "tokenizer_2", "tokenizer_3", "scheduler"):
        assert (folder / name).is_dir()
    pipe = load(folder)
    assert pipe.transformer.input_names == ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"]
    assert pipe.transformer.output_names == ["out_hidden_states"]
    assert pipe.text_encoder.output_names[:2] == ["text_embeds", "last_hidden_state"]
    assert pipe.text_encoder_2.output_names[2:] == ["hidden_states.0", "hidden_states.1", "hidden_states.2"]
    assert pipe.text_encoder_3.output_names == ["last_hidden_state"]
    assert pipe.text_encoder_3.input_dtypes["input_ids"] == torch.int64
    assert pipe.vae_decoder.config["shift_factor"] == pytest.approx(0.0609)


def test_a_float16_export_keeps_t5_in_float32_and_converts_the_rest(sd3, tmp_path):
    torch_pipe, _ = sd3
    folder = export_pipeline(None, tmp_path / "fp16", torch_pipeline=torch_pipe, fp16=True, progress=False)

    def input_type(name, input_name):
        graph = onnx.load(str(folder / name / "model.onnx")).graph
        return next(value.type.tensor_type.elem_type for value in graph.input if value.name == input_name)

    def output_type(name):
        return onnx.load(str(folder / name / "model.onnx")).graph.output[0].type.tensor_type.elem_type

    assert output_type("text_encoder_3") == onnx.TensorProto.FLOAT
    assert input_type("transformer", "hidden_states") == onnx.TensorProto.FLOAT16
    assert output_type("text_encoder") == onnx.TensorProto.FLOAT16
    assert input_type("vae_decoder", "latent_sample") == onnx.TensorProto.FLOAT16
    # diffusers feeds SD3's timestep in float32 whatever the pipeline's dtype
    assert input_type("transformer", "timestep") == onnx.TensorProto.FLOAT


def test_a_float16_export_loads_feeds_a_float32_timestep_and_stays_close_to_diffusers(sd3, tmp_path):
    torch_pipe, _ = sd3
    half = load(export_pipeline(None, tmp_path / "fp16", torch_pipeline=torch_pipe, fp16=True, progress=False))
    assert half.transformer.input_dtypes["timestep"] == torch.float32
    assert half.transformer.input_dtypes["hidden_states"] == torch.float16
    expected, got = both(torch_pipe, half, PROMPT, latents=initial_latents())
    np.testing.assert_allclose(got, expected, atol=0.05)


def test_weights_past_the_threshold_go_to_external_data_and_load_the_same(sd3, tmp_path):
    torch_pipe, folder = sd3
    # the tiny transformer and T5 weigh a few hundred KB: a threshold below that exercises the switch
    split = export_sd3_pipeline(torch_pipe, tmp_path / "split", progress=False, external_data_threshold=100_000)
    assert (split / "transformer" / "model.onnx_data").is_file()
    assert (split / "text_encoder_3" / "model.onnx_data").is_file()
    assert not (folder / "transformer" / "model.onnx_data").exists()
    latents = initial_latents()
    expected = load(folder)(
        PROMPT,
        height=SIZE,
        width=SIZE,
        num_inference_steps=2,
        latents=latents,
        max_sequence_length=SEQUENCE,
        output_type="np",
    ).images
    got = load(split)(
        PROMPT,
        height=SIZE,
        width=SIZE,
        num_inference_steps=2,
        latents=latents,
        max_sequence_length=SEQUENCE,
        output_type="np",
    ).images
    np.testing.assert_array_equal(got, expected)


def test_a_cpu_optimized_export_matches_diffusers(sd3, tmp_path):
    torch_pipe, _ = sd3
    folder = export_pipeline(None, tmp_path / "fused", torch_pipeline=torch_pipe, optimize="cpu", progress=False)
    expected, got = both(torch_pipe, load(folder), PROMPT, latents=initial_latents())
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_export_tiny_random_sd3_from_the_command_line_loads_as_sd3(tmp_path):
    assert main(["export", "--tiny-random", "sd3", "--output", str(tmp_path / "sd3")]) == 0
    assert pipeline_class_for(tmp_path / "sd3") is OnnxStableDiffusion3Pipeline
    image = load(tmp_path / "sd3")(
        PROMPT, height=SIZE, width=SIZE, num_inference_steps=1, max_sequence_length=SEQUENCE
    ).images[0]
    assert isinstance(image, PIL.Image.Image) and image.size == (SIZE, SIZE)


# ---------------------------------------------------------------------------------------------- against diffusers
@pytest.mark.parametrize("io_binding", [True, False])
@pytest.mark.parametrize(
    "call",
    [
        dict(guidance_scale=7.0),
        dict(guidance_scale=1.0),
        dict(
            guidance_scale=4.0,
            negative_prompt="blurry",
            prompt_2="an oil painting",
            prompt_3="a red castle",
            negative_prompt_3="ugly",
        ),
        dict(guidance_scale=5.0, clip_skip=1),
    ],
    ids=["cfg", "no-cfg", "negatives-and-prompts-2-3", "clip-skip"],
)
def test_txt2img_matches_diffusers_torch_sd3(sd3, io_binding, call):
    torch_pipe, folder = sd3
    expected, got = both(torch_pipe, load(folder, io_binding), PROMPT, latents=initial_latents(), **call)
    assert got.shape == expected.shape == (1, SIZE, SIZE, 3)
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_without_t5_the_t5_part_is_zeros_as_in_diffusers(sd3_without_t5):
    torch_pipe, folder = sd3_without_t5
    assert not (folder / "text_encoder_3").exists() and not (folder / "tokenizer_3").exists()
    pipe = load(folder)
    assert pipe.text_encoder_3 is None
    expected, got = both(torch_pipe, pipe, PROMPT, latents=initial_latents())
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_two_prompts_and_two_images_per_prompt_come_out_in_diffusers_order(sd3):
    torch_pipe, folder = sd3
    expected, got = both(
        torch_pipe,
        load(folder),
        [PROMPT, "a red car"],
        negative_prompt=["blurry", "dark"],
        num_images_per_prompt=2,
        latents=initial_latents(4, width=96),
        width=96,
    )
    assert got.shape == (4, SIZE, 96, 3)
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_a_torch_generator_draws_the_noise_diffusers_draws(sd3):
    torch_pipe, folder = sd3
    expected = torch_pipe(
        PROMPT,
        height=SIZE,
        width=SIZE,
        num_inference_steps=2,
        max_sequence_length=SEQUENCE,
        generator=torch.Generator().manual_seed(7),
        output_type="np",
    ).images
    got = load(folder)(
        PROMPT,
        height=SIZE,
        width=SIZE,
        num_inference_steps=2,
        max_sequence_length=SEQUENCE,
        generator=torch.Generator().manual_seed(7),
        output_type="np",
    ).images
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_given_prompt_embeds_give_diffusers_image(sd3):
    torch_pipe, folder = sd3
    embeds, negative, pooled, negative_pooled = torch_pipe.encode_prompt(
        PROMPT, None, None, negative_prompt="blurry", max_sequence_length=SEQUENCE
    )
    given = dict(
        prompt_embeds=embeds,
        negative_prompt_embeds=negative,
        pooled_prompt_embeds=pooled,
        negative_pooled_prompt_embeds=negative_pooled,
    )
    expected, got = both(torch_pipe, load(folder), latents=initial_latents(), **given)
    reference = torch_pipe(
        PROMPT,
        negative_prompt="blurry",
        height=SIZE,
        width=SIZE,
        num_inference_steps=3,
        max_sequence_length=SEQUENCE,
        latents=initial_latents(),
        output_type="np",
    ).images
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)
    np.testing.assert_allclose(got, reference, atol=TOLERANCE)


@pytest.mark.parametrize("output_type", ["latent", "pt"])
def test_latent_and_pt_outputs_equal_diffusers(sd3, output_type):
    torch_pipe, folder = sd3
    expected, got = both(torch_pipe, load(folder), PROMPT, latents=initial_latents(), output_type=output_type)
    assert isinstance(got, torch.Tensor) and got.shape == expected.shape
    np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=TOLERANCE)


def test_pil_output_is_diffusers_images(sd3):
    torch_pipe, folder = sd3
    expected, got = both(torch_pipe, load(folder), PROMPT, latents=initial_latents(), output_type="pil")
    assert [image.size for image in got] == [(SIZE, SIZE)]
    assert np.abs(np.asarray(got[0], dtype=int) - np.asarray(expected[0], dtype=int)).max() <= 1


def test_dynamic_shifting_takes_the_shift_diffusers_computes(sd3):
    from diffusers import FlowMatchEulerDiscreteScheduler

    torch_pipe, folder = sd3
    config = dict(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_image_seq_len=16,
        max_image_seq_len=256,
        base_shift=0.5,
        max_shift=1.15,
    )
    original = torch_pipe.scheduler
    torch_pipe.scheduler = FlowMatchEulerDiscreteScheduler(**config)
    try:
        expected, got = both(
            torch_pipe,
            load(folder, scheduler=FlowMatchEulerDiscreteScheduler(**config)),
            PROMPT,
            latents=initial_latents(width=96),
            width=96,
        )
    finally:
        torch_pipe.scheduler = original
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_custom_sigmas_give_diffusers_schedule(sd3):
    torch_pipe, folder = sd3
    expected, got = both(torch_pipe, load(folder), PROMPT, latents=initial_latents(), sigmas=[1.0, 0.6, 0.2])
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_a_step_end_callback_sees_and_replaces_the_pooled_embeddings_as_in_diffusers(sd3):
    torch_pipe, folder = sd3
    seen = {"torch": [], "onnx": []}

    def halve_pooled(where):
        def callback(pipe, step, timestep, tensors):
            seen[where].append(sorted(tensors))
            return {"pooled_prompt_embeds": tensors["pooled_prompt_embeds"] * 0.5}

        return callback

    names = ["latents", "pooled_prompt_embeds"]
    call = dict(
        height=SIZE,
        width=SIZE,
        num_inference_steps=3,
        max_sequence_length=SEQUENCE,
        output_type="np",
        latents=initial_latents(),
        callback_on_step_end_tensor_inputs=names,
    )
    expected = torch_pipe(PROMPT, callback_on_step_end=halve_pooled("torch"), **call).images
    got = load(folder)(PROMPT, callback_on_step_end=halve_pooled("onnx"), **call).images
    assert seen["onnx"] == seen["torch"] == [names] * 3
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


# -------------------------------------------------------------------------------------------- loading, saving
def test_generate_picks_the_sd3_pipeline_for_an_sd3_folder(sd3):
    assert pipeline_class_for(sd3[1]) is OnnxStableDiffusion3Pipeline


def test_a_saved_pipeline_loads_and_gives_the_same_image(sd3, tmp_path):
    _, folder = sd3
    pipe = load(folder)
    pipe.save_pretrained(tmp_path / "saved")
    call = dict(
        height=SIZE,
        width=SIZE,
        num_inference_steps=2,
        max_sequence_length=SEQUENCE,
        output_type="np",
        latents=initial_latents(),
    )
    np.testing.assert_array_equal(load(tmp_path / "saved")(PROMPT, **call).images, pipe(PROMPT, **call).images)
    assert json.loads((tmp_path / "saved" / "model_index.json").read_text())["transformer"] == [
        "diffusers",
        "SD3Transformer2DModel",
    ]
    for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):  # transformers 4 (optimum's) reads them too
        config = json.loads((tmp_path / "saved" / name / "tokenizer_config.json").read_text())
        assert config.get("extra_special_tokens") != [], name


def test_after_warmup_a_call_of_that_size_creates_no_session(sd3):
    _, folder = sd3
    pipe = load(folder)
    pipe.warmup(heights=SIZE, batch_sizes=1, guidance_scales=7.0, num_inference_steps=1)
    created = pipe.sessions_created
    pipe([""], height=SIZE, width=SIZE, num_inference_steps=2, guidance_scale=7.0, output_type="np")
    assert pipe.sessions_created == created


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(heights=[SIZE, 72]), r"height and width: expected multiples of 16"),
        (dict(heights=[]), r"heights and widths: expected at least one size"),
        (dict(batch_sizes=[1, 0]), r"batch_sizes: expected positive integers, got \[1, 0\]"),
        (dict(guidance_scales=[7.0, float("nan")]), r"guidance_scales: expected finite numbers"),
        (dict(num_inference_steps=0), r"num_inference_steps: expected a positive integer, got 0"),
        (
            dict(max_sequence_length=513),
            r"max_sequence_length: expected an integer in \[1, 512\] \(T5 tokens\), got 513",
        ),
        (dict(max_sequence_length=16.0), r"max_sequence_length: expected an integer in \[1, 512\]"),
    ],
    ids=["height", "no-size", "batch", "guidance", "steps", "sequence", "sequence-float"],
)
def test_a_warmup_with_a_bad_argument_is_refused_by_name_before_any_component_runs(
    sd3, arguments, message, refused_runs_nothing
):
    pipe = load(sd3[1])
    # where a list is refused, its first item is good: a check made late would have warmed that one up
    call = {**dict(heights=SIZE, batch_sizes=1, num_inference_steps=1, max_sequence_length=SEQUENCE), **arguments}
    created = pipe.sessions_created
    assert refused_runs_nothing(pipe, ValueError, message, lambda: pipe.warmup(**call))
    assert pipe.sessions_created == created


def test_without_t5_a_warmup_checks_and_takes_max_sequence_length_as_a_call_does(sd3_without_t5, refused_runs_nothing):
    # the T5 part is max_sequence_length tokens of zeros then (diffusers' too): the length still shapes the
    # transformer's input (the graphs it makes are checked in tests/gpu/test_gpu_sd3.py)
    pipe = load(sd3_without_t5[1])
    assert refused_runs_nothing(
        pipe,
        ValueError,
        r"max_sequence_length: expected an integer in \[1, 512\]",
        lambda: pipe.warmup(heights=SIZE, max_sequence_length=0),
    )
    pipe.warmup(heights=SIZE, num_inference_steps=1, max_sequence_length=SEQUENCE)


def test_a_vae_config_without_sd3s_constants_decodes_as_diffusers_sd3_vae(sd3, tmp_path, with_vae_config):
    torch_pipe, folder = sd3
    assert (torch_pipe.vae.config.scaling_factor, torch_pipe.vae.config.shift_factor) == (
        SD3_VAE_SCALING_FACTOR,
        SD3_VAE_SHIFT_FACTOR,
    )
    for name, value in (("absent", ...), ("null", None)):
        pipe = load(with_vae_config(folder, tmp_path / name, scaling_factor=value, shift_factor=value))
        expected, got = both(torch_pipe, pipe, PROMPT, latents=initial_latents(), num_inference_steps=2)
        np.testing.assert_allclose(got, expected, atol=TOLERANCE)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("scaling_factor", 0, r"scaling_factor: expected a positive finite number, got 0"),
        ("scaling_factor", -1.5, r"scaling_factor: expected a positive finite number, got -1.5"),
        ("scaling_factor", "1.5305", r"scaling_factor: expected a positive finite number, got '1.5305'"),
        ("shift_factor", float("nan"), r"shift_factor: expected a finite number, got nan"),
        ("shift_factor", "0.0609", r"shift_factor: expected a finite number, got '0.0609'"),
    ],
    ids=["zero-scale", "negative-scale", "text-scale", "nan-shift", "text-shift"],
)
def test_a_bad_vae_constant_is_refused_by_name_quoting_sd3s(sd3, tmp_path, key, value, message, with_vae_config):
    folder = with_vae_config(sd3[1], tmp_path / "bad", **{key: value})
    with pytest.raises(
        ValueError,
        match=rf"vae_decoder config.json: {message} \(SD3's are scaling_factor 1.5305, "
        r"shift_factor 0.0609\)",
    ):
        load(folder)


def test_an_sd_folder_is_refused_by_the_sd3_pipeline(tiny_folder):
    # the denoiser is looked for first: its absence says the folder is of another family
    with pytest.raises(
        FileNotFoundError, match=r"component 'transformer' is missing.*holds a UNet.*pipeline_class_for"
    ):
        OnnxStableDiffusion3Pipeline.from_pretrained(tiny_folder)


# ------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "call, error, message",
    [
        (dict(height=72), ValueError, r"height and width: expected multiples of 16 .*patch size 2"),
        (dict(max_sequence_length=513), ValueError, r"max_sequence_length: expected an integer in \[1, 512\]"),
        (dict(skip_guidance_layers=[1]), ValueError, "skip_guidance_layers: expected None"),
        (dict(joint_attention_kwargs={"scale": 0.5}), ValueError, "joint_attention_kwargs: expected None"),
        (dict(prompt_2=["a", "b"]), ValueError, r"prompt_2: expected 1 prompt \(as many as prompt\), got 2"),
        (dict(prompt_3=3), TypeError, "prompt_3: expected a str or a list of str, got int"),
        (dict(prompt=5), TypeError, "prompt: expected a str or a list of str, got int 5"),
        (
            dict(callback_on_step_end_tensor_inputs=["noise"]),
            ValueError,
            r"callback_on_step_end_tensor_inputs: expected names among \['latents', 'prompt_embeds', "
            r"'pooled_prompt_embeds'\], got \['noise'\]",
        ),
        (dict(sigmas=[]), ValueError, "sigmas: expected a non-empty list of finite numbers"),
        (dict(num_images_per_prompt=0), ValueError, "num_images_per_prompt: expected a positive integer"),
        (dict(output_type="jpg"), ValueError, "output_type: expected 'pil', 'np', 'pt' or 'latent'"),
    ],
    ids=[
        "size",
        "sequence",
        "skip-layers",
        "attention-kwargs",
        "prompt-2-count",
        "prompt-3-type",
        "prompt-type",
        "callback-names",
        "sigmas",
        "images-per-prompt",
        "output-type",
    ],
)
def test_bad_arguments_are_refused_by_name_before_any_work(sd3, call, error, message):
    pipe = load(sd3[1])
    arguments = dict(height=SIZE, width=SIZE, num_inference_steps=1)
    arguments.update(call)
    with contextlib.ExitStack() as stack:
        runs = [stack.enter_context(model.watch_runs()) for model in pipe.onnx_models.values()]
        with pytest.raises(error, match=message):
            pipe(**{"prompt": PROMPT, **arguments})
    assert not any(runs)  # refused before any component ran


def test_prompt_embeds_without_pooled_embeds_are_refused(sd3):
    pipe = load(sd3[1])
    with pytest.raises(ValueError, match="pooled_prompt_embeds: expected them with prompt_embeds"):
        pipe(prompt_embeds=torch.zeros(1, 77 + SEQUENCE, 64), height=SIZE, width=SIZE, num_inference_steps=1)


def test_pooled_embeds_of_the_wrong_width_are_refused_naming_the_transformer_input(sd3):
    pipe = load(sd3[1])
    with pytest.raises(
        ValueError,
        match=r"pooled_prompt_embeds: expected hidden size 64 \(the width of the "
        r"transformer's pooled_projections\), got 32",
    ):
        pipe(
            prompt_embeds=torch.zeros(1, 77 + SEQUENCE, 64),
            pooled_prompt_embeds=torch.zeros(1, 32),
            height=SIZE,
            width=SIZE,
            num_inference_steps=1,
        )


def test_a_unet_in_the_transformer_folder_is_refused_naming_it(sd3, tiny_folder, tmp_path):
    import shutil

    _, folder = sd3
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    shutil.copy(tiny_folder / "unet" / "model.onnx", broken / "transformer" / "model.onnx")
    with pytest.raises(ValueError, match=r"transformer: expected inputs \['hidden_states', .*a UNet"):
        OnnxStableDiffusion3Pipeline.from_pretrained(broken)


# ---------------------------------------------------------------------------------------------------- optimum
def test_optimums_export_loads_and_matches_diffusers(sd3, tmp_path):
    pytest.importorskip("optimum.exporters.onnx", reason="needs optimum-onnx (the optimum environment)")
    from optimum.exporters.onnx import main_export

    torch_pipe, _ = sd3
    torch_pipe.save_pretrained(tmp_path / "torch")
    main_export(
        model_name_or_path=str(tmp_path / "torch"),
        output=tmp_path / "optimum",
        task="text-to-image",
        do_validation=False,
        no_post_process=True,
    )
    pipe = load(tmp_path / "optimum")
    assert pipe.vae_encoder.output_names == ["latent_parameters"]
    assert pipeline_class_for(tmp_path / "optimum") is OnnxStableDiffusion3Pipeline
    expected, got = both(torch_pipe, pipe, PROMPT, latents=initial_latents())
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_our_export_loads_in_optimums_sd3_pipeline(sd3):
    pytest.importorskip("optimum.onnxruntime", reason="needs optimum-onnx (the optimum environment)")
    from optimum.onnxruntime import ORTStableDiffusion3Pipeline

    torch_pipe, folder = sd3
    theirs = ORTStableDiffusion3Pipeline.from_pretrained(folder)
    theirs.set_progress_bar_config(disable=True)
    expected, got = both(torch_pipe, theirs, PROMPT, latents=initial_latents())
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_one_prompt_2_and_prompt_3_string_serves_every_prompt(sd3):
    _, folder = sd3
    pipe = load(folder)
    call = dict(height=SIZE, width=SIZE, num_inference_steps=2, max_sequence_length=SEQUENCE, output_type="np")
    prompts = [PROMPT, "a red car"]
    one = pipe(prompts, prompt_2="a cat", prompt_3="a dog", latents=initial_latents(2), **call).images
    each = pipe(prompts, prompt_2=["a cat"] * 2, prompt_3=["a dog"] * 2, latents=initial_latents(2), **call).images
    np.testing.assert_allclose(one, each, atol=0)


def test_runtime_lora_is_the_capability_every_family_record_gives_a_diffusers_loader():
    import diffusers.loaders

    from optimum_iobinding.families import FAMILIES, family, pipeline_class

    for record in FAMILIES:
        methods = [hasattr(pipeline_class(record), name) for name in ("load_lora_weights", "set_adapters", "fuse_lora")]
        assert all(methods) if record.lora else not any(methods), record.key
        assert record.lora is None or hasattr(diffusers.loaders, record.lora), record.key
    assert family("sd3").lora == "SD3LoraLoaderMixin" and family("flux").lora == "FluxLoraLoaderMixin"


def test_generate_refuses_a_discrete_time_scheduler_for_sd3_before_loading_it(sd3, tmp_path, capsys):
    assert (
        main(["generate", "a cat", "--model", str(sd3[1]), "--scheduler", "ddim", "--out", str(tmp_path / "cat.png")])
        == 2
    )
    assert "--scheduler: expected none for OnnxStableDiffusion3Pipeline" in capsys.readouterr().err
    assert not (tmp_path / "cat.png").exists()

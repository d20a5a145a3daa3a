"""FLUX.1 (schnell and dev) on the tiny random Flux pipelines, CPU execution provider: our ONNX pipeline against
diffusers' torch ``FluxPipeline`` on the same weights (exported here), with and without binding; the export's layout,
its ORT-optimized, float16 and external-data variants; optimum's Flux export and pipeline both ways (in the optimum
environment)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import PIL.Image
import pytest
import torch

from optimum_iobinding import OnnxFluxPipeline
from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.flux import export_flux_pipeline
from optimum_iobinding.export.tiny import build_tiny_random_flux_pipeline
from optimum_iobinding.export.transformer import EXTERNAL_DATA_FILE
from optimum_iobinding.pipelines import pipeline_class_for
from optimum_iobinding.pipelines.flux import FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR

PROMPTS = ["a photo of an astronaut riding a horse", "a red castle in the forest"]
HEIGHT, WIDTH = 64, 48  # 4 × 3 tokens of 2 × 2 latent pixels: not square, so rows and columns cannot be swapped
# a short T5 length keeps the tiny transformer's text tokens few
CALL = dict(height=HEIGHT, width=WIDTH, num_inference_steps=3, max_sequence_length=16, output_type="np")
# fp32 ONNX Runtime vs fp32 torch on the CPU, a few steps: rounding only
TOLERANCE = 1e-4


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def load(folder, io_binding=True):
    pipe = OnnxFluxPipeline.from_pretrained(folder, io_binding=io_binding)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ------------------------------------------------------------------------------------------------------- export
def test_the_export_has_optimums_flux_layout(schnell, dev):
    for (_, folder), guidance in ((schnell, False), (dev, True)):
        for name in ("text_encoder", "text_encoder_2", "transformer", "vae_encoder", "vae_decoder"):
            assert (folder / name / "model.onnx").is_file() and (folder / name / "config.json").is_file()
        transformer = onnx.load(str(folder / "transformer" / "model.onnx"), load_external_data=False).graph
        inputs = {value.name: value.type.tensor_type.elem_type for value in transformer.input}
        expected = {
            "hidden_states": onnx.TensorProto.FLOAT,
            "encoder_hidden_states": onnx.TensorProto.FLOAT,
            "pooled_projections": onnx.TensorProto.FLOAT,
            "timestep": onnx.TensorProto.FLOAT,
            "txt_ids": onnx.TensorProto.INT64,
            "img_ids": onnx.TensorProto.INT64,
        }
        if guidance:
            expected["guidance"] = onnx.TensorProto.FLOAT
        assert inputs == expected
        assert [value.name for value in transformer.output] == ["out_hidden_states"]
        t5 = onnx.load(str(folder / "text_encoder_2" / "model.onnx")).graph
        assert [value.name for value in t5.output] == ["last_hidden_state"]
        index = json.loads((folder / "model_index.json").read_text())
        assert index["_class_name"] == "FluxPipeline"
        assert index["transformer"] == ["diffusers", "FluxTransformer2DModel"]
        assert index["text_encoder_2"] == ["transformers", "T5EncoderModel"]
        assert index["tokenizer_2"] == ["transformers", "T5TokenizerFast"]


def test_the_export_gives_the_torch_pipeline_back_as_it_was(schnell):
    torch_pipe, _ = schnell
    attention = torch_pipe.transformer.transformer_blocks[0].attn
    assert type(attention.norm_q) is torch.nn.RMSNorm and type(attention.processor).__name__ == "FluxAttnProcessor"
    assert type(torch_pipe.transformer.pos_embed).__name__ == "FluxPosEmbed"


def test_a_vae_or_controlnet_for_a_flux_export_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="vae: expected none for a FLUX.1 pipeline"):
        export_pipeline(None, tmp_path / "out", tiny_random="flux", vae="some/vae", progress=False)
    assert not (tmp_path / "out").exists()


def test_the_tiny_random_kinds_are_schnell_and_dev():
    assert not build_tiny_random_flux_pipeline().transformer.config.guidance_embeds
    assert build_tiny_random_flux_pipeline(guidance_embeds=True).transformer.config.guidance_embeds


def test_a_component_over_the_threshold_gets_its_weights_in_external_data(schnell, tmp_path):
    torch_pipe, folder = schnell
    external = export_flux_pipeline(torch_pipe, tmp_path / "external", progress=False, external_data_threshold=1024)
    for name in ("text_encoder", "text_encoder_2", "transformer", "vae_encoder", "vae_decoder"):
        assert (external / name / EXTERNAL_DATA_FILE).is_file()
        assert not (folder / name / EXTERNAL_DATA_FILE).exists()
    np.testing.assert_allclose(
        load(external)(PROMPTS[0], generator=seeded(), **CALL).images,
        load(folder)(PROMPTS[0], generator=seeded(), **CALL).images,
        atol=TOLERANCE,
    )


def test_an_ort_optimized_export_fuses_the_attention_and_matches_diffusers(dev, tmp_path):
    torch_pipe, _ = dev
    fused = export_pipeline(None, tmp_path / "fused", torch_pipeline=torch_pipe, optimize="cpu", progress=False)
    ops = [node.op_type for node in onnx.load(str(fused / "transformer" / "model.onnx")).graph.node]
    assert ops.count("MultiHeadAttention") == 2  # ORT's MMDiT fusion: the double block's and the single block's
    np.testing.assert_allclose(
        load(fused)(PROMPTS, generator=seeded(), **CALL).images,
        torch_pipe(PROMPTS, generator=seeded(), **CALL).images,
        atol=TOLERANCE,
    )


def test_a_float16_export_keeps_t5_in_float32_converts_the_vae_and_stays_close_to_diffusers(dev, tmp_path):
    torch_pipe, _ = dev
    half = load(export_pipeline(None, tmp_path / "fp16", torch_pipeline=torch_pipe, fp16=True, progress=False))
    assert half.text_encoder_2.output_dtypes["last_hidden_state"] == torch.float32
    assert half.transformer.input_dtypes["hidden_states"] == torch.float16
    assert half.text_encoder.output_dtypes["pooler_output"] == torch.float16
    # the tiny VAE's config says force_upcast (as FLUX.1's does), which diffusers' FluxPipeline never reads: it decodes
    # in the pipeline's dtype, and so does the export
    assert half.vae_decoder.input_dtypes["latent_sample"] == torch.float16
    assert half.vae_decoder.config["force_upcast"] is False
    assert half.transformer.input_dtypes["timestep"] == torch.float16
    np.testing.assert_allclose(
        half(PROMPTS, generator=seeded(), **CALL).images,
        torch_pipe(PROMPTS, generator=seeded(), **CALL).images,
        atol=0.05,
    )


# -------------------------------------------------------------------------------------------- against diffusers
@pytest.mark.parametrize("io_binding", [True, False])
def test_txt2img_matches_diffusers_torch_flux(flux, io_binding):
    torch_pipe, folder = flux
    arguments = dict(CALL, num_images_per_prompt=2, guidance_scale=4.0)
    ours = load(folder, io_binding)(PROMPTS, generator=seeded(), **arguments).images
    theirs = torch_pipe(PROMPTS, generator=seeded(), **arguments).images
    assert ours.shape == (4, HEIGHT, WIDTH, 3)
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE)


def test_the_guidance_scale_reaches_the_dev_transformer(dev):
    _, folder = dev
    pipe = load(folder)
    low = pipe(PROMPTS[0], guidance_scale=1.0, generator=seeded(), **CALL).images
    high = pipe(PROMPTS[0], guidance_scale=8.0, generator=seeded(), **CALL).images
    assert np.abs(low - high).max() > 1e-3


def test_true_cfg_with_negative_prompts_matches_diffusers(flux):
    torch_pipe, folder = flux
    arguments = dict(CALL, negative_prompt=["a blue sky", "a dog"], true_cfg_scale=2.5)
    np.testing.assert_allclose(
        load(folder)(PROMPTS, generator=seeded(), **arguments).images,
        torch_pipe(PROMPTS, generator=seeded(), **arguments).images,
        atol=TOLERANCE,
    )


def test_given_latents_give_diffusers_image(dev):
    torch_pipe, folder = dev
    latents = torch.randn(1, (HEIGHT // 16) * (WIDTH // 16), 64, generator=seeded(3))
    np.testing.assert_allclose(
        load(folder)(PROMPTS[0], latents=latents.numpy(), **CALL).images,
        torch_pipe(PROMPTS[0], latents=latents, **CALL).images,
        atol=TOLERANCE,
    )


def test_a_separate_t5_prompt_and_a_short_sequence_match_diffusers(schnell):
    torch_pipe, folder = schnell
    arguments = dict(CALL, prompt_2="a cat in the city at night", max_sequence_length=6)
    np.testing.assert_allclose(
        load(folder)(PROMPTS[0], generator=seeded(), **arguments).images,
        torch_pipe(PROMPTS[0], generator=seeded(), **arguments).images,
        atol=TOLERANCE,
    )


def test_given_prompt_embeds_give_the_image_of_their_prompts(dev):
    torch_pipe, folder = dev
    with torch.no_grad():
        embeds, pooled, _ = torch_pipe.encode_prompt(PROMPTS, max_sequence_length=16)
    pipe = load(folder)
    given = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled.numpy(), generator=seeded(), **CALL).images
    np.testing.assert_allclose(given, pipe(PROMPTS, generator=seeded(), **CALL).images, atol=TOLERANCE)


def test_explicit_sigmas_match_diffusers(schnell):
    torch_pipe, folder = schnell
    arguments = dict(CALL, sigmas=[1.0, 0.6, 0.25])
    np.testing.assert_allclose(
        load(folder)(PROMPTS[0], generator=seeded(), **arguments).images,
        torch_pipe(PROMPTS[0], generator=seeded(), **arguments).images,
        atol=TOLERANCE,
    )


def test_output_types_pt_pil_and_packed_latents_agree_with_np(dev):
    torch_pipe, folder = dev
    pipe = load(folder)
    as_np = pipe(PROMPTS[0], generator=seeded(), **CALL).images
    as_pt = pipe(PROMPTS[0], generator=seeded(), **dict(CALL, output_type="pt")).images
    as_pil = pipe(PROMPTS[0], generator=seeded(), **dict(CALL, output_type="pil")).images
    latents = pipe(PROMPTS[0], generator=seeded(), **dict(CALL, output_type="latent")).images
    assert isinstance(as_pt, torch.Tensor) and as_pt.shape == (1, 3, HEIGHT, WIDTH)
    np.testing.assert_allclose(as_pt.permute(0, 2, 3, 1).numpy(), as_np, atol=1e-6)
    assert isinstance(as_pil[0], PIL.Image.Image) and as_pil[0].size == (WIDTH, HEIGHT)
    theirs = torch_pipe(PROMPTS[0], generator=seeded(), **dict(CALL, output_type="latent")).images
    assert latents.shape == (1, (HEIGHT // 16) * (WIDTH // 16), 64)
    np.testing.assert_allclose(latents.numpy(), theirs.numpy(), atol=TOLERANCE)


def test_a_step_end_callback_replaces_latents_as_in_diffusers(schnell):
    torch_pipe, folder = schnell
    seen = []

    def halve_at_first_step(pipe, step, timestep, tensors):
        seen.append((step, tuple(tensors["latents"].shape), tuple(tensors["prompt_embeds"].shape)))
        return {"latents": tensors["latents"] * 0.5} if step == 0 else {}

    arguments = dict(
        CALL, callback_on_step_end=halve_at_first_step, callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"]
    )
    ours = load(folder)(PROMPTS[0], generator=seeded(), **arguments).images
    theirs = torch_pipe(PROMPTS[0], generator=seeded(), **arguments).images
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE)
    assert seen[:3] == [(i, (1, 12, 64), (1, 16, 32)) for i in range(3)]


def test_return_dict_false_gives_a_tuple_of_the_images(schnell):
    _, folder = schnell
    (images,) = load(folder)(PROMPTS[0], generator=seeded(), return_dict=False, **CALL)
    assert images.shape == (1, HEIGHT, WIDTH, 3)


def test_a_warmed_up_pipeline_creates_no_session_in_a_call(dev):
    _, folder = dev
    pipe = load(folder)
    pipe.warmup(heights=HEIGHT, widths=WIDTH, batch_sizes=2, max_sequence_length=16)
    created = pipe.sessions_created
    pipe(PROMPTS, generator=seeded(), **CALL)
    assert pipe.sessions_created == created


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(heights=[HEIGHT, 72]), r"height and width: expected multiples of 16"),
        (dict(batch_sizes=[1, 0]), r"batch_sizes: expected positive integers, got \[1, 0\]"),
        (dict(guidance_scales=[3.5, float("inf")]), r"guidance_scales: expected finite numbers"),
        (dict(num_inference_steps=0), r"num_inference_steps: expected a positive integer, got 0"),
        (
            dict(max_sequence_length=513),
            r"max_sequence_length: expected an integer in \[1, 512\] \(T5 tokens\), got 513",
        ),
    ],
    ids=["height", "batch", "guidance", "steps", "sequence"],
)
def test_a_warmup_with_a_bad_argument_is_refused_by_name_before_any_component_runs(
    schnell, arguments, message, refused_runs_nothing
):
    _, folder = schnell
    pipe = load(folder)
    # where a list is refused, its first item is good: a check made late would have warmed that one up
    call = {**dict(heights=HEIGHT, widths=WIDTH, num_inference_steps=1, max_sequence_length=16), **arguments}
    created = pipe.sessions_created
    assert refused_runs_nothing(pipe, ValueError, message, lambda: pipe.warmup(**call))
    assert pipe.sessions_created == created


def test_a_vae_config_without_flux_constants_decodes_as_diffusers_flux_vae(schnell, tmp_path, with_vae_config):
    torch_pipe, folder = schnell
    assert (torch_pipe.vae.config.scaling_factor, torch_pipe.vae.config.shift_factor) == (
        FLUX_VAE_SCALING_FACTOR,
        FLUX_VAE_SHIFT_FACTOR,
    )
    pipe = load(with_vae_config(folder, tmp_path / "bare", scaling_factor=..., shift_factor=...))
    np.testing.assert_allclose(
        pipe(PROMPTS[0], generator=seeded(), **CALL).images,
        torch_pipe(PROMPTS[0], generator=seeded(), **CALL).images,
        atol=TOLERANCE,
    )


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("scaling_factor", 0, r"scaling_factor: expected a positive finite number, got 0"),
        ("shift_factor", float("nan"), r"shift_factor: expected a finite number, got nan"),
    ],
    ids=["zero-scale", "nan-shift"],
)
def test_a_bad_vae_constant_is_refused_by_name_quoting_flux(schnell, tmp_path, key, value, message, with_vae_config):
    folder = with_vae_config(schnell[1], tmp_path / "bad", **{key: value})
    with pytest.raises(
        ValueError,
        match=rf"vae_decoder config.json: {message} \(FLUX.1's are scaling_factor "
        r"0.3611, shift_factor 0.1159\)",
    ):
        load(folder)


def test_save_pretrained_round_trips(dev, tmp_path):
    _, folder = dev
    pipe = load(folder)
    pipe.save_pretrained(tmp_path / "saved")
    again = load(tmp_path / "saved")
    np.testing.assert_array_equal(
        pipe(PROMPTS[0], generator=seeded(), **CALL).images, again(PROMPTS[0], generator=seeded(), **CALL).images
    )


# ------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(height=72), "height and width: expected multiples of 16"),
        (dict(width=40), "height and width: expected multiples of 16"),
        (dict(height=0), "height: expected a positive integer"),
        (dict(max_sequence_length=513), "max_sequence_length: expected an integer in [1, 512]"),
        (dict(num_inference_steps=0), "num_inference_steps: expected a positive integer"),
        (dict(output_type="tensor"), "output_type: expected 'pil', 'np', 'pt' or 'latent'"),
        (dict(guidance_scale=float("nan")), "guidance_scale: expected a finite number"),
        (dict(num_images_per_prompt=0), "num_images_per_prompt: expected a positive integer"),
        (dict(prompt_2=["a", "b", "c"]), "prompt_2: expected 2 prompts"),
        (dict(negative_prompt=["a"], true_cfg_scale=2.0), "negative_prompt: expected 2 prompts"),
        (dict(joint_attention_kwargs={"scale": 0.5}), "joint_attention_kwargs: expected None"),
        (dict(sigmas=[]), "sigmas: expected a non-empty list"),
        (dict(latents=np.zeros((2, 12, 60), np.float32)), "latents: expected packed latents of shape (2, 12, 64)"),
        (
            dict(generator=[seeded()]),
            "generator: expected one torch.Generator per image (2: 2 prompts × num_images_per_prompt 1), got a list "
            "of 1",
        ),
        (dict(callback_on_step_end_tensor_inputs=["noise"]), "callback_on_step_end_tensor_inputs"),
    ],
)
def test_bad_arguments_are_refused_by_name(schnell, arguments, message):
    _, folder = schnell
    with pytest.raises(ValueError) as error:
        load(folder)(PROMPTS, **{**CALL, **arguments})
    assert message in str(error.value)


def test_prompt_embeds_without_pooled_embeds_are_refused(schnell):
    _, folder = schnell
    with pytest.raises(ValueError, match="pooled_prompt_embeds: expected them with prompt_embeds"):
        load(folder)(prompt_embeds=torch.zeros(1, 16, 32), **CALL)


def test_prompt_embeds_of_the_wrong_width_name_the_transformers_width(schnell):
    _, folder = schnell
    with pytest.raises(
        ValueError,
        match=r"prompt_embeds: expected hidden size 32 \(the width of the "
        r"transformer's encoder_hidden_states\), got 48",
    ):
        load(folder)(prompt_embeds=torch.zeros(1, 16, 48), pooled_prompt_embeds=torch.zeros(1, 32), **CALL)


def test_a_prompt_list_with_a_non_string_names_the_item(schnell):
    _, folder = schnell
    with pytest.raises(TypeError, match=r"prompt\[1\]: expected a str, got int"):
        load(folder)(["a cat", 3], **CALL)


def test_a_stable_diffusion_folder_is_refused_naming_the_missing_transformer(tiny_folder):
    with pytest.raises(FileNotFoundError, match="component 'transformer' is missing: .* holds a UNet"):
        OnnxFluxPipeline.from_pretrained(tiny_folder)


# --------------------------------------------------------------------------------------------- generate, CLI
def test_generate_picks_the_flux_pipeline_from_the_folder(schnell, tmp_path, capsys):
    from optimum_iobinding.cli import main as cli_main

    _, folder = schnell
    assert pipeline_class_for(folder) is OnnxFluxPipeline
    out = tmp_path / "flux.png"
    assert (
        cli_main(
            [
                "generate",
                "a cat",
                "--model",
                str(folder),
                "--steps",
                "1",
                "--height",
                "32",
                "--width",
                "32",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "OnnxFluxPipeline" in capsys.readouterr().out and PIL.Image.open(out).size == (32, 32)


def test_the_cli_exports_a_tiny_flux_dev_offline(tmp_path):
    from optimum_iobinding.cli import main as cli_main

    assert cli_main(["export", "--tiny-random", "flux-dev", "--output", str(tmp_path / "flux")]) == 0
    pipe = load(tmp_path / "flux")
    assert pipe.guidance_embeds
    assert pipe(PROMPTS[0], generator=seeded(), **CALL).images.shape == (1, HEIGHT, WIDTH, 3)


# -------------------------------------------------------------------------------------------------- optimum
def test_optimums_flux_pipeline_runs_our_export_to_diffusers_image(dev):
    ort_diffusion = pytest.importorskip("optimum.onnxruntime", reason="needs the optimum-onnx environment")
    torch_pipe, folder = dev
    theirs = ort_diffusion.ORTFluxPipeline.from_pretrained(str(folder))
    theirs.set_progress_bar_config(disable=True)
    np.testing.assert_allclose(
        theirs(PROMPTS, generator=seeded(), guidance_scale=4.0, **CALL).images,
        torch_pipe(PROMPTS, generator=seeded(), guidance_scale=4.0, **CALL).images,
        atol=TOLERANCE,
    )


def test_an_optimum_cli_flux_export_loads_unchanged_and_gives_diffusers_image(dev, tmp_path):
    exporters = pytest.importorskip("optimum.exporters.onnx", reason="needs the optimum-onnx environment")
    torch_pipe, _ = dev
    torch_pipe.save_pretrained(tmp_path / "torch")
    exporters.main_export(str(tmp_path / "torch"), output=str(tmp_path / "onnx"), task="text-to-image")
    assert pipeline_class_for(tmp_path / "onnx") is OnnxFluxPipeline
    np.testing.assert_allclose(
        load(tmp_path / "onnx")(PROMPTS, generator=seeded(), guidance_scale=4.0, **CALL).images,
        torch_pipe(PROMPTS, generator=seeded(), guidance_scale=4.0, **CALL).images,
        atol=TOLERANCE,
    )


def test_given_prompt_embeds_shorter_than_max_sequence_length_take_a_text_negative_prompt(dev):
    torch_pipe, folder = dev
    with torch.no_grad():
        embeds, pooled, _ = torch_pipe.encode_prompt(PROMPTS, max_sequence_length=16)
    pipe = load(folder)
    arguments = dict(CALL, negative_prompt=["a blue sky", "a dog"], true_cfg_scale=2.5)
    longer = dict(arguments, max_sequence_length=32)  # the embeddings have 16 tokens
    given = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, generator=seeded(), **longer).images
    from_text = pipe(PROMPTS, generator=seeded(), **arguments).images  # prompt and negative at 16 tokens
    np.testing.assert_allclose(given, from_text, atol=TOLERANCE)


def test_generate_refuses_a_negative_prompt_flux_would_ignore_and_takes_its_default_guidance(dev, tmp_path, capsys):
    from optimum_iobinding.cli import main

    folder = str(dev[1])
    assert (
        main(
            [
                "generate",
                "a cat",
                "--model",
                folder,
                "--negative-prompt",
                "a dog",
                "--height",
                "64",
                "--width",
                "64",
                "--out",
                str(tmp_path / "cat.png"),
            ]
        )
        == 2
    )
    assert "--negative-prompt: expected none for OnnxFluxPipeline" in capsys.readouterr().err
    assert (
        main(
            [
                "generate",
                "a cat",
                "--model",
                folder,
                "--steps",
                "2",
                "--height",
                "64",
                "--width",
                "64",
                "--out",
                str(tmp_path / "cat.png"),
            ]
        )
        == 0
    )
    assert (tmp_path / "cat.png").is_file()

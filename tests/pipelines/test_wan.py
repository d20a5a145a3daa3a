"""Wan text to video on the tiny random Wan pipelines, CPU execution provider: our ONNX pipeline against diffusers'
torch ``WanPipeline`` on the same weights (Wan 2.1; Wan 2.2's two experts; TI2V's per-token timesteps), at several
frame counts and sizes from one export; the export's transformer graph (ORT's RotaryEmbedding, no ScatterND,
ORT's MultiHeadAttention); First-Block Cache against diffusers' own hook on its torch pipeline (each expert its own
parts and state); refusals before any work; detection of a Wan folder."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import onnx
import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig

from optimum_iobinding import OnnxWanPipeline
from optimum_iobinding.errors import ArgumentError, ModelFileError
from optimum_iobinding.families import WAN_INPUTS, WAN_TEXT_INPUTS, detect, family
from optimum_iobinding.pipelines import pipeline_class_for
from optimum_iobinding.pipelines.auto import denoiser_inputs
from optimum_iobinding.pipelines.loop import Guidance, Stage, denoise

PROMPTS = ["a photo of a cat", "a red castle in the forest"]
SEQUENCE = 16  # UMT5 tokens: few, to keep the transformer's cross-attention small
# fp32 ONNX Runtime vs fp32 torch on the CPU, a few steps: rounding only
TOLERANCE = 1e-4
# (height, width, num_frames): 1 × 1 and 2 × 1 patches of latent pixels, 2 and 3 latent frames
SHAPES = [(16, 16, 5), (32, 16, 9)]


# what the exports that make latents only hold: no VAE (faster to export; such a folder refuses decoded outputs)
WITHOUT_VAE = ("text_encoder", "transformer", "transformer_2")


def export_of(shared_export, name, torch_pipe, components=None):
    from optimum_iobinding.export import export_pipeline

    torch_pipe.set_progress_bar_config(disable=True)
    if components is not None:
        components = [name for name in components if getattr(torch_pipe, name, None) is not None]
    return shared_export(
        name,
        lambda target: export_pipeline(None, target, torch_pipeline=torch_pipe, components=components, progress=False),
    )


@pytest.fixture(scope="module")
def wan(shared_export):
    """The tiny random Wan 2.1 pipeline: diffusers' torch pipeline and its export (shared with ``export
    --tiny-random wan``'s: the builder is seeded)."""
    from optimum_iobinding.export.tiny import build_tiny_random_wan_pipeline

    torch_pipe = build_tiny_random_wan_pipeline()
    return torch_pipe, export_of(shared_export, "tiny-random-wan", torch_pipe)


@pytest.fixture(scope="module")
def wan22(shared_export):
    """The tiny random Wan 2.2 pipeline (two experts, switched at a boundary ratio of 0.875) and its export without
    the VAE."""
    from optimum_iobinding.export.tiny import build_tiny_random_wan_pipeline

    torch_pipe = build_tiny_random_wan_pipeline(two_experts=True)
    return torch_pipe, export_of(shared_export, "wan2.2-without-vae", torch_pipe, WITHOUT_VAE)


def load(folder, **options):
    pipe = OnnxWanPipeline.from_pretrained(folder, **options)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def loaded():
    """``loaded(folder)``: our pipeline of ``folder`` with the default options, one per folder and module (loading
    makes every component's sessions; the calls of these tests change nothing a later call reads)."""
    pipes = {}

    def get(folder):
        if folder not in pipes:
            pipes[folder] = load(folder)
        return pipes[folder]

    return get


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def both(torch_pipe, pipe, prompt=PROMPTS, **kwargs):
    """The frames (by default the latent videos) of the same call of diffusers' torch pipeline and ours."""
    call = dict(
        height=16, width=16, num_frames=5, num_inference_steps=3, max_sequence_length=SEQUENCE, output_type="latent"
    )
    call.update(kwargs)
    theirs = torch_pipe(prompt, generator=seeded(), **call).frames
    ours = pipe(prompt, generator=seeded(), **call).frames
    return theirs, ours


# ------------------------------------------------------------------------------------------------------ export
def test_the_export_writes_the_umt5_encoder_and_the_transformer_with_every_axis_but_the_channels_dynamic(wan, loaded):
    _, folder = wan
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert index["transformer"] == ["diffusers", "WanTransformer3DModel"]
    assert index["text_encoder"] == ["transformers", "UMT5EncoderModel"]
    assert index["boundary_ratio"] is None and index["expand_timesteps"] is False
    pipe = loaded(folder)
    assert pipe.text_encoder.input_names == list(WAN_TEXT_INPUTS)
    assert pipe.transformer.input_names == list(WAN_INPUTS)
    assert pipe.transformer.input_dims["hidden_states"] == ["batch", 16, "frames", "height", "width"]
    assert pipe.transformer.input_dims["encoder_hidden_states"] == ["batch", "sequence", 32]
    assert pipe.transformer.input_dims["timestep"] == ["batch"]


def test_the_exported_transformer_rotates_and_attends_with_ort_rotary_embedding_and_multi_head_attention(wan):
    _, folder = wan
    ops = [node.op_type for node in onnx.load(str(folder / "transformer" / "model.onnx")).graph.node]
    assert "ScatterND" not in ops  # diffusers' strided assignment of the rotated halves would export to it
    assert ops.count("RotaryEmbedding") == 4  # each of the two blocks: its self-attention's queries and keys
    assert ops.count("MultiHeadAttention") == 4  # each of the two blocks: self-attention and cross-attention
    assert "Softmax" not in ops


def test_the_names_the_wan_export_writes_and_its_pipelines_read_are_declared_once_in_families():
    import ast
    import inspect

    from optimum_iobinding import families
    from optimum_iobinding.export import wan as wan_export
    from optimum_iobinding.pipelines import wan as wan_pipeline
    from optimum_iobinding.pipelines import wan_i2v

    assert OnnxWanPipeline.settings == families.WAN_SETTINGS
    for module in (wan_export, wan_pipeline, wan_i2v):
        assert module.WAN_TEXT_CONTEXT is families.WAN_TEXT_CONTEXT
        literals = [
            node.value for node in ast.walk(ast.parse(inspect.getsource(module))) if isinstance(node, ast.Constant)
        ]
        assert {512, "pixel_values", "boundary_ratio"}.isdisjoint(literals), module.__name__


def test_the_export_gives_the_torch_pipeline_back_as_it_was(wan):
    torch_pipe, _ = wan
    transformer = torch_pipe.transformer
    assert type(transformer.rope).__name__ == "WanRotaryPosEmbed"
    assert {type(p).__name__ for p in transformer.attn_processors.values()} == {"WanAttnProcessor"}


# -------------------------------------------------------------------------------------------- against diffusers
@pytest.mark.parametrize("height,width,num_frames", SHAPES, ids=[f"{h}x{w}x{f}" for h, w, f in SHAPES])
def test_text_to_video_matches_diffusers_torch_wan_at_each_size_and_frame_count(wan, height, width, num_frames, loaded):
    torch_pipe, folder = wan
    pipe = loaded(folder)
    size = dict(height=height, width=width, num_frames=num_frames, num_videos_per_prompt=2)
    theirs, ours = both(torch_pipe, pipe, **size)
    assert tuple(ours.shape) == (4, 16, (num_frames - 1) // 4 + 1, height // 8, width // 8)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=TOLERANCE)
    theirs, ours = both(torch_pipe, pipe, output_type="np", **size)
    assert ours.shape == (4, num_frames, height, width, 3) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE)


def test_each_output_type_is_diffusers(wan, loaded):
    torch_pipe, folder = wan
    pipe = loaded(folder)
    frames = both(torch_pipe, pipe, PROMPTS[0], output_type="np")[1]
    assert 0.0 <= frames.min() and frames.max() <= 1.0
    theirs, ours = both(torch_pipe, pipe, PROMPTS[0], output_type="pt")
    assert isinstance(ours, torch.Tensor) and tuple(ours.shape) == (1, 5, 3, 16, 16)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=TOLERANCE)
    np.testing.assert_allclose(ours.permute(0, 1, 3, 4, 2).numpy(), frames, atol=1e-6)
    theirs, ours = both(torch_pipe, pipe, PROMPTS[0], output_type="pil")
    assert len(ours) == 1 and len(ours[0]) == 5 and ours[0][0].size == (16, 16)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(ours[0], theirs[0]))
    (as_tuple,) = pipe(
        PROMPTS[0],
        generator=seeded(),
        num_frames=5,
        height=16,
        width=16,
        num_inference_steps=3,
        max_sequence_length=SEQUENCE,
        return_dict=False,
    )
    np.testing.assert_array_equal(as_tuple, frames)


@pytest.mark.parametrize("io_binding", [True, False])
def test_without_guidance_and_without_binding_it_matches_diffusers(wan, io_binding):
    torch_pipe, folder = wan
    theirs, ours = both(torch_pipe, load(folder, io_binding=io_binding), PROMPTS[0], guidance_scale=1.0)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=TOLERANCE)


def test_a_negative_prompt_and_given_embeddings_match_diffusers(wan, loaded):
    torch_pipe, folder = wan
    pipe = loaded(folder)
    theirs, ours = both(torch_pipe, pipe, PROMPTS, negative_prompt=["blurry", "dark &amp; grey  "])
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=TOLERANCE)
    embeds, negative = pipe.encode_prompt(PROMPTS, "blurry", True, 1, max_sequence_length=SEQUENCE)
    theirs, ours = both(torch_pipe, pipe, None, prompt_embeds=embeds, negative_prompt_embeds=negative)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=TOLERANCE)


def test_a_str_negative_prompt_serves_every_prompt_and_a_str_prompt_takes_a_list_of_one_as_in_diffusers(wan, loaded):
    torch_pipe, folder = wan
    pipe = loaded(folder)
    for prompt, negative_prompt in ((PROMPTS, "blurry"), (PROMPTS[0], ["blurry"])):
        theirs, ours = both(torch_pipe, pipe, prompt, negative_prompt=negative_prompt, num_inference_steps=1)
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=TOLERANCE)


def test_a_step_end_callback_replaces_the_latents_and_negative_embeddings_as_diffusers_does(wan, loaded):
    torch_pipe, folder = wan
    seen = []

    def damp(pipe, step, timestep, tensors):
        seen.append((step, sorted(tensors)))
        return {"latents": tensors["latents"] * 0.9, "negative_prompt_embeds": tensors["negative_prompt_embeds"] * 2}

    names = ["latents", "negative_prompt_embeds"]
    theirs, ours = both(torch_pipe, loaded(folder), callback_on_step_end=damp, callback_on_step_end_tensor_inputs=names)
    assert seen == [(step, names) for step in range(3)] * 2
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=TOLERANCE)


def test_wan22_runs_the_low_noise_expert_below_the_boundary_as_diffusers_does(wan22, loaded):
    torch_pipe, folder = wan22
    pipe = loaded(folder)
    assert pipe.config.boundary_ratio == 0.875
    with pipe.transformer.watch_runs() as high, pipe.transformer_2.watch_runs() as low:
        theirs, ours = both(torch_pipe, pipe, num_inference_steps=4, guidance_scale=4.0, guidance_scale_2=2.0)
    # UniPC's timesteps 999, 900, 750, 500: two at or above 875, two below
    assert (len(high), len(low)) == (2, 2)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=TOLERANCE)


@pytest.mark.parametrize("fixture", ["wan", "wan22"])
def test_a_saved_pipeline_loads_again_with_its_experts_and_boundary_and_gives_the_same_video(
    request, fixture, tmp_path, loaded
):
    _, folder = request.getfixturevalue(fixture)
    pipe = loaded(folder)
    decodes = pipe.vae_decoder is not None
    call = dict(num_frames=5, height=16, width=16, num_inference_steps=3, max_sequence_length=SEQUENCE)
    call["output_type"] = "np" if decodes else "latent"
    expected = pipe(PROMPTS[0], generator=seeded(), **call).frames
    pipe.save_pretrained(tmp_path / "saved")
    again = load(tmp_path / "saved")
    assert again.config.boundary_ratio == pipe.config.boundary_ratio
    assert (again.transformer_2 is None) == (pipe.transformer_2 is None)
    assert (again.vae_decoder is None) == (not decodes)  # with its VAE's chunk graphs, where it has one
    np.testing.assert_array_equal(
        np.asarray(again(PROMPTS[0], generator=seeded(), **call).frames), np.asarray(expected)
    )


def test_the_same_generator_gives_the_same_video_and_another_another_one(wan, loaded):
    pipe = loaded(wan[1])
    call = dict(num_frames=5, height=16, width=16, num_inference_steps=2, max_sequence_length=SEQUENCE)
    first = pipe(PROMPTS[0], generator=seeded(0), **call).frames
    np.testing.assert_array_equal(pipe(PROMPTS[0], generator=seeded(0), **call).frames, first)
    assert not np.array_equal(pipe(PROMPTS[0], generator=seeded(1), **call).frames, first)


def test_after_warmup_the_next_call_makes_no_session(wan, loaded):
    pipe = loaded(wan[1])
    pipe.warmup(heights=16, widths=32, num_inference_steps=2, num_frames=9, max_sequence_length=SEQUENCE)
    made = pipe.sessions_created
    pipe(PROMPTS[0], height=16, width=32, num_frames=9, num_inference_steps=2, max_sequence_length=SEQUENCE)
    assert pipe.sessions_created == made


def test_a_warmup_of_a_frame_count_the_vae_cannot_make_is_refused_before_any_work(wan, loaded):
    pipe = loaded(wan[1])
    with contextlib.ExitStack() as stack:
        runs = [stack.enter_context(model.watch_runs()) for model in pipe.onnx_models.values()]
        with pytest.raises(ValueError, match="num_frames: expected a positive integer of the form 4k"):
            pipe.warmup(heights=16, num_frames=8)
    assert not any(runs)


def test_ti2v_per_token_timesteps_match_diffusers(shared_export):
    from optimum_iobinding.export.tiny import build_tiny_random_wan_pipeline

    torch_pipe = build_tiny_random_wan_pipeline(expand_timesteps=True, scheduler="euler")
    pipe = load(export_of(shared_export, "wan-ti2v-without-vae", torch_pipe, WITHOUT_VAE))
    assert pipe.transformer.input_dims["timestep"] == ["batch", "tokens"]
    theirs, ours = both(torch_pipe, pipe, height=32, width=16, num_frames=9)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=TOLERANCE)


# ---------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "call,message",
    [
        (dict(num_frames=6), r"num_frames: expected a positive integer of the form 4k \+ 1 .*got 6; e.g. 5 or 9"),
        (dict(num_frames=0), "num_frames: expected a positive integer of the form 4k"),
        (dict(height=24), "height and width: expected multiples of 16"),
        (dict(guidance_scale_2=3.0), "guidance_scale_2: expected None for a pipeline of one transformer"),
        (dict(attention_kwargs={"scale": 0.5}), "attention_kwargs: expected None"),
        (dict(num_videos_per_prompt=0), "num_videos_per_prompt: expected a positive integer"),
        (dict(max_sequence_length=513), r"max_sequence_length: expected an integer in \[1, 512\]"),
        (dict(callback_on_step_end_tensor_inputs=["noise"]), "callback_on_step_end_tensor_inputs: expected names"),
        (
            dict(generator=[seeded(), seeded()]),
            r"generator: expected one torch.Generator per video \(1: 1 prompt × num_videos_per_prompt 1\), got a "
            r"list of 2",
        ),
        (dict(num_inference_steps=0), "num_inference_steps: expected a positive integer, got 0"),
    ],
    ids=[
        "frames-not-4k+1",
        "no-frames",
        "height",
        "guidance-scale-2",
        "attention-kwargs",
        "videos",
        "sequence",
        "callback-tensor",
        "generators",
        "steps",
    ],
)
def test_a_call_it_cannot_run_is_refused_by_name_before_any_component_runs(wan, call, message, loaded):
    pipe = loaded(wan[1])
    arguments = dict(height=16, width=16, num_frames=5, num_inference_steps=1, output_type="latent")
    arguments.update(call)
    with contextlib.ExitStack() as stack:
        runs = [stack.enter_context(model.watch_runs()) for model in pipe.onnx_models.values()]
        with pytest.raises(ValueError, match=message):
            pipe(PROMPTS[0], **arguments)
    assert not any(runs)


def test_a_decoded_output_of_a_folder_without_a_vae_is_refused_before_any_component_runs(wan22, loaded):
    pipe = loaded(wan22[1])
    with contextlib.ExitStack() as stack:
        runs = [stack.enter_context(model.watch_runs()) for model in pipe.onnx_models.values()]
        with pytest.raises(ValueError, match="output_type: expected 'latent' for a folder without vae_decoder"):
            pipe(PROMPTS[0], height=16, width=16, num_frames=5, output_type="np")
    assert not any(runs)


def test_given_prompt_embeds_of_another_length_than_the_negative_prompts_are_refused(wan, loaded):
    pipe = loaded(wan[1])
    with pytest.raises(ValueError, match="max_sequence_length: expected 8, the length of prompt_embeds"):
        pipe(
            prompt_embeds=torch.zeros(1, 8, 32),
            num_frames=5,
            height=16,
            width=16,
            max_sequence_length=SEQUENCE,
            output_type="latent",
        )


def test_given_negative_prompt_embeds_of_another_length_than_the_prompts_are_refused_before_any_work(wan, loaded):
    pipe = loaded(wan[1])
    with contextlib.ExitStack() as stack:
        runs = [stack.enter_context(model.watch_runs()) for model in pipe.onnx_models.values()]
        with pytest.raises(
            ValueError, match=r"negative_prompt_embeds: expected sequence length 16 .*got shape \(1, 8, 32\)"
        ):
            pipe(
                PROMPTS[0],
                negative_prompt_embeds=torch.zeros(1, 8, 32),
                num_frames=5,
                height=16,
                width=16,
                max_sequence_length=SEQUENCE,
                output_type="latent",
            )
    assert not any(runs)


def test_a_boundary_ratio_without_the_low_noise_expert_is_a_model_file_error(wan, loaded):
    components = loaded(wan[1]).components
    with pytest.raises(ModelFileError, match="model_index.json: boundary_ratio 0.5 needs Wan 2.2's low-noise expert"):
        OnnxWanPipeline(**components, boundary_ratio=0.5)


def test_a_later_stage_guided_in_another_batch_is_refused_naming_stages(wan22, loaded):
    pipe = loaded(wan22[1])
    embeds = torch.zeros(1, SEQUENCE, 32)
    later = Stage(1, pipe.transformer_2, Guidance(1.0, batched=False))
    with pytest.raises(ArgumentError, match="stages: expected guidance that batches as the first stage's"):
        denoise(
            pipe.denoiser,
            torch.zeros(1, 16, 2, 2, 2),
            torch.tensor([999.0, 500.0]),
            tensors={"prompt_embeds": embeds, "negative_prompt_embeds": embeds},
            guidance=Guidance(5.0, batched=True),
            stages=[later],
        )


def test_first_block_cache_on_a_folder_exported_without_its_parts_says_how_to_export_them(wan, loaded):
    pipe = loaded(wan[1])
    with pytest.raises(ValueError, match=r"lacks \['head.onnx', 'body.onnx', 'out.onnx'\]; export the pipeline with"):
        pipe.enable_cache(FirstBlockCacheConfig(threshold=0.1))
    assert pipe.step_cache is None


# --------------------------------------------------------------------------------------------------- detection
def test_a_wan_folder_is_detected_by_its_class_name_and_by_its_transformers_inputs(wan22):
    _, folder = wan22
    assert pipeline_class_for(folder) is OnnxWanPipeline
    inputs, channels = denoiser_inputs(folder)
    assert detect("WanPipeline", inputs, channels) is family("wan")
    assert detect("SomeFinetunedWanPipeline", inputs, channels) is family("wan")


def readers_of(graph, value):
    return [node for node in graph.node if value in node.input]


def test_an_ort_optimized_export_keeps_the_multi_head_attention_and_matches_diffusers(wan, tmp_path):
    from optimum_iobinding.export import export_pipeline

    torch_pipe, _ = wan
    fused = export_pipeline(
        None, tmp_path / "fused", torch_pipeline=torch_pipe, optimize="cpu", components=WITHOUT_VAE[:2], progress=False
    )
    graph = onnx.load(str(fused / "transformer" / "model.onnx"), load_external_data=False).graph
    ops = [node.op_type for node in graph.node]
    assert ops.count("MultiHeadAttention") == 4 and "FastGelu" in ops and "ScatterND" not in ops
    # the modulations LayerNorm(x) · (1 + scale) + shift, each one LayerNormalization reading the modulation as its
    # scale and bias: each block's two and the output norm's (the project's rewrites, given ORT's shape inference)
    norms = [node for node in graph.node if node.op_type == "LayerNormalization"]
    assert len([norm for norm in norms if norm.name.endswith("/modulated")]) == 5
    assert not {"Mul", "Add"} & {reader.op_type for norm in norms for reader in readers_of(graph, norm.output[0])}
    theirs, ours = both(torch_pipe, load(fused), height=16, width=32)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=TOLERANCE)


def test_cuda_graph_true_asks_graphs_of_the_transformer_only_and_component_options_override_it(wan):
    # on the CPU no graph can be captured: True is an error for the denoiser only
    with pytest.raises(ValueError, match="cuda_graph: needs a CUDA session with io_binding=True, got device cpu"):
        load(wan[1], cuda_graph=True)
    # the pipeline's True asks graphs of the transformer only: the other components capture where they can ("auto"),
    # and each component's own option overrides the pipeline's
    options = {"transformer": {"cuda_graph": "auto"}, "text_encoder": {"cuda_graph": False}}
    pipe = load(wan[1], cuda_graph=True, component_options=options)
    settings = {name: model.options.cuda_graph for name, model in pipe.onnx_models.items()}
    assert settings == {"text_encoder": False, "transformer": "auto", "vae_decoder": "auto", "vae_encoder": "auto"}


def test_vae_tiling_decodes_tile_by_tile_as_diffusers_vae_tiling_does(wan):
    torch_pipe, folder = wan
    pipe = load(folder)
    sizes = dict(tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=8,
                 tile_sample_stride_width=8)  # fmt: skip
    call = dict(height=32, width=48, output_type="np")
    _, untiled = both(torch_pipe, pipe, **call)
    pipe.enable_vae_tiling(**sizes)
    assert pipe.vae_tiling == sizes
    torch_pipe.vae.enable_tiling(**sizes)
    try:
        theirs, ours = both(torch_pipe, pipe, **call)
    finally:
        torch_pipe.vae.disable_tiling()
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE)
    assert np.abs(ours - untiled).max() > 100 * TOLERANCE  # the tiles did blend
    pipe.disable_vae_tiling()
    assert pipe.vae_tiling is None
    with pytest.raises(ValueError, match="tile_sample_stride_height: expected a positive multiple of 8"):
        pipe.enable_vae_tiling(tile_sample_stride_height=12)


# ---------------------------------------------------------------------------------------------- First-Block Cache
# thresholds for the tiny random transformers: under every step's change of the first block's residual (every step
# computes), and between them (some steps skip); a negative prompt's states made far from the prompt's change less per
# step, so that the guided batch's two halves decide apart at some steps
NEVER, SOME = 0.05, 0.1
CACHE_CALL = dict(height=16, width=16, num_frames=5, num_inference_steps=6, max_sequence_length=SEQUENCE)


@pytest.fixture(scope="module")
def wan_parts(wan, shared_export):
    """Diffusers' tiny random Wan 2.1 pipeline and its export with First-Block Cache's parts (no VAE)."""
    torch_pipe, _ = wan
    return torch_pipe, export_of_parts(shared_export, "wan-step-cache", torch_pipe)


@pytest.fixture(scope="module")
def wan22_parts(wan22, shared_export):
    """Diffusers' tiny random Wan 2.2 pipeline (two experts) and its export with each expert's parts (no VAE)."""
    torch_pipe, _ = wan22
    return torch_pipe, export_of_parts(shared_export, "wan2.2-step-cache", torch_pipe)


def export_of_parts(shared_export, name, torch_pipe):
    from optimum_iobinding.export import export_pipeline

    components = [name for name in WITHOUT_VAE if getattr(torch_pipe, name, None) is not None]
    return shared_export(
        name,
        lambda target: export_pipeline(
            None, target, torch_pipeline=torch_pipe, components=components, progress=False, step_cache=True
        ),
    )


def skip_without_diffusers_wan_cache() -> None:
    """diffusers before 0.42 runs its First-Block Cache hook on Wan's blocks outside the cache context its pipeline
    sets ("No context is set"): there is no oracle to compare with there."""
    import diffusers
    from packaging.version import Version

    if Version(diffusers.__version__) < Version("0.42"):
        pytest.skip(f"diffusers {diffusers.__version__}'s First-Block Cache does not run on its own WanPipeline")


def diffusers_cached(torch_pipe, threshold, **call):
    """Diffusers' torch pipeline with its own First-Block Cache on each transformer: its latents and, per step, for
    the negative prompt's call and then the prompt's (one call without guidance), whether its last block ran."""
    skip_without_diffusers_wan_cache()
    transformers = [t for t in (torch_pipe.transformer, getattr(torch_pipe, "transformer_2", None)) if t is not None]
    calls, ran = [], set()
    handles = []
    for transformer in transformers:
        handles.append(transformer.register_forward_pre_hook(lambda *_: calls.append(len(calls))))
        handles.append(transformer.blocks[-1].ffn.register_forward_hook(lambda *_: ran.add(len(calls) - 1)))
        transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    try:
        latents = torch_pipe(generator=seeded(), output_type="latent", **call).frames
    finally:
        for transformer in transformers:
            transformer.disable_cache()
        for handle in handles:
            handle.remove()
    per_step = 2 if call.get("guidance_scale", 5.0) > 1.0 else 1
    computed = [tuple(c in ran for c in reversed(calls[i : i + per_step])) for i in range(0, len(calls), per_step)]
    return latents, computed  # diffusers calls the prompt's branch first, the negative one second


def cached_call(pipe, threshold, **call):
    pipe.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    try:
        return pipe(generator=seeded(), output_type="latent", **call).frames, pipe.step_cache.computed_by_group
    finally:
        pipe.disable_cache()


def test_the_step_cache_export_writes_each_experts_parts_with_the_full_exports_attention_and_dynamic_axes(
    wan22_parts,
):
    _, folder = wan22_parts
    for name in ("transformer", "transformer_2"):
        parts = {part: onnx.load(str(folder / name / part)) for part in ("head.onnx", "body.onnx", "out.onnx")}
        ops = {part: [node.op_type for node in model.graph.node] for part, model in parts.items()}
        # the first block's two attentions in the head, the second block's in the body, none after
        assert [ops[part].count("MultiHeadAttention") for part in parts] == [2, 2, 0]
        assert not any("ScatterND" in found or "Softmax" in found for found in ops.values())
        head_inputs = {value.name: value for value in parts["head.onnx"].graph.input}
        dims = [d.dim_param or d.dim_value for d in head_inputs["hidden_states"].type.tensor_type.shape.dim]
        assert dims == ["batch", 16, "frames", "height", "width"]
        # the parts read the full model's weights file: the weights are on disk once
        assert sorted(path.name for path in (folder / name).glob("*.onnx_data")) == ["model.onnx_data"]


@pytest.mark.parametrize("threshold", [NEVER, SOME])
def test_first_block_cache_skips_the_steps_diffusers_skips_and_gives_its_latents(wan_parts, loaded, threshold):
    torch_pipe, folder = wan_parts
    call = dict(prompt=PROMPTS, **CACHE_CALL)
    ours, computed = cached_call(loaded(folder), threshold, **call)
    theirs, expected = diffusers_cached(torch_pipe, threshold, **call)
    assert computed == expected
    skipped = [step for step, groups in enumerate(computed) if not any(groups)]
    assert skipped == [] if threshold == NEVER else 0 < len(skipped) < 5
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=TOLERANCE)


def test_the_negative_and_positive_prompts_decide_apart_as_diffusers_calls_do(wan_parts, loaded):
    torch_pipe, folder = wan_parts
    pipe = loaded(folder)
    embeds, negative = pipe.encode_prompt(PROMPTS[0], "blurry", True, 1, max_sequence_length=SEQUENCE)
    call = dict(prompt_embeds=embeds, negative_prompt_embeds=negative * 20, **CACHE_CALL)
    ours, computed = cached_call(pipe, 0.08, **call)
    theirs, expected = diffusers_cached(torch_pipe, 0.08, **call)
    assert computed == expected
    assert any(groups[0] != groups[1] for groups in computed)  # a step where one half computes, the other skips
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=TOLERANCE)


def test_wan22s_experts_each_cache_with_their_own_parts_and_state_as_diffusers(wan22_parts, loaded):
    torch_pipe, folder = wan22_parts
    pipe = loaded(folder)
    call = dict(prompt=PROMPTS[0], guidance_scale=4.0, guidance_scale_2=2.0, **CACHE_CALL)
    with pipe.transformer.watch_runs() as high, pipe.transformer_2.watch_runs() as low:
        ours, computed = cached_call(pipe, SOME, **call)
    theirs, expected = diffusers_cached(torch_pipe, SOME, **call)
    assert not high and not low  # the parts ran, not the full graphs
    assert computed == expected
    # UniPC's 6 steps: two above the boundary, then the low-noise expert, whose first step computes
    assert computed[0] == computed[2] == (True, True) and computed[1] == (False, False)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=TOLERANCE)


def test_disabling_first_block_cache_gives_the_uncached_frames_back_exactly(wan_parts, loaded):
    _, folder = wan_parts
    pipe = loaded(folder)
    call = dict(prompt=PROMPTS[0], generator=seeded(), output_type="latent", **CACHE_CALL)
    before = pipe(**call).frames
    pipe.enable_cache(FirstBlockCacheConfig(threshold=SOME))
    cached = pipe(**dict(call, generator=seeded())).frames
    assert pipe.step_cache.skipped_steps > 0
    pipe.disable_cache()
    assert pipe.step_cache is None
    np.testing.assert_array_equal(pipe(**dict(call, generator=seeded())).frames, before)
    assert np.abs(cached.numpy() - before.numpy()).max() > 1e-4


# every precision and optimization the exporter offers a Wan transformer
TRANSFORMER_VARIANTS = [(dtype, optimize) for dtype in ("fp32", "fp16", "bf16") for optimize in (None, "cpu", "cuda")]


@pytest.mark.parametrize(
    "dtype,optimize",
    TRANSFORMER_VARIANTS,
    ids=[f"{dtype}-{optimize or 'plain'}" for dtype, optimize in TRANSFORMER_VARIANTS],
)
def test_every_precision_and_optimization_of_the_transformer_loads_in_onnx_runtime(wan, tmp_path, dtype, optimize):
    # loading checks every node's types: the float32 timestep embedding must be cast before its float16 Linear (ORT's
    # symbolic shape inference, which the converter needs for that, stops at the exporter's unflatten arithmetic)
    import onnxruntime as ort
    from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as NoKernel

    from optimum_iobinding.export import export_pipeline

    folder = export_pipeline(
        None,
        tmp_path / "out",
        torch_pipeline=wan[0],
        dtype=dtype,
        optimize=optimize,
        components=["transformer"],
        progress=False,
    )
    path = str(folder / "transformer" / "model.onnx")
    if dtype == "bf16":  # typed and checked, then ORT's CPU provider has no bfloat16 kernels (it runs on CUDA)
        with pytest.raises(NoKernel, match="Could not find an implementation"):
            ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    else:
        ort.InferenceSession(path, providers=["CPUExecutionProvider"])


def test_the_float16_transformer_gives_the_float32_ones_output_to_float16_rounding(wan, tmp_path):
    import onnxruntime as ort

    from optimum_iobinding.export import export_pipeline

    torch_pipe, fp32 = wan
    fp16 = export_pipeline(
        None, tmp_path / "fp16", torch_pipeline=torch_pipe, dtype="fp16", components=["transformer"], progress=False
    )
    rng = np.random.default_rng(0)
    feeds = {
        "hidden_states": rng.standard_normal((2, torch_pipe.transformer.config.in_channels, 2, 8, 6)),
        "encoder_hidden_states": rng.standard_normal((2, SEQUENCE, torch_pipe.transformer.config.text_dim)),
        "timestep": np.array([999.0, 17.0]),
    }
    outputs = []
    for folder in (fp32, fp16):
        session = ort.InferenceSession(str(folder / "transformer" / "model.onnx"), providers=["CPUExecutionProvider"])
        typed = {
            i.name: feeds[i.name].astype(np.float16 if "16" in i.type else np.float32) for i in session.get_inputs()
        }
        assert session.get_inputs()[2].type == "tensor(float)"  # the timestep float32, as diffusers embeds it
        outputs.append(session.run(None, typed)[0].astype(np.float32))
    np.testing.assert_allclose(outputs[1], outputs[0], atol=5e-3 * np.abs(outputs[0]).max())


def test_a_float16_vae_decodes_the_float32_ones_frames_to_float16_rounding_and_other_families_refuse_it(wan, tmp_path):
    from optimum_iobinding.errors import ArgumentError
    from optimum_iobinding.export import export_pipeline

    torch_pipe, fp32 = wan
    fp16 = export_pipeline(
        None,
        tmp_path / "vae16",
        torch_pipeline=torch_pipe,
        vae_dtype="fp16",
        components=["text_encoder", "transformer", "vae_decoder"],
        progress=False,
    )
    assert load(fp16).vae_decoder.input_dtypes["latent_sample"] == torch.float16
    arguments = dict(height=16, width=32, num_frames=5, num_inference_steps=2, max_sequence_length=SEQUENCE)
    frames = [
        load(folder)("a cat", generator=torch.Generator().manual_seed(0), output_type="np", **arguments).frames
        for folder in (fp32, fp16)
    ]
    assert np.abs(frames[1] - frames[0]).max() <= 1e-2  # float16 rounding of [0, 1] frames
    with pytest.raises(
        ArgumentError,
        match=r"vae_dtype: expected none for a StableDiffusionPipeline \(its VAE follows the export's precision; "
        r".*\), got 'fp16'",
    ):
        export_pipeline(None, tmp_path / "sd", tiny_random="sd", vae_dtype="fp16", progress=False)
    assert not (tmp_path / "sd").exists()


@pytest.fixture
def exported_as_past_two_gib(monkeypatch):
    """The TorchScript export writing what it writes for a model past 2 GiB (the full-width Wan transformers): each
    tensor in a file of its own beside the graph, the Constant nodes' values too — here every one, however small."""
    from optimum_iobinding.export import components

    torchscript_export = components.torchscript_export

    def past_two_gib(spec, path, opset):
        torchscript_export(spec, path, opset)
        onnx.save_model(
            onnx.load(str(path)),
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=False,
            size_threshold=0,
            convert_attribute=True,
        )

    monkeypatch.setattr(components, "torchscript_export", past_two_gib)


def export_wan_transformer(torch_pipe, target, dtype):
    """The transformer alone, in ``dtype`` after ORT's CUDA optimizer, its weights written to model.onnx_data."""
    from optimum_iobinding.export.wan import export_wan_pipeline

    folder = export_wan_pipeline(
        torch_pipe,
        target,
        components=["transformer"],
        dtype=dtype,
        optimize="cuda",
        progress=False,
        external_data_threshold=0,
    )
    assert (folder / "transformer" / "model.onnx_data").is_file()
    return str(folder / "transformer" / "model.onnx")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_half_precision_transformer_exported_with_its_weights_and_constants_on_disk_loads_in_onnx_runtime(
    wan, tmp_path, exported_as_past_two_gib, dtype
):
    # the retry of ORT's shape inference with the unflatten arithmetic folded reads the constants where they are:
    # without its types the float32 timestep embedding reached its float16 Gemm uncast
    import onnxruntime as ort
    from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as NoKernel

    path = export_wan_transformer(wan[0], tmp_path / "out", dtype)
    if dtype == "bf16":  # loaded and typed, then the CPU provider has no bfloat16 kernels
        with pytest.raises(NoKernel, match="Could not find an implementation"):
            ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    else:
        ort.InferenceSession(path, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("onnx_types", [True, False], ids=["onnx-types", "no-types"])
def test_without_orts_shape_inference_the_float16_export_converts_with_onnx_types_or_writes_nothing(
    wan, tmp_path, monkeypatch, onnx_types
):
    import onnxruntime as ort
    from onnxruntime.transformers.shape_infer_helper import SymbolicShapeInferenceHelper

    from optimum_iobinding.export import optimize

    def fails(*args, **kwargs):
        raise ValueError("no inference here")

    # ORT's symbolic shape inference fails, the first try and the retry with the index arithmetic folded
    monkeypatch.setattr(SymbolicShapeInferenceHelper, "infer_shapes", fails)
    if onnx_types:
        path = export_wan_transformer(wan[0], tmp_path / "out", "fp16")
        ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    else:  # a conversion without types leaves the float32 island's edge uncast: refused, not written
        monkeypatch.setattr(optimize, "onnx_typed", lambda model: None)
        with pytest.raises(RuntimeError, match=r"refuses to load.*Type Error.*Gemm.*no inference here"):
            export_wan_transformer(wan[0], tmp_path / "out", "fp16")
        assert not (tmp_path / "out").exists()

"""Stable Diffusion 3 on the GPU (skipped without CUDA; run on the GPU machine): the tiny random SD3 pipeline on the
CUDA execution provider against diffusers' torch pipeline on CUDA, CUDA graphs captured for the transformer, no
session created after warm-up, the fused float16 export."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

CUDA = "CUDAExecutionProvider"
# exact comparisons: without TF32, fp32 matmuls and convolutions on Hopper round like the CPU's
EXACT = {"use_tf32": "0"}
SIZE = 64
SEQUENCE = 16
PROMPT = "a photo of an astronaut riding a horse"


def load(folder, **kwargs):
    from optimum_iobinding import OnnxStableDiffusion3Pipeline

    kwargs.setdefault("provider_options", EXACT)
    pipe = OnnxStableDiffusion3Pipeline.from_pretrained(folder, provider=CUDA, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def latents(rows=1, seed=0):
    return torch.randn(rows, 16, SIZE // 8, SIZE // 8, generator=torch.Generator().manual_seed(seed))


def call(**kwargs):
    arguments = dict(height=SIZE, width=SIZE, num_inference_steps=4, max_sequence_length=SEQUENCE, output_type="np")
    arguments.update(kwargs)
    return arguments


@pytest.mark.parametrize("guidance_scale", [7.0, 1.0], ids=["cfg", "no-cfg"])
def test_the_cuda_pipeline_equals_diffusers_on_cuda_and_replays_transformer_graphs(sd3, guidance_scale):
    torch_pipe, folder = sd3
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        torch_pipe.to("cuda")
        expected = torch_pipe(
            [PROMPT, "a red car"], **call(latents=latents(2).cuda(), guidance_scale=guidance_scale)
        ).images
    finally:
        torch_pipe.to("cpu")
    pipe = load(folder)
    got = pipe([PROMPT, "a red car"], **call(latents=latents(2), guidance_scale=guidance_scale)).images
    assert pipe.device.type == "cuda"
    assert np.abs(got - expected).max() <= 1e-3
    rows = 4 if guidance_scale > 1 else 2
    assert [signature["hidden_states"] for signature in pipe.transformer.graph_signatures] == [
        (rows, 16, SIZE // 8, SIZE // 8)
    ]


def test_the_cuda_pipeline_equals_the_cpu_pipeline(sd3):
    from optimum_iobinding import OnnxStableDiffusion3Pipeline

    _, folder = sd3
    cpu = OnnxStableDiffusion3Pipeline.from_pretrained(folder)
    cpu.set_progress_bar_config(disable=True)
    expected = cpu(PROMPT, **call(latents=latents())).images
    assert np.abs(load(folder)(PROMPT, **call(latents=latents())).images - expected).max() <= 1e-3


def test_after_warmup_no_session_is_created_and_the_components_replay_graphs(sd3):
    _, folder = sd3
    pipe = load(folder)
    pipe.warmup(
        heights=SIZE, batch_sizes=[1, 2], guidance_scales=7.0, num_inference_steps=2, max_sequence_length=SEQUENCE
    )
    created = pipe.sessions_created
    for prompts in ([PROMPT], [PROMPT, "a red car"]):
        pipe(prompts, **call(guidance_scale=7.0, generator=torch.Generator().manual_seed(0)))
    assert pipe.sessions_created == created
    # the components a call runs on every prompt or step (T5's relative-position arithmetic on int64 shapes may be
    # placed on the CPU by ORT, which keeps its graph from being captured: it is left out)
    for name in ("text_encoder", "text_encoder_2", "transformer", "vae_decoder"):
        assert getattr(pipe, name).graph_signatures, name


def test_a_warmup_refused_for_its_height_leaves_the_next_one_at_the_default_t5_length(sd3):
    _, folder = sd3
    pipe = load(folder)
    with pytest.raises(ValueError, match="height and width: expected multiples of 16"):
        pipe.warmup(heights=[SIZE, 72], max_sequence_length=SEQUENCE)
    assert pipe.transformer.signatures == []  # refused before the good size ran
    pipe.warmup(heights=SIZE)
    # CLIP's 77 tokens, then T5's: __call__'s default of 256
    assert [signature["encoder_hidden_states"][1] for signature in pipe.transformer.signatures] == [77 + 256]


def test_without_t5_a_warmup_makes_the_graph_a_call_of_its_t5_length_replays(sd3_without_t5):
    pipe = load(sd3_without_t5[1])
    assert pipe.text_encoder_3 is None
    pipe.warmup(heights=SIZE, max_sequence_length=SEQUENCE)
    created, signatures = pipe.sessions_created, pipe.transformer.signatures
    # the T5 part is SEQUENCE tokens of zeros, as in diffusers
    assert [signature["encoder_hidden_states"][1] for signature in signatures] == [77 + SEQUENCE]
    pipe(PROMPT, **call(num_inference_steps=2))
    assert pipe.sessions_created == created and pipe.transformer.signatures == signatures


def test_a_captured_step_writes_the_guidance_batch_into_the_transformer_graph(sd3):
    _, folder = sd3
    pipe = load(folder)
    pipe(PROMPT, **call(latents=latents()))  # captures the transformer's graph for this signature
    (signature,) = pipe.transformer.graph_signatures
    buffers = pipe.transformer.graph_input_buffers(signature)
    with pipe.transformer.watch_runs() as runs:
        pipe(PROMPT, **call(latents=latents()))
    assert len(runs) == 4
    # the loop finds the graph's buffers after its first call (whose inputs the graph runner copies in, as the UNet
    # loop's GraphFeed does); from then on its inputs are the graph's own buffers: no copy before each replay
    for run in runs[1:]:
        assert run.inputs["hidden_states"] == buffers["hidden_states"].data_ptr()
        assert run.inputs["encoder_hidden_states"] == buffers["encoder_hidden_states"].data_ptr()
        assert run.inputs["pooled_projections"] == buffers["pooled_projections"].data_ptr()


def test_the_fused_float16_export_stays_close_to_the_float32_one(sd3, tmp_path):
    """Component by component: the fused float16 transformer and CLIP (ORT's mmdit and clip fusions) and the fused
    float32 T5 against the plain float32 export on the same inputs."""
    from optimum_iobinding import IOBindingORTModel
    from optimum_iobinding.export import export_pipeline

    torch_pipe, folder = sd3
    fused = export_pipeline(
        None, tmp_path / "fused", torch_pipeline=torch_pipe, fp16=True, optimize="cuda", progress=False
    )
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (2, SEQUENCE), generator=generator)
    inputs = {
        "transformer": {
            "hidden_states": torch.randn(2, 16, 8, 8, generator=generator),
            "encoder_hidden_states": torch.randn(2, 77 + SEQUENCE, 64, generator=generator),
            "pooled_projections": torch.randn(2, 64, generator=generator),
            "timestep": torch.full((2,), 500.0),
        },
        "text_encoder_3": {"input_ids": ids},
        "text_encoder": {"input_ids": torch.randint(0, 300, (2, 77), generator=generator)},
    }
    tolerances = {"transformer": 3e-2, "text_encoder_3": 1e-3, "text_encoder": 3e-2}
    for component, feed in inputs.items():
        outputs = []
        for source in (folder, fused):
            model = IOBindingORTModel.from_pretrained(
                source, subfolder=component, provider=CUDA, provider_options=EXACT
            )
            cast = {key: value.to(model.device, model.input_dtypes[key]) for key, value in feed.items()}
            outputs.append(model(**cast)[0].float().cpu().clone())
        error = (outputs[0] - outputs[1]).abs().max().item()
        assert error <= tolerances[component] * max(1.0, outputs[0].abs().max().item()), (component, error)


def test_cuda_graph_true_requires_the_transformer_captured_and_it_is(sd3, captures_the_transformer_as_required):
    _, folder = sd3
    pipe = load(folder, cuda_graph=True)
    captures_the_transformer_as_required(pipe, lambda: pipe(PROMPT, **call(latents=latents())))


def test_the_fused_float16_pipeline_is_no_further_from_diffusers_float32_image_than_diffusers_float16_is(sd3, tmp_path):
    """The export people deploy (fused float16 with the project's graph rewrites, T5 float32) against diffusers' own
    pipeline on the same weights and latents: its image lies within twice the distance float16 puts diffusers' own
    float16 image from the float32 one, plus 1e-2 (images in [0, 1])."""
    import copy

    from optimum_iobinding.export import export_pipeline

    torch_pipe, _ = sd3
    fused = export_pipeline(
        None, tmp_path / "fused", torch_pipeline=torch_pipe, fp16=True, optimize="cuda", progress=False
    )
    arguments = call(guidance_scale=7.0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    images = {}
    for dtype in (torch.float32, torch.float16):  # a copy: the module's pipeline keeps its float32 weights
        pipe = copy.deepcopy(torch_pipe).to("cuda", dtype)
        images[dtype] = pipe([PROMPT, "a red car"], latents=latents(2).to("cuda", dtype), **arguments).images
        del pipe
    ours = load(fused, provider_options={})([PROMPT, "a red car"], latents=latents(2), **arguments).images
    assert np.isfinite(ours).all()
    theirs_error = np.abs(images[torch.float16] - images[torch.float32]).max()
    our_error = np.abs(ours - images[torch.float32]).max()
    assert our_error <= 2 * theirs_error + 1e-2, (our_error, theirs_error)

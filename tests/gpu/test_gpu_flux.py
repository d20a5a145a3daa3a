"""FLUX.1 on the GPU (skipped without CUDA; run on the GPU machine): our pipeline against diffusers' torch
FluxPipeline on CUDA, the transformer's CUDA graphs, no session after warm-up, no host wait in the loop, and the
ORT-optimized float16 export; the image-conditioned variants (Kontext, Fill, Control) captured and equal to the CPU
provider's images, their loops without a host wait."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch

from optimum_iobinding import (
    IOBindingORTModel,
    OnnxFluxControlPipeline,
    OnnxFluxFillPipeline,
    OnnxFluxKontextPipeline,
    OnnxFluxPipeline,
)
from optimum_iobinding.bench.probes import host_waits
from optimum_iobinding.pipelines.loop import Guidance, denoise
from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.tiny import build_tiny_random_flux_pipeline
from optimum_iobinding.pipelines.flux import latent_image_ids, pack_latents

pytestmark = pytest.mark.gpu

CUDA = "CUDAExecutionProvider"
# exact comparisons: without TF32, fp32 matmuls and convolutions on Hopper round like the CPU's
EXACT = {"use_tf32": "0"}
PROMPTS = ["a photo of an astronaut riding a horse", "a red castle in the forest"]
CALL = dict(height=64, width=48, num_inference_steps=3, max_sequence_length=16, output_type="np")
TOLERANCE = 1e-3


def load(folder, pipeline_class=OnnxFluxPipeline, **kwargs):
    kwargs.setdefault("provider_options", EXACT)
    pipe = pipeline_class.from_pretrained(folder, provider=CUDA, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


def test_flux_on_cuda_equals_diffusers_on_cuda_and_captures_every_component(flux):
    torch_pipe, folder = flux
    pipe = load(folder)
    arguments = dict(CALL, num_images_per_prompt=2, guidance_scale=4.0)
    ours = pipe(PROMPTS, generator=seeded(), **arguments).images
    previous = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        theirs = torch_pipe.to("cuda")(PROMPTS, generator=seeded(), **arguments).images
    finally:
        torch.backends.cudnn.allow_tf32 = previous
        torch_pipe.to("cpu")
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE)
    assert pipe.transformer.graph_signatures, pipe.transformer.graph_fallbacks
    for name, model in pipe.onnx_models.items():
        if name != "vae_encoder":  # text-to-image never runs it
            assert model.graph_signatures or model.graph_fallbacks, name


def test_a_warmed_up_flux_pipeline_creates_no_session_and_keeps_a_graph_per_batch(flux):
    _, folder = flux
    pipe = load(folder)
    pipe.warmup(heights=64, widths=48, batch_sizes=[1, 2], max_sequence_length=16)
    created = pipe.sessions_created
    for prompts in (PROMPTS, PROMPTS[:1], PROMPTS):
        pipe(prompts, generator=seeded(), **CALL)
    assert pipe.sessions_created == created
    batches = sorted(signature["hidden_states"][0] for signature in pipe.transformer.graph_signatures)
    assert batches == [1, 2]


def test_a_warmup_refused_for_its_height_leaves_the_next_one_at_the_default_t5_length(flux):
    _, folder = flux
    pipe = load(folder)
    with pytest.raises(ValueError, match="height and width: expected multiples of 16"):
        pipe.warmup(heights=[64, 72], widths=48, max_sequence_length=16)
    assert pipe.transformer.signatures == []  # refused before the good size ran
    pipe.warmup(heights=64, widths=48)
    assert [signature["encoder_hidden_states"][1] for signature in pipe.transformer.signatures] == [512]


def test_true_cfg_on_cuda_equals_the_cpu_pipeline(flux):
    _, folder = flux
    arguments = dict(CALL, negative_prompt=["a blue sky", "a dog"], true_cfg_scale=2.5)
    on_cpu = OnnxFluxPipeline.from_pretrained(folder)
    on_cpu.set_progress_bar_config(disable=True)
    np.testing.assert_allclose(
        load(folder)(PROMPTS, generator=seeded(), **arguments).images,
        on_cpu(PROMPTS, generator=seeded(), **arguments).images,
        atol=TOLERANCE,
    )


def test_the_host_enqueues_the_whole_flux_loop_without_waiting(flux):
    _, folder = flux
    pipe = load(folder)
    with torch.cuda.stream(pipe.stream):
        embeds, pooled, text_ids = pipe.encode_prompt(PROMPTS[0], max_sequence_length=16)
        noise = pipe.prepare_latents((1, pipe.latent_channels, 8, 6), torch.float32, seeded())
        latents = pack_latents(noise)
        image_ids = latent_image_ids(4, 3).to(pipe.transformer.input_dtypes["img_ids"]).to(pipe.device)
        inputs = {"txt_ids": text_ids, "img_ids": image_ids}
        if pipe.guidance_embeds:
            inputs["guidance"] = torch.full((1,), 3.5, device=pipe.device)

        def loop():
            timesteps = pipe.denoiser.timesteps(4, image_seq_len=12)
            return denoise(
                pipe.denoiser,
                latents,
                timesteps,
                tensors={"prompt_embeds": embeds, "pooled_prompt_embeds": pooled},
                guidance=Guidance(),
                inputs=inputs,
            )

        loop()  # warm up: capture
        torch.cuda.synchronize()
        waits = host_waits(loop)
    assert waits == [], "\n".join(f"{waits.count(w)}× {w}" for w in sorted(set(waits)))
    torch.cuda.synchronize()


def test_the_fused_fp16_transformer_adds_no_error_beyond_fp16_itself(tmp_path):
    """The mmdit-optimized float16 transformer is as close to the fp32 export as the plain float16 one is."""
    torch_pipe = build_tiny_random_flux_pipeline(0, guidance_embeds=True)
    folders = {
        "fp32": export_pipeline(None, tmp_path / "fp32", torch_pipeline=torch_pipe, progress=False),
        "plain": export_pipeline(None, tmp_path / "plain", torch_pipeline=torch_pipe, fp16=True, progress=False),
        "fused": export_pipeline(
            None, tmp_path / "fused", torch_pipeline=torch_pipe, fp16=True, optimize="cuda", progress=False
        ),
    }
    generator = torch.Generator().manual_seed(0)
    feed = {
        "hidden_states": torch.randn(2, 12, 64, generator=generator),
        "encoder_hidden_states": torch.randn(2, 16, 32, generator=generator),
        "pooled_projections": torch.randn(2, 32, generator=generator),
        "timestep": torch.full((2,), 0.5),
        "txt_ids": torch.zeros(16, 3),
        "img_ids": latent_image_ids(4, 3),
        "guidance": torch.full((2,), 3.5),
    }
    outputs = {}
    for name, folder in folders.items():
        model = IOBindingORTModel.from_pretrained(
            folder, subfolder="transformer", provider=CUDA, provider_options=EXACT
        )
        cast = {key: value.to(model.device, model.input_dtypes[key]) for key, value in feed.items()}
        outputs[name] = model(**cast)[0].float().cpu().clone()
    plain_error = (outputs["plain"] - outputs["fp32"]).abs().max().item()
    fused_error = (outputs["fused"] - outputs["fp32"]).abs().max().item()
    assert fused_error <= 2 * plain_error + 2e-3, (fused_error, plain_error)


def test_cuda_graph_true_requires_the_transformer_captured_and_it_is(flux, captures_the_transformer_as_required):
    _, folder = flux
    pipe = load(folder, cuda_graph=True)
    captures_the_transformer_as_required(pipe, lambda: pipe(PROMPTS, generator=seeded(), **CALL))


def test_the_fused_float16_pipeline_is_no_further_from_diffusers_float32_image_than_diffusers_float16_is(
    flux, tmp_path
):
    """The export people deploy (fused float16 with the project's graph rewrites, T5 float32) against diffusers' own
    FluxPipeline on the same weights and latents: its image lies within twice the distance float16 puts diffusers'
    own float16 image from the float32 one, plus 1e-2 (images in [0, 1])."""
    import copy

    torch_pipe, _ = flux
    fused = export_pipeline(
        None, tmp_path / "fused", torch_pipeline=torch_pipe, fp16=True, optimize="cuda", progress=False
    )
    # FLUX.1's packed latents of a 64×48 image: 4 × 3 tokens of 64 channels, one row per prompt
    packed = torch.randn(len(PROMPTS), 12, 64, generator=seeded())
    arguments = dict(CALL, guidance_scale=4.0)
    previous = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    images = {}
    try:
        for dtype in (torch.float32, torch.float16):  # a copy: the module's pipeline keeps its float32 weights
            pipe = copy.deepcopy(torch_pipe).to("cuda", dtype)
            images[dtype] = pipe(PROMPTS, latents=packed.to("cuda", dtype), **arguments).images
            del pipe
    finally:
        torch.backends.cudnn.allow_tf32 = previous
    ours = load(fused, provider_options={})(PROMPTS, latents=packed, **arguments).images
    assert np.isfinite(ours).all()
    theirs_error = np.abs(images[torch.float16] - images[torch.float32]).max()
    our_error = np.abs(ours - images[torch.float32]).max()
    assert our_error <= 2 * theirs_error + 1e-2, (our_error, theirs_error)


def test_a_transformer_lora_on_the_fused_export_replays_in_the_captured_graphs_and_equals_the_plain_exports(tmp_path):
    """Runtime LoRA on the fused CUDA export (its single blocks' output biases fold the value biases: a LoRA on
    proj_out changes them too), captured, against the plain export (no fusion, no fold; not captured) with the same
    LoRA, whose images equal diffusers' on the CPU (tests/pipelines/test_transformer_lora.py; the GPU machine has no
    peft); switching adapters creates no session."""
    from optimum_iobinding.export.tiny import random_lora_layers, save_lora

    torch_pipe = build_tiny_random_flux_pipeline(0)
    fused = export_pipeline(None, tmp_path / "fused", torch_pipeline=torch_pipe, optimize="cuda", progress=False)
    plain = export_pipeline(None, tmp_path / "plain", torch_pipeline=torch_pipe, progress=False)
    lora = save_lora(
        tmp_path / "lora",
        transformer=random_lora_layers(torch_pipe.transformer, ["to_q", "to_v", "to_out.0", "proj_out"], 4, 1),
    )
    pipe = load(fused, cuda_graph=True)
    base = pipe(PROMPTS[0], generator=seeded(), **CALL).images
    pipe.load_lora_weights(str(lora), adapter_name="x")
    ours = pipe(PROMPTS[0], generator=seeded(), **CALL).images
    created = pipe.transformer.sessions_created
    pipe.disable_lora()
    disabled = pipe(PROMPTS[0], generator=seeded(), **CALL).images
    pipe.enable_lora()
    assert np.abs(pipe(PROMPTS[0], generator=seeded(), **CALL).images - ours).max() <= 1e-5
    assert pipe.transformer.sessions_created == created and pipe.transformer.graph_signatures
    reference = load(plain, cuda_graph=False)
    reference.load_lora_weights(str(lora), adapter_name="x")
    np.testing.assert_allclose(ours, reference(PROMPTS[0], generator=seeded(), **CALL).images, atol=TOLERANCE)
    assert np.abs(ours - base).max() > 1e-2 and np.abs(disabled - base).max() <= 1e-5


# ------------------------------------------------------------------------------------ the image-conditioned variants
def picture(height: int, width: int) -> PIL.Image.Image:
    return PIL.Image.fromarray((np.random.default_rng(0).random((height, width, 3)) * 255).astype(np.uint8))


def white_square(height: int, width: int) -> PIL.Image.Image:
    white = np.zeros((height, width), np.uint8)
    white[height // 4 : 3 * height // 4, width // 3 :] = 255
    return PIL.Image.fromarray(white)


# each variant's class and the image arguments of its calls (Kontext: a reference image of 2 × 3 tokens beside the
# latents' 4 × 3, at the call's area, not resized to a Kontext resolution)
VARIANTS = {
    "flux-kontext": (
        OnnxFluxKontextPipeline,
        lambda: dict(image=picture(32, 48), max_area=64 * 48, _auto_resize=False, true_cfg_scale=2.0),
    ),
    "flux-fill": (OnnxFluxFillPipeline, lambda: dict(image=picture(64, 48), mask_image=white_square(64, 48))),
    "flux-control": (OnnxFluxControlPipeline, lambda: dict(control_image=picture(64, 48))),
}


@pytest.fixture(params=list(VARIANTS))
def variant(request, shared_export):
    """(its pipeline class, its image arguments, its tiny random export) of each variant in turn (the export shared
    with the CPU tests': ``export --tiny-random KIND``)."""
    kind = request.param
    folder = shared_export(
        f"tiny-random-{kind}", lambda target: export_pipeline(None, target, tiny_random=kind, progress=False)
    )
    pipeline_class, images = VARIANTS[kind]
    return pipeline_class, images, folder


def test_each_flux_variant_captures_its_transformer_and_equals_the_cpu_image(
    variant, captures_the_transformer_as_required
):
    """Under ``cuda_graph=True`` the transformer (fed the reference tokens, or the conditioning channels, through
    its graph's input) replays a graph, and the images are the CPU provider's (Kontext with true CFG: negative and
    positive in one batch)."""
    pipeline_class, images, folder = variant
    arguments = dict(CALL, **images(), guidance_scale=4.0)
    if pipeline_class is OnnxFluxKontextPipeline:
        arguments["negative_prompt"] = ["a blue sky", "a dog"]
    pipe = load(folder, pipeline_class, cuda_graph=True)
    made = {}

    def run():
        made["images"] = pipe(prompt=PROMPTS, generator=seeded(), **arguments).images

    captures_the_transformer_as_required(pipe, run)
    on_cpu = pipeline_class.from_pretrained(folder)
    on_cpu.set_progress_bar_config(disable=True)
    np.testing.assert_allclose(
        made["images"], on_cpu(prompt=PROMPTS, generator=seeded(), **arguments).images, atol=TOLERANCE
    )
    # a second call replays the graphs captured by the first: no session, no new signature
    signatures, created = len(pipe.transformer.graph_signatures), pipe.sessions_created
    np.testing.assert_array_equal(pipe(prompt=PROMPTS, generator=seeded(), **arguments).images, made["images"])
    assert (len(pipe.transformer.graph_signatures), pipe.sessions_created) == (signatures, created)


@pytest.mark.parametrize("extra", ["tokens", "channels"])
def test_the_host_enqueues_a_loop_with_extra_tokens_or_channels_without_waiting(shared_export, extra):
    """The loop's hooks of the variants (Kontext's reference tokens appended, their prediction sliced off; Fill's and
    Control's conditioning concatenated on the token values) write into the transformer graph's input and make the
    host wait for nothing."""
    kind = "flux-kontext" if extra == "tokens" else "flux-control"
    pipeline_class, _ = VARIANTS[kind]
    folder = shared_export(
        f"tiny-random-{kind}", lambda target: export_pipeline(None, target, tiny_random=kind, progress=False)
    )
    pipe = load(folder, pipeline_class)
    with torch.cuda.stream(pipe.stream):
        embeds, pooled, text_ids = pipe.encode_prompt(PROMPTS[0], max_sequence_length=16)
        latents = pack_latents(pipe.prepare_latents((1, pipe.latent_channels, 8, 6), torch.float32, seeded()))
        image_ids = pipe.position_ids(4, 3)
        hooks = {}
        if extra == "tokens":  # a reference image of 2 × 3 tokens
            hooks["extra_tokens"] = torch.randn(1, 6, 64, generator=seeded(1)).to(pipe.device)
            image_ids = torch.cat([image_ids, pipe.position_ids(2, 3, first=1.0)])
        else:  # the control image's packed latents
            hooks["extra_channels"] = torch.randn(1, 12, 64, generator=seeded(1)).to(pipe.device)
        inputs = pipe.transformer_inputs(text_ids, image_ids, 1, 3.5)

        def loop():
            timesteps = pipe.denoiser.timesteps(4, image_seq_len=12)
            return denoise(
                pipe.denoiser,
                latents,
                timesteps,
                tensors={"prompt_embeds": embeds, "pooled_prompt_embeds": pooled},
                guidance=Guidance(),
                inputs=inputs,
                **hooks,
            )

        loop()  # warm up: capture
        torch.cuda.synchronize()
        waits = host_waits(loop)
        assert tuple(loop().shape) == (1, 12, 64)
    assert waits == [], "\n".join(f"{waits.count(w)}× {w}" for w in sorted(set(waits)))
    torch.cuda.synchronize()

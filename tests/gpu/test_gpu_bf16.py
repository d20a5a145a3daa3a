"""bfloat16 diffusion transformers on the GPU (skipped without CUDA; run on the GPU machine): the tiny SD3.5-shaped
and FLUX.1 dev transformers, exported fused (ORT's optimizer for CUDA and the project's rewrites) in bfloat16 by
``export_pipeline(dtype="bf16")`` (the float16 graph retyped, its weights rounded from the float32 ones:
:func:`optimum_iobinding.export.bfloat16.to_bfloat16`), run on ORT's CUDA provider with every node on the GPU —
``cuda_graph=True`` warns where a signature cannot be captured, which one node left on the CPU is enough for — and
compute what diffusers' own transformer computes in bfloat16 on the same inputs."""

from __future__ import annotations

import copy
import warnings
from typing import Dict

import onnx
import pytest
import torch

from optimum_iobinding import IOBindingORTModel
from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.bfloat16 import ops_without_bfloat16_cuda_kernels
from optimum_iobinding.export.tiny import build_tiny_random_flux_pipeline, build_tiny_random_sd3_pipeline

pytestmark = pytest.mark.gpu

CUDA = "CUDAExecutionProvider"
# without TF32 the float32 ops (the patch embedding kept in float32, diffusers' float32 reference) round as float32
EXACT = {"use_tf32": "0"}
BUILDERS = {
    "sd3.5": build_tiny_random_sd3_pipeline,
    "flux-dev": lambda: build_tiny_random_flux_pipeline(guidance_embeds=True),
}


@pytest.fixture(scope="module", params=list(BUILDERS))
def bfloat16_transformer(request, tmp_path_factory):
    """(kind, diffusers' float32 transformer on the CPU, the path of its fused bfloat16 export)."""
    torch_pipe = BUILDERS[request.param]()
    out = export_pipeline(
        None,
        tmp_path_factory.mktemp(request.param) / "bf16",
        torch_pipeline=torch_pipe,
        dtype="bf16",
        optimize="cuda",
        components=["transformer"],
        progress=False,
    )
    path = out / "transformer" / "model.onnx"
    assert ops_without_bfloat16_cuda_kernels(onnx.load(str(path))) == []
    return request.param, torch_pipe.transformer, path


def transformer_inputs(kind: str) -> Dict[str, torch.Tensor]:
    """Inputs of the tiny transformer, as diffusers' pipelines hand them over (float32 on the CPU): SD3 at 16² latents
    with classifier-free guidance (batch 2), FLUX.1 dev at 8 × 8 packed tokens for two prompts; 7 text tokens."""
    generator = torch.Generator().manual_seed(0)
    if kind == "sd3.5":
        return {
            "hidden_states": torch.randn(2, 16, 16, 16, generator=generator),
            "encoder_hidden_states": torch.randn(2, 7, 64, generator=generator),
            "pooled_projections": torch.randn(2, 64, generator=generator),
            "timestep": torch.tensor([700.0, 700.0]),
        }
    rows, columns = torch.meshgrid(torch.arange(8), torch.arange(8), indexing="ij")
    return {
        "hidden_states": torch.randn(2, 64, 64, generator=generator),
        "encoder_hidden_states": torch.randn(2, 7, 32, generator=generator),
        "pooled_projections": torch.randn(2, 32, generator=generator),
        "timestep": torch.tensor([0.7, 0.7]),
        "guidance": torch.tensor([3.5, 3.5]),
        "img_ids": torch.stack([torch.zeros_like(rows), rows, columns], -1).reshape(-1, 3).float(),
        "txt_ids": torch.zeros(7, 3),
    }


def diffusers_output(transformer: torch.nn.Module, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """diffusers' transformer in ``dtype`` on CUDA (a copy: the fixture's stays float32 on the CPU), given what its
    pipelines give it in that dtype: the latents and embeddings in ``dtype``; SD3 its timestep in float32, FLUX.1
    its timestep and guidance in ``dtype`` too and its position ids in float32."""
    inputs = transformer_inputs(kind)
    rounded = {"hidden_states", "encoder_hidden_states", "pooled_projections"}
    if kind == "flux-dev":
        rounded |= {"timestep", "guidance"}
    feed = {name: value.to("cuda", dtype if name in rounded else torch.float32) for name, value in inputs.items()}
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        module = copy.deepcopy(transformer).to("cuda", dtype).eval()
        with torch.no_grad():
            return module(**feed, return_dict=False)[0].float().cpu()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def onnx_feed(model: IOBindingORTModel, kind: str) -> Dict[str, torch.Tensor]:
    """The same inputs in the model's dtypes on its device (bfloat16; SD3's timestep float32, the ids int64)."""
    return {name: value.to(model.device, model.input_dtypes[name]) for name, value in transformer_inputs(kind).items()}


def test_every_node_of_a_bfloat16_transformer_runs_on_cuda_inside_a_captured_graph(bfloat16_transformer):
    kind, _, path = bfloat16_transformer
    model = IOBindingORTModel(path, provider=CUDA, provider_options=EXACT, cuda_graph=True)
    assert model.input_dtypes["hidden_states"] == model.output_dtypes["out_hidden_states"] == torch.bfloat16
    feed = onnx_feed(model, kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a signature run without its graph warns
        for _ in range(3):  # capture, then replays
            (output,) = model(**feed)
    assert model.graph_signatures and not model.graph_fallbacks
    assert output.dtype == torch.bfloat16 and bool(torch.isfinite(output).all())


def test_a_bfloat16_transformer_on_cuda_computes_what_diffusers_transformer_computes_in_bfloat16(bfloat16_transformer):
    """ORT's bfloat16 output lies within three times the distance that bfloat16 puts diffusers' own bfloat16 output
    from its float32 one (what it would if it were no further from float32 than twice bfloat16's own error), plus
    1e-3 of the output's largest value."""
    kind, transformer, path = bfloat16_transformer
    expected = diffusers_output(transformer, kind, torch.bfloat16)
    reference = diffusers_output(transformer, kind, torch.float32)
    model = IOBindingORTModel(path, provider=CUDA, provider_options=EXACT, cuda_graph=True)
    (output,) = model(**onnx_feed(model, kind))
    ours = output.float().cpu().clone()
    assert ours.shape == expected.shape and bool(torch.isfinite(ours).all())
    bfloat16_error = (expected - reference).abs().max().item()
    our_error = (ours - expected).abs().max().item()
    scale = reference.abs().max().item()
    assert bfloat16_error > 0  # bfloat16 rounds: the tolerance is not zero
    assert our_error <= 3 * bfloat16_error + 1e-3 * scale, (our_error, bfloat16_error, scale)
    # and no further from diffusers' float32 output than twice diffusers' bfloat16 output is
    assert (ours - reference).abs().max().item() <= 2 * bfloat16_error + 1e-3 * scale

"""IP-Adapter on the GPU (skipped without CUDA; run on the GPU machine): under ``cuda_graph=True`` the UNet of an
export for IP-Adapter replays its graph with the image prompt, the images are the CPU provider's, and switching the
adapter, its scale or the stream's image prompt makes no session and captures no graph again; the fused fp16 export
(the text attention fused, the image-prompt attention one ``MultiHeadAttention`` node) is captured too, its UNet and
image encoder as close to the fp32 export's as the plain fp16 ones are."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from optimum_iobinding import OnnxStableDiffusionPipeline, OnnxStreamDiffusionPipeline
from optimum_iobinding.export import export_pipeline
from tests.ip_adapter_models import (
    TURBO,
    adapter_state_dict,
    full_adapter_state_dict,
    prompt_image,
    torch_pipeline,
)

pytestmark = pytest.mark.gpu

CUDA = "CUDAExecutionProvider"
EXACT = {"use_tf32": "0"}  # fp32 matmuls and convolutions on Hopper round like the CPU's
TOLERANCE = 1e-3
PROMPT = "a photo of a cat"


@pytest.fixture(scope="module")
def folders(shared_export):
    return {
        "fp32": shared_export(
            "gpu-ip-adapter", lambda t: export_pipeline(None, t, torch_pipeline=torch_pipeline(), ip_adapter=True)
        ),
        "fp16": shared_export(
            "gpu-ip-adapter-fp16",
            lambda t: export_pipeline(None, t, torch_pipeline=torch_pipeline(), ip_adapter=True, fp16=True),
        ),
        "fused": shared_export(
            "gpu-ip-adapter-fused",
            lambda t: export_pipeline(
                None, t, torch_pipeline=torch_pipeline(), ip_adapter=True, fp16=True, optimize="cuda"
            ),
        ),
    }


def load(pipeline_class, folder, provider=CUDA, **options):
    if provider == CUDA:
        options.setdefault("provider_options", EXACT)
    pipe = pipeline_class.from_pretrained(folder, provider=provider, **options)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, **kwargs):
    call = dict(prompt=PROMPT, num_inference_steps=3, height=64, width=64, output_type="np", **kwargs)
    return pipe(generator=torch.Generator().manual_seed(0), **call).images


def test_the_unet_replays_its_graph_with_the_image_prompt_and_switching_adapters_captures_nothing(folders):
    first, second = adapter_state_dict(torch_pipeline().unet, 1), adapter_state_dict(torch_pipeline().unet, 2)
    pipe = load(OnnxStableDiffusionPipeline, folders["fp32"], cuda_graph=True)
    pipe.load_ip_adapter(first)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback of the UNet would warn
        made = run(pipe, ip_adapter_image=prompt_image())
    assert pipe.unet.graph_signatures and not pipe.unet.graph_fallbacks
    on_cpu = load(OnnxStableDiffusionPipeline, folders["fp32"], provider="CPUExecutionProvider")
    on_cpu.load_ip_adapter(first)
    np.testing.assert_allclose(made, run(on_cpu, ip_adapter_image=prompt_image()), atol=TOLERANCE)
    signatures, created = len(pipe.unet.graph_signatures), pipe.sessions_created
    pipe.set_ip_adapter_scale(0.5)
    run(pipe, ip_adapter_image=prompt_image(seed=9))
    pipe.load_ip_adapter(second)  # another adapter: another projection and weights, the same four image tokens
    assert run(pipe, ip_adapter_image=prompt_image()).shape == made.shape
    assert (len(pipe.unet.graph_signatures), pipe.sessions_created) == (signatures, created)
    # a "full" adapter's image tokens are the encoder's sequence: the UNet's inputs change shape, one graph more
    pipe.load_ip_adapter(full_adapter_state_dict(torch_pipeline().unet, 3))
    run(pipe, ip_adapter_image=prompt_image())
    assert len(pipe.unet.graph_signatures) == signatures + 1 and not pipe.unet.graph_fallbacks


def test_the_fused_fp16_export_is_captured_and_adds_no_error_beyond_fp16_itself(
    folders, fused_adds_no_error_beyond_fp16
):
    from optimum_iobinding import IOBindingORTModel

    pipe = load(OnnxStableDiffusionPipeline, folders["fused"], cuda_graph=True)
    pipe.load_ip_adapter(adapter_state_dict(torch_pipeline().unet, 1))
    run(pipe, ip_adapter_image=prompt_image())
    assert pipe.unet.graph_signatures and not pipe.unet.graph_fallbacks
    # then, component by component: the UNet with the image prompt's inputs, and the image encoder
    generator = torch.Generator().manual_seed(0)

    def random_feed(dims, batch):
        shape = [batch if index == 0 else (dim if isinstance(dim, int) else 4) for index, dim in enumerate(dims)]
        return torch.randn(*shape, generator=generator)

    reference = IOBindingORTModel.from_pretrained(folders["fp32"], subfolder="unet", provider=CUDA)
    feeds = {
        "unet": {
            "sample": torch.randn(2, 4, 8, 8, generator=generator),
            "timestep": torch.full((2,), 500.0),
            "encoder_hidden_states": torch.randn(2, 77, 32, generator=generator),
            **{
                name: random_feed(dims, 2)
                for name, dims in reference.input_dims.items()
                if name.startswith("ip_adapter_")
            },
        },
        "image_encoder": {"pixel_values": torch.randn(1, 3, 32, 32, generator=generator)},
    }
    for component, feed in feeds.items():
        fused_adds_no_error_beyond_fp16(folders, component, feed)


def test_a_streams_image_prompt_updates_in_place_and_equals_the_cpus(folders):
    import diffusers

    state = adapter_state_dict(torch_pipeline().unet, 1)
    frame = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    outputs = {}
    for provider in (CUDA, "CPUExecutionProvider"):
        stream = load(OnnxStreamDiffusionPipeline, folders["fp32"], provider=provider)
        name, overrides = TURBO
        stream.scheduler = getattr(diffusers, name).from_config(stream.scheduler.config, **overrides)
        stream.load_ip_adapter(state)
        stream.prepare(PROMPT, seed=3, height=64, width=64, ip_adapter_image=prompt_image())
        first = stream(frame.to(stream.device)).cpu()
        created = stream.sessions_created
        graphs = stream.captured_graphs
        stream.update_image_prompt(ip_adapter_image=prompt_image(seed=8))
        outputs[provider] = (first, stream(frame.to(stream.device)).cpu())
        assert (stream.sessions_created, stream.captured_graphs) == (created, graphs)
    for got, expected in zip(outputs[CUDA], outputs["CPUExecutionProvider"]):
        torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0)
    assert (outputs[CUDA][0] - outputs[CUDA][1]).abs().max() > 1e-3  # the new image prompt counts

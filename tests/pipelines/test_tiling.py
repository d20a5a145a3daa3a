"""Tiled VAE decoding and encoding (CPU here; the overlapped CUDA transfers are checked in tests/gpu/test_gpu.py): the
same tiles and blends as diffusers' AutoencoderKL tiling, on the tiny VAE's weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from optimum_iobinding import IOBindingORTModel, OnnxStableDiffusionPipeline, TiledVAE
from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.tiny import build_tiny_random_pipeline

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny(shared_export):
    torch_pipe = build_tiny_random_pipeline()
    torch_pipe.set_progress_bar_config(disable=True)
    folder = shared_export(
        "sd", lambda target: export_pipeline(None, target, torch_pipeline=torch_pipe, progress=False)
    )
    return torch_pipe, folder


@pytest.fixture(scope="module")
def tiler(tiny):
    torch_pipe, folder = tiny
    decoder = IOBindingORTModel.from_pretrained(folder, subfolder="vae_decoder")
    encoder = IOBindingORTModel.from_pretrained(folder, subfolder="vae_encoder")
    # diffusers' tile: the VAE's sample_size (64 px, 8 latents for the tiny VAE)
    return TiledVAE(decoder, encoder, tile_sample_size=torch_pipe.vae.config.sample_size)


def torch_vae(tiny):
    vae = tiny[0].vae
    vae.enable_tiling()
    return vae


@pytest.mark.parametrize("latent_shape", [(1, 4, 20, 20), (1, 4, 16, 26), (2, 4, 13, 9)])
def test_tiled_decode_matches_diffusers_tiled_decode(tiny, tiler, latent_shape):
    latents = torch.randn(*latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = torch_vae(tiny).tiled_decode(latents).sample
    got = tiler.decode(latents)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0)


def test_decoding_to_the_host_gives_the_postprocessed_tiled_image(tiler):
    latents = torch.randn(1, 4, 20, 28, generator=torch.Generator().manual_seed(1))
    expected = (tiler.decode(latents) / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    got = tiler.decode_to_host(latents)
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize("size", [(192, 240), (128, 64)])
def test_tiled_encode_matches_diffusers_tiled_encode(tiny, tiler, size):
    image = torch.rand(1, 3, *size, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        expected = torch_vae(tiny).encode(image).latent_dist.mode()
    torch.testing.assert_close(tiler.encode(image), expected, atol=TOLERANCE, rtol=0)


def test_a_pipeline_with_vae_tiling_matches_diffusers_with_vae_tiling(tiny):
    torch_pipe, folder = tiny
    torch_vae(tiny)
    latents = torch.randn(1, 4, 20, 24, generator=torch.Generator().manual_seed(3))
    expected = torch_pipe(
        "a cat", height=160, width=192, num_inference_steps=2, latents=latents, output_type="np"
    ).images
    pipe = OnnxStableDiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    pipe.enable_vae_tiling()
    assert pipe.vae_tiler.tile_sample_size == torch_pipe.vae.config.sample_size
    got = pipe("a cat", height=160, width=192, num_inference_steps=2, latents=latents, output_type="np").images
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)
    pipe.disable_vae_tiling()
    untiled = pipe("a cat", height=160, width=192, num_inference_steps=2, latents=latents, output_type="np").images
    assert np.abs(untiled - got).max() > TOLERANCE  # the tiling really was on: random weights see the seams


@pytest.mark.parametrize(
    "arguments,message",
    [
        (dict(tile_sample_size=60), "tile_sample_size: expected a positive multiple of 8"),
        (
            dict(tile_sample_size=64, overlap=1.0),
            r"overlap: expected a fraction in \[0, 0.5\] \(diffusers uses 0.25\), got 1.0",
        ),
        (dict(tile_sample_size=64, overlap=0.9), r"overlap: expected a fraction in \[0, 0.5\].*got 0.9"),
        (dict(tile_sample_size=64.0), "tile_sample_size: expected a positive multiple of 8 .*got 64.0"),
    ],
)
def test_bad_tiling_arguments_are_refused(tiler, arguments, message):
    with pytest.raises(ValueError, match=message):
        TiledVAE(tiler.vae_decoder, **arguments)


def test_decoding_without_a_decoder_says_so():
    with pytest.raises(ValueError, match="vae_decoder"):
        TiledVAE(None, tile_sample_size=64).decode(torch.zeros(1, 4, 16, 16))


def test_each_tile_shape_can_run_in_a_session_of_its_own_with_the_same_result(tiny, tiler):
    # on CUDA the default: a session whose input shape changes searches its convolution algorithms again
    _, folder = tiny
    decoder = IOBindingORTModel.from_pretrained(folder, subfolder="vae_decoder")
    per_shape = TiledVAE(decoder, tile_sample_size=64, session_per_shape=True)
    latents = torch.randn(1, 4, 20, 20, generator=torch.Generator().manual_seed(2))
    expected = tiler.decode(latents)
    torch.testing.assert_close(per_shape.decode(latents), expected, atol=0, rtol=0)
    models = per_shape.tile_models("decoder")
    # tiles of 8 latents every 6: 8, 8, 8 and an edge of 2 along each axis → four shapes, four sessions
    assert sorted(shape[2:] for shape in models) == [(2, 2), (2, 8), (8, 2), (8, 8)]
    assert decoder in models.values() and len({id(model.session) for model in models.values()}) == 4
    before = {shape: id(model) for shape, model in models.items()}
    torch.testing.assert_close(per_shape.decode(latents), expected, atol=0, rtol=0)
    assert {shape: id(model) for shape, model in per_shape.tile_models("decoder").items()} == before  # reused
    assert tiler.session_per_shape is None and tiler.tile_models("decoder") == {}  # CPU default: one session


def test_tile_sessions_are_bounded(tiny):
    _, folder = tiny
    decoder = IOBindingORTModel.from_pretrained(folder, subfolder="vae_decoder")
    bounded = TiledVAE(decoder, tile_sample_size=64, session_per_shape=True, max_tile_sessions=2)
    latents = torch.randn(1, 4, 20, 20, generator=torch.Generator().manual_seed(3))
    reference = TiledVAE(decoder, tile_sample_size=64, session_per_shape=False).decode(latents)
    torch.testing.assert_close(bounded.decode(latents), reference, atol=0, rtol=0)
    assert len(bounded.tile_models("decoder")) == 2
    with pytest.raises(ValueError, match="max_tile_sessions: expected an integer ≥ 1, got 0"):
        TiledVAE(decoder, max_tile_sessions=0)


def test_tiled_encoding_with_a_session_per_shape_gives_the_same_latents(tiny, tiler):
    _, folder = tiny
    encoder = IOBindingORTModel.from_pretrained(folder, subfolder="vae_encoder")
    per_shape = TiledVAE(None, encoder, tile_sample_size=64, session_per_shape=True)
    image = torch.rand(1, 3, 160, 112, generator=torch.Generator().manual_seed(4)) * 2 - 1
    torch.testing.assert_close(per_shape.encode(image), tiler.encode(image), atol=0, rtol=0)
    assert len(per_shape.tile_models("encoder")) == 4  # 64², and edges of 16 (rows) and 16 (columns)

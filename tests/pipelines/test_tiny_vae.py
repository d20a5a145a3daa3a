"""The tiny VAE (diffusers' AutoencoderTiny, TAESD) exported in place of the full VAE, or alone; and the full VAE's
attention fused into one ORT Attention node by the optimized export. CPU, against diffusers' torch models on the
same tiny random weights; the GPU tests at the end run where CUDA is."""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from optimum_iobinding import IOBindingORTModel, OnnxStableDiffusionImg2ImgPipeline, OnnxStableDiffusionPipeline
from optimum_iobinding.cli import main as cli_main
from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.tiny import build_tiny_random_pipeline, build_tiny_random_tiny_vae
from tests.commands import error_line

PROMPT = "a photo of a cat"
VAE = ("vae_encoder", "vae_decoder")


@pytest.fixture(scope="module")
def tiny_vae():
    """The tiny random AutoencoderTiny every export here is made of (the builder is seeded)."""
    return build_tiny_random_tiny_vae().eval()


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory):
    """The tiny random Stable Diffusion pipeline with the tiny random tiny VAE."""
    return export_pipeline(
        None, tmp_path_factory.mktemp("sd-taesd") / "sd", tiny_random=True, tiny_vae=True, progress=False
    )


def session(folder, name):
    return ort.InferenceSession(str(folder / name / "model.onnx"), providers=["CPUExecutionProvider"])


def images(seed=0, batch=2, height=48, width=80):
    """Images in [-1, 1], the range diffusers' AutoencoderTiny encodes."""
    return torch.rand(batch, 3, height, width, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def torch_vae(vae, pixels):
    with torch.no_grad():
        latents = vae.encode(pixels).latents
        return latents, vae.decode(latents).sample


def io_signature(folder, name):
    """Each input's and output's name, element type and dims (dim names included) as the ONNX file declares them."""
    graph = onnx.load(str(folder / name / "model.onnx"), load_external_data=False).graph

    def describe(value):
        return (
            value.name,
            value.type.tensor_type.elem_type,
            tuple(d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim),
        )

    return [describe(v) for v in graph.input], [describe(v) for v in graph.output]


# ------------------------------------------------------------------------------------------------- the tiny VAE
def test_the_exported_encoder_and_decoder_equal_diffusers_autoencoder_tiny(vae_folder, tiny_vae):
    pixels = images()
    latents, decoded = torch_vae(tiny_vae, pixels)
    assert latents.shape == (2, 4, 6, 10) and latents.std() > 0.1 and decoded.std() > 0.1  # not a constant
    (ours,) = session(vae_folder, "vae_encoder").run(None, {"sample": pixels.numpy()})
    np.testing.assert_allclose(ours, latents.numpy(), atol=1e-5, rtol=1e-5)
    (ours,) = session(vae_folder, "vae_decoder").run(None, {"latent_sample": latents.numpy()})
    np.testing.assert_allclose(ours, decoded.numpy(), atol=1e-5, rtol=1e-5)


def test_the_tiny_vae_has_the_names_dtypes_and_axes_of_the_full_vae(vae_folder, pipeline_folder, tiny_folder):
    def dynamic_axes(signature):  # batch, height, width: the channels are fixed (the full encoder's is unnamed)
        return [[(name, dtype, dims[0], dims[2:]) for name, dtype, dims in values] for values in signature]

    for name in VAE:
        for folder in (vae_folder, pipeline_folder):
            assert dynamic_axes(io_signature(folder, name)) == dynamic_axes(io_signature(tiny_folder, name))
            inputs, outputs = io_signature(folder, name)
            assert [dims[1] for _, _, dims in inputs + outputs] == ([3, 4] if name == "vae_encoder" else [4, 3])


def test_the_tiny_vae_config_says_what_it_is_and_how_diffusers_scales_its_latents(vae_folder, tiny_vae):
    for name in VAE:
        config = json.loads((vae_folder / name / "config.json").read_text())
        assert config["_class_name"] == "AutoencoderTiny"
        assert config["scaling_factor"] == tiny_vae.config.scaling_factor == 1.0
        assert config["latent_channels"] == 4 and config["force_upcast"] is False
        assert len(config["block_out_channels"]) == 4  # the pipelines' 8× scale factor


def test_a_folder_of_the_tiny_vae_alone_holds_its_two_components_and_nothing_else(vae_folder):
    assert sorted(p.name for p in vae_folder.iterdir()) == sorted(VAE)  # no model_index.json: no pipeline
    for name in VAE:
        assert sorted(p.name for p in (vae_folder / name).iterdir()) == ["config.json", "model.onnx"]


def test_the_tiny_vae_alone_exports_one_component_when_asked(tmp_path):
    folder = export_pipeline(None, tmp_path / "decoder", tiny_vae=True, components=["vae_decoder"], progress=False)
    assert sorted(p.name for p in folder.iterdir()) == ["vae_decoder"]


def diffusers_img2img(tiny_vae):
    from diffusers import StableDiffusionImg2ImgPipeline

    pipe = StableDiffusionImg2ImgPipeline(**{**build_tiny_random_pipeline().components, "vae": tiny_vae})
    pipe.set_progress_bar_config(disable=True)
    return pipe


def img2img(pipe, **kwargs):
    start = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(7))
    return pipe(
        PROMPT,
        image=start,
        strength=0.75,
        num_inference_steps=3,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
        **kwargs,
    ).images


@pytest.mark.parametrize("io_binding", [True, False])
def test_img2img_with_the_tiny_vae_equals_diffusers_img2img_with_autoencoder_tiny(
    pipeline_folder, tiny_vae, io_binding
):
    expected = img2img(diffusers_img2img(tiny_vae))
    pipe = OnnxStableDiffusionImg2ImgPipeline.from_pretrained(pipeline_folder, io_binding=io_binding)
    pipe.set_progress_bar_config(disable=True)
    got = img2img(pipe)
    assert got.shape == (1, 64, 64, 3) and got.std() > 0.05
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_text_to_image_with_the_tiny_vae_equals_diffusers(pipeline_folder, tiny_vae):
    from diffusers import StableDiffusionPipeline

    theirs = StableDiffusionPipeline(**{**build_tiny_random_pipeline().components, "vae": tiny_vae})
    ours = OnnxStableDiffusionPipeline.from_pretrained(pipeline_folder)
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    got, expected = (
        pipe(
            PROMPT,
            height=64,
            width=64,
            num_inference_steps=2,
            latents=latents,
            output_type="np",
            generator=torch.Generator().manual_seed(0),
        ).images
        for pipe in (ours, theirs)
    )
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_the_tiny_vae_alone_replaces_a_pipelines_full_vae(vae_folder, tiny_folder, tiny_vae):
    # what a pipeline given a tiny VAE folder does: the folder's two components in place of its own
    full = OnnxStableDiffusionImg2ImgPipeline.from_pretrained(tiny_folder)
    pipe = OnnxStableDiffusionImg2ImgPipeline(
        **{**full.components, **{name: IOBindingORTModel.from_pretrained(vae_folder, subfolder=name) for name in VAE}}
    )
    pipe.set_progress_bar_config(disable=True)
    expected = img2img(diffusers_img2img(tiny_vae))
    np.testing.assert_allclose(img2img(pipe), expected, atol=1e-4)
    assert np.abs(img2img(full) - expected).max() > 1e-2  # the VAE decides the image


@pytest.mark.parametrize("optimize", [None, "cpu"])
def test_a_float16_tiny_vae_takes_and_gives_float16_and_stays_close(tmp_path, tiny_vae, optimize):
    folder = export_pipeline(None, tmp_path / "fp16", tiny_vae=True, fp16=True, optimize=optimize, progress=False)
    for name in VAE:
        inputs, outputs = io_signature(folder, name)
        assert [i[1] for i in inputs + outputs] == [onnx.TensorProto.FLOAT16] * 2
    pixels = images(batch=1)
    latents, decoded = torch_vae(tiny_vae, pixels)
    (ours,) = session(folder, "vae_encoder").run(None, {"sample": pixels.numpy().astype(np.float16)})
    np.testing.assert_allclose(ours.astype(np.float32), latents.numpy(), atol=2e-2, rtol=2e-2)
    (ours,) = session(folder, "vae_decoder").run(None, {"latent_sample": latents.numpy().astype(np.float16)})
    np.testing.assert_allclose(ours.astype(np.float32), decoded.numpy(), atol=2e-2, rtol=2e-2)


def test_the_cpu_optimized_tiny_vae_equals_diffusers(tmp_path, tiny_vae):
    folder = export_pipeline(None, tmp_path / "cpu", tiny_vae=True, optimize="cpu", progress=False)
    pixels = images()
    latents, decoded = torch_vae(tiny_vae, pixels)
    (ours,) = session(folder, "vae_encoder").run(None, {"sample": pixels.numpy()})
    np.testing.assert_allclose(ours, latents.numpy(), atol=1e-5, rtol=1e-5)
    (ours,) = session(folder, "vae_decoder").run(None, {"latent_sample": latents.numpy()})
    np.testing.assert_allclose(ours, decoded.numpy(), atol=1e-5, rtol=1e-5)


def test_the_cuda_optimized_tiny_vae_runs_its_convolutions_channels_last(tmp_path):
    # ORT's NhwcConv (CUDA only): the fusion the optimizer has for a model of convolutions and no attention
    folder = export_pipeline(None, tmp_path / "cuda", tiny_vae=True, optimize="cuda", progress=False)
    for name in VAE:
        ops = [node.op_type for node in onnx.load(str(folder / name / "model.onnx")).graph.node]
        assert "NhwcConv" in ops and "Conv" not in ops


# ------------------------------------------------------------------------------------------------------ the CLI
def test_cli_exports_a_pipeline_with_a_tiny_vae_folder(tmp_path, tiny_vae, capsys):
    tiny_vae.save_pretrained(str(tmp_path / "taesd"))
    assert (
        cli_main(["export", "--tiny-random", "--tiny-vae", str(tmp_path / "taesd"), "--output", str(tmp_path / "onnx")])
        == 0
    )
    assert "with the tiny VAE" in capsys.readouterr().out
    assert (
        json.loads((tmp_path / "onnx" / "vae_decoder" / "config.json").read_text())["_class_name"] == "AutoencoderTiny"
    )
    assert (tmp_path / "onnx" / "model_index.json").is_file()
    pixels = images(batch=1)
    (ours,) = session(tmp_path / "onnx", "vae_encoder").run(None, {"sample": pixels.numpy()})
    np.testing.assert_allclose(ours, torch_vae(tiny_vae, pixels)[0].numpy(), atol=1e-5, rtol=1e-5)


def test_cli_exports_the_tiny_random_tiny_vae_alone_offline(tmp_path, capsys):
    assert cli_main(["export", "--tiny-vae", "--output", str(tmp_path / "taesd")]) == 0
    assert "exported a tiny random tiny VAE" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "taesd").iterdir()) == sorted(VAE)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--tiny-random", "--tiny-vae", "{full}"],
            "--tiny-vae: expected an AutoencoderTiny folder or hub id, got "
            "'{full}', whose config.json names the class AutoencoderKL; a full "
            "VAE goes in --vae",
        ),
        (
            ["--tiny-random", "--tiny-vae", "{wide}"],
            "--tiny-vae: expected a tiny VAE of 4 latent channels (the UNet's), got one of 16",
        ),
        (
            ["--tiny-vae", "{tmp}"],
            "--tiny-vae: expected a folder holding an AutoencoderTiny's config.json, got '{tmp}'",
        ),
        (["--tiny-vae", "./no/such/folder"], "--tiny-vae: expected an existing local folder or a hub repository id"),
        (["some/model", "--tiny-vae"], "--tiny-vae: expected an AutoencoderTiny's folder or hub id for 'some/model'"),
        (
            ["--tiny-random", "--tiny-vae", "--vae", "some/vae"],
            "--vae and --tiny-vae: expected one VAE to export, got both",
        ),
        (
            ["--tiny-vae", "--controlnet", "some/controlnet"],
            "--controlnet: expected none for a folder of the tiny VAE alone",
        ),
    ],
    ids=["full-vae", "latent-channels", "no-config", "missing", "random-for-a-model", "two-vaes", "controlnet"],
)
def test_cli_tiny_vae_mistakes_name_the_option_and_write_nothing(tmp_path, capsys, argv, message):
    build_tiny_random_pipeline().vae.save_pretrained(str(tmp_path / "full"))
    build_tiny_random_tiny_vae(latent_channels=16).save_pretrained(str(tmp_path / "wide"))
    names = dict(full=tmp_path / "full", wide=tmp_path / "wide", tmp=tmp_path)
    argv = [arg.format(**names) for arg in argv]
    assert cli_main(["export", *argv, "--output", str(tmp_path / "out")]) == 2
    assert message.format(**names) in error_line(capsys)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ bad arguments
@pytest.mark.parametrize(
    "make, error, message",
    [
        (
            lambda tmp: build_tiny_random_pipeline().vae,
            TypeError,
            r"tiny_vae: expected an AutoencoderTiny, its folder or hub id, or True \(a tiny random one\), got "
            "AutoencoderKL; an AutoencoderKL is a full VAE: pass it as vae=",
        ),
        (lambda tmp: 3, TypeError, "tiny_vae: expected an AutoencoderTiny, its folder or hub id, or True"),
        (
            lambda tmp: build_tiny_random_tiny_vae(latent_channels=16),
            ValueError,
            r"tiny_vae: expected a tiny VAE of 4 latent channels \(the UNet's\), got one of 16",
        ),
        (
            lambda tmp: str(tmp / "missing"),
            ValueError,
            "tiny_vae: expected an AutoencoderTiny folder or hub id .*, got '.*missing', which does not load: ",
        ),
        (
            lambda tmp: build_tiny_random_pipeline().vae.save_pretrained(str(tmp / "full")) or tmp / "full",
            TypeError,
            "tiny_vae: expected an AutoencoderTiny folder or hub id, got '.*full', whose config.json names the class "
            "AutoencoderKL; a full VAE goes in vae$",
        ),
    ],
    ids=["full-vae", "a-number", "latent-channels", "unloadable", "full-vae-folder"],
)
def test_a_wrong_tiny_vae_is_a_named_error_before_anything_is_written(tmp_path, make, error, message):
    with pytest.raises(error, match=message):
        export_pipeline(None, tmp_path / "out", tiny_random=True, tiny_vae=make(tmp_path), progress=False)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no partial folder either


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(model_id_or_path="some/model", tiny_vae=True),
            r"tiny_vae: True \(a tiny random AutoencoderTiny\) goes "
            "with tiny_random or alone",
        ),
        (
            dict(tiny_random=True, tiny_vae=True, vae="some/vae"),
            "vae and tiny_vae: expected one VAE to export, got both",
        ),
        (
            dict(tiny_vae=True, components=["unet"]),
            r"components: a folder of the tiny VAE alone has \['vae_encoder', "
            r"'vae_decoder'\], got \['unet'\]",
        ),
    ],
    ids=["random-for-a-model", "two-vaes", "vae-alone-with-a-unet"],
)
def test_tiny_vae_arguments_that_do_not_go_together_are_refused_first(tmp_path, kwargs, message):
    kwargs = {"model_id_or_path": None, **kwargs}
    with pytest.raises(ValueError, match=message):
        export_pipeline(output_dir=tmp_path / "out", progress=False, **kwargs)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ the full VAE's attention, fused
def test_the_optimized_full_vae_fuses_its_attention_without_falling_back(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        folder = export_pipeline(
            None, tmp_path / "vae", tiny_random=True, optimize="cpu", components=VAE, progress=False
        )
    assert "attention fusion failed" not in caplog.text
    for name in VAE:
        nodes = onnx.load(str(folder / name / "model.onnx")).graph.node
        assert [(n.domain, n.op_type) for n in nodes if n.op_type in ("Attention", "Softmax")] == [
            ("com.microsoft", "Attention")
        ]  # the mid block's one attention, fused


def test_the_fused_full_vae_computes_what_the_unfused_export_and_diffusers_compute(tiny_fused_folder, tiny_folder):
    vae = build_tiny_random_pipeline().vae.eval()
    pixels = images(batch=2, height=64, width=96)
    with torch.no_grad():
        latents = vae.encode(pixels).latent_dist.mode()
        decoded = vae.decode(latents).sample
    for folder in (tiny_fused_folder, tiny_folder):
        (encoded,) = session(folder, "vae_encoder").run(None, {"sample": pixels.numpy()})
        np.testing.assert_allclose(encoded, latents.numpy(), atol=1e-4, rtol=1e-4)
        (ours,) = session(folder, "vae_decoder").run(None, {"latent_sample": latents.numpy()})
        np.testing.assert_allclose(ours, decoded.numpy(), atol=1e-4, rtol=1e-4)
    fused, unfused = (
        session(folder, "vae_decoder").run(None, {"latent_sample": latents.numpy()})[0]
        for folder in (tiny_fused_folder, tiny_folder)
    )
    np.testing.assert_allclose(fused, unfused, atol=1e-5, rtol=1e-5)


def test_the_optimized_export_leaves_the_callers_vae_attention_as_it_was(tmp_path):
    pipe = build_tiny_random_pipeline()
    before = {name: type(processor) for name, processor in pipe.vae.attn_processors.items()}
    export_pipeline(None, tmp_path / "vae", torch_pipeline=pipe, optimize="cpu", components=VAE, progress=False)
    assert {name: type(processor) for name, processor in pipe.vae.attn_processors.items()} == before


# ------------------------------------------------------------------------------------------------------ the GPU
def exact(fp16: bool) -> dict:
    """fp32 compared at 1e-4 runs without TF32 (ORT's CUDA provider uses it for fp32 convolutions and matmuls by
    default: 1e-3 apart from the CPU's on Hopper)."""
    return {} if fp16 else {"use_tf32": "0"}


@pytest.mark.gpu
@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_on_cuda_the_tiny_vae_alone_equals_diffusers_through_captured_graphs(tmp_path, tiny_vae, fp16):
    folder = export_pipeline(None, tmp_path / "taesd", tiny_vae=True, fp16=fp16, optimize="cuda", progress=False)
    dtype = torch.float16 if fp16 else torch.float32
    encoder, decoder = (
        IOBindingORTModel.from_pretrained(
            folder, subfolder=name, provider="CUDAExecutionProvider", provider_options=exact(fp16), cuda_graph=True
        )
        for name in VAE
    )
    pixels = images(batch=1, height=64, width=64)
    latents, decoded = torch_vae(tiny_vae, pixels)
    tolerance = 2e-2 if fp16 else 1e-4
    for _ in range(2):  # the second call replays the graph captured by the first
        (ours,) = encoder(sample=pixels.to("cuda", dtype))
        np.testing.assert_allclose(ours.float().cpu().numpy(), latents.numpy(), atol=tolerance, rtol=tolerance)
        (ours,) = decoder(latent_sample=latents.to("cuda", dtype))
        np.testing.assert_allclose(ours.float().cpu().numpy(), decoded.numpy(), atol=tolerance, rtol=tolerance)
    assert encoder.graph_signatures and decoder.graph_signatures


@pytest.mark.gpu
@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_on_cuda_the_fused_full_vae_decoder_equals_the_unfused_one(tmp_path, tiny_folder, fp16):
    folder = export_pipeline(
        None, tmp_path / "vae", tiny_random=True, fp16=fp16, optimize="cuda", components=VAE, progress=False
    )
    dtype = torch.float16 if fp16 else torch.float32
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    (expected,) = session(tiny_folder, "vae_decoder").run(None, {"latent_sample": latents.numpy()})
    decoder = IOBindingORTModel.from_pretrained(
        folder, subfolder="vae_decoder", provider="CUDAExecutionProvider", provider_options=exact(fp16)
    )
    (ours,) = decoder(latent_sample=latents.to("cuda", dtype))
    tolerance = 2e-2 if fp16 else 1e-4
    np.testing.assert_allclose(ours.float().cpu().numpy(), expected, atol=tolerance, rtol=tolerance)

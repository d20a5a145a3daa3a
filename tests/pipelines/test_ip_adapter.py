"""IP-Adapter on the Stable Diffusion pipelines: a UNet exported with image-prompt inputs and an image encoder, an
adapter loaded at run time, against diffusers' torch pipeline with the same adapter (tiny random weights, fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from optimum_iobinding.errors import ArgumentError
from tests.ip_adapter_models import (
    TURBO,
    adapter_state_dict,
    full_adapter_state_dict,
    image_encoder,
    prompt_image,
    torch_pipeline,
)

PROMPT = "a photo of a cat"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from optimum_iobinding.export import export_pipeline

    root = tmp_path_factory.mktemp("ip-adapter")
    with_encoder = export_pipeline(None, root / "with-encoder", torch_pipeline=torch_pipeline(), ip_adapter=True)
    from optimum_iobinding.export.tiny import build_tiny_random_pipeline

    embeds_only = export_pipeline(
        None, root / "embeds-only", torch_pipeline=build_tiny_random_pipeline(), ip_adapter=True
    )
    return {"with-encoder": with_encoder, "embeds-only": embeds_only}


def reference(state_dict, scale=1.0):
    pipe = torch_pipeline()
    pipe.load_ip_adapter(state_dict, subfolder="", weight_name="")
    pipe.set_ip_adapter_scale(scale)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def ours(folder, io_binding=True):
    from optimum_iobinding import OnnxStableDiffusionPipeline

    pipe = OnnxStableDiffusionPipeline.from_pretrained(folder, io_binding=io_binding)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, **kwargs):
    kwargs = {"prompt": PROMPT, "num_inference_steps": 3, "output_type": "np", "height": 64, "width": 64, **kwargs}
    return pipe(generator=torch.Generator().manual_seed(0), **kwargs).images


@pytest.mark.parametrize("io_binding", [True, False])
@pytest.mark.parametrize(
    "kwargs, scale",
    [({}, 1.0), ({"guidance_scale": 1.0}, 1.0), ({"num_images_per_prompt": 2}, 0.5)],
    ids=["guided", "unguided", "two-images-scale-0.5"],
)
def test_an_image_prompt_equals_diffusers(folders, io_binding, kwargs, scale):
    state = adapter_state_dict(torch_pipeline().unet, seed=1)
    pipe = ours(folders["with-encoder"], io_binding)
    pipe.load_ip_adapter(state)
    pipe.set_ip_adapter_scale(scale)
    got = run(pipe, ip_adapter_image=prompt_image(), **kwargs)
    expected = run(reference(state, scale), ip_adapter_image=prompt_image(), **kwargs)
    np.testing.assert_allclose(got, expected, atol=1e-4)
    assert (
        np.abs(got - run(ours(folders["with-encoder"], io_binding), **kwargs)).max() > 1e-3
    )  # the image prompt counts


@pytest.mark.parametrize("guidance", [7.5, 1.0])
def test_an_adapter_of_the_encoders_hidden_states_equals_diffusers(folders, guidance):
    state = full_adapter_state_dict(torch_pipeline().unet, seed=3)
    pipe = ours(folders["with-encoder"])
    pipe.load_ip_adapter(state)
    got = run(pipe, ip_adapter_image=prompt_image(), guidance_scale=guidance)
    expected = run(reference(state), ip_adapter_image=prompt_image(), guidance_scale=guidance)
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_img2img_with_an_image_prompt_equals_diffusers(folders, vae_encodes_its_mode):
    import diffusers

    from optimum_iobinding import OnnxStableDiffusionImg2ImgPipeline

    state = adapter_state_dict(torch_pipeline().unet, seed=1)
    start = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(2)) * 2 - 1
    pipe = OnnxStableDiffusionImg2ImgPipeline.from_pretrained(folders["with-encoder"])
    pipe.set_progress_bar_config(disable=True)
    pipe.load_ip_adapter(state)
    reference_pipe = vae_encodes_its_mode(diffusers.StableDiffusionImg2ImgPipeline.from_pipe(reference(state)))
    call = dict(prompt=PROMPT, image=start, strength=0.6, num_inference_steps=4, output_type="np")
    got = pipe(generator=torch.Generator().manual_seed(0), ip_adapter_image=prompt_image(), **call).images
    expected = reference_pipe(
        generator=torch.Generator().manual_seed(0),
        ip_adapter_image=prompt_image(),
        **{**call, "image": start / 2 + 0.5},
    ).images
    np.testing.assert_allclose(got, expected, atol=1e-4)


@pytest.mark.parametrize(
    "scale",
    [{"up": {"block_0": [0.0, 1.0]}}, {"down": 0.7, "mid": 0.2}, [{"down": {"block_1": [0.5]}, "up": 0.3}]],
    ids=["style-layer", "down-and-mid", "list-of-one"],
)
def test_per_block_scales_equal_diffusers(folders, scale):
    state = adapter_state_dict(torch_pipeline().unet, seed=1)
    pipe = ours(folders["with-encoder"])
    pipe.load_ip_adapter(state)
    pipe.set_ip_adapter_scale(scale)
    got = run(pipe, ip_adapter_image=prompt_image())
    np.testing.assert_allclose(got, run(reference(state, scale), ip_adapter_image=prompt_image()), atol=1e-4)


def test_image_embeds_a_switched_adapter_and_unloading(folders):
    first, second = adapter_state_dict(torch_pipeline().unet, 1), adapter_state_dict(torch_pipeline().unet, 2)
    embeds = torch.randn(2, 1, 32, generator=torch.Generator().manual_seed(4))  # [negative; positive]
    pipe = ours(folders["embeds-only"])
    plain = run(pipe)
    pipe.load_ip_adapter(first)
    pipe.load_ip_adapter(second)  # replaces the first: no session is made
    sessions = pipe.unet.session
    got = run(pipe, ip_adapter_image_embeds=[embeds])
    np.testing.assert_allclose(got, run(reference(second), ip_adapter_image_embeds=[embeds]), atol=1e-4)
    assert pipe.unet.session is sessions
    pipe.set_ip_adapter_scale(0.0)  # an image-prompt attention of zero: the plain image
    np.testing.assert_allclose(run(pipe, ip_adapter_image_embeds=[embeds]), plain, atol=1e-6)
    pipe.unload_ip_adapter()
    np.testing.assert_array_equal(run(pipe), plain)


def test_the_image_encoder_declares_the_size_of_every_output_but_the_batch(folders):
    # ONNX shape inference stops at the encoder's attention nodes: an output dim the export did not declare is one a
    # CUDA graph cannot know before the run (the encoder would run uncaptured)
    import onnx

    from optimum_iobinding import IOBindingORTModel

    path = folders["with-encoder"] / "image_encoder" / "model.onnx"
    declared = {
        output.name: [dim.dim_value or dim.dim_param for dim in output.type.tensor_type.shape.dim]
        for output in onnx.load(str(path), load_external_data=False).graph.output
    }  # what the file says (the CPU session reports what ORT infers besides)
    config = torch_pipeline().image_encoder.config
    tokens = (config.image_size // config.patch_size) ** 2 + 1
    assert declared == {
        "image_embeds": ["batch", config.projection_dim],
        "penultimate_hidden_states": ["batch", tokens, config.hidden_size],
    }
    encoder = IOBindingORTModel.from_pretrained(folders["with-encoder"], subfolder="image_encoder")
    outputs = encoder(pixel_values=torch.rand(2, 3, config.image_size, config.image_size))
    assert [tuple(output.shape) for output in outputs] == [
        (2, config.projection_dim),
        (2, tokens, config.hidden_size),
    ]


def test_a_saved_pipeline_keeps_its_image_encoder_and_layer_names(folders, tmp_path):
    state = adapter_state_dict(torch_pipeline().unet, seed=1)
    pipe = ours(folders["with-encoder"])
    pipe.save_pretrained(tmp_path / "saved")
    again = ours(tmp_path / "saved")
    for loaded in (pipe, again):
        loaded.load_ip_adapter(state)
        loaded.set_ip_adapter_scale({"up": {"block_0": [0.0, 1.0]}})
    np.testing.assert_array_equal(
        run(again, ip_adapter_image=prompt_image()), run(pipe, ip_adapter_image=prompt_image())
    )


def test_the_plain_export_and_a_folder_without_adapter_or_encoder_are_refused_by_name(folders, tiny_folder, tmp_path):
    state = adapter_state_dict(torch_pipeline().unet, 1)
    with pytest.raises(ArgumentError, match=r"pretrained_model_name_or_path_or_dict: expected a UNet exported for"):
        ours(tiny_folder).load_ip_adapter(state)
    pipe = ours(folders["embeds-only"])
    with pytest.raises(ArgumentError, match=r"ip_adapter_image: expected a loaded IP-Adapter"):
        run(pipe, ip_adapter_image=prompt_image())
    pipe.load_ip_adapter(state)
    with pytest.raises(ArgumentError, match=r"ip_adapter_image: expected a folder with an image_encoder"):
        run(pipe, ip_adapter_image=prompt_image())
    with pytest.raises(ArgumentError, match=r"expected ip_adapter_image or ip_adapter_image_embeds, got both"):
        run(pipe, ip_adapter_image=prompt_image(), ip_adapter_image_embeds=[torch.zeros(2, 1, 32)])
    wrong = {**state, "ip_adapter": {k: v for k, v in state["ip_adapter"].items() if not k.startswith("1.")}}
    with pytest.raises(ArgumentError, match=r"cross-attention layers"):
        pipe.load_ip_adapter(wrong)
    other_width = {**state, "ip_adapter": {k: v[:, :16] for k, v in state["ip_adapter"].items()}}
    with pytest.raises(
        ArgumentError, match=r"layer 1's to_k_ip of shape \(64, 32\) \(this UNet's widths\), got \(64, 16\)"
    ):
        pipe.load_ip_adapter(other_width)
    (tmp_path / "broken.safetensors").write_text("not weights")
    with pytest.raises(ArgumentError, match=r"weight_name: expected an IP-Adapter weights file"):
        pipe.load_ip_adapter(str(tmp_path), weight_name="broken.safetensors")
    with pytest.raises(ArgumentError, match=r"scale: expected per-block scales of this UNet's blocks"):
        pipe.set_ip_adapter_scale({"up": {"block_0": [1.0] * 7}})
    with pytest.raises(ArgumentError, match=r"scale: expected one scale"):
        pipe.set_ip_adapter_scale([0.5, 0.5])


def test_the_export_refuses_what_takes_no_image_prompt(tmp_path):
    from optimum_iobinding.export import export_pipeline

    with pytest.raises(ArgumentError, match=r"ip_adapter: expected it without step_cache"):
        export_pipeline(None, tmp_path / "a", tiny_random=True, ip_adapter=True, step_cache=True)
    with pytest.raises(ArgumentError, match=r"image_encoder: expected it with ip_adapter=True"):
        export_pipeline(None, tmp_path / "b", tiny_random=True, image_encoder=image_encoder())
    with pytest.raises(
        ArgumentError,
        match=r"ip_adapter: expected a Stable Diffusion 1.x/2.x or SDXL pipeline .*, got a LatentConsistencyModelPipeline",
    ):
        export_pipeline(None, tmp_path / "c", tiny_random="lcm", ip_adapter=True)


# ------------------------------------------------------------------------------------------------------ the stream


def stream_of(folder):
    import diffusers

    from optimum_iobinding import OnnxStreamDiffusionPipeline

    stream = OnnxStreamDiffusionPipeline.from_pretrained(folder)
    name, overrides = TURBO
    stream.scheduler = getattr(diffusers, name).from_config(stream.scheduler.config, **overrides)
    return stream


def one_step_img2img(pipe, frame, **kwargs):
    """diffusers' image-to-image ``pipe`` as the stream runs it, SD-Turbo's one step: a [-1, 1] frame in, a [-1, 1]
    image out."""
    import diffusers

    name, overrides = TURBO
    pipe.scheduler = getattr(diffusers, name).from_config(pipe.scheduler.config, **overrides)
    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        PROMPT,
        image=frame[None] / 2 + 0.5,
        generator=torch.Generator().manual_seed(3),
        output_type="pt",
        strength=0.5,
        num_inference_steps=2,
        **kwargs,
    ).images
    return image[0] * 2 - 1


def diffusers_img2img(vae_encodes_its_mode, state, frame, scale=1.0, **kwargs):
    import diffusers

    pipe = vae_encodes_its_mode(diffusers.StableDiffusionImg2ImgPipeline.from_pipe(reference(state, scale)))
    return one_step_img2img(pipe, frame, **kwargs)


@pytest.mark.parametrize("guidance", [0.0, 3.0])
def test_a_streams_image_prompt_equals_diffusers_img2img_and_updates_in_place(folders, guidance, vae_encodes_its_mode):
    state = adapter_state_dict(torch_pipeline().unet, seed=1)
    frame = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    stream = stream_of(folders["with-encoder"])
    stream.load_ip_adapter(state)
    stream.prepare(PROMPT, seed=3, height=64, width=64, guidance_scale=guidance, ip_adapter_image=prompt_image())
    expected = diffusers_img2img(
        vae_encodes_its_mode, state, frame, ip_adapter_image=prompt_image(), guidance_scale=guidance
    )
    torch.testing.assert_close(stream(frame), expected, atol=1e-4, rtol=0)
    inputs = dict(stream.unet_inputs)
    stream.set_ip_adapter_scale(0.5)
    stream.update_image_prompt(ip_adapter_image=prompt_image(seed=8))  # another image at another scale, in place
    assert all(stream.unet_inputs[name] is value for name, value in inputs.items())
    expected = diffusers_img2img(
        vae_encodes_its_mode, state, frame, 0.5, ip_adapter_image=prompt_image(seed=8), guidance_scale=guidance
    )
    torch.testing.assert_close(stream(frame), expected, atol=1e-4, rtol=0)
    stream.update_image_prompt()  # none: the stream without an image prompt
    stream.unload_ip_adapter()
    plain = stream_of(folders["with-encoder"])
    plain.prepare(PROMPT, seed=3, height=64, width=64, guidance_scale=guidance)
    torch.testing.assert_close(stream(frame), plain(frame), atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------------------------------ SDXL
@pytest.fixture(scope="module")
def xl_folder_for_ip(tmp_path_factory):
    from optimum_iobinding.export import export_pipeline
    from optimum_iobinding.export.tiny import build_tiny_random_xl_pipeline

    folder = tmp_path_factory.mktemp("ip-adapter-xl") / "onnx"
    return export_pipeline(
        None, folder, torch_pipeline=build_tiny_random_xl_pipeline(), ip_adapter=True, image_encoder=image_encoder()
    )


def xl_reference(state, scale):
    from optimum_iobinding.export.tiny import build_tiny_random_xl_pipeline

    pipe = build_tiny_random_xl_pipeline()
    pipe.register_modules(image_encoder=image_encoder())
    pipe.load_ip_adapter(state, subfolder="", weight_name="")
    pipe.set_ip_adapter_scale(scale)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("guidance", [5.0, 1.0])
def test_sdxl_with_an_image_prompt_equals_diffusers(xl_folder_for_ip, guidance):
    from optimum_iobinding import OnnxStableDiffusionXLPipeline
    from optimum_iobinding.export.tiny import build_tiny_random_xl_pipeline

    folder = xl_folder_for_ip
    state = adapter_state_dict(build_tiny_random_xl_pipeline().unet, seed=1)
    pipe = OnnxStableDiffusionXLPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_ip_adapter(state)
    pipe.set_ip_adapter_scale(0.7)
    got = run(pipe, ip_adapter_image=prompt_image(), guidance_scale=guidance)
    expected = run(xl_reference(state, 0.7), ip_adapter_image=prompt_image(), guidance_scale=guidance)
    np.testing.assert_allclose(got, expected, atol=1e-4)
    pipe.unload_ip_adapter()
    assert np.abs(got - run(pipe, guidance_scale=guidance)).max() > 1e-3


def test_an_sdxl_streams_image_prompt_equals_diffusers_sdxl_img2img(xl_folder_for_ip, vae_encodes_its_mode):
    import diffusers

    from optimum_iobinding.export.tiny import build_tiny_random_xl_pipeline

    state = adapter_state_dict(build_tiny_random_xl_pipeline().unet, seed=1)
    frame = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    stream = stream_of(xl_folder_for_ip)
    stream.load_ip_adapter(state)
    stream.prepare(PROMPT, seed=3, height=64, width=64, guidance_scale=3.0, ip_adapter_image=prompt_image())
    pipe = vae_encodes_its_mode(diffusers.StableDiffusionXLImg2ImgPipeline.from_pipe(xl_reference(state, 1.0)))
    expected = one_step_img2img(pipe, frame, guidance_scale=3.0, ip_adapter_image=prompt_image())
    torch.testing.assert_close(stream(frame), expected, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------- what users get wrong
def test_the_export_leaves_the_torch_pipeline_as_it_was(tmp_path):
    from optimum_iobinding.export import export_pipeline

    pipe = torch_pipeline()
    pipe.set_progress_bar_config(disable=True)
    before = run(pipe, guidance_scale=1.0)
    export_pipeline(None, tmp_path / "onnx", torch_pipeline=pipe, ip_adapter=True)
    np.testing.assert_array_equal(run(pipe, guidance_scale=1.0), before)
    assert (tmp_path / "onnx" / "image_encoder" / "model.onnx").is_file()
    assert not any("forward" in module.__dict__ for module in pipe.image_encoder.modules())  # its layers' own


def test_a_tensor_image_prompt_is_the_encoders_pixel_values_as_in_diffusers(folders):
    state = adapter_state_dict(torch_pipeline().unet, seed=1)
    pixels = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(6)) * 2 - 1  # preprocessed already
    pipe = ours(folders["with-encoder"])
    pipe.load_ip_adapter(state)
    got = run(pipe, ip_adapter_image=pixels)
    np.testing.assert_allclose(got, run(reference(state), ip_adapter_image=pixels), atol=1e-4)
    with pytest.raises(ArgumentError, match=r"ip_adapter_image: expected a tensor of the image encoder's pixel_values"):
        run(pipe, ip_adapter_image=torch.rand(1, 3, 64, 64))


def test_image_embeds_of_each_image_and_wrong_ones(folders):
    state = adapter_state_dict(torch_pipeline().unet, seed=1)
    pipe = ours(folders["embeds-only"])
    pipe.load_ip_adapter(state)
    one = torch.randn(2, 1, 32, generator=torch.Generator().manual_seed(4))
    each = torch.cat([one[:1], one[:1], one[1:], one[1:]])  # one row per image: the same as one shared
    shared = run(pipe, ip_adapter_image_embeds=[one], num_images_per_prompt=2)
    np.testing.assert_allclose(run(pipe, ip_adapter_image_embeds=[each], num_images_per_prompt=2), shared, atol=1e-6)
    for wrong in (one[:1], torch.randn(2, 1, 48), torch.randn(2, 32), torch.randn(6, 1, 32)):
        with pytest.raises(ArgumentError, match=r"ip_adapter_image_embeds: expected a (list of one )?tensor of shape"):
            run(pipe, ip_adapter_image_embeds=[wrong])


def test_an_adapter_for_another_image_encoder_and_other_encoder_folders_are_refused(folders):
    from diffusers.models.embeddings import ImageProjection

    state = adapter_state_dict(torch_pipeline().unet, seed=1)
    wider = ImageProjection(cross_attention_dim=32, image_embed_dim=48, num_image_text_embeds=4).state_dict()
    state["image_proj"] = {
        "proj.weight": wider["image_embeds.weight"],
        "proj.bias": wider["image_embeds.bias"],
        "norm.weight": wider["norm.weight"],
        "norm.bias": wider["norm.bias"],
    }
    pipe = ours(folders["with-encoder"])
    with pytest.raises(ArgumentError, match=r"image encoder's image_embeds of width 32, got one taking 48"):
        pipe.load_ip_adapter(state)
    assert pipe._ip_adapter is None  # nothing half-loaded
    with pytest.raises(ArgumentError, match=r"image_encoder_folder: expected the default"):
        pipe.load_ip_adapter(adapter_state_dict(torch_pipeline().unet, 1), image_encoder_folder="models/other")
    with pytest.raises(ArgumentError, match=r"pretrained_model_name_or_path_or_dict: expected a local folder or a hub"):
        pipe.load_ip_adapter("no/such-folder-here", weight_name="ip.safetensors", local_files_only=True)


def test_a_refused_image_prompt_leaves_the_prepared_stream_as_it_was(folders):
    state = adapter_state_dict(torch_pipeline().unet, seed=1)
    frame = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    stream = stream_of(folders["with-encoder"])
    stream.load_ip_adapter(state)
    stream.prepare(PROMPT, seed=3, height=64, width=64, ip_adapter_image=prompt_image())
    before = stream(frame)
    with pytest.raises(ArgumentError, match=r"ip_adapter_image_embeds: expected a tensor of shape"):
        stream.prepare(PROMPT, seed=3, height=64, width=64, ip_adapter_image_embeds=[torch.randn(1, 1, 48)])
    assert stream.prepared
    torch.testing.assert_close(stream(frame), before, atol=0, rtol=0)
    plain = stream_of(folders["with-encoder"])
    plain.prepare(PROMPT, seed=3, height=64, width=64)
    plain.load_ip_adapter(state)
    with pytest.raises(ArgumentError, match=r"a stream prepared without an image prompt has 1"):
        plain.update_image_prompt(ip_adapter_image_embeds=[torch.randn(1, 1, 32)])


# ------------------------------------------------------------------------------------------------- with ControlNets
@pytest.fixture(scope="module")
def controlnet_folder_for_ip(tmp_path_factory):
    from optimum_iobinding.export import export_pipeline
    from optimum_iobinding.export.tiny import build_tiny_random_controlnet_pipeline

    pipe = build_tiny_random_controlnet_pipeline()
    pipe.register_modules(image_encoder=image_encoder())
    return export_pipeline(
        None, tmp_path_factory.mktemp("ip-controlnet") / "onnx", torch_pipeline=pipe, ip_adapter=True
    )


def controlnet_reference(state, pipeline_class_name="StableDiffusionControlNetPipeline"):
    import diffusers

    from optimum_iobinding.export.tiny import build_tiny_random_controlnet_pipeline

    pipe = getattr(diffusers, pipeline_class_name)(**build_tiny_random_controlnet_pipeline().components)
    pipe.register_modules(image_encoder=image_encoder())
    pipe.load_ip_adapter(state, subfolder="", weight_name="")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("guidance", [7.5, 1.0])
def test_a_controlnet_pipeline_with_an_image_prompt_equals_diffusers(controlnet_folder_for_ip, guidance):
    from optimum_iobinding import OnnxStableDiffusionControlNetPipeline

    state = adapter_state_dict(torch_pipeline().unet, seed=1)
    control = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(5))
    pipe = OnnxStableDiffusionControlNetPipeline.from_pretrained(controlnet_folder_for_ip)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_ip_adapter(state)
    call = dict(image=control, guidance_scale=guidance, ip_adapter_image=prompt_image())
    np.testing.assert_allclose(run(pipe, **call), run(controlnet_reference(state), **call), atol=1e-4)


def test_a_controlnet_stream_with_an_image_prompt_equals_diffusers(controlnet_folder_for_ip, vae_encodes_its_mode):

    state = adapter_state_dict(torch_pipeline().unet, seed=1)
    frame = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    control = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(5))
    stream = stream_of(controlnet_folder_for_ip)
    stream.load_ip_adapter(state)
    stream.prepare(PROMPT, seed=3, height=64, width=64, control_image=control, ip_adapter_image=prompt_image())
    pipe = vae_encodes_its_mode(controlnet_reference(state, "StableDiffusionControlNetImg2ImgPipeline"))
    expected = one_step_img2img(
        pipe,
        frame,
        control_image=control,
        controlnet_conditioning_scale=0.8,
        guidance_scale=0.0,
        ip_adapter_image=prompt_image(),
    )
    torch.testing.assert_close(stream(frame), expected, atol=1e-4, rtol=0)


def test_an_sdxl_controlnet_pipeline_with_an_image_prompt_equals_diffusers(tmp_path_factory):
    import diffusers

    from optimum_iobinding import OnnxStableDiffusionXLControlNetPipeline
    from optimum_iobinding.export import export_pipeline
    from optimum_iobinding.export.tiny import build_tiny_random_xl_controlnet_pipeline

    def with_encoder():
        pipe = build_tiny_random_xl_controlnet_pipeline()
        pipe.register_modules(image_encoder=image_encoder())
        return pipe

    folder = export_pipeline(
        None, tmp_path_factory.mktemp("ip-xl-controlnet") / "onnx", torch_pipeline=with_encoder(), ip_adapter=True
    )
    state = adapter_state_dict(with_encoder().unet, seed=1)
    control = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(5))
    pipe = OnnxStableDiffusionXLControlNetPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_ip_adapter(state)
    pipe.set_ip_adapter_scale(0.7)
    reference_pipe = diffusers.StableDiffusionXLControlNetPipeline(**with_encoder().components)
    reference_pipe.load_ip_adapter(state, subfolder="", weight_name="")
    reference_pipe.set_ip_adapter_scale(0.7)
    reference_pipe.set_progress_bar_config(disable=True)
    call = dict(image=control, guidance_scale=5.0, ip_adapter_image=prompt_image())
    np.testing.assert_allclose(run(pipe, **call), run(reference_pipe, **call), atol=1e-4)

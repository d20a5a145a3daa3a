"""Runtime LoRA: the export's map of where each torch layer's weight went in the ONNX file."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from optimum_iobinding import OnnxStableDiffusionImg2ImgPipeline, OnnxStableDiffusionPipeline
from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.lora_places import lora_layers, places_of
from optimum_iobinding.export.tiny import TINY_RANDOM_KINDS
from optimum_iobinding.layout import WeightPlace, read_weight_map
from optimum_iobinding.pipelines.lora import to_view_layout, torch_layout_view

EXPORTS = {
    "plain": {},
    "fp16": {"fp16": True},
    "fused": {"optimize": "cpu"},
    "fused-fp16": {"optimize": "cpu", "fp16": True},
}


@pytest.fixture(scope="module")
def tiny_torch():
    return TINY_RANDOM_KINDS["sd"]()


# the plain and fused folders are the ones every test reads (tiny_folder, tiny_fused_folder: the same seeded weights)
SHARED = {"plain": "tiny_folder", "fused": "tiny_fused_folder"}


@pytest.mark.parametrize("export", sorted(EXPORTS))
def test_every_linear_and_conv_weight_of_the_unet_and_text_encoder_is_found_in_the_export(
    tmp_path, tiny_torch, export, request
):
    if export in SHARED:
        folder = request.getfixturevalue(SHARED[export])
    else:
        folder = export_pipeline(
            None,
            tmp_path / export,
            torch_pipeline=tiny_torch,
            components=("unet", "text_encoder"),
            progress=False,
            **EXPORTS[export],
        )
    for component, module in (("unet", tiny_torch.unet), ("text_encoder", tiny_torch.text_encoder)):
        places, not_found = read_weight_map(folder / component)
        layers = dict(lora_layers(module))
        assert not_found == [] and set(places) == set(layers)
        model = onnx.load(str(folder / component / "model.onnx"))
        arrays = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        for name, found in places.items():
            weight = layers[name].weight.detach()
            for place in found:
                initializer = torch.from_numpy(arrays[place.initializer].copy())
                view = torch_layout_view(initializer, place, weight.shape)
                expected = to_view_layout(weight, place).to(initializer.dtype)
                torch.testing.assert_close(view, expected, rtol=2e-3, atol=1e-6)
    if export.startswith("fused"):  # ORT's attention fusion packed the UNet's self-attention Q, K and V
        assert any(
            place.layout == "packed" for found in read_weight_map(folder / "unet")[0].values() for place in found
        )


def test_a_view_in_torch_layout_writes_the_initializer_in_place_for_every_layout():
    rng = np.random.RandomState(0)
    q, k, v = (rng.randn(8, 6).astype(np.float32) for _ in range(3))  # (out, in)
    heads = 2
    # ORT's interleaved packing: per head, the head's columns of Q, K and V side by side
    packed = np.stack([w.T.reshape(6, heads, 4) for w in (q, k, v)], axis=2).reshape(6, 24)
    conv = rng.randn(5, 3, 3, 3).astype(np.float32)
    arrays = {
        "qkv": packed,
        "conv_nhwc": np.ascontiguousarray(conv.transpose(0, 2, 3, 1)),
        "q_t": np.ascontiguousarray(q.T),
        "conv": conv.copy(),
    }
    by_shape = {}
    for name, array in arrays.items():
        by_shape.setdefault(array.shape, []).append((name, array))
    assert places_of(k, by_shape) == [WeightPlace("qkv", "packed", 3, 1, heads)]
    assert places_of(q, by_shape) == [WeightPlace("q_t", "transposed"), WeightPlace("qkv", "packed", 3, 0, heads)]
    assert places_of(conv, by_shape) == [WeightPlace("conv", "same"), WeightPlace("conv_nhwc", "nhwc")]
    # writing through the view changes exactly that weight's numbers
    tensors = {name: torch.from_numpy(array.copy()) for name, array in arrays.items()}
    new_k = torch.from_numpy(k) * 3
    place = WeightPlace("qkv", "packed", 3, 1, heads)
    torch_layout_view(tensors["qkv"], place, k.shape).copy_(to_view_layout(new_k, place))
    assert places_of(new_k.numpy(), {(6, 24): [("qkv", tensors["qkv"].numpy())]}) == [place]
    assert places_of(q, {(6, 24): [("qkv", tensors["qkv"].numpy())]}) == [WeightPlace("qkv", "packed", 3, 0, heads)]
    new_conv = torch.from_numpy(conv) + 1
    torch_layout_view(tensors["conv_nhwc"], WeightPlace("conv_nhwc", "nhwc"), conv.shape).copy_(new_conv)
    np.testing.assert_array_equal(tensors["conv_nhwc"].numpy(), new_conv.numpy().transpose(0, 2, 3, 1))


def test_a_folder_without_a_map_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="Export the model again to use LoRA"):
        read_weight_map(tmp_path)
    (tmp_path / "lora_map.json").write_text('{"version": 99, "layers": {}}')
    with pytest.raises(ValueError, match="not a LoRA map this version reads: version 99"):
        read_weight_map(tmp_path)


def test_a_saved_pipeline_keeps_its_lora_maps(tmp_path):
    folder = export_pipeline(None, tmp_path / "tiny", tiny_random=True, progress=False)
    OnnxStableDiffusionPipeline.from_pretrained(folder).save_pretrained(tmp_path / "saved")
    for component in ("unet", "text_encoder"):
        assert read_weight_map(tmp_path / "saved" / component) == read_weight_map(folder / component)


# ------------------------------------------------------------------------------------------------ runtime LoRA
@pytest.fixture(scope="module")
def loras(tmp_path_factory, make_lora):
    folder = tmp_path_factory.mktemp("loras")
    maker = TINY_RANDOM_KINDS["sd"]()
    first = make_lora(
        maker, folder / "a", 1, ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "ff.net.2"], ["q_proj", "v_proj", "fc1"]
    )
    maker = TINY_RANDOM_KINDS["sd"]()
    second = make_lora(maker, folder / "b", 2, ["to_q", "to_v", "conv1"], rank=2)
    return first, second


def images(pipe):
    return pipe(
        "a photo of a cat",
        num_inference_steps=3,
        generator=torch.Generator().manual_seed(0),
        height=64,
        width=64,
        output_type="np",
    ).images


def beside_diffusers(ours):
    """diffusers' tiny SD pipeline of the exported weights beside ``ours``, and ``same(step)``: both pipelines'
    images, equal within 1e-4 (``step`` names a failure), ours returned."""
    reference = TINY_RANDOM_KINDS["sd"]()
    for pipe in (reference, ours):
        pipe.set_progress_bar_config(disable=True)

    def same(step):
        expected, got = images(reference), images(ours)
        assert np.abs(expected - got).max() <= 1e-4, step
        return got

    return reference, same


def run_beside(reference, ours, same, steps, base, changes=lambda step: True):
    """Each ``(step, action)`` of ``steps`` on both pipelines; after each, the images equal, and (where ``changes``
    says so) away from ``base``: the LoRA changed the image."""
    for step, action in steps:
        action(reference)
        action(ours)
        got = same(step)
        assert not changes(step) or np.abs(got - base).max() > 1e-3, step


@pytest.mark.parametrize("export, io_binding", [("plain", True), ("plain", False), ("fused", True)])
def test_lora_images_equal_diffusers_through_load_set_disable_fuse_and_unload(loras, export, io_binding, request):
    ours = OnnxStableDiffusionPipeline.from_pretrained(request.getfixturevalue(SHARED[export]), io_binding=io_binding)
    reference, same = beside_diffusers(ours)
    first, second = loras
    base = same("no LoRA")
    steps = [
        ("load a", lambda p: p.load_lora_weights(first, adapter_name="a")),
        (
            "load b: the active adapter of the UNet, a stays the text encoder's",
            lambda p: p.load_lora_weights(second, adapter_name="b"),
        ),
        ("set a and b", lambda p: p.set_adapters(["a", "b"], adapter_weights=[0.7, 1.3])),
        ("per component", lambda p: p.set_adapters(["a", "b"], [{"unet": 0.5, "text_encoder": 2.0}, 1.0])),
        ("disable", lambda p: p.disable_lora()),
        ("enable", lambda p: p.enable_lora()),
        ("fuse", lambda p: p.fuse_lora(lora_scale=0.5)),
        ("unfuse", lambda p: p.unfuse_lora()),
    ]
    run_beside(reference, ours, same, steps, base, changes=lambda step: step != "disable")
    assert ours.get_list_adapters() == {"unet": ["a", "b"], "text_encoder": ["a"]}
    reference.unload_lora_weights()
    ours.unload_lora_weights()
    # the exported weights again (on the CPU the session reading owned weights skips the layout optimizations, so
    # its rounding differs from the first session's by a few 1e-6)
    np.testing.assert_allclose(same("unload"), base, atol=1e-5)


def test_fusing_twice_deleting_and_unloading_after_a_fuse_equal_diffusers(tiny_folder, loras):
    """diffusers' semantics: a fused adapter is not fused again; ``unload_lora_weights`` after ``fuse_lora`` keeps
    the fused update in the weights (a LoRA baked in), and a LoRA loaded after it changes those weights;
    ``delete_adapters`` removes one adapter and keeps the others."""
    ours = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    reference, same = beside_diffusers(ours)
    first, second = loras
    base = same("no LoRA")
    steps = [
        ("load a and b", lambda p: (p.load_lora_weights(first, adapter_name="a"), p.load_lora_weights(second, "b"))),
        ("delete b", lambda p: p.delete_adapters("b")),
        ("fuse a", lambda p: p.fuse_lora(lora_scale=0.8)),
        ("fuse a again", lambda p: p.fuse_lora(lora_scale=0.8)),
        ("unload", lambda p: p.unload_lora_weights()),
        ("load b over the fused a", lambda p: p.load_lora_weights(second, adapter_name="b")),
    ]
    run_beside(reference, ours, same, steps, base)  # the LoRA changed the image, and it stays after unload
    assert ours.get_list_adapters() == {"unet": ["b"]}


def test_deleting_a_fused_adapter_keeps_its_fused_update_as_diffusers_does(tiny_folder, loras):
    ours = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    reference, same = beside_diffusers(ours)
    first, second = loras
    base = same("no LoRA")
    steps = [
        ("load a, fuse it", lambda p: (p.load_lora_weights(first, adapter_name="a"), p.fuse_lora(lora_scale=0.7))),
        ("delete a", lambda p: p.delete_adapters("a")),
        ("load a again and b", lambda p: (p.load_lora_weights(first, "a"), p.load_lora_weights(second, "b"))),
        ("delete b", lambda p: p.delete_adapters(["b"])),
    ]
    run_beside(reference, ours, same, steps, base)
    assert ours.get_list_adapters() == {"unet": ["a"], "text_encoder": ["a"]}


def test_a_pipeline_from_pipe_shares_the_lora_adapters_of_the_models_it_shares(tiny_folder, loras):
    """As diffusers' adapters live in the shared modules: an adapter loaded through one pipeline is listed, set and
    unloaded through the other, and loading its name again through the other is refused."""
    first, _ = loras
    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    pipe.set_progress_bar_config(disable=True)
    other = OnnxStableDiffusionImg2ImgPipeline.from_pipe(pipe)
    base = images(pipe)
    pipe.load_lora_weights(first, adapter_name="a")
    with_lora = images(pipe)
    assert other.get_list_adapters() == {"unet": ["a"], "text_encoder": ["a"]}
    with pytest.raises(ValueError, match="adapter_name: 'a' is already loaded"):
        other.load_lora_weights(first, adapter_name="a")
    np.testing.assert_array_equal(images(pipe), with_lora)  # the refused load changed nothing
    other.set_adapters("a", 0.0)
    np.testing.assert_allclose(images(pipe), base, atol=1e-5)
    other.unload_lora_weights()
    assert pipe.get_list_adapters() == {}
    np.testing.assert_allclose(images(pipe), base, atol=1e-5)


@pytest.mark.parametrize("kind", ["img2img", "inpaint"])
def test_img2img_and_inpaint_loras_equal_diffusers(tiny_fused_folder, loras, kind, vae_encodes_its_mode):
    from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline

    from optimum_iobinding import OnnxStableDiffusionImg2ImgPipeline, OnnxStableDiffusionInpaintPipeline

    start = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(7))
    mask = torch.zeros(1, 1, 64, 64)
    mask[..., 16:48, 16:48] = 1
    torch_class, our_class, kwargs = {
        "img2img": (StableDiffusionImg2ImgPipeline, OnnxStableDiffusionImg2ImgPipeline, {}),
        "inpaint": (
            StableDiffusionInpaintPipeline,
            OnnxStableDiffusionInpaintPipeline,
            {"mask_image": mask, "height": 64, "width": 64},
        ),
    }[kind]
    reference = vae_encodes_its_mode(torch_class(**TINY_RANDOM_KINDS["sd"]().components))
    ours = our_class.from_pretrained(tiny_fused_folder)
    first, second = loras

    def image(pipe):
        pipe.set_progress_bar_config(disable=True)
        return pipe(
            "a photo of a cat",
            image=start,
            strength=0.75,
            num_inference_steps=3,
            output_type="np",
            generator=torch.Generator().manual_seed(0),
            **kwargs,
        ).images

    base = image(ours)
    for pipe in (reference, ours):
        pipe.load_lora_weights(first, adapter_name="a")
        pipe.load_lora_weights(second, adapter_name="b")
        pipe.set_adapters(["a", "b"], adapter_weights=[0.6, 1.1])
    got = image(ours)
    np.testing.assert_allclose(got, image(reference), atol=1e-4)
    assert np.abs(got - base).max() > 1e-3


def test_adapters_switch_without_creating_a_session(tiny_folder, loras):
    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(loras[0], adapter_name="a")  # the CPU's models now keep their weights as tensors
    pipe.load_lora_weights(loras[1], adapter_name="b")
    images(pipe)
    created = {name: getattr(pipe, name).sessions_created for name in ("unet", "text_encoder")}
    for action in (
        lambda: pipe.set_adapters(["a", "b"], [0.3, 0.9]),
        pipe.disable_lora,
        pipe.enable_lora,
        lambda: pipe.fuse_lora(),
        pipe.unfuse_lora,
        lambda: pipe.set_adapters("b"),
        pipe.unload_lora_weights,
    ):
        action()
        images(pipe)
    assert {name: getattr(pipe, name).sessions_created for name in ("unet", "text_encoder")} == created


def test_a_kohya_lora_with_alphas_equals_diffusers(tiny_folder, loras, tmp_path):
    """The same updates renamed the kohya way (``lora_unet_…``, ``lora_te_…``, ``alpha`` = 2 × rank: scale 2)."""
    from safetensors.torch import load_file, save_file

    kohya = {}
    for key, value in load_file(str(loras[0] / "pytorch_lora_weights.safetensors")).items():
        component, _, rest = key.partition(".")
        module, _, matrix = rest.rpartition(".lora_")
        module = module[len("text_model.") :] if module.startswith("text_model.") else module  # transformers 4 names
        prefix = "lora_unet_" if component == "unet" else "lora_te_text_model_"
        name = prefix + module.replace(".", "_")
        kohya[f"{name}.lora_{'down' if matrix.startswith('A') else 'up'}.weight"] = value
        kohya[f"{name}.alpha"] = torch.tensor(2.0 * value.shape[0 if matrix.startswith("A") else 1])
    save_file(kohya, str(tmp_path / "kohya.safetensors"))
    reference = TINY_RANDOM_KINDS["sd"]()
    ours = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    for pipe in (reference, ours):
        pipe.set_progress_bar_config(disable=True)
        pipe.load_lora_weights(str(tmp_path), weight_name="kohya.safetensors")
    assert np.abs(images(reference) - images(ours)).max() <= 1e-4


def test_lora_mistakes_get_messages_that_name_them(tiny_folder, loras):
    from safetensors.torch import load_file

    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    state = load_file(str(loras[0] / "pytorch_lora_weights.safetensors"))
    layer = "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"
    wrong = dict(state, **{f"{layer}.lora_A.weight": torch.zeros(4, 99)})  # a LoRA for a wider model
    with pytest.raises(
        ValueError,
        match=r"unet layer down_blocks\.1\.attentions\.0\.transformer_blocks\.0\.attn1\."
        r"to_q: the LoRA's update is \(64, 4\) @ \(4, 99\), the layer's weight is "
        r"\(64, 64\)",
    ):
        pipe.load_lora_weights(wrong, adapter_name="wide")
    unknown = {
        "unet.down_blocks.9.attn.to_q.lora_A.weight": torch.zeros(4, 8),
        "unet.down_blocks.9.attn.to_q.lora_B.weight": torch.zeros(8, 4),
    }
    with pytest.raises(
        ValueError,
        match=r"unet: the LoRA changes layer 'down_blocks\.9\.attn\.to_q', which this "
        "model does not have",
    ):
        pipe.load_lora_weights(unknown)
    pipe.load_lora_weights(loras[0], adapter_name="a")
    with pytest.raises(ValueError, match="adapter_name: 'a' is already loaded"):
        pipe.load_lora_weights(loras[1], adapter_name="a")
    with pytest.raises(ValueError, match=r"adapter_names: expected names of loaded adapters \['a'\], got \['x'\]"):
        pipe.set_adapters(["a", "x"])
    with pytest.raises(ValueError, match="adapter_weights: expected 1 weights"):
        pipe.set_adapters(["a"], [1.0, 2.0])
    before = images(pipe)
    for weights, message in [
        ([float("nan")], r"adapter_weights: expected a finite number .*, got nan"),
        (["x"], r"adapter_weights: expected a finite number .*, got 'x'"),
        (
            [{"unet": 1.0, "transformer": 1.0}],
            r"adapter_weights: expected components a LoRA changes here \(unet, "
            r"text_encoder\), got \['transformer'\]",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            pipe.set_adapters(["a"], weights)
    with pytest.raises(ValueError, match=r"components: expected components a LoRA changes here .*, got \['vae'\]"):
        pipe.fuse_lora(components=["vae"])
    with pytest.raises(ValueError, match=r"lora_scale: expected a finite number .*, got 'x'"):
        pipe.fuse_lora(lora_scale="x")
    missing = "pretrained_model_name_or_path_or_dict: expected an existing LoRA file or folder, or a hub id, got"
    with pytest.raises(FileNotFoundError, match=f"{missing} 'missing.safetensors': no such file"):
        pipe.load_lora_weights("missing.safetensors")
    with pytest.raises(
        FileNotFoundError,
        match="pretrained_model_name_or_path_or_dict: 'no-such-user/no-such-lora' is not a local file or folder",
    ):
        pipe.load_lora_weights("no-such-user/no-such-lora")
    np.testing.assert_array_equal(images(pipe), before)  # every refusal left the adapters as they were


@pytest.mark.parametrize("kind", ["xl", "lcm"])
def test_sdxl_and_lcm_loras_equal_diffusers(tmp_path, kind, make_lora):
    """SDXL: a UNet and second-text-encoder LoRA (diffusers' SDXL reader); LCM: a UNet LoRA on the LCM UNet."""
    from optimum_iobinding.pipelines import pipeline_class_for

    folder = export_pipeline(None, tmp_path / kind, tiny_random=kind, progress=False)
    make_lora(
        TINY_RANDOM_KINDS[kind](),
        tmp_path / "lora",
        3,
        ["to_q", "to_v"],
        ["q_proj"] if kind == "xl" else (),
        text_encoder="text_encoder_2",
    )
    reference = TINY_RANDOM_KINDS[kind]()
    ours = pipeline_class_for(str(folder)).from_pretrained(folder)
    size = ours.default_image_size

    def image(pipe):
        return pipe(
            "a cat",
            num_inference_steps=2,
            generator=torch.Generator().manual_seed(0),
            height=size,
            width=size,
            output_type="np",
        ).images[0]

    base = image(ours)
    for pipe in (reference, ours):
        pipe.set_progress_bar_config(disable=True)
        pipe.load_lora_weights(str(tmp_path / "lora"), adapter_name="x")
    got = image(ours)
    assert np.abs(image(reference) - got).max() <= 1e-4 and np.abs(got - base).max() > 1e-3
    assert ours.get_list_adapters() == ({"text_encoder_2": ["x"], "unet": ["x"]} if kind == "xl" else {"unet": ["x"]})

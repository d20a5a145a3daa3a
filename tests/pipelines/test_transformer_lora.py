"""Runtime LoRA on the diffusion transformers (SD3, FLUX.1): the export's map of the transformer's weights, plain and
through ORT's fusions and the project's rewrites (a bias folded from a weight changes with it), and the images
against diffusers' torch pipelines with the same LoRAs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from optimum_iobinding import OnnxFluxPipeline, OnnxStableDiffusion3Pipeline
from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.tiny import random_lora_layers, save_lora
from optimum_iobinding.layout import folded_biases, read_weight_map

CALL = dict(prompt="a red castle in the forest", height=32, width=48, num_inference_steps=2, output_type="np")
FLUX_CALL = dict(CALL, max_sequence_length=16)
TOLERANCE = 1e-4
# every kind of Linear the transformers have: joint attention (both streams), FLUX.1's single blocks (whose attention
# output projection, proj_out, carries a folded bias in the fused export), feed-forwards, modulations
TRANSFORMER_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_v_proj",
    "to_add_out",
    "proj_mlp",
    "proj_out",
    "ff.net.2",
    "norm1.linear",
)
TEXT_TARGETS = ("q_proj", "v_proj", "out_proj")


@pytest.fixture(scope="module")
def schnell_fused(schnell, shared_export):
    """The tiny FLUX.1 schnell fused for the CPU: ORT's optimizer and the transformer rewrites (value biases folded)."""
    torch_pipe, _ = schnell
    return shared_export(
        "schnell-fused",
        lambda folder: export_pipeline(None, folder, torch_pipeline=torch_pipe, optimize="cpu", progress=False),
    )


@pytest.fixture
def family(request, schnell, schnell_fused, sd3):
    """(diffusers' torch pipeline, our folder, our class, the call) of the case."""
    if request.param == "sd3-plain":
        return sd3[0], sd3[1], OnnxStableDiffusion3Pipeline, CALL
    folder = schnell[1] if request.param == "flux-plain" else schnell_fused
    return schnell[0], folder, OnnxFluxPipeline, FLUX_CALL


def loras(torch_pipe, folder):
    """Two LoRAs: ``a`` on the transformer and the first text encoder (CLIP), ``b`` on the transformer only."""
    first = save_lora(
        folder / "a",
        transformer=random_lora_layers(torch_pipe.transformer, TRANSFORMER_TARGETS, 4, 1),
        text_encoder=random_lora_layers(torch_pipe.text_encoder, TEXT_TARGETS, 2, 2),
    )
    second = save_lora(folder / "b", transformer=random_lora_layers(torch_pipe.transformer, ("to_v", "proj_out"), 4, 3))
    return first, second


def images(pipe, call):
    return pipe(generator=torch.Generator().manual_seed(0), **call).images


def test_every_layer_of_the_transformer_is_found_and_the_fused_exports_folded_biases_are_recorded(
    schnell, schnell_fused, sd3
):
    for folder in (schnell[1], schnell_fused, sd3[1]):
        places, not_found = read_weight_map(folder / "transformer")
        assert places and not_found == [], folder
    folds = folded_biases(onnx.load(str(schnell_fused / "transformer" / "model.onnx"), load_external_data=False))
    places, _ = read_weight_map(schnell_fused / "transformer")
    single_outputs = {
        place.initializer
        for layer, found in places.items()
        if layer.startswith("single_transformer_blocks.") and layer.endswith(".proj_out")
        for place in found
    }
    assert folds and {fold["weight"] for fold in folds} <= single_outputs  # one per single block
    assert len(folds) == len(single_outputs)


@pytest.mark.parametrize("family", ["flux-plain", "flux-fused", "sd3-plain"], indirect=True)
def test_transformer_loras_equal_diffusers_through_load_set_disable_fuse_and_unload(family, tmp_path):
    torch_pipe, folder, pipeline_class, call = family
    ours = pipeline_class.from_pretrained(folder)
    ours.set_progress_bar_config(disable=True)
    first, second = loras(torch_pipe, tmp_path)

    def same(step):
        expected, got = images(torch_pipe, call), images(ours, call)
        assert np.abs(expected - got).max() <= TOLERANCE, step
        return got

    base = same("no LoRA")
    steps = [
        ("load a", lambda p: p.load_lora_weights(first, adapter_name="a")),
        ("load b: the transformer's active adapter", lambda p: p.load_lora_weights(second, adapter_name="b")),
        ("set a and b", lambda p: p.set_adapters(["a", "b"], adapter_weights=[0.7, 1.3])),
        ("per component", lambda p: p.set_adapters(["a", "b"], [{"transformer": 0.5, "text_encoder": 2.0}, 1.0])),
        ("disable", lambda p: p.disable_lora()),
        ("enable", lambda p: p.enable_lora()),
        ("fuse", lambda p: p.fuse_lora(lora_scale=0.5)),
        ("unfuse", lambda p: p.unfuse_lora()),
    ]
    try:
        for step, action in steps:
            action(torch_pipe)
            action(ours)
            got = same(step)
            assert step == "disable" or np.abs(got - base).max() > 1e-3, step  # the LoRA changed the image
        assert ours.get_list_adapters() == {"text_encoder": ["a"], "transformer": ["a", "b"]}
    finally:
        torch_pipe.unload_lora_weights()  # the module's torch pipeline, shared by the other cases
    ours.unload_lora_weights()
    np.testing.assert_allclose(same("unload"), base, atol=1e-5)


def test_switching_transformer_adapters_creates_no_session(schnell, schnell_fused, tmp_path):
    torch_pipe, _ = schnell
    pipe = OnnxFluxPipeline.from_pretrained(schnell_fused)
    pipe.set_progress_bar_config(disable=True)
    first, second = loras(torch_pipe, tmp_path)
    pipe.load_lora_weights(first, adapter_name="a")
    pipe.load_lora_weights(second, adapter_name="b")
    images(pipe, FLUX_CALL)
    created = {name: getattr(pipe, name).sessions_created for name in ("transformer", "text_encoder")}
    for action in (
        lambda: pipe.set_adapters(["a", "b"], [0.3, 0.9]),
        pipe.disable_lora,
        pipe.enable_lora,
        pipe.fuse_lora,
        pipe.unfuse_lora,
        pipe.unload_lora_weights,
    ):
        action()
        images(pipe, FLUX_CALL)
    assert {name: getattr(pipe, name).sessions_created for name in ("transformer", "text_encoder")} == created


def test_a_lora_that_replaces_a_transformers_weights_is_refused_by_name(schnell):
    """A FLUX.1 Control LoRA also replaces norm weights: no low-rank update, which runtime LoRA cannot carry."""
    torch_pipe, folder = schnell
    pipe = OnnxFluxPipeline.from_pretrained(folder)
    state = {
        f"transformer.{key}": value
        for key, value in random_lora_layers(torch_pipe.transformer, ("to_q",), 2, 0).items()
    }
    state["transformer.single_transformer_blocks.0.norm.linear.weight"] = torch.zeros(3, 3)
    with pytest.raises(
        ValueError, match=r"single_transformer_blocks\.0\.norm\.linear\.weight'.*which is no LoRA matrix"
    ):
        pipe.load_lora_weights(state)
    wide = {
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 99),
        "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(32, 2),
    }
    with pytest.raises(ValueError, match=r"transformer layer transformer_blocks\.0\.attn\.to_q: the LoRA's update is"):
        pipe.load_lora_weights(wide)


def test_first_block_caches_parts_see_the_lora_as_the_whole_transformer_does(schnell, shared_export, tmp_path):
    """The step-cache export (its transformer cut into parts that read its weights), fused: a LoRA loaded before or
    after the cache is enabled reaches the parts. A threshold of 0 skips no step, so the image is the uncached one."""
    from diffusers.hooks import FirstBlockCacheConfig

    torch_pipe, _ = schnell
    folder = shared_export(
        "schnell-fused-step-cache",
        lambda target: export_pipeline(
            None, target, torch_pipeline=torch_pipe, optimize="cpu", step_cache=True, progress=False
        ),
    )
    first, _ = loras(torch_pipe, tmp_path)
    pipes = [OnnxFluxPipeline.from_pretrained(folder) for _ in range(3)]
    for pipe in pipes:
        pipe.set_progress_bar_config(disable=True)
    whole, cached_first, lora_first = pipes
    cached_first.enable_cache(FirstBlockCacheConfig(threshold=0.0))
    for pipe in pipes:
        pipe.load_lora_weights(first, adapter_name="a")
    lora_first.enable_cache(FirstBlockCacheConfig(threshold=0.0))
    expected = images(whole, FLUX_CALL)
    for pipe in (cached_first, lora_first):
        assert np.abs(images(pipe, FLUX_CALL) - expected).max() <= 1e-5
    whole.unload_lora_weights()
    assert np.abs(images(whole, FLUX_CALL) - expected).max() > 1e-3  # the LoRA did change the image


def test_a_kohya_flux_lora_with_alphas_equals_diffusers(schnell_fused, schnell):
    """The kohya format FLUX.1 LoRAs mostly come in (``lora_unet_double_blocks_N_img_attn_qkv``: one update of the
    fused Q, K, V, split by diffusers' converter), with alphas (here 2 × the rank: scale 2), on the fused export. (A
    single block's ``linear1`` is left out: the converter splits it at FLUX.1's own widths, 3072 and 12288.)"""
    torch_pipe, _ = schnell
    dim, mlp = (
        torch_pipe.transformer.inner_dim,
        torch_pipe.transformer.single_transformer_blocks[0].proj_mlp.out_features,
    )
    generator = torch.Generator().manual_seed(5)
    rank = 4
    shapes = {  # kohya name → (in, out) of the original FLUX.1 layer
        "lora_unet_double_blocks_0_img_attn_qkv": (dim, 3 * dim),
        "lora_unet_double_blocks_0_img_attn_proj": (dim, dim),
        "lora_unet_double_blocks_0_txt_mlp_2": (4 * dim, dim),
        "lora_unet_single_blocks_0_linear2": (dim + mlp, dim),
    }
    kohya = {}
    for name, (fan_in, fan_out) in shapes.items():
        kohya[f"{name}.lora_down.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
        kohya[f"{name}.lora_up.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.3
        kohya[f"{name}.alpha"] = torch.tensor(2.0 * rank)
    ours = OnnxFluxPipeline.from_pretrained(schnell_fused)
    ours.set_progress_bar_config(disable=True)
    base = images(ours, FLUX_CALL)
    try:
        torch_pipe.load_lora_weights(dict(kohya), adapter_name="kohya")
        expected = images(torch_pipe, FLUX_CALL)
    finally:
        torch_pipe.unload_lora_weights()
    ours.load_lora_weights(dict(kohya), adapter_name="kohya")
    got = images(ours, FLUX_CALL)
    assert np.abs(got - expected).max() <= TOLERANCE and np.abs(got - base).max() > 1e-2


def test_a_lora_on_a_layer_the_export_could_not_keep_addressable_is_refused_by_name(schnell, tmp_path):
    import json
    import shutil

    torch_pipe, folder = schnell
    copy = shutil.copytree(folder, tmp_path / "copy")
    path = copy / "transformer" / "lora_map.json"
    data = json.loads(path.read_text())
    data["layers"].pop("transformer_blocks.0.attn.to_q")  # as if a rewrite had folded it into another computation
    data["not_found"].append("transformer_blocks.0.attn.to_q")
    path.write_text(json.dumps(data))
    state = random_lora_layers(torch_pipe.transformer, ("transformer_blocks.0.attn.to_q",), 2, 0)
    with pytest.raises(
        ValueError,
        match=r"transformer: the LoRA changes layer 'transformer_blocks\.0\.attn\.to_q', whose weight the export folded",
    ):
        OnnxFluxPipeline.from_pretrained(copy).load_lora_weights({f"transformer.{k}": v for k, v in state.items()})


def test_a_map_that_places_no_layer_on_a_folded_bias_weight_is_refused(schnell, schnell_fused, tmp_path):
    """A bias folded from a weight the map places for no layer would keep a stale value under a LoRA."""
    import json
    import shutil

    torch_pipe, _ = schnell
    copy = shutil.copytree(schnell_fused, tmp_path / "copy")
    path = copy / "transformer" / "lora_map.json"
    data = json.loads(path.read_text())
    data["layers"].pop("single_transformer_blocks.0.proj_out")
    path.write_text(json.dumps(data))
    state = random_lora_layers(torch_pipe.transformer, ("transformer_blocks.0.attn.to_q",), 2, 0)
    with pytest.raises(ValueError, match=r"transformer: a bias is folded from the weight .* places for no layer"):
        OnnxFluxPipeline.from_pretrained(copy).load_lora_weights({f"transformer.{k}": v for k, v in state.items()})

"""Runtime LoRA: the export's map of where each torch layer's weight went in the ONNX file."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from optimum_iobinding.lora import (WeightPlace, _lora_layers, _places_of, read_weight_map, to_view_layout,
                                    torch_layout_view)

EXPORTS = {"plain": {}, "fp16": {"fp16": True}, "fused": {"optimize": "cpu"}, "fused-fp16": {"optimize": "cpu", "fp16": True}}


@pytest.fixture(scope="module")
def tiny_torch():
    from optimum_iobinding.export import TINY_RANDOM_KINDS

    return TINY_RANDOM_KINDS["sd"]()


@pytest.mark.parametrize("export", sorted(EXPORTS))
def test_every_linear_and_conv_weight_of_the_unet_and_text_encoder_is_found_in_the_export(tmp_path, tiny_torch,
                                                                                           export):
    from optimum_iobinding.export import export_pipeline

    folder = export_pipeline(None, tmp_path / export, torch_pipeline=tiny_torch, components=("unet", "text_encoder"),
                             progress=False, **EXPORTS[export])
    for component, module in (("unet", tiny_torch.unet), ("text_encoder", tiny_torch.text_encoder)):
        places, not_found = read_weight_map(folder / component)
        layers = dict(_lora_layers(module))
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
        assert any(place.layout == "packed" for found in read_weight_map(folder / "unet")[0].values()
                   for place in found)


def test_a_view_in_torch_layout_writes_the_initializer_in_place_for_every_layout():
    rng = np.random.RandomState(0)
    q, k, v = (rng.randn(8, 6).astype(np.float32) for _ in range(3))  # (out, in)
    heads = 2
    # ORT's interleaved packing: per head, the head's columns of Q, K and V side by side
    packed = np.stack([w.T.reshape(6, heads, 4) for w in (q, k, v)], axis=2).reshape(6, 24)
    conv = rng.randn(5, 3, 3, 3).astype(np.float32)
    arrays = {"qkv": packed, "conv_nhwc": np.ascontiguousarray(conv.transpose(0, 2, 3, 1)),
              "q_t": np.ascontiguousarray(q.T), "conv": conv.copy()}
    by_shape = {}
    for name, array in arrays.items():
        by_shape.setdefault(array.shape, []).append((name, array))
    assert _places_of(k, by_shape) == [WeightPlace("qkv", "packed", 3, 1, heads)]
    assert _places_of(q, by_shape) == [WeightPlace("q_t", "transposed"), WeightPlace("qkv", "packed", 3, 0, heads)]
    assert _places_of(conv, by_shape) == [WeightPlace("conv", "same"), WeightPlace("conv_nhwc", "nhwc")]
    # writing through the view changes exactly that weight's numbers
    tensors = {name: torch.from_numpy(array.copy()) for name, array in arrays.items()}
    new_k = torch.from_numpy(k) * 3
    place = WeightPlace("qkv", "packed", 3, 1, heads)
    torch_layout_view(tensors["qkv"], place, k.shape).copy_(to_view_layout(new_k, place))
    assert _places_of(new_k.numpy(), {(6, 24): [("qkv", tensors["qkv"].numpy())]}) == [place]
    assert _places_of(q, {(6, 24): [("qkv", tensors["qkv"].numpy())]}) == [WeightPlace("qkv", "packed", 3, 0, heads)]
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
    from optimum_iobinding import OnnxStableDiffusionPipeline
    from optimum_iobinding.export import export_pipeline

    folder = export_pipeline(None, tmp_path / "tiny", tiny_random=True, progress=False)
    OnnxStableDiffusionPipeline.from_pretrained(folder).save_pretrained(tmp_path / "saved")
    for component in ("unet", "text_encoder"):
        assert read_weight_map(tmp_path / "saved" / component) == read_weight_map(folder / component)

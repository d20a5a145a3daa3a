"""The fused export keeps the weights on disk while ORT's optimizer rewrites the graph (optimize_component): the
result must be exactly what ORT's optimizer and float16 conversion give on the fully loaded model."""

import io

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export import components as components_module
from optimum_iobinding.export.unet import component_specs
from optimum_iobinding.export.optimize import (
    float32_island,
    fusion_options,
    in_folder,
    optimize_component,
    optimized_to_float16,
    optimizer_model_type,
    use_classic_attention,
)
from optimum_iobinding.export.tiny import build_tiny_random_pipeline, build_tiny_random_xl_pipeline


def _graph_of(model: onnx.ModelProto):
    nodes = [
        (
            n.op_type,
            n.domain,
            tuple(n.input),
            tuple(n.output),
            tuple(sorted(a.SerializeToString() for a in n.attribute)),
        )
        for n in model.graph.node
    ]
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return nodes, weights


def _reference(name, path, options, target, fp16):
    """ORT's own way: optimize_model on the path (weights loaded), OnnxModel.convert_float_to_float16."""
    from onnxruntime.transformers.optimizer import optimize_model

    model = optimize_model(
        str(path),
        model_type=optimizer_model_type(name),
        opt_level=0,
        optimization_options=options,
        use_gpu=target == "cuda",
    )
    if fp16:
        model.convert_float_to_float16(keep_io_types=False)
    return model.model


@pytest.fixture(scope="module")
def tiny_specs():
    return component_specs(build_tiny_random_pipeline())


@pytest.fixture(scope="module")
def exported_bytes(tiny_specs):
    """``exported_bytes(name)``: the component's TorchScript export (ORT's optimizer input), made once per module."""
    made = {}

    def export(name: str) -> bytes:
        if name not in made:
            spec = tiny_specs[name]
            use_classic_attention(spec["module"])
            buffer = io.BytesIO()
            with torch.no_grad():
                torch.onnx.export(
                    spec["module"].eval(),
                    spec["args"],
                    buffer,
                    dynamo=False,
                    input_names=spec["input_names"],
                    output_names=spec["output_names"],
                    dynamic_axes=spec["dynamic_axes"],
                    opset_version=17,
                    do_constant_folding=True,
                )
            made[name] = buffer.getvalue()
        return made[name]

    return export


# every component at every precision and target, but the UNet (ORT's slowest optimizer run, twice a case) at two
# cases that still take each precision and each target: its path is the others', with its own fusion options
OPTIMIZER_CASES = [
    (name, fp16, target)
    for name in ("unet", "vae_decoder", "text_encoder")
    for fp16 in (False, True)
    for target in ("cpu", "cuda")
    if name != "unet" or fp16 == (target == "cuda")
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, fp16, target",
    OPTIMIZER_CASES,
    ids=[f"{name}-{'fp16' if fp16 else 'fp32'}-{target}" for name, fp16, target in OPTIMIZER_CASES],
)
def test_optimizing_with_the_weights_on_disk_gives_exactly_ORTs_result(
    tmp_path, tiny_specs, exported_bytes, name, fp16, target
):
    spec = tiny_specs[name]
    path = tmp_path / "model.onnx"
    path.write_bytes(exported_bytes(name))  # a file of its own: the light path moves its weights beside it
    options = lambda: fusion_options(name, spec["config"], target)  # noqa: E731 (the fallback mutates them)
    try:
        expected = _reference(name, path, options(), target, fp16)
    except Exception:  # the VAE's attention fusion fails in ORT; optimize_component retries without it, so must this
        reference_options = options()
        reference_options.enable_attention = False
        expected = _reference(name, path, reference_options, target, fp16)

    optimized = optimize_component(name, path, options(), target)
    if fp16:
        ours = optimized_to_float16(optimized, tmp_path)
    else:
        ours = optimized.model
        onnx.load_external_data_for_model(ours, str(tmp_path))

    # the light path really ran light: the exported file now keeps its weights beside it
    assert any(
        t.data_location == onnx.TensorProto.EXTERNAL
        for t in onnx.load(str(path), load_external_data=False).graph.initializer
    )
    expected_nodes, expected_weights = _graph_of(expected)
    our_nodes, our_weights = _graph_of(ours)
    if fp16 and name == "unet":
        # the timestep embedding stays float32 (float32_island), which ORT's own conversion makes float16: its
        # nodes and the Casts around them differ; every other node is exactly ORT's
        island = set(float32_island(ours.graph))
        assert island

        def outside(model):
            return [
                (n.op_type, n.domain, tuple(n.output), tuple(sorted(a.SerializeToString() for a in n.attribute)))
                for n in model.graph.node
                if n.op_type != "Cast" and n.name not in island
            ]

        assert outside(ours) == outside(expected)
    else:
        assert our_nodes == expected_nodes
    assert sorted(our_weights) == sorted(expected_weights)
    for key, value in expected_weights.items():
        assert our_weights[key].dtype == value.dtype, key
        np.testing.assert_array_equal(our_weights[key], value, err_msg=key)
    if fp16:
        assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in ours.graph.initializer)
    fused = {n.op_type for n in ours.graph.node}
    if name == "unet":
        assert "MultiHeadAttention" in fused or "Attention" in fused, fused


def test_the_working_directory_is_restored_when_the_optimizer_fails(tmp_path):
    import os

    before = os.getcwd()
    with pytest.raises(RuntimeError, match="boom"):
        with in_folder(tmp_path):
            assert os.getcwd() == str(tmp_path.resolve())
            raise RuntimeError("boom")
    assert os.getcwd() == before


@pytest.mark.parametrize("kind,fp16,warns", [("sd", False, False), ("sd", True, False), ("xl", True, True)])
def test_a_float16_vae_export_cannot_be_upcast_and_warns_only_for_sdxl(tmp_path, kind, fp16, warns, caplog):
    """diffusers' SDXL pipelines upcast a force_upcast VAE to float32 (optimum-onnx's fails trying, on an ONNX VAE);
    a float16 ONNX VAE cannot be upcast, so its config must not ask for it. An fp32 export keeps the flag. Only
    SDXL's VAE overflows float16, so only an SDXL export warns."""
    import json

    pipe = build_tiny_random_pipeline() if kind == "sd" else build_tiny_random_xl_pipeline()
    assert pipe.vae.config.force_upcast  # diffusers' default, as in SD 1.x/SDXL
    with caplog.at_level("WARNING", logger=components_module.__name__):
        export_pipeline(
            None, tmp_path / "out", torch_pipeline=pipe, fp16=fp16, components=("vae_decoder",), progress=False
        )
    config = json.loads((tmp_path / "out" / "vae_decoder" / "config.json").read_text())
    assert config["force_upcast"] is (not fp16)
    assert config["scaling_factor"] == pipe.vae.config.scaling_factor
    assert ("force_upcast" in caplog.text) is warns
    if warns:
        assert "--vae" in caplog.text and "torch_pipeline" not in caplog.text


@pytest.mark.parametrize("kind", ["sd", "xl", "xl-projection", "with-projection"])
def test_a_clip_text_encoders_export_computes_nothing_from_its_inputs_shape_and_equals_transformers(tmp_path, kind):
    # the causal mask transformers builds from the sequence's length and the batch's arange it pools with would run on
    # the CPU in a CUDA session (shape arithmetic feeding data): ORT then refuses one graph for every input shape. The
    # export makes each attention one causal MultiHeadAttention node and pools with a gather instead
    import onnxruntime as ort

    from optimum_iobinding.export.components import clip_text_encoder_spec

    if kind == "sd":
        pipe = build_tiny_random_pipeline()
        encoder, spec = pipe.text_encoder, component_specs(pipe)["text_encoder"]
    elif kind.startswith("xl"):
        pipe = build_tiny_random_xl_pipeline()
        name = "text_encoder_2" if kind == "xl-projection" else "text_encoder"
        encoder, spec = getattr(pipe, name), component_specs(pipe)[name]
    else:
        encoder = build_tiny_random_xl_pipeline().text_encoder_2
        spec = clip_text_encoder_spec(encoder, 77, with_projection=True)
    name = "text_encoder"
    components_module.export_component(name, spec, tmp_path, 17, False, None)
    graph = onnx.load(str(tmp_path / name / "model.onnx"))
    kinds = {node.op_type for node in graph.graph.node}
    assert not kinds & {"Range", "If", "Softmax"}, kinds
    attentions = [node for node in graph.graph.node if node.op_type == "MultiHeadAttention"]
    assert len(attentions) == encoder.config.num_hidden_layers
    assert all(
        onnx.helper.get_attribute_value(a) == 1 for n in attentions for a in n.attribute if a.name == "unidirectional"
    )
    ids = torch.randint(3, encoder.config.vocab_size - 1, (3, 77), generator=torch.Generator().manual_seed(0))
    ids[ids == encoder.config.eos_token_id] = 3
    for row, end in enumerate((5, 40, 76)):
        ids[row, end] = encoder.config.eos_token_id
    session = ort.InferenceSession(str(tmp_path / name / "model.onnx"), providers=["CPUExecutionProvider"])
    feed = ids.numpy().astype(np.int32 if session.get_inputs()[0].type == "tensor(int32)" else np.int64)
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"input_ids": feed})))
    with torch.no_grad():
        expected = encoder(input_ids=ids, output_hidden_states=True)
    np.testing.assert_allclose(outputs["last_hidden_state"], expected.last_hidden_state.numpy(), atol=1e-5)
    pooled = expected.text_embeds if "text_embeds" in outputs else expected.pooler_output
    np.testing.assert_allclose(outputs.get("text_embeds", outputs.get("pooler_output")), pooled.numpy(), atol=1e-5)
    for index, states in enumerate(expected.hidden_states):
        if f"hidden_states.{index}" in outputs:
            np.testing.assert_allclose(outputs[f"hidden_states.{index}"], states.numpy(), atol=1e-5)


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
@pytest.mark.parametrize("eos_token_id", [2, 49407], ids=["legacy-eos-id", "eos-id"])
def test_the_text_encoder_pools_the_end_token_on_floats_and_equals_transformers(tmp_path, eos_token_id, fp16):
    # CLIP pools the end-of-text token: with SD 1.x's legacy config (eos_token_id 2) the largest id, else the first
    # id equal to eos_token_id. ORT's CUDA provider has no ArgMax over integers, so the export finds it on floats
    # that float16 holds exactly (ids near 49407 are 32 apart in float16: the start token 49406 would tie with the
    # end token 49407)
    import onnxruntime as ort
    from transformers import CLIPTextConfig, CLIPTextModel

    pipe = build_tiny_random_pipeline()
    torch.manual_seed(0)
    pipe.text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=49408,
            hidden_size=32,
            intermediate_size=37,
            num_attention_heads=4,
            num_hidden_layers=2,
            max_position_embeddings=77,
            bos_token_id=49406,
            eos_token_id=eos_token_id,
            pad_token_id=1,
        )
    ).eval()
    spec = component_specs(pipe)["text_encoder"]
    components_module.export_component("text_encoder", spec, tmp_path, 17, fp16, None)
    graph = onnx.load(str(tmp_path / "text_encoder" / "model.onnx"))
    producers = {output: node for node in graph.graph.node for output in node.output}
    argmaxes = [node for node in graph.graph.node if node.op_type == "ArgMax"]
    assert argmaxes and all(producers[node.input[0]].op_type == "Cast" for node in argmaxes)
    assert all(producers[producers[node.input[0]].input[0]].op_type in ("Equal", "And") for node in argmaxes)
    ids = torch.full((2, 77), 49407, dtype=torch.int32)  # padded with the end token, as SD 1.x's tokenizer pads
    ids[:, 0] = 49406
    ids[0, 1:4] = torch.tensor([320, 49400, 1929])
    ids[1, 1:2] = torch.tensor([49405])
    with torch.no_grad():
        expected = pipe.text_encoder(input_ids=ids.long()).pooler_output.numpy()
    session = ort.InferenceSession(str(tmp_path / "text_encoder" / "model.onnx"), providers=["CPUExecutionProvider"])
    _, pooled = session.run(None, {"input_ids": ids.numpy()})
    np.testing.assert_allclose(pooled.astype(np.float32), expected, atol=2e-2 if fp16 else 1e-5)


@pytest.mark.parametrize("fp16, optimize", [(False, None), (True, None), (False, "cpu")], ids=["fp32", "fp16", "fused"])
def test_the_vae_declares_its_output_channels_so_its_outputs_are_sized_before_the_run(tmp_path, fp16, optimize):
    from optimum_iobinding import IOBindingORTModel, infer_output_shapes

    folder = export_pipeline(
        None,
        tmp_path / "sd",
        tiny_random=True,
        fp16=fp16,
        optimize=optimize,
        components=("vae_encoder", "vae_decoder"),
        progress=False,
    )
    config = build_tiny_random_pipeline().vae.config
    for name, channels in (("vae_encoder", config.latent_channels), ("vae_decoder", config.out_channels)):
        output = onnx.load(str(folder / name / "model.onnx")).graph.output[0]
        assert output.type.tensor_type.shape.dim[1].dim_value == channels, name
    encoder, decoder = (
        IOBindingORTModel.from_pretrained(folder, subfolder=name) for name in ("vae_encoder", "vae_decoder")
    )
    latent = config.latent_channels
    assert infer_output_shapes(encoder, {"sample": (2, 3, 64, 96)}) == {"latent_sample": (2, latent, 8, 12)}
    assert infer_output_shapes(decoder, {"latent_sample": (2, latent, 8, 12)}) == {"sample": (2, 3, 64, 96)}


@pytest.mark.parametrize("optimize", [None, "cpu"], ids=["plain", "fused"])
def test_the_vae_encoder_pads_inside_its_convolutions_and_equals_diffusers(tmp_path, optimize):
    import onnxruntime as ort

    folder = export_pipeline(
        None, tmp_path / "sd", tiny_random=True, optimize=optimize, components=("vae_encoder",), progress=False
    )
    model = onnx.load(str(folder / "vae_encoder" / "model.onnx"))
    assert [node.name for node in model.graph.node if node.op_type == "Pad"] == []
    asymmetric = [
        list(a.ints)
        for node in model.graph.node
        if node.op_type in ("Conv", "NhwcConv")
        for a in node.attribute
        if a.name == "pads" and list(a.ints) == [0, 0, 1, 1]
    ]
    vae = build_tiny_random_pipeline().vae
    assert len(asymmetric) == len(vae.config.block_out_channels) - 1  # one per downsampling block
    image = torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        expected = vae.encode(image).latent_dist.mode().numpy()
    session = ort.InferenceSession(str(folder / "vae_encoder" / "model.onnx"), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"sample": image.numpy()})
    np.testing.assert_allclose(got, expected, atol=1e-4)


def _pad_then_conv(mode=b"constant", fill=0.0, reader="Conv", channel_pad=0):
    from onnx import TensorProto, helper

    pads = numpy_helper.from_array(np.array([0, channel_pad, 0, 0, 0, 0, 1, 1], np.int64), "pads")
    value = numpy_helper.from_array(np.array(fill, np.float32), "value")
    weight = numpy_helper.from_array(np.random.RandomState(0).randn(2, 2 + channel_pad, 3, 3).astype(np.float32), "w")
    pad = helper.make_node("Pad", ["x", "pads", "value"], ["padded"], mode=mode.decode())
    if reader == "Conv":
        read = helper.make_node("Conv", ["padded", "w"], ["y"], strides=[2, 2], kernel_shape=[3, 3])
    else:
        read = helper.make_node("Relu", ["padded"], ["y"])
    graph = helper.make_graph(
        [pad, read],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [pads, value, weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize(
    "case, folds",
    [
        (dict(), True),
        (dict(mode=b"reflect"), False),
        (dict(fill=1.0), False),
        (dict(reader="Relu"), False),
        (dict(channel_pad=1), False),
    ],
    ids=["zero-pad-into-conv", "reflect", "nonzero-fill", "not-a-conv", "channel-pad"],
)
def test_only_a_zero_spatial_pad_read_by_convolutions_is_folded_and_the_result_is_the_same(case, folds):
    import onnxruntime as ort
    from optimum_iobinding.export.optimize import fold_pads_into_convs

    model = _pad_then_conv(**case)
    x = np.random.RandomState(1).randn(1, 2, 8, 8).astype(np.float32)
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(  # noqa: E731
        None, {"x": x}
    )[0]
    expected = run(model)
    assert fold_pads_into_convs(model) == int(folds)
    assert any(node.op_type == "Pad" for node in model.graph.node) != folds
    np.testing.assert_allclose(run(model), expected, atol=1e-6)


def test_a_graph_with_control_flow_is_left_as_it_is_and_the_pads_chain_alone_goes():
    from onnx import TensorProto, helper
    from optimum_iobinding.export.optimize import fold_pads_into_convs

    model = _pad_then_conv()
    branch = helper.make_graph(
        [helper.make_node("Identity", ["pads"], ["kept"])],
        "branch",
        [],
        [helper.make_tensor_value_info("kept", TensorProto.INT64, None)],
    )
    with_if = onnx.ModelProto()
    with_if.CopyFrom(model)
    with_if.graph.input.append(helper.make_tensor_value_info("flag", TensorProto.BOOL, []))
    with_if.graph.node.append(helper.make_node("If", ["flag"], ["chosen"], then_branch=branch, else_branch=branch))
    with_if.graph.output.append(helper.make_tensor_value_info("chosen", TensorProto.INT64, None))
    before = with_if.SerializeToString()
    assert fold_pads_into_convs(with_if) == 0 and with_if.SerializeToString() == before
    # without control flow: the Pad's own constants go, an unrelated unread initializer stays
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(3, np.float32), "unrelated"))
    assert fold_pads_into_convs(model) == 1
    assert {t.name for t in model.graph.initializer} == {"w", "unrelated"}
    import onnxruntime as ort

    ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])  # a valid graph


def test_cascaded_casts_merge_between_float_types_and_never_through_an_integer():
    from onnx import TensorProto, helper
    from onnxruntime.transformers.onnx_model import OnnxModel
    from optimum_iobinding.export.optimize import remove_cascaded_casts

    nodes = [
        helper.make_node("Cast", ["x"], ["half"], to=TensorProto.FLOAT16),
        helper.make_node("Cast", ["half"], ["back"], to=TensorProto.FLOAT),  # fp32 → fp16 → fp32: merged
        helper.make_node("Cast", ["x"], ["whole"], to=TensorProto.INT32),
        helper.make_node("Cast", ["whole"], ["rounded"], to=TensorProto.FLOAT),
    ]  # rounds: kept
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [
            helper.make_tensor_value_info("back", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("rounded", TensorProto.FLOAT, [3]),
        ],
    )
    model = OnnxModel(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    remove_cascaded_casts(model)
    producers = {node.output[0]: node for node in model.model.graph.node}
    assert producers["back"].input[0] == "x" and "half" not in producers
    assert producers["rounded"].input[0] == "whole"
    import onnxruntime as ort

    x = np.array([0.4, 1.6, 2.5], np.float32)
    back, rounded = ort.InferenceSession(model.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    np.testing.assert_array_equal(back, x)
    np.testing.assert_array_equal(rounded, x.astype(np.int32).astype(np.float32))


@pytest.mark.parametrize("name", ["unet", "vae_decoder"])  # the text encoder's export has none such casts
def test_removing_same_type_casts_first_leaves_orts_optimized_graph_exactly_as_it_was(
    tmp_path, tiny_specs, exported_bytes, name
):
    # the export removes them in one pass before ORT's optimizer, which would remove them one full rewrite at a time
    from optimum_iobinding.export.optimize import remove_same_type_casts

    spec = tiny_specs[name]
    results = {}
    for removed_first in (False, True):
        folder = tmp_path / str(removed_first)
        folder.mkdir()
        path = folder / "model.onnx"
        path.write_bytes(exported_bytes(name))
        if removed_first:
            model = onnx.load(str(path))
            casts = sum(node.op_type == "Cast" for node in model.graph.node)
            assert 0 < remove_same_type_casts(model) <= casts
            onnx.save_model(model, str(path))
        optimized = optimize_component(name, path, fusion_options(name, spec["config"], "cuda"), "cuda").model
        onnx.load_external_data_for_model(optimized, str(folder))
        results[removed_first] = _graph_of(optimized)
    (nodes, weights), (cleaned_nodes, cleaned_weights) = results[False], results[True]
    assert cleaned_nodes == nodes
    assert cleaned_weights.keys() == weights.keys()
    for key, value in weights.items():
        np.testing.assert_array_equal(cleaned_weights[key], value)


def test_a_cast_to_another_type_or_making_a_graph_output_stays_and_the_graph_computes_the_same():
    from onnx import TensorProto, helper
    from optimum_iobinding.export.optimize import remove_same_type_casts
    import onnxruntime as ort

    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Cast", ["shape"], ["shape64"], to=TensorProto.INT64),  # int64 → int64: goes
        helper.make_node("Cast", ["shape64"], ["again"], to=TensorProto.INT64),  # a cast of it: goes too
        helper.make_node("Cast", ["again"], ["as_float"], to=TensorProto.FLOAT),  # another type: stays
        helper.make_node("Cast", ["x"], ["same"], to=TensorProto.FLOAT),  # float → float: goes
        helper.make_node("Cast", ["w"], ["weight"], to=TensorProto.FLOAT),  # a float initializer: goes
        helper.make_node("Mul", ["same", "as_float"], ["scaled"]),
        helper.make_node("Mul", ["scaled", "weight"], ["weighted"]),
        helper.make_node("Cast", ["weighted"], ["out"], to=TensorProto.FLOAT),
    ]  # a graph output: stays
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [3])],
        [numpy_helper.from_array(np.array([0.5, 2.0, -1.0], np.float32), "w")],
        value_info=[helper.make_tensor_value_info("same", TensorProto.FLOAT, [3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = np.array([1.0, 2.0, 3.0], np.float32)
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(  # noqa: E731
        None, {"x": x}
    )[0]
    expected = run(model)
    with_if = onnx.ModelProto()  # control flow: left as it is
    with_if.CopyFrom(model)
    branch = helper.make_graph(
        [helper.make_node("Identity", ["same"], ["kept"])],
        "branch",
        [],
        [helper.make_tensor_value_info("kept", TensorProto.FLOAT, None)],
    )
    with_if.graph.input.append(helper.make_tensor_value_info("flag", TensorProto.BOOL, []))
    with_if.graph.node.append(helper.make_node("If", ["flag"], ["chosen"], then_branch=branch, else_branch=branch))
    before = with_if.SerializeToString()
    assert remove_same_type_casts(with_if) == 0 and with_if.SerializeToString() == before
    assert remove_same_type_casts(model) == 4
    casts = {node.output[0]: node for node in model.graph.node if node.op_type == "Cast"}
    assert set(casts) == {"as_float", "out"} and casts["as_float"].input[0] == "shape"
    assert [value.name for value in model.graph.value_info] == []  # the removed value's type goes with it
    np.testing.assert_array_equal(run(model), expected)

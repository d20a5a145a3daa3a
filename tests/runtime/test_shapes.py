"""infer_output_shapes and the dim-expression evaluator."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from optimum_iobinding import IOBindingORTModel, infer_output_shapes
from optimum_iobinding.runtime.shapes import DimExpressionError, ShapeInferencer, evaluate_dim_expression


@pytest.mark.parametrize(
    "expression, symbols, expected",
    [
        ("latent_height * 8", {"latent_height": 64}, 512),
        ("2*batch", {"batch": 3}, 6),
        ("sequence_length + 1", {"sequence_length": 77}, 78),
        ("floor(h / 2)", {"h": 7}, 3),
        ("ceil(h / 2)", {"h": 7}, 4),
        ("(h - 1)//2 + 1", {"h": 9}, 5),
        ("Mod(h, 4)", {"h": 10}, 2),
        ("Max(a, 2*b)", {"a": 3, "b": 4}, 8),
        ("FloorDiv(s0, 2)", {"s0": 5}, 2),
        ("h**2", {"h": 3}, 9),
        ("-a + 10", {"a": 4}, 6),
    ],
)
def test_dim_expressions_exporters_write_evaluate_exactly(expression, symbols, expected):
    assert evaluate_dim_expression(expression, symbols) == expected


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os').getcwd()", "not allowed"),
        ("h.real", "not allowed"),
        ("h if h else 1", "not allowed"),
        ("open('x')", "not allowed"),
        ("h / 3", "not a whole number"),
        ("unknown * 2", "uses 'unknown'"),
        ("h / 0", "divides by zero"),
        ("h ** 100", "exponent"),
        ("h +", "not an arithmetic expression"),
        ("'text'", "not allowed"),
    ],
)
def test_anything_but_arithmetic_over_known_dims_is_refused(expression, message):
    with pytest.raises(DimExpressionError, match=message):
        evaluate_dim_expression(expression, {"h": 7})


def test_named_dims_resolve_from_the_inputs(three_output_model, make_session):
    shapes = infer_output_shapes(make_session(three_output_model), {"a": (5, 3), "b": (5, 3)})
    assert shapes == {"sum": (5, 3), "rounded": (5, 3), "greater": (5, 3)}


def test_expression_dims_resolve_without_running_shape_inference(concat_model, make_session):
    session = make_session(concat_model)
    # no model source: ONNX shape inference cannot run, so the expression alone must size the output
    inferencer = ShapeInferencer(
        {i.name: i.shape for i in session.get_inputs()}, {o.name: o.shape for o in session.get_outputs()}
    )
    assert inferencer({"x": (4, 9)}) == {"y": (8, 9)}


def test_an_output_dim_written_as_an_inputs_expression_takes_that_inputs_size():
    """A graph cut out of a larger one declares the values between the parts with the larger graph's expressions: the
    input's own names (``height``, ``width``) are not among its dims, but the same text is."""
    tokens = "floor(height/2)*floor(width/2)"
    inferencer = ShapeInferencer({"x": ["batch", tokens, 32]}, {"y": ["batch", tokens, 64], "z": [tokens, "height"]})
    assert inferencer({"x": (2, 12, 32)}) == {"y": (2, 12, 64), "z": None}


def test_dims_nothing_resolves_are_data_dependent_without_a_model_source():
    inferencer = ShapeInferencer({"x": ["batch", 4]}, {"y": [None, None]})
    assert inferencer({"x": (3, 4)}) == {"y": None}


def test_upsampling_expression_dim_resolves(tmp_path, make_model, make_session, tensor):
    model = make_model(
        [helper.make_node("Tile", ["x", "repeats"], ["y"])],
        [tensor("x", TensorProto.FLOAT, ["batch", "latent_height"])],
        [tensor("y", TensorProto.FLOAT, ["batch", "latent_height * 8"])],
        [numpy_helper.from_array(np.array([1, 8], dtype=np.int64), "repeats")],
    )
    session = make_session(model)
    assert infer_output_shapes(session, {"x": (2, 64)}) == {"y": (2, 512)}
    (y,) = IOBindingORTModel(session)(x=torch.ones(2, 64))
    assert y.shape == (2, 512)


@pytest.fixture
def reshape_model(make_model, tensor) -> onnx.ModelProto:
    """y = reshape(x @ w, [-1, 2]) with an unnamed output: only shape inference of the graph can size it."""
    weight = numpy_helper.from_array(np.ones((4, 16), dtype=np.float32), "w")
    target = numpy_helper.from_array(np.array([-1, 2], dtype=np.int64), "target")
    return make_model(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Reshape", ["m", "target"], ["y"])],
        [tensor("x", TensorProto.FLOAT, ["batch", 4])],
        [tensor("y", TensorProto.FLOAT, [None, None])],
        [weight, target],
    )


def test_unnamed_dims_resolve_by_shape_inference_of_a_model_proto(reshape_model):
    assert infer_output_shapes(reshape_model, {"x": (3, 4)}) == {"y": (24, 2)}


def test_unnamed_dims_resolve_for_a_model_with_external_data(tmp_path, reshape_model):
    path = tmp_path / "model.onnx"
    # the weight goes to the external file; ORT needs the small shape constant inline
    onnx.save_model(
        reshape_model, str(path), save_as_external_data=True, location="model.onnx_data", size_threshold=128
    )
    assert (tmp_path / "model.onnx_data").stat().st_size == 4 * 16 * 4
    assert infer_output_shapes(str(path), {"x": (5, 4)}) == {"y": (40, 2)}
    model = IOBindingORTModel(path)
    assert infer_output_shapes(model, {"x": (1, 4)}) == {"y": (8, 2)}
    (y,) = model(x=torch.ones(1, 4))
    assert torch.equal(y, torch.full((8, 2), 4.0))


def test_results_are_cached_per_signature(concat_model, make_session):
    model = IOBindingORTModel(make_session(concat_model))
    first = infer_output_shapes(model, {"x": (2, 3)})
    assert model.shape_inferencer.cached_signatures == ((("x", (2, 3)),),)
    assert infer_output_shapes(model, {"x": (2, 3)}) == first
    infer_output_shapes(model, {"x": (4, 3)})
    assert model.shape_inferencer.cached_signatures == ((("x", (2, 3)),), (("x", (4, 3)),))


def test_the_cache_keeps_the_most_recently_used_signatures():
    inferencer = ShapeInferencer({"x": ["batch", "h"]}, {"y": ["2*batch", "h"]}, max_cached_signatures=2)
    for batch in (1, 2, 1, 3):
        inferencer({"x": (batch, 5)})
    assert inferencer.cached_signatures == ((("x", (1, 5)),), (("x", (3, 5)),))


def test_data_dependent_output_shape_is_none(make_model, make_session, tensor):
    model = make_model(
        [helper.make_node("NonZero", ["x"], ["y"])],
        [tensor("x", TensorProto.FLOAT, [4])],
        [tensor("y", TensorProto.INT64, [1, None])],
    )
    assert infer_output_shapes(make_session(model), {"x": (4,)}) == {"y": None}


def test_missing_input_shape_is_an_error(three_output_model, make_session):
    with pytest.raises(ValueError, match=r"missing input 'b'"):
        infer_output_shapes(make_session(three_output_model), {"a": (1, 3)})


def test_unknown_input_shape_is_an_error(concat_model):
    with pytest.raises(ValueError, match=r"unknown input 'q'"):
        infer_output_shapes(concat_model, {"x": (1, 3), "q": (1,)})


def test_model_of_an_unsupported_type_is_an_error():
    with pytest.raises(TypeError, match="model: expected an IOBindingORTModel"):
        infer_output_shapes(42, {})

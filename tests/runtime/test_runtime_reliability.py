"""A model's reliability on the CPU: threads, leaks, broken files, and property tests of the output-shape helper
against ONNX shape inference and real runs."""

from __future__ import annotations

import gc
import os
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import numpy as np
import onnx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from optimum_iobinding import IOBindingORTModel, infer_output_shapes
from optimum_iobinding.runtime.shapes import evaluate_dim_expression


@pytest.fixture
def tanh_model(make_model, tensor) -> onnx.ModelProto:
    """y = tanh(x) * x, x [batch, 16]."""
    return make_model(
        [helper.make_node("Tanh", ["x"], ["t"]), helper.make_node("Mul", ["t", "x"], ["y"])],
        [tensor("x", TensorProto.FLOAT, ["batch", 16])],
        [tensor("y", TensorProto.FLOAT, ["batch", 16])],
    )


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --------------------------------------------------------------------------------------------------------- threads
def test_one_model_called_from_four_threads_gives_the_serial_results(make_session, tanh_model):
    model = IOBindingORTModel(make_session(tanh_model))
    inputs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(seed)) for seed in range(32)]
    serial = [model(x=x)[0].clone() for x in inputs]

    def call(x):
        y = model(x=x)[0]
        return y.clone()  # read after the call returns: another thread's call must not have overwritten it

    with ThreadPoolExecutor(max_workers=4) as pool:
        threaded = list(pool.map(call, inputs))
    for expected, got in zip(serial, threaded):
        assert torch.equal(expected, got)


# ----------------------------------------------------------------------------------------------------------- leaks
def test_a_thousand_calls_with_constant_shapes_do_not_grow_memory(make_session, tanh_model):
    model = IOBindingORTModel(make_session(tanh_model))
    x = torch.randn(8, 16)
    for _ in range(1000):  # warm up: allocator pools, ORT's arena and thread pool, the caches
        model(x=x)
    growth = []
    for _ in range(3):  # a leak grows in every window; a one-off (another thread, the allocator) in one at most
        gc.collect()
        before = rss_bytes()
        for _ in range(2000):  # a leaked 8×16 output per call would be ≥ 1 MiB per window
            model(x=x)
        gc.collect()
        growth.append(rss_bytes() - before)
    assert min(growth) < 2**19, f"RSS grew by {growth} bytes in three windows of 2000 calls"
    assert model.output_signatures == 1 and len(model.shape_inferencer.cached_signatures) == 1


def test_alternating_shapes_keep_at_most_max_output_signatures_buffers(make_session, tanh_model):
    model = IOBindingORTModel(make_session(tanh_model), max_output_signatures=4)
    for call in range(200):
        model(x=torch.randn(1 + call % 20, 16))
    assert model.output_signatures == 4
    assert len(model.shape_inferencer.cached_signatures) <= model.shape_inferencer.max_cached_signatures


# ----------------------------------------------------------------------------------------- failed loads, files
def test_a_truncated_model_file_is_an_error_naming_it(tmp_path, tanh_model):
    path = tmp_path / "model.onnx"
    data = tanh_model.SerializeToString()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"could not load .*model\.onnx"):
        IOBindingORTModel(path)


def test_a_missing_external_data_file_is_an_error_naming_it(tmp_path, make_model, tensor):
    weight = numpy_helper.from_array(np.ones((16, 16), dtype=np.float32), "w")
    model = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [tensor("x", TensorProto.FLOAT, ["n", 16])],
        [tensor("y", TensorProto.FLOAT, ["n", 16])],
        [weight],
    )
    onnx.save_model(
        model, str(tmp_path / "model.onnx"), save_as_external_data=True, location="weights.pb", size_threshold=0
    )
    (tmp_path / "weights.pb").unlink()
    with pytest.raises(ValueError, match=r"could not load .*model\.onnx.*weights\.pb"):
        IOBindingORTModel(tmp_path / "model.onnx")


# ------------------------------------------------------------------------------------------------ property tests
SYMBOLS = ["batch", "height", "width", "seq", "s0"]


@st.composite
def expressions(draw, depth=0):
    """(expression text, its exact value) over SYMBOLS bound to known sizes — the value computed without eval."""
    values = {"batch": 2, "height": 64, "width": 48, "seq": 77, "s0": 5}
    if depth > 2 or draw(st.booleans()):
        if draw(st.booleans()):
            number = draw(st.integers(0, 16))
            return str(number), Fraction(number)
        name = draw(st.sampled_from(SYMBOLS))
        return name, Fraction(values[name])
    left, left_value = draw(expressions(depth + 1))
    right, right_value = draw(expressions(depth + 1))
    op = draw(st.sampled_from(["+", "-", "*", "floor", "max"]))
    if op == "floor":
        divisor = draw(st.integers(1, 8))
        return f"floor(({left}) / {divisor})", Fraction((left_value / divisor).__floor__())
    if op == "max":
        return f"max({left}, {right})", max(left_value, right_value)
    value = {"+": left_value + right_value, "-": left_value - right_value, "*": left_value * right_value}[op]
    return f"({left}) {op} ({right})", value


@given(expressions())
@settings(max_examples=200)
def test_dim_expressions_evaluate_to_their_exact_value(expression_and_value):
    expression, value = expression_and_value
    symbols = {"batch": 2, "height": 64, "width": 48, "seq": 77, "s0": 5}
    assert evaluate_dim_expression(expression, symbols) == value


@st.composite
def concat_models(draw):
    """x of random rank and dims (named, static or unnamed) → y = concat(x, x) on a random axis, with output dims
    declared by name, by an expression of the names, or not at all: (axis, x's dims, y's dims) and x's sizes."""
    rank = draw(st.integers(1, 4))
    axis = draw(st.integers(0, rank - 1))
    input_dims, sizes = [], []
    for position in range(rank):
        kind = draw(st.sampled_from(["named", "static", "unnamed"]))
        size = draw(st.integers(1, 5))
        sizes.append(size)
        input_dims.append({"named": f"d{position}", "static": size, "unnamed": None}[kind])
    output_dims = []
    for position, dim in enumerate(input_dims):
        form = draw(st.sampled_from(["declared", "unnamed"]))
        if form == "unnamed" or dim is None:
            output_dims.append(None)
        elif position == axis:
            output_dims.append(
                2 * dim if isinstance(dim, int) else draw(st.sampled_from([f"2*{dim}", f"{dim} + {dim}", f"{dim} * 2"]))
            )
        else:
            output_dims.append(dim)
    return (axis, input_dims, output_dims), tuple(sizes)


@given(concat_models())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_inferred_output_shapes_match_onnx_shape_inference_and_a_real_run(
    make_model, make_session, tensor, declaration_and_sizes
):
    (axis, input_dims, output_dims), sizes = declaration_and_sizes
    model = make_model(
        [helper.make_node("Concat", ["x", "x"], ["y"], axis=axis)],
        [tensor("x", TensorProto.FLOAT, input_dims)],
        [tensor("y", TensorProto.FLOAT, output_dims)],
    )
    session = make_session(model)
    (expected,) = [tuple(output.shape) for output in session.run(None, {"x": np.zeros(sizes, np.float32)})]
    assert infer_output_shapes(session, {"x": sizes}) == {"y": expected}
    assert infer_output_shapes(model, {"x": sizes}) == {"y": expected}
    (bound,) = IOBindingORTModel(session)(x=torch.zeros(sizes))
    assert tuple(bound.shape) == expected

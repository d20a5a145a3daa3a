"""Bind torch tensors to an ONNX model with IOBindingORTModel and print what comes back.

Builds a small two-output model offline (nothing is downloaded), saves it with external weights, loads it the way
diffusers loads a component, and runs it with IO binding and with the numpy baseline.

    python examples/bind_model.py [--provider CUDAExecutionProvider]
"""

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from optimum_iobinding import IOBindingORTModel, infer_output_shapes
from optimum_iobinding.cli import run_script


def build_model(folder: Path) -> Path:
    """y = tanh(x @ w) with x [batch, 8], and its row sums; w saved as external data like a real component."""
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32), "w")
    axes = numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"]),
            helper.make_node("Tanh", ["m"], ["y"]),
            helper.make_node("ReduceSum", ["y", "axes"], ["row_sum"], keepdims=0),
        ],
        "example",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("row_sum", TensorProto.FLOAT, ["batch"]),
        ],
        initializer=[weight, axes],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    path = folder / "model.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="weights.pb", size_threshold=64)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", default="CPUExecutionProvider")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        build_model(Path(folder))
        model = IOBindingORTModel.from_pretrained(folder, provider=args.provider)
        baseline = IOBindingORTModel.from_pretrained(folder, provider=args.provider, io_binding=False)
        print(model)
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0), device="cpu").to(model.device)
        print("output shapes, before running:", infer_output_shapes(model, {"x": tuple(x.shape)}))
        y, row_sum = model(x=x)
        print("y on", y.device, y.dtype, tuple(y.shape))
        print(y)
        print("row_sum:", row_sum)
        y_numpy, _ = baseline(x=x.cpu())
        print("largest difference from the numpy baseline:", (y.cpu() - y_numpy).abs().max().item())


if __name__ == "__main__":
    sys.exit(run_script(main))

"""Rewrites of a diffusion transformer's graph (SD3's MMDiT, FLUX.1) onto ONNX Runtime's fused operators, for work
that ORT's own MMDiT optimizer leaves to separate elementwise kernels. They run after that optimizer (its
``LayerNormalization`` and ``FastGelu`` nodes are what they start from) and before the float16 conversion; each keeps
the values the graph computes (up to float rounding) and only changes how many passes over the activations it takes.

- :func:`fuse_modulated_layer_norms`: AdaLN's modulation ``LayerNorm(x) · (1 + scale) + shift`` (diffusers'
  ``AdaLayerNormZero``, ``AdaLayerNormContinuous``, FLUX.1's single blocks) becomes one ``LayerNormalization`` whose
  scale and bias are the per-sample ``(batch, 1, channels)`` modulation. ONNX's LayerNormalization broadcasts its scale
  and bias to the input, and ORT's CUDA kernel takes exactly that shape; three passes over the tokens (norm, Mul, Add)
  become one.
- :func:`fuse_gelu_biases`: the feed-forward's first projection ``MatMul + bias`` followed by ``FastGelu`` becomes
  ``FastGelu(MatMul, bias)``: the bias is added inside the GELU kernel, so the GEMM writes its output once and no bias
  pass (ORT's ``BroadcastBiasKernel`` before a beta-accumulating GEMM, or an ``Add``) runs over the widest
  activation of the block.

:func:`fuse_diffusion_transformer` applies every rewrite and says how many of each it made.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["fuse_diffusion_transformer", "fuse_modulated_layer_norms", "fuse_gelu_biases"]


class _Graph:
    """Producers and readers of a graph's values, and the constant value of small constants."""

    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.producer = {output: node for node in graph.node for output in node.output}
        self.readers: Dict[str, List[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                self.readers.setdefault(name, []).append(node)
        self.initializers = {tensor.name: tensor for tensor in graph.initializer}
        self.outputs = {value.name for value in graph.output}
        self.inputs = {value.name for value in graph.input}

    def only_reader(self, value: str) -> Optional[onnx.NodeProto]:
        """The one node reading ``value``, where exactly one does and ``value`` is no graph output."""
        readers = self.readers.get(value, [])
        return readers[0] if len(readers) == 1 and value not in self.outputs else None

    def constant(self, name: str) -> Optional[np.ndarray]:
        """The value of ``name`` where it is an initializer held in the file or a ``Constant`` node's, else None."""
        from onnx.external_data_helper import uses_external_data

        if name in self.inputs:
            return None
        tensor = self.initializers.get(name)
        if tensor is not None:
            return None if uses_external_data(tensor) else numpy_helper.to_array(tensor)
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            value = next((a for a in node.attribute if a.name == "value"), None)
            return None if value is None else numpy_helper.to_array(value.t)
        return None

    def dims(self, name: str) -> Optional[tuple]:
        """``name``'s dims as written by shape inference (ints, names, or None where unknown); None without a rank."""
        tensor = self.initializers.get(name)
        if tensor is not None:
            return tuple(tensor.dims)
        for value in (*self.graph.value_info, *self.graph.input, *self.graph.output):
            if value.name == name and value.type.tensor_type.HasField("shape"):
                return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                             for d in value.type.tensor_type.shape.dim)
        return None


def _attribute(node: onnx.NodeProto, name: str, default):
    attribute = next((a for a in node.attribute if a.name == name), None)
    return default if attribute is None else helper.get_attribute_value(attribute)


def _with_shapes(model: onnx.ModelProto) -> onnx.GraphProto:
    """A copy of ``model``'s graph with the shapes of its values from ORT's symbolic shape inference (onnx's own stops at
    the com.microsoft operators ORT's optimizer writes), so that a rewrite can ask a value's rank and dims. The copy
    holds the small initializers (shape constants and the like, which inference reads) and only the dims of the
    others: the weights are neither copied nor read."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    light.graph.name = model.graph.name
    light.graph.node.extend(model.graph.node)
    light.graph.input.extend(model.graph.input)
    light.graph.output.extend(model.graph.output)
    for tensor in model.graph.initializer:
        if len(tensor.raw_data) <= 1024 and not tensor.external_data:
            light.graph.initializer.append(tensor)
        else:  # a weight: its name, type and dims are all inference needs
            stub = light.graph.initializer.add()
            stub.name, stub.data_type = tensor.name, tensor.data_type
            stub.dims.extend(tensor.dims)
    try:
        return SymbolicShapeInference.infer_shapes(light, auto_merge=True, guess_output_rank=False).graph
    except Exception:  # ORT's inference fails on some graph: no shapes, so no rewrite that needs one
        return light.graph


def _is_modulation(dims: Optional[tuple], channels) -> bool:
    """A per-sample modulation tensor: ``(batch, 1, channels)``."""
    return dims is not None and len(dims) == 3 and dims[1] == 1 and (channels is None or dims[2] == channels)


def fuse_modulated_layer_norms(model: onnx.ModelProto) -> int:
    """Rewrites each ``LayerNormalization(x)`` with a unit scale and zero bias whose output is only read by
    ``Mul(·, m)`` nodes each read only by an ``Add(·, a)``, where ``m`` and ``a`` are per-sample modulation tensors of
    one shape ``(batch, 1, channels)``, into ``LayerNormalization(x, scale=m, bias=a)`` (one per such pair: SD3.5's
    first norm feeds two modulations). Modifies ``model`` in place; returns how many LayerNormalizations it wrote."""
    graph = model.graph
    index = _Graph(graph)
    shapes = _Graph(_with_shapes(model))
    rewritten = 0
    for norm in [node for node in graph.node if node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx")]:
        if len(norm.output) != 1 and any(norm.output[1:]):  # mean / inverse std read by someone: leave it
            continue
        scale = index.constant(norm.input[1]) if len(norm.input) > 1 else None
        bias = index.constant(norm.input[2]) if len(norm.input) > 2 and norm.input[2] else np.zeros(1)
        if scale is None or bias is None or not np.all(scale == 1) or not np.all(bias == 0):
            continue
        axis = _attribute(norm, "axis", -1)
        input_dims = shapes.dims(norm.input[0])
        if input_dims is not None and axis not in (-1, len(input_dims) - 1):
            continue
        channels = scale.shape[-1] if scale.ndim else None
        readers = index.readers.get(norm.output[0], [])
        if not readers or norm.output[0] in index.outputs:
            continue
        pairs = []
        for mul in readers:
            add = index.only_reader(mul.output[0]) if mul.op_type == "Mul" else None
            if add is None or add.op_type != "Add":
                break
            modulation = mul.input[1] if mul.input[0] == norm.output[0] else mul.input[0]
            shift = add.input[1] if add.input[0] == mul.output[0] else add.input[0]
            if norm.output[0] in (modulation, shift) or mul.output[0] == shift:
                break
            modulation_dims, shift_dims = shapes.dims(modulation), shapes.dims(shift)
            if not (_is_modulation(modulation_dims, channels) and modulation_dims == shift_dims):
                break
            pairs.append((mul, add, modulation, shift))
        if len(pairs) != len(readers):
            continue
        graph.node.remove(norm)
        for number, (mul, add, modulation, shift) in enumerate(pairs):
            fused = helper.make_node("LayerNormalization", [norm.input[0], modulation, shift], [add.output[0]],
                                     name=f"{norm.name}/modulated" + (f"_{number}" if len(pairs) > 1 else ""))
            fused.attribute.extend(a for a in norm.attribute)
            graph.node.remove(mul)
            graph.node.remove(add)
            # it reads the modulation too, which may be computed after the norm's input
            _insert_after_producers(graph, fused)
            rewritten += 1
        _remove_unread(graph, [name for name in norm.input[1:] if name])
    return rewritten


def fuse_gelu_biases(model: onnx.ModelProto) -> int:
    """Rewrites each ``FastGelu(Add(MatMul(x, W), b))`` (``b`` a constant 1-D bias, the Add read only by the GELU, the
    GELU without a bias of its own) into ``FastGelu(MatMul(x, W), b)``. Modifies ``model`` in place; returns how many
    it rewrote."""
    graph = model.graph
    index = _Graph(graph)
    rewritten = 0
    for gelu in [node for node in graph.node if node.op_type == "FastGelu" and node.domain == "com.microsoft"]:
        if len(gelu.input) > 1 and gelu.input[1]:
            continue
        add = index.producer.get(gelu.input[0])
        if add is None or add.op_type != "Add" or index.only_reader(add.output[0]) is not gelu:
            continue
        first = index.producer.get(add.input[0])
        matmul_input, bias = (add.input[0], add.input[1]) if first is not None and first.op_type == "MatMul" \
            else (add.input[1], add.input[0])
        matmul = index.producer.get(matmul_input)
        if matmul is None or matmul.op_type != "MatMul" or index.only_reader(matmul.output[0]) is not add:
            continue
        bias_dims = index.dims(bias) if bias in index.initializers else None
        weight_dims = index.dims(matmul.input[1]) if matmul.input[1] in index.initializers else None
        if bias_dims is None or len(bias_dims) != 1 or weight_dims is None or bias_dims[0] != weight_dims[-1]:
            continue
        del gelu.input[:]
        gelu.input.extend([matmul.output[0], bias])
        graph.node.remove(add)
        rewritten += 1
    return rewritten


def fuse_diffusion_transformer(model: onnx.ModelProto) -> Dict[str, int]:
    """Every rewrite of this module on an ORT-optimized SD3 / FLUX.1 transformer, in place.

    Args:
        model: the transformer after ORT's ``mmdit`` optimizer (float32 or float16; weights may be left on disk: no
            rewrite reads a weight larger than a bias).

    Returns:
        How many places each rewrite changed, by its name.
    """
    return {"modulated_layer_norm": fuse_modulated_layer_norms(model), "gelu_bias": fuse_gelu_biases(model)}


def _insert_after_producers(graph: onnx.GraphProto, node: onnx.NodeProto) -> None:
    """Puts ``node`` into ``graph`` right after the last node producing one of its inputs (graph order stays a
    topological order), or first where none does."""
    nodes = list(graph.node)
    last = -1
    for position, other in enumerate(nodes):
        if any(output in node.input for output in other.output):
            last = position
    graph.node.insert(last + 1, node)


def _remove_unread(graph: onnx.GraphProto, names: Sequence[str]) -> None:
    """Removes the Constant nodes and initializers behind ``names`` that nothing reads any more."""
    read = {name for node in graph.node for name in node.input} | {value.name for value in graph.output}
    for name in names:
        if name in read:
            continue
        for node in [n for n in graph.node if n.op_type == "Constant" and name in n.output]:
            graph.node.remove(node)
        for tensor in [t for t in graph.initializer if t.name == name]:
            graph.initializer.remove(tensor)

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
- :func:`fuse_rotary_embeddings`: FLUX.1's rotary embedding of the queries and keys, ``x · cos + rotate(x) · sin``
  with ``rotate`` pairing neighbouring channels (two strided Slices, a Neg, a Concat, two Muls and an Add, each a
  pass over the activation), becomes ORT's ``RotaryEmbedding`` in its interleaved form, one pass, reading
  half-width cos/sin tables that the graph computes once for all blocks.
- :func:`fold_value_biases`: where one stream attends alone (SD3.5's second attention, FLUX.1's single blocks), the
  value projection's bias moves into the output projection's (each row of attention weights sums to one): one bias
  pass over the activations fewer per such attention.

:func:`fuse_diffusion_transformer` applies every rewrite and says how many of each it made.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..layout import record_folded_bias

__all__ = [
    "fuse_diffusion_transformer",
    "fuse_modulated_layer_norms",
    "fuse_gelu_biases",
    "fuse_rotary_embeddings",
    "fold_value_biases",
    "inferred_shapes",
    "all_nodes",
    "fresh_names",
]

# the most elements of a constant a rewrite reads (a norm's scale or a bias: one value per channel)
_SMALL = 1 << 16


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
        self._values: Optional[Dict[str, List[onnx.ValueInfoProto]]] = None  # see _value_infos

    def only_reader(self, value: str) -> Optional[onnx.NodeProto]:
        """The one node reading ``value``, where exactly one does and ``value`` is no graph output."""
        readers = self.readers.get(value, [])
        return readers[0] if len(readers) == 1 and value not in self.outputs else None

    def constant(self, name: str) -> Optional[np.ndarray]:
        """The value of ``name`` where it is a small initializer or a ``Constant`` node's (read from its external data,
        relative to the working directory, where the model was loaded without it), else None."""
        if name in self.inputs:
            return None
        tensor = self.initializers.get(name)
        node = self.producer.get(name) if tensor is None else None
        if node is not None and node.op_type == "Constant":
            value = next((a for a in node.attribute if a.name == "value"), None)
            tensor = None if value is None else value.t
        if tensor is None or int(np.prod(tensor.dims)) > _SMALL:
            return None
        try:
            return numpy_helper.to_array(tensor)
        except Exception:  # external data that is not where the working directory says: unknown here
            return None

    def dims(self, name: str) -> Optional[tuple]:
        """``name``'s dims as written by shape inference (ints, names, or None where unknown); None without a rank."""
        tensor = self.initializers.get(name)
        if tensor is not None:
            return tuple(tensor.dims)
        for value in self._value_infos(name):
            if value.type.tensor_type.HasField("shape"):
                return tuple(
                    d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                    for d in value.type.tensor_type.shape.dim
                )
        return None

    def element_type(self, name: str) -> Optional[int]:
        """``name``'s element type (a ``TensorProto`` data type) where the graph says it, else None."""
        tensor = self.initializers.get(name)
        if tensor is not None:
            return tensor.data_type
        for value in self._value_infos(name):
            if value.type.tensor_type.elem_type != onnx.TensorProto.UNDEFINED:
                return value.type.tensor_type.elem_type
        return None

    def _value_infos(self, name: str) -> List[onnx.ValueInfoProto]:
        """The graph's value infos, inputs and outputs naming ``name``, in that order (indexed on first use)."""
        if self._values is None:
            self._values = {}
            for value in (*self.graph.value_info, *self.graph.input, *self.graph.output):
                self._values.setdefault(value.name, []).append(value)
        return self._values.get(name, [])


def _attribute(node: onnx.NodeProto, name: str, default):
    attribute = next((a for a in node.attribute if a.name == name), None)
    return default if attribute is None else helper.get_attribute_value(attribute)


def inferred_shapes(model: onnx.ModelProto, strict: bool = False) -> onnx.GraphProto:
    """A copy of ``model``'s graph with the shapes of its values from ORT's symbolic shape inference (onnx's own stops at
    the com.microsoft operators ORT's optimizer writes), so that a rewrite can ask a value's rank and dims. The copy
    holds the small initializers (shape constants, biases: inference may compute with them; read from disk, relative
    to the working directory, where the model was loaded without them) and only the dims of the others: the weights
    are neither copied nor read. Where the inference fails: the graph as it is, or with ``strict`` the failure raised."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    from .optimize import in_folder

    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    light.graph.name = model.graph.name
    light.graph.node.extend(model.graph.node)
    light.graph.input.extend(model.graph.input)
    light.graph.output.extend(model.graph.output)
    try:
        for tensor in model.graph.initializer:
            small = int(np.prod(tensor.dims)) <= _SMALL
            if small and not tensor.external_data:
                light.graph.initializer.append(tensor)
            elif small:  # inference may compute with it (a bias added to a constant): its values, from disk
                light.graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
            else:  # a weight: its name, type and dims are all inference needs
                stub = light.graph.initializer.add()
                stub.name, stub.data_type = tensor.name, tensor.data_type
                stub.dims.extend(tensor.dims)
        # where it infers all but some values, ORT writes the model into the working directory (the model's folder,
        # for the small weights read above): a scratch folder's instead
        with tempfile.TemporaryDirectory(prefix="shape-inference-") as scratch, in_folder(Path(scratch)):
            return SymbolicShapeInference.infer_shapes(light, auto_merge=True, guess_output_rank=False).graph
    except Exception:  # data not where the working directory says, or ORT's inference fails on some graph
        if strict:
            raise
        return model.graph  # no shapes beyond what the model carries, so no rewrite that needs one


def _is_modulation(dims: Optional[tuple], channels) -> bool:
    """A per-sample modulation tensor: ``(batch, 1, channels)``."""
    return dims is not None and len(dims) == 3 and dims[1] == 1 and (channels is None or dims[2] == channels)


def fuse_modulated_layer_norms(model: onnx.ModelProto) -> int:
    """Rewrites each ``LayerNormalization(x)`` with a unit scale and zero bias whose output is only read by
    ``Mul(·, m)`` nodes each read only by an ``Add(·, a)``, where ``m`` and ``a`` are per-sample modulation tensors of
    one shape ``(batch, 1, channels)``, into ``LayerNormalization(x, scale=m, bias=a)`` (one per such pair: SD3.5's
    first norm feeds two modulations). Modifies ``model`` in place; returns how many LayerNormalizations it wrote."""
    return _fuse_modulated_layer_norms(model, None)


def _fuse_modulated_layer_norms(model: onnx.ModelProto, shapes: Optional[onnx.GraphProto]) -> int:
    graph = model.graph
    index = _Graph(graph)
    shapes = _Graph(shapes if shapes is not None else inferred_shapes(model))  # the caller's, where it has them
    removed: List[onnx.NodeProto] = []
    added: List[onnx.NodeProto] = []
    unread: List[str] = []
    for norm in [
        node for node in graph.node if node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx")
    ]:
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
            # the modulation's batch is the input's (or one): Mul would broadcast a larger one, a norm refuses it
            if not (
                _is_modulation(modulation_dims, channels)
                and modulation_dims == shift_dims
                and input_dims is not None
                and modulation_dims[0] in (1, input_dims[0])
            ):
                break
            pairs.append((mul, add, modulation, shift))
        if len(pairs) != len(readers):
            continue
        removed.append(norm)
        for number, (mul, add, modulation, shift) in enumerate(pairs):
            fused = helper.make_node(
                "LayerNormalization",
                [norm.input[0], modulation, shift],
                [add.output[0]],
                name=f"{norm.name}/modulated" + (f"_{number}" if len(pairs) > 1 else ""),
            )
            fused.attribute.extend(a for a in norm.attribute)
            removed.extend((mul, add))
            added.append(fused)
        unread.extend(name for name in norm.input[1:] if name)
    # it reads the modulation too, which may be computed after the norm's input: each goes after its producers
    _replace_nodes(graph, removed, added)
    _remove_dead(graph, unread)
    return len(added)


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
        matmul_input, bias = (
            (add.input[0], add.input[1])
            if first is not None and first.op_type == "MatMul"
            else (add.input[1], add.input[0])
        )
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


class _RotaryPlace(NamedTuple):
    """One rotary embedding matched in the graph: its input ``x``, the full-width cos and sin tables ``(S, D)`` it
    reads, whether ``x`` is laid out ``(batch, sequence, heads, head_dim)`` (else ``(batch, heads, sequence,
    head_dim)``), its number of heads and head size, the nodes computing it and the value it writes."""

    x: str
    cos: str
    sin: str
    sequence_second: bool
    heads: Optional[int]
    head_dim: int
    nodes: Tuple[onnx.NodeProto, ...]
    output: str


def _unsqueeze_axes(index: _Graph, node: onnx.NodeProto) -> Optional[List[int]]:
    """An ``Unsqueeze``'s axes (its attribute before opset 13, its constant second input since)."""
    if len(node.input) > 1 and node.input[1]:
        axes = index.constant(node.input[1])
        return None if axes is None else [int(a) for a in np.ravel(axes)]
    axes = _attribute(node, "axes", None)
    return None if axes is None else [int(a) for a in axes]


def _every_other(index: _Graph, node: Optional[onnx.NodeProto], rank: int, head_dim) -> Optional[Tuple[str, int]]:
    """``(data, start)`` where ``node`` is ``Slice(data, start, ≥ head_dim, last axis, step 2)`` with ``start`` 0 or
    1: every other channel of the last axis, from the first or from the second."""
    if node is None or node.op_type != "Slice" or len(node.input) != 5 or not isinstance(head_dim, int):
        return None
    starts, ends, axes, steps = (index.constant(name) for name in node.input[1:])
    if any(value is None or value.size != 1 for value in (starts, ends, axes, steps)):
        return None
    if (
        int(axes.item()) not in (-1, rank - 1)
        or int(steps.item()) != 2
        or int(ends.item()) < head_dim
        or int(starts.item()) not in (0, 1)
    ):
        return None
    return node.input[0], int(starts.item())


def _last_axis_unsqueeze(index: _Graph, node: Optional[onnx.NodeProto], rank: int) -> bool:
    """``node`` is an ``Unsqueeze`` adding a last axis to a value of rank ``rank``."""
    return node is not None and node.op_type == "Unsqueeze" and _unsqueeze_axes(index, node) in ([-1], [rank])


def _feeds_only_shape_of(index: _Graph, node: onnx.NodeProto, reshape: onnx.NodeProto, depth: int = 8) -> bool:
    """What ``node`` computes is read only, through at most ``depth`` nodes, as ``reshape``'s shape."""
    for output in node.output:
        if output in index.outputs:
            return False
        for reader in index.readers.get(output, []):
            if reader is reshape:
                if list(reshape.input).index(output) != 1:
                    return False
            elif depth == 0 or not _feeds_only_shape_of(index, reader, reshape, depth - 1):
                return False
    return True


def _broadcast_table(index: _Graph, shapes: _Graph, name: str) -> Optional[Tuple[str, int]]:
    """``(table, axis)`` where ``name`` is ``Unsqueeze``\\ s of a 2-D ``(S, D)`` table ``table`` to rank 4 with its
    rows on ``axis`` (1 or 2) and its columns last, every other axis of size one: how diffusers broadcasts FLUX.1's
    cos/sin to ``(batch, heads, sequence, head_dim)``, and ORT's attention fusion to its query's
    ``(batch, sequence, heads, head_dim)``."""
    unsqueezes = []
    node = index.producer.get(name)
    while node is not None and node.op_type == "Unsqueeze":
        unsqueezes.append(node)
        name = node.input[0]
        node = index.producer.get(name)
    dims = shapes.dims(name)
    if not unsqueezes or dims is None or len(dims) != 2:
        return None
    layout: List[Optional[int]] = [0, 1]  # where each axis comes from: the table's rows, its columns, or nowhere
    for unsqueeze in reversed(unsqueezes):
        axes = _unsqueeze_axes(index, unsqueeze)
        if axes is None:
            return None
        rank = len(layout) + len(axes)
        for axis in sorted(a + rank if a < 0 else a for a in axes):
            layout.insert(axis, None)
    if layout == [None, 0, None, 1]:
        return name, 1
    if layout == [None, None, 0, 1]:
        return name, 2
    return None


def _pair_repeated(index: _Graph, shapes: _Graph, name: str) -> Optional[List[str]]:
    """The 2-D values ``h_1 … h_k`` where ``name`` is ``[h_1 … h_k]`` side by side with each column repeated twice in
    a row (``Flatten(Concat([h[..., None], h[..., None]], -1))`` per part, the parts concatenated on the last axis:
    how FLUX.1's position embedding interleaves each frequency's cos or sin with itself), else None."""
    node = index.producer.get(name)
    if node is None:
        return None
    if node.op_type == "Concat" and _attribute(node, "axis", None) in (-1, 1) and len(node.input) > 1:
        parts = [_pair_repeated(index, shapes, part) for part in node.input]
        return None if any(part is None for part in parts) else [h for part in parts for h in part]
    if node.op_type != "Flatten" or _attribute(node, "axis", 1) != 1:
        return None
    stack = index.producer.get(node.input[0])
    if (
        stack is None
        or stack.op_type != "Concat"
        or _attribute(stack, "axis", None) not in (-1, 2)
        or len(stack.input) != 2
    ):
        return None
    halves = [index.producer.get(value) for value in stack.input]
    if not all(_last_axis_unsqueeze(index, half, 2) for half in halves) or halves[0].input[0] != halves[1].input[0]:
        return None
    values = halves[0].input[0]
    dims = shapes.dims(values)
    return [values] if dims is not None and len(dims) == 2 else None


def _rotary_place(index: _Graph, shapes: _Graph, neg: onnx.NodeProto) -> Optional[_RotaryPlace]:
    """The rotary embedding around ``neg``, where it is FLUX.1's (see :func:`fuse_rotary_embeddings`), else None."""
    only = index.only_reader
    imaginary = index.producer.get(neg.input[0])
    x = imaginary.input[0] if imaginary is not None and imaginary.op_type == "Slice" else None
    dims = shapes.dims(x) if x else None
    if dims is None or len(dims) != 4 or any(d is None for d in dims) or not isinstance(dims[3], int) or dims[3] % 2:
        return None
    head_dim = dims[3]
    if _every_other(index, imaginary, 4, head_dim) != (x, 1) or only(imaginary.output[0]) is not neg:
        return None
    negated = only(neg.output[0])
    if not _last_axis_unsqueeze(index, negated, 4):
        return None
    stack = only(negated.output[0])
    if (
        stack is None
        or stack.op_type != "Concat"
        or _attribute(stack, "axis", None) not in (-1, 4)
        or list(stack.input[:1]) != [negated.output[0]]
        or len(stack.input) != 2
    ):
        return None
    unsqueezed_real = index.producer.get(stack.input[1])
    real = index.producer.get(unsqueezed_real.input[0]) if unsqueezed_real is not None else None
    if (
        not _last_axis_unsqueeze(index, unsqueezed_real, 4)
        or only(unsqueezed_real.output[0]) is not stack
        or _every_other(index, real, 4, head_dim) != (x, 0)
        or only(real.output[0]) is not unsqueezed_real
    ):
        return None
    # the stacked pairs are read by their Reshape back to x's shape, and by the Shape nodes computing that shape
    flattens = [node for node in index.readers.get(stack.output[0], []) if node.op_type != "Shape"]
    flatten = flattens[0] if len(flattens) == 1 and stack.output[0] not in index.outputs else None
    if (
        flatten is None
        or flatten.op_type != "Reshape"
        or flatten.input[0] != stack.output[0]
        or shapes.dims(flatten.output[0]) != dims
        or not all(
            _feeds_only_shape_of(index, node, flatten) for node in index.readers[stack.output[0]] if node is not flatten
        )
    ):
        return None
    times_sin = only(flatten.output[0])
    add = only(times_sin.output[0]) if times_sin is not None and times_sin.op_type == "Mul" else None
    if add is None or add.op_type != "Add" or len(set(add.input)) != 2:
        return None
    times_cos = index.producer.get(add.input[1] if add.input[0] == times_sin.output[0] else add.input[0])
    if (
        times_cos is None
        or times_cos.op_type != "Mul"
        or only(times_cos.output[0]) is not add
        or list(times_cos.input).count(x) != 1
    ):
        return None
    sin = _broadcast_table(
        index, shapes, times_sin.input[1] if times_sin.input[0] == flatten.output[0] else times_sin.input[0]
    )
    cos = _broadcast_table(index, shapes, times_cos.input[1] if times_cos.input[0] == x else times_cos.input[0])
    if sin is None or cos is None or sin[1] != cos[1]:
        return None
    sequence_axis = cos[1]
    for table in (cos[0], sin[0]):
        if shapes.dims(table) != (dims[sequence_axis], head_dim):
            return None
    types = {shapes.element_type(name) for name in (x, cos[0], sin[0])}
    if len(types) != 1 or None in types:
        return None
    heads = dims[2] if sequence_axis == 1 else dims[1]
    if sequence_axis == 1 and not isinstance(heads, int):  # the 3-D form needs the number of heads
        return None
    return _RotaryPlace(
        x,
        cos[0],
        sin[0],
        sequence_axis == 1,
        heads if isinstance(heads, int) else None,
        head_dim,
        (imaginary, neg, negated, real, unsqueezed_real, stack, flatten, times_sin, times_cos, add),
        add.output[0],
    )


def fuse_rotary_embeddings(model: onnx.ModelProto) -> int:
    """Rewrites each FLUX.1 rotary embedding of a query or key ``x`` of head size ``D`` into ORT's
    ``com.microsoft.RotaryEmbedding(interleaved=1)``. Modifies ``model`` in place; returns how many it rewrote.

    The pattern (diffusers' ``apply_rotary_emb`` with ``use_real_unbind_dim=-1``, as the export writes it):
    ``Slice(x, 1::2) → Neg → Unsqueeze(-1)`` and ``Slice(x, 0::2) → Unsqueeze(-1)``, concatenated on the last axis
    in that order and reshaped to ``x``'s shape (``rotate(x)``), then ``Add(Mul(x, cos), Mul(rotate(x), sin))``;
    ``cos`` and ``sin`` are 2-D ``(S, D)`` tables unsqueezed onto ``x``'s sequence axis, each the graph's
    pair-repeated cosines or sines (``Flatten(Concat([h[..., None], h[..., None]], -1))`` per rotary axis, the axes
    concatenated; see :func:`_pair_repeated`). Token ``s`` then gets, for each pair ``k``,
    ``y[2k] = x[2k]·c[s, k] - x[2k+1]·s[s, k]`` and ``y[2k+1] = x[2k+1]·c[s, k] + x[2k]·s[s, k]`` with ``c``/``s``
    the tables before the repeat: exactly ORT's interleaved rotation ``y[i] = x[i]·cos[p, ⌊i/2⌋] ∓ x[i±1]·sin[p,
    ⌊i/2⌋]`` (upper signs for even ``i``) at position ``p = s``, over the whole head (``rotary_embedding_dim`` left at
    its default: twice the tables' width).

    The RotaryEmbedding reads:

    - cos_cache / sin_cache: the ``(S, D/2)`` tables before the repeat, the graph's own per-axis cosines and sines
      concatenated (made once per graph and read by every RotaryEmbedding; the full-width tables and their
      broadcasts are removed once nothing reads them).
    - position_ids: the one-element ``[0]``, ORT's start offset: token ``s`` reads row ``0 + s`` (the tables have a
      row per token, text tokens first, as ``x``).
    - input: ``x`` itself where it is ``(batch, heads, sequence, head_dim)`` (the keys: ORT's 4-D layout); where ORT's
      attention fusion has laid the query out ``(batch, sequence, heads, head_dim)`` (which the 4-D form does not
      take), ``x`` reshaped to ``(batch, sequence, heads·head_dim)`` with ``num_heads``, the 3-D layout, which the
      fused MultiHeadAttention reads its query in anyway (its Reshape to that shape is dropped; any other reader
      gets the 4-D shape back).

    ORT's CPU kernel (float32 and float16) and its CUDA kernel (float32, float16, bfloat16) take both layouts and the
    one-element position ids. A pattern whose tables cannot be traced to their values before the repeat, whose
    ``x`` has another layout or unknown dims, or whose ``x`` and tables differ in element type, is left alone.
    """
    return _fuse_rotary_embeddings(model, None)


def _fuse_rotary_embeddings(model: onnx.ModelProto, shapes: Optional[onnx.GraphProto]) -> int:
    graph = model.graph
    index = _Graph(graph)
    shapes = _Graph(shapes if shapes is not None else inferred_shapes(model))  # the caller's, where it has them
    places = [
        place
        for place in (_rotary_place(index, shapes, neg) for neg in graph.node if neg.op_type == "Neg")
        if place is not None
    ]
    parts = {table: _pair_repeated(index, shapes, table) for place in places for table in (place.cos, place.sin)}
    places = [place for place in places if parts[place.cos] is not None and parts[place.sin] is not None]
    if not places:
        return 0
    fresh = fresh_names(graph)
    removed: List[onnx.NodeProto] = []
    added: List[onnx.NodeProto] = []  # each after the added nodes it reads
    halves: Dict[str, str] = {}  # each table's columns before the repeat: its parts side by side, made once
    for table in dict.fromkeys(name for place in places for name in (place.cos, place.sin)):
        if len(parts[table]) == 1:
            halves[table] = parts[table][0]
            continue
        halves[table] = fresh(f"{table}/every_other_column")
        added.append(
            helper.make_node(
                "Concat", parts[table], [halves[table]], axis=-1, name=fresh(f"{table}/every_other_column/Concat")
            )
        )
    positions = fresh("rotary_embedding/position_ids")
    graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.int64), positions))
    flat_shape = ""
    if any(place.sequence_second for place in places):
        flat_shape = fresh("rotary_embedding/bsnh_to_bsd_shape")
        graph.initializer.append(numpy_helper.from_array(np.array([0, 0, -1], np.int64), flat_shape))
    if not any(opset.domain == "com.microsoft" for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))

    for place in places:
        name = place.nodes[-1].name or place.output
        removed.extend(place.nodes)
        tables = [positions, halves[place.cos], halves[place.sin]]
        if not place.sequence_second:
            added.append(
                helper.make_node(
                    "RotaryEmbedding",
                    [place.x, *tables],
                    [place.output],
                    interleaved=1,
                    domain="com.microsoft",
                    name=fresh(f"{name}/RotaryEmbedding"),
                )
            )
            continue
        flat = fresh(f"{place.x}_BSD")
        added.append(helper.make_node("Reshape", [place.x, flat_shape], [flat], name=fresh(f"{name}/Reshape_BSD")))
        reshape = index.only_reader(place.output)
        target = index.constant(reshape.input[1]) if reshape is not None and reshape.op_type == "Reshape" else None
        if target is None or target.tolist() != [0, 0, -1] or _attribute(reshape, "allowzero", 0) != 0:
            reshape = None
        else:  # the attention's own Reshape to (batch, sequence, heads·head_dim): the RotaryEmbedding writes that
            removed.append(reshape)
        output = reshape.output[0] if reshape is not None else fresh(f"{place.output}_BSD")
        added.append(
            helper.make_node(
                "RotaryEmbedding",
                [flat, *tables],
                [output],
                interleaved=1,
                num_heads=place.heads,
                domain="com.microsoft",
                name=fresh(f"{name}/RotaryEmbedding"),
            )
        )
        if reshape is None:  # the other readers get the (batch, sequence, heads, head_dim) they read
            back = fresh(f"{place.output}/bsd_to_bsnh_shape")
            graph.initializer.append(
                numpy_helper.from_array(np.array([0, 0, place.heads, place.head_dim], np.int64), back)
            )
            added.append(
                helper.make_node("Reshape", [output, back], [place.output], name=fresh(f"{name}/Reshape_BSNH"))
            )
    _replace_nodes(graph, removed, added)
    _remove_dead(graph, [name for node in removed for name in node.input])
    return len(places)


def _value_bias(index: _Graph, shapes: _Graph, value: str) -> Optional[Tuple[onnx.NodeProto, np.ndarray]]:
    """``(Add, bias)`` where ``value`` is ``Add(MatMul(x, W), b)`` of a constant 1-D ``b``, or that behind a
    ``Reshape`` splitting its channels into heads ``(batch, sequence, heads, head_dim)`` and a ``Transpose`` to
    ``(batch, heads, sequence, head_dim)`` (both or neither), each read only by the next: the channel order stays the
    heads' ``h · head_dim + d``, the order of the attention's output; else None."""
    node = index.producer.get(value)
    if node is not None and node.op_type == "Transpose":  # heads split and moved before the sequence, or nothing
        if list(_attribute(node, "perm", [])) != [0, 2, 1, 3] or index.only_reader(node.input[0]) is not node:
            return None
        node = index.producer.get(node.input[0])
        if node is None or node.op_type != "Reshape":
            return None
        before, after = shapes.dims(node.input[0]), shapes.dims(node.output[0])  # (B, S, N·H) → (B, S, N, H)
        if (
            before is None
            or after is None
            or len(before) != 3
            or len(after) != 4
            or not all(isinstance(d, int) for d in (before[2], after[2], after[3]))
            or before[2] != after[2] * after[3]
            or index.only_reader(node.input[0]) is not node
        ):
            return None
        node = index.producer.get(node.input[0])
    if node is None or node.op_type != "Add":
        return None
    for position in (0, 1):
        product = index.producer.get(node.input[position])
        bias = index.constant(node.input[1 - position])
        if (
            product is not None
            and product.op_type == "MatMul"
            and bias is not None
            and bias.ndim == 1
            and index.only_reader(node.output[0]) is not None
        ):
            return node, bias
    return None


def _rows(tensor: onnx.TensorProto, start: int, count: int) -> Optional[np.ndarray]:
    """Rows ``start … start + count`` of a 2-D initializer: from its external data file (relative to the working
    directory) only those rows' bytes, else from the tensor; None where its data cannot be read."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    try:
        if not uses_external_data(tensor):
            return numpy_helper.to_array(tensor)[start : start + count]
        info = ExternalDataInfo(tensor)
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
        row_bytes = int(tensor.dims[1]) * dtype.itemsize
        with open(info.location, "rb") as file:
            file.seek(int(info.offset or 0) + start * row_bytes)
            data = file.read(count * row_bytes)
        return (
            np.frombuffer(data, dtype=dtype).reshape(count, int(tensor.dims[1]))
            if len(data) == count * row_bytes
            else None
        )
    except (OSError, ValueError, TypeError):
        return None


def fold_value_biases(model: onnx.ModelProto) -> int:
    """Moves the bias of an attention's values into its output projection's bias, where one stream attends alone
    (SD3.5's second, image-only attention; FLUX.1's single blocks): each row of attention weights sums to one, so
    ``softmax(q kᵀ) (v + b) = softmax(q kᵀ) v + b``, and ``(o + b) W + c = o W + (b W + c)``. The value projection's
    bias pass over the activations goes; the output projection's bias, one vector, changes. Each fold is recorded in
    the model's metadata (:func:`~optimum_iobinding.layout.record_folded_bias`): runtime LoRA changes the bias with
    the output projection's weight.

    Rewrites each ``MultiHeadAttention`` (com.microsoft, with no inputs beyond query, key and value) whose value is
    ``Add(MatMul(x, W_v), b_v)`` (see :func:`_value_bias`) and whose output is read only by ``MatMul(·, W_o)`` —
    directly, or as one part of a ``Concat`` along channels of known widths, FLUX.1's attention and MLP outputs —
    followed by ``Add(·, c)`` with a constant 1-D ``c``: ``c`` becomes ``c + b_v W_o[rows of the attention]``, a new
    initializer of its own. A joint attention (values of two streams, each with its own bias) and values read by
    anything but the attention are left alone. Modifies ``model`` in place (the rows of the output projection's
    weight it needs are read, from disk relative to the working directory where the model was loaded without
    them); returns how many biases it moved."""
    return _fold_value_biases(model, None)


def _fold_value_biases(model: onnx.ModelProto, shapes: Optional[onnx.GraphProto]) -> int:
    graph = model.graph
    index = _Graph(graph)
    shapes = _Graph(shapes if shapes is not None else inferred_shapes(model))  # the caller's, where it has them
    fresh = fresh_names(graph)
    moved = 0
    for attention in [
        node for node in graph.node if node.op_type == "MultiHeadAttention" and node.domain == "com.microsoft"
    ]:
        if len(attention.input) != 3 or len(attention.output) != 1:
            continue
        found = _value_bias(index, shapes, attention.input[2])
        if found is None or index.only_reader(attention.input[2]) is not attention:  # another reader keeps the bias
            continue
        value_add, value_bias = found
        reader, offset = index.only_reader(attention.output[0]), 0
        if reader is not None and reader.op_type == "Concat":
            rank = len(shapes.dims(reader.output[0]) or ())
            if _attribute(reader, "axis", 0) not in (-1, rank - 1) or rank == 0:
                continue
            widths = [(shapes.dims(name) or (None,))[-1] for name in reader.input]
            place = list(reader.input).index(attention.output[0])
            if list(reader.input).count(attention.output[0]) != 1 or not all(isinstance(w, int) for w in widths):
                continue
            offset = sum(widths[:place])
            reader = index.only_reader(reader.output[0])
        if reader is None or reader.op_type != "MatMul" or reader.input[1] not in index.initializers:
            continue
        output_add = index.only_reader(reader.output[0])
        if output_add is None or output_add.op_type != "Add":
            continue
        bias_name = output_add.input[1] if output_add.input[0] == reader.output[0] else output_add.input[0]
        output_bias = index.constant(bias_name)
        if output_bias is None or output_bias.ndim != 1 or bias_name not in index.initializers:
            continue
        weight = index.initializers[reader.input[1]]
        if (
            len(weight.dims) != 2
            or weight.dims[1] != output_bias.shape[0]
            or offset + value_bias.shape[0] > weight.dims[0]
        ):
            continue
        rows = _rows(weight, offset, value_bias.shape[0])
        if rows is None:
            continue
        folded = output_bias.astype(np.float64) + value_bias.astype(np.float64) @ rows.astype(np.float64)
        name = fresh(f"{bias_name}/with_value_bias")  # the old bias may be shared: each fold gets its own
        graph.initializer.append(numpy_helper.from_array(folded.astype(output_bias.dtype), name))
        record_folded_bias(model, name, reader.input[1], offset, value_bias)  # runtime LoRA re-folds it
        output_add.input[list(output_add.input).index(bias_name)] = name
        product = next(
            i for i in value_add.input if index.producer.get(i) is not None and index.producer[i].op_type == "MatMul"
        )
        for node in index.readers[value_add.output[0]]:
            node.input[list(node.input).index(value_add.output[0])] = product
        graph.node.remove(value_add)
        _remove_dead(graph, [name for name in value_add.input if name != product] + [bias_name])
        moved += 1
    return moved


def fuse_diffusion_transformer(model: onnx.ModelProto) -> Dict[str, int]:
    """Every rewrite of this module on an ORT-optimized SD3 / FLUX.1 transformer, in place.

    Args:
        model: the transformer after ORT's ``mmdit`` optimizer (float32 or float16; weights may be left on disk, to
            be found from the working directory: the rewrites read biases, norm scales and the rows of an output
            projection that a value bias meets, never a whole weight).

    Returns:
        How many places each rewrite changed, by its name.
    """
    shapes = inferred_shapes(model)  # the rewrites change no value's shape: inferred once for all of them
    return {
        "modulated_layer_norm": _fuse_modulated_layer_norms(model, shapes),
        "gelu_bias": fuse_gelu_biases(model),
        "rotary_embedding": _fuse_rotary_embeddings(model, shapes),
        "value_bias": _fold_value_biases(model, shapes),
    }


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """The nodes of ``graph`` and of every subgraph in it."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for subgraph in (
                [attribute.g]
                if attribute.type == onnx.AttributeProto.GRAPH
                else attribute.graphs
                if attribute.type == onnx.AttributeProto.GRAPHS
                else ()
            ):
                yield from all_nodes(subgraph)


def fresh_names(graph: onnx.GraphProto) -> Callable[[str], str]:
    """``fresh(name)``: ``name``, or ``name_1``, ``name_2`` … where the graph (a subgraph included, or an earlier
    ``fresh``) has it already as a value, node, initializer, input or output name."""
    taken = {name for node in all_nodes(graph) for name in (*node.input, *node.output, node.name)}
    taken |= {tensor.name for tensor in graph.initializer}
    taken |= {value.name for value in (*graph.input, *graph.output, *graph.value_info)}

    def fresh(name: str) -> str:
        number, candidate = 0, name
        while candidate in taken:
            number += 1
            candidate = f"{name}_{number}"
        taken.add(candidate)
        return candidate

    return fresh


def _replace_nodes(graph: onnx.GraphProto, removed: Sequence[onnx.NodeProto], added: Sequence[onnx.NodeProto]) -> None:
    """Takes ``removed`` out of ``graph`` and puts each of ``added`` (listed after the added nodes it reads) right
    after the last node producing one of its inputs (graph order stays a topological order), in one pass."""
    gone = {output for node in removed for output in node.output if output}
    kept = [node for node in graph.node if not any(output in gone for output in node.output)]
    position = {output: number for number, node in enumerate(kept) for output in node.output if output}
    after: Dict[int, List[onnx.NodeProto]] = {}
    for node in added:
        slot = max((position[name] for name in node.input if name in position), default=-1)
        after.setdefault(slot, []).append(node)
        position.update((output, slot) for output in node.output)
    nodes = list(after.get(-1, []))
    for number, node in enumerate(kept):
        nodes.append(node)
        nodes.extend(after.get(number, []))
    del graph.node[:]
    graph.node.extend(nodes)


def _remove_dead(graph: onnx.GraphProto, names: Sequence[str]) -> None:
    """Removes the nodes and initializers behind ``names`` that nothing reads any more, and in turn those behind
    their inputs that nothing else reads (nodes inside subgraphs count as readers of what they name)."""
    reads: Dict[str, int] = {}

    def count(nodes) -> None:
        for node in nodes:
            for name in node.input:
                reads[name] = reads.get(name, 0) + 1
            for attribute in node.attribute:
                for subgraph in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs:
                    count(subgraph.node)
                    for value in subgraph.output:
                        reads[value.name] = reads.get(value.name, 0) + 1

    count(graph.node)
    for value in graph.output:
        reads[value.name] = reads.get(value.name, 0) + 1
    producer = {output: node for node in graph.node for output in node.output if output}
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    removed: set = set()  # the removed nodes, by the values they wrote
    stack = [name for name in names if name]
    while stack:
        name = stack.pop()
        if reads.get(name, 0):
            continue
        node = producer.get(name)
        if node is not None and name not in removed and not any(reads.get(output, 0) for output in node.output):
            removed.update(output for output in node.output if output)
            for value in node.input:
                if value:
                    reads[value] -= 1
                    stack.append(value)
        elif node is None and name in initializers:
            graph.initializer.remove(initializers.pop(name))
    if removed:
        kept = [node for node in graph.node if not any(output in removed for output in node.output)]
        del graph.node[:]
        graph.node.extend(kept)

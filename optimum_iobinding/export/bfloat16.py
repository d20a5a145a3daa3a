"""bfloat16 exports of the diffusion transformers (SD3/SD3.5's MMDiT, FLUX.1): the float16 graph that ORT's
converter made (:func:`~optimum_iobinding.export.optimize.optimized_to_float16`, after ORT's optimizer and the
project's rewrites) retyped to bfloat16, its weights rounded from the float32 originals.

Why: the residual stream of SD3's and FLUX.1's blocks can grow past float16's range (65504; diffusers clips it when
it runs them in float16), while bfloat16 has float32's range in float16's two bytes. On GPUs with bfloat16 tensor cores
(compute capability 8.0 and later) ORT's CUDA kernels take bfloat16 for nearly every op these graphs hold.

Why from the float16 graph: it already is the graph a half-precision export needs — the sinusoidal timestep and
guidance embeddings and FLUX.1's rotary tables kept float32 up to the first layer
(:func:`~optimum_iobinding.export.optimize.float32_island`), the inputs and outputs the export keeps float32
(``float32_inputs``), the Casts at those edges — so a bfloat16 export differs from it only in the element type. The
weights are not taken from the float16 values: ORT's converter clamps them to float16's range (and lifts tiny ones
to its smallest subnormal, 6e-8), and rounding twice (float32 → float16 → bfloat16) is not rounding once. Each float16
weight is therefore replaced by the float32 weight of the same name (the converter keeps the names), rounded to
bfloat16 to nearest, ties to even (as ``torch.Tensor.to(torch.bfloat16)`` rounds); a value with no float32 original
is rounded from its float16 one.

Ops kept in float32 (Casts around them; their weights the float32 originals), because ONNX Runtime's CUDA execution
provider registers no bfloat16 kernel for them at the opset of these exports (17) — a node without one would run on
the CPU, and keep the transformer out of CUDA graphs. Source: onnxruntime's ``docs/OperatorKernels.md`` (generated
from the kernel registrations; its CUDAExecutionProvider section at commit 001d12d, a main snapshot that has the
bfloat16 ``MultiHeadAttention`` of microsoft/onnxruntime#26083 and the bfloat16 memory-efficient attention of #26894),
summarized in :data:`BFLOAT16_CUDA_KERNELS`:

- ``Conv`` (SD3's patch embedding): bfloat16 only from opset 22 (``Conv`` 22+); opsets 11–21 take float, float16
  and double. One small convolution of the latents.
- ``Einsum`` (SD3's unpatchify, a permutation of the output): float, float16 and double only, at every opset.
- ``ReduceMean`` (the RMS norms of the queries and keys in an export without ORT's optimizer, which otherwise fuses
  them into ``SimplifiedLayerNormalization``): no bfloat16 at any opset (microsoft/onnxruntime#19502 lists it,
  with ``Pad``, ``Clip``, ``Resize``, ``Reciprocal``, ``Equal``, ``Less``, ``Greater`` and more).

Everything else these graphs run on bfloat16 has a bfloat16 CUDA kernel at opset 17: ``MatMul`` and ``Gemm`` (13+),
``Add``/``Sub``/``Mul``/``Div`` (13+), ``LayerNormalization``, ``SimplifiedLayerNormalization``, ``Softmax``,
``Sigmoid``, ``Tanh``, ``Sqrt``, ``Pow`` (15+ for a bfloat16 exponent), ``Where`` (16+), the data-movement ops, and
com.microsoft's ``MultiHeadAttention``, ``RotaryEmbedding``, ``FastGelu``, ``BiasGelu``, ``SkipLayerNormalization``
and ``SkipSimplifiedLayerNormalization``. Not among them, should a graph hold them: com.microsoft's ``BiasAdd``,
``BiasSplitGelu``, ``GroupNorm``, ``SkipGroupNorm`` and ``NhwcConv`` (float and float16 only), and ``Resize``. The
ops the float16 conversion keeps float32 (its block list: ``Range``, ``CumSum``, ``Min``, ``Max``, …, and the
conditioning's island with its ``Sin`` and ``Cos``, which have no bfloat16 kernel either) stay float32 here too.

:func:`ops_without_bfloat16_cuda_kernels` lists the ops of a model that would fall back (on a float16 model: what
:func:`to_bfloat16` will keep in float32; on its result: nothing).
"""

from __future__ import annotations

import copy
import heapq
import logging
import os
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple, Union

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import ArgumentError, ArgumentTypeError
from .optimize import refuse_unloadable
from .transformer_fusions import all_nodes, fresh_names

logger = logging.getLogger(__name__)

__all__ = [
    "to_bfloat16",
    "ops_without_bfloat16_cuda_kernels",
    "has_bfloat16_cuda_kernel",
    "bfloat16_bits",
    "BFLOAT16_CUDA_KERNELS",
]

FLOAT, FLOAT16, BFLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16
_MICROSOFT = "com.microsoft"

# (domain, op type) → the first opset of that domain whose ONNX Runtime CUDA kernel takes bfloat16 (the op's
# versions from then on all do). From onnxruntime's docs/OperatorKernels.md, CUDAExecutionProvider section (see the
# module's docstring), for the ops a diffusion transformer's graph may hold; an op not listed has none, or is one no
# such graph holds, and is kept in float32 (the safe side: a Cast more, never a node on the CPU). Ops that compute
# nothing (Constant) count as covered.
BFLOAT16_CUDA_KERNELS: Dict[Tuple[str, str], int] = {
    **{
        ("", op): 1
        for op in (
            "Constant",
            "Flatten",
            "Gather",
            "Identity",
            "If",
            "LayerNormalization",
            "Loop",
            "Reshape",
            "Shape",
            "SimplifiedLayerNormalization",
            "Size",
            "Slice",
            "Squeeze",
            "Transpose",
            "Unsqueeze",
        )
    },
    ("", "Split"): 2,
    ("", "Concat"): 4,
    ("", "Max"): 6,
    ("", "Min"): 6,
    ("", "Sum"): 6,
    ("", "Expand"): 8,
    ("", "ConstantOfShape"): 9,
    ("", "GatherElements"): 11,
    ("", "ScatterElements"): 11,
    ("", "ScatterND"): 11,
    **{
        ("", op): 13
        for op in (
            "Abs",
            "Add",
            "Cast",
            "Div",
            "Dropout",
            "Erf",
            "Exp",
            "GatherND",
            "Gemm",
            "IsNaN",
            "MatMul",
            "Mod",
            "Mul",
            "Neg",
            "ReduceSum",
            "Relu",
            "Sigmoid",
            "Sign",
            "Softmax",
            "Sqrt",
            "Sub",
            "Tanh",
            "Tile",
        )
    },
    ("", "Trilu"): 14,
    ("", "Pow"): 15,
    ("", "Where"): 16,
    ("", "Gelu"): 20,
    ("", "IsInf"): 20,
    ("", "AveragePool"): 22,
    ("", "Conv"): 22,
    ("", "HardSigmoid"): 22,
    ("", "HardSwish"): 22,
    ("", "Attention"): 23,
    ("", "RMSNormalization"): 23,
    ("", "RotaryEmbedding"): 23,
    **{
        (_MICROSOFT, op): 1
        for op in (
            "Attention",
            "BiasDropout",
            "BiasGelu",
            "FastGelu",
            "FusedMatMul",
            "Gelu",
            "GroupQueryAttention",
            "MatMulNBits",
            "MultiHeadAttention",
            "QuickGelu",
            "RotaryEmbedding",
            "SkipLayerNormalization",
            "SkipSimplifiedLayerNormalization",
            "TransposeMatMul",
            "Trilu",
        )
    },
}
_DTYPE_ATTRIBUTES = ("to", "dtype", "output_dtype")  # int attributes naming an element type (Cast's ``to``, …)


# ------------------------------------------------------------------------------------------------ the coverage
def has_bfloat16_cuda_kernel(domain: str, op_type: str, opset: int) -> bool:
    """Whether ONNX Runtime's CUDA execution provider runs ``op_type`` of ``domain`` (``""`` or ``"ai.onnx"`` for
    ONNX's own ops, ``"com.microsoft"`` for ORT's) in bfloat16 at that domain's ``opset``
    (:data:`BFLOAT16_CUDA_KERNELS`)."""
    first = BFLOAT16_CUDA_KERNELS.get((_domain(domain), op_type))
    return first is not None and opset >= first


def ops_without_bfloat16_cuda_kernels(model: onnx.ModelProto) -> List[str]:
    """The op types of ``model``'s nodes (subgraphs' too) that read or write a float16 or bfloat16 tensor and that ONNX
    Runtime's CUDA execution provider has no bfloat16 kernel for at the model's opset, sorted; ops outside ONNX's
    domain are named with theirs (``com.microsoft.BiasAdd``). Of a float16 model: the ops :func:`to_bfloat16` keeps
    in float32; of its result: none (a node listed there would run on the CPU).

    Args:
        model: an ONNX model whose values carry their element types (graph inputs, outputs and ``value_info``, as
            the float16 conversion leaves them); a value of unknown type is not taken for a half-precision one.
    """
    opsets = _opsets(model)
    missing: Set[str] = set()
    for graph, types in _graphs_with_types(model.graph, {}):
        for node in graph.node:
            if _touches(node, types, (FLOAT16, BFLOAT16)) and not _covered(node, opsets):
                missing.add(node.op_type if _domain(node.domain) == "" else f"{node.domain}.{node.op_type}")
    return sorted(missing)


# ------------------------------------------------------------------------------------------------ the conversion
def to_bfloat16(
    float16_model: onnx.ModelProto,
    float32_weights: Union[Mapping[str, np.ndarray], onnx.ModelProto],
    *,
    base_dir: Optional[Union[str, os.PathLike]] = None,
    in_place: bool = False,
) -> onnx.ModelProto:
    """A bfloat16 model from a float16 one: every float16 element type (graph inputs and outputs, ``value_info``,
    initializers, Cast's ``to``, Constant and ConstantOfShape values, any other tensor or element-type attribute, in
    subgraphs too) becomes bfloat16, and the ops of the main graph without a bfloat16 CUDA kernel (see the module's
    docstring) run in float32 between Casts (nodes inside If or Loop bodies are retyped only; the transformers have
    none). What the float16 model keeps float32 (the conditioning's island, inputs and outputs kept float32) stays
    as it is.

    Values: a float16 initializer (or Constant node) whose name (output name) ``float32_weights`` has takes that
    float32 value rounded to bfloat16 (to nearest, ties to even); one it lacks takes its float16 value, rounded. A
    weight read only by ops kept in float32 keeps the float32 value itself. Each float32 value must be the one the
    float16 value was converted from (same shape, and rounded by ORT's converter to the float16 value): a model
    other than the one converted is refused.

    The result passes ``onnx.checker``: its nodes are in topological order (ORT's converter appends its Casts at the
    end) and it imports each domain its nodes use.

    Args:
        float16_model: the float16 model (ORT's converter's output, with the element types of its values in
            ``value_info``; where some are missing ORT's symbolic shape inference fills them in), its weights in
            memory.
        float32_weights: the float32 values by initializer name (and by output name for Constant nodes), or the
            float32 model the float16 one was converted from (its initializers and Constant nodes, read one at a
            time, from its external data relative to ``base_dir`` where they are on disk).
        base_dir: the folder of ``float32_weights``' external data, when it is a model whose weights are on disk.
        in_place: convert ``float16_model`` itself (a model the size of FLUX.1's is not copied) instead of a copy.

    Returns:
        The bfloat16 model (``float16_model`` itself with ``in_place``).

    Raises:
        ArgumentTypeError: ``float16_model`` is not a ModelProto, or ``float32_weights`` neither a mapping nor one.
        ArgumentError: ``float16_model`` has weights on disk, or a float32 value is not the original of the float16
            one of its name.
        RuntimeError: the bfloat16 graph is one ONNX Runtime refuses to load (nothing such is written:
            :func:`~optimum_iobinding.export.optimize.refuse_unloadable`).
    """
    if not isinstance(float16_model, onnx.ModelProto):
        raise ArgumentTypeError("float16_model", f"expected an onnx.ModelProto, got {type(float16_model).__name__}")
    if isinstance(float32_weights, onnx.ModelProto):
        originals: Mapping[str, np.ndarray] = _Float32Values(float32_weights, base_dir)
    elif isinstance(float32_weights, Mapping):
        originals = float32_weights
    else:
        raise ArgumentTypeError(
            "float32_weights",
            "expected a mapping of names to float32 arrays or the float32 "
            f"onnx.ModelProto, got {type(float32_weights).__name__}",
        )
    on_disk = [tensor.name for tensor in float16_model.graph.initializer if _on_disk(tensor)]
    if on_disk:
        raise ArgumentError(
            "float16_model",
            f"expected its weights in memory, got {len(on_disk)} on disk (e.g. "
            f"{on_disk[0]!r}); hint: onnx.load_external_data_for_model(model, folder)",
        )
    model = float16_model if in_place else copy.deepcopy(float16_model)
    _fill_missing_types(model)
    opsets = _opsets(model)
    kept = _keep_in_float32(model.graph, opsets, originals)
    _retype_graph(model.graph, originals)
    _remove_cascaded_and_useless_casts(model)
    _remove_unread_initializers(model.graph)
    _sort_topologically(model.graph)
    _import_domains(model)
    refuse_unloadable(model, "bfloat16 conversion")
    if kept:
        logger.info(
            "bfloat16: %d node(s) kept in float32, without a bfloat16 CUDA kernel at opset %d: %s",
            len(kept),
            opsets.get("", 0),
            sorted({node.op_type for node in kept}),
        )
    return model


class _Float32Values(Mapping):
    """A float32 model's float values by initializer name and by Constant output name, each read when asked for (from
    its external data relative to ``base_dir`` where it is on disk): a model the size of FLUX.1's is never held as
    a second copy."""

    def __init__(self, model: onnx.ModelProto, base_dir: Optional[Union[str, os.PathLike]]):
        self._tensors: Dict[str, TensorProto] = {}
        for node in model.graph.node:
            if node.op_type == "Constant" and _domain(node.domain) == "":
                value = next(
                    (a.t for a in node.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR), None
                )
                if value is not None and value.data_type == FLOAT:
                    self._tensors[node.output[0]] = value
        self._tensors.update({tensor.name: tensor for tensor in model.graph.initializer if tensor.data_type == FLOAT})
        self._base_dir = os.fspath(base_dir) if base_dir is not None else ""

    def __getitem__(self, name: str) -> np.ndarray:
        return numpy_helper.to_array(self._tensors[name], self._base_dir)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors


# ---------------------------------------------------------------------------------------- ops kept in float32
def _keep_in_float32(
    graph: onnx.GraphProto, opsets: Dict[str, int], originals: Mapping[str, np.ndarray]
) -> List[onnx.NodeProto]:
    """Rewires each node of ``graph`` that reads or writes float16 and has no bfloat16 CUDA kernel to read and write
    float32: its float16 inputs through a Cast to float32 (a weight or constant that only such nodes read becomes
    float32 itself, its float32 original where there is one), its float16 outputs written under a new name and Cast
    back to float16 (which the retyping then makes bfloat16). Returns the nodes kept."""
    types = _element_types(graph)
    kept = [node for node in graph.node if _touches(node, types, (FLOAT16,)) and not _covered(node, opsets)]
    if not kept:
        return []
    kept_ids = {id(node) for node in kept}
    readers: Dict[str, List[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in _reads(node):
            readers.setdefault(name, []).append(node)
    outputs = {value.name for value in graph.output}
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    constants = {
        node.output[0]: node for node in graph.node if node.op_type == "Constant" and _domain(node.domain) == ""
    }
    shapes = {value.name: value for value in (*graph.input, *graph.value_info, *graph.output)}
    fresh = fresh_names(graph)
    widened: Dict[str, str] = {}  # float16 value → its float32 counterpart
    added: List[onnx.NodeProto] = []

    def widen(name: str) -> str:
        if name not in widened:
            only_kept = name not in outputs and all(id(reader) in kept_ids for reader in readers.get(name, ()))
            if only_kept and name in initializers:
                _to_float32(initializers[name], originals.get(name) if name in originals else None)
                widened[name] = name
            elif only_kept and name in constants:
                value = next(a for a in constants[name].attribute if a.name == "value")
                _to_float32(value.t, originals.get(name) if name in originals else None)
                widened[name] = name
            else:
                wide = fresh(f"{name}/float32")
                added.append(helper.make_node("Cast", [name], [wide], name=fresh(f"{name}/to_float32"), to=FLOAT))
                _declare(graph, wide, FLOAT, shapes.get(name))
                widened[name] = wide
            types[widened[name]] = FLOAT
        return widened[name]

    for node in kept:
        for index, name in enumerate(node.input):
            if name and types.get(name) == FLOAT16:
                node.input[index] = widen(name)
        for index, name in enumerate(node.output):
            if name and types.get(name) == FLOAT16:
                wide = fresh(f"{name}/float32")
                node.output[index] = wide
                _declare(graph, wide, FLOAT, shapes.get(name))
                added.append(helper.make_node("Cast", [wide], [name], name=fresh(f"{name}/to_half"), to=FLOAT16))
    graph.node.extend(added)  # in order by _sort_topologically
    return kept


def _to_float32(tensor: TensorProto, original: Optional[np.ndarray]) -> None:
    """``tensor`` (float16) made float32, in place: its float32 original where given (checked), else its float16
    values (exact in float32)."""
    half = numpy_helper.to_array(tensor)
    values = _checked_original(tensor.name, half, original) if original is not None else half.astype(np.float32)
    tensor.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(values, dtype=np.float32), tensor.name))


# ------------------------------------------------------------------------------------------------ the retyping
def _retype_graph(graph: onnx.GraphProto, originals: Mapping[str, np.ndarray]) -> None:
    """Every float16 element type in ``graph`` (and its subgraphs) made bfloat16, values rounded from their float32
    originals where ``originals`` has them."""
    for value in (*graph.input, *graph.output, *graph.value_info):
        _retype(value.type)
    for tensor in graph.initializer:
        if tensor.data_type == FLOAT16:
            _to_bfloat16(tensor, originals.get(tensor.name) if tensor.name in originals else None)
    for sparse in graph.sparse_initializer:
        if sparse.values.data_type == FLOAT16:
            _to_bfloat16(sparse.values, None)
    for node in graph.node:
        constant = node.op_type == "Constant" and _domain(node.domain) == ""
        for attribute in node.attribute:
            if (
                attribute.type == onnx.AttributeProto.INT
                and attribute.name in _DTYPE_ATTRIBUTES
                and attribute.i == FLOAT16
            ):
                attribute.i = BFLOAT16
            elif attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == FLOAT16:
                name = node.output[0] if constant else None
                _to_bfloat16(attribute.t, originals.get(name) if name is not None and name in originals else None)
            elif attribute.type == onnx.AttributeProto.TENSORS:
                for tensor in attribute.tensors:
                    if tensor.data_type == FLOAT16:
                        _to_bfloat16(tensor, None)
            elif (
                attribute.type == onnx.AttributeProto.SPARSE_TENSOR
                and attribute.sparse_tensor.values.data_type == FLOAT16
            ):
                _to_bfloat16(attribute.sparse_tensor.values, None)
            elif attribute.type == onnx.AttributeProto.GRAPH:
                _retype_graph(attribute.g, originals)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for subgraph in attribute.graphs:
                    _retype_graph(subgraph, originals)


def _retype(kind: onnx.TypeProto) -> None:
    """A value's type, float16 → bfloat16 (tensors, sequences, optionals and maps of them)."""
    field = kind.WhichOneof("value")
    if field in ("tensor_type", "sparse_tensor_type"):
        element = getattr(kind, field)
        if element.elem_type == FLOAT16:
            element.elem_type = BFLOAT16
    elif field in ("sequence_type", "optional_type"):
        _retype(getattr(kind, field).elem_type)
    elif field == "map_type":
        _retype(kind.map_type.value_type)


def _to_bfloat16(tensor: TensorProto, original: Optional[np.ndarray]) -> None:
    """``tensor`` (float16) made bfloat16 in place: its float32 original rounded where given (checked), else its
    float16 values rounded."""
    half = numpy_helper.to_array(tensor)
    values = _checked_original(tensor.name, half, original) if original is not None else half.astype(np.float32)
    bits = bfloat16_bits(values)
    for field in ("int32_data", "float_data", "raw_data"):
        tensor.ClearField(field)
    tensor.data_type = BFLOAT16
    tensor.raw_data = bits.astype("<u2").tobytes()


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """The bfloat16 nearest to each float32 of ``values`` (ties to even, as torch and CUDA's ``__float2bfloat16``
    round; NaN stays NaN, overflow goes to infinity), as its 16 bits (uint16, ``values``' shape)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():  # a quiet NaN of the same sign (rounding could carry a NaN's payload into infinity)
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def _checked_original(name: str, half: np.ndarray, original: np.ndarray) -> np.ndarray:
    """``original`` as float32, where it is the value that ORT's converter turned into ``half`` (its float16 rounding,
    with the converter's clamping, equal to ``half``)."""
    from onnxruntime.transformers.float16 import convert_np_to_float16

    original = np.asarray(original)
    if original.dtype != np.float32 or original.shape != half.shape:
        raise ArgumentError(
            "float32_weights",
            f"expected {name!r} as a float32 array of shape {half.shape}, got "
            f"{original.dtype} of shape {original.shape}",
        )
    rounded = convert_np_to_float16(original.reshape(-1)).reshape(original.shape)  # as the converter reads it
    same = (rounded.view(np.uint16) == half.view(np.uint16)) | (np.isnan(rounded) & np.isnan(half))
    if not same.all():
        raise ArgumentError(
            "float32_weights",
            f"expected the float32 original of {name!r}, got values whose float16 "
            f"rounding differs from the float16 model's; hint: pass the float32 "
            f"model as it was just before the float16 conversion",
        )
    return original


# ---------------------------------------------------------------------------------------------------- the graph
def _remove_cascaded_and_useless_casts(model: onnx.ModelProto) -> None:
    """The Casts the float32 ops leave behind: a Cast reading a Cast (both to float types) reads the first one's input
    (ORT's float16 round trip between two float32 nodes, now bfloat16, and its Cast back), then a Cast to the type
    its input has already is dropped, its readers reading its input (unless it writes a graph output)."""
    from onnxruntime.transformers.onnx_model import OnnxModel

    from .optimize import remove_cascaded_casts

    remove_cascaded_casts(OnnxModel(model))
    graph = model.graph
    types = _element_types(graph)
    outputs = {value.name for value in graph.output}
    useless = [
        node
        for node in graph.node
        if node.op_type == "Cast"
        and node.output[0] not in outputs
        and types.get(node.input[0]) is not None
        and types.get(node.input[0]) == _attribute(node, "to")
    ]
    for node in useless:
        source, target = node.input[0], node.output[0]
        for reader in all_nodes(graph):
            for index, name in enumerate(reader.input):
                if name == target:
                    reader.input[index] = source
        graph.node.remove(node)


def _remove_unread_initializers(graph: onnx.GraphProto) -> None:
    """Drops the initializers and value infos nothing names any more (a float16 weight a float32 op read alone)."""
    read = {name for node in all_nodes(graph) for name in node.input} | {value.name for value in graph.output}
    for tensor in [tensor for tensor in graph.initializer if tensor.name not in read]:
        graph.initializer.remove(tensor)
    written = read | {name for node in graph.node for name in node.output} | {value.name for value in graph.input}
    for value in [value for value in graph.value_info if value.name not in written]:
        graph.value_info.remove(value)


def _sort_topologically(graph: onnx.GraphProto) -> None:
    """``graph``'s nodes in an order where each comes after the nodes writing what it reads (those inside its
    subgraphs too), otherwise in their present order (a valid order is left as it is)."""
    nodes = list(graph.node)
    producer = {name: index for index, node in enumerate(nodes) for name in node.output if name}
    waiting_on: List[int] = [0] * len(nodes)
    successors: List[List[int]] = [[] for _ in nodes]
    for index, node in enumerate(nodes):
        for name in set(_reads(node)):
            source = producer.get(name)
            if source is not None and source != index:
                waiting_on[index] += 1
                successors[source].append(index)
    ready = [index for index, count in enumerate(waiting_on) if count == 0]
    heapq.heapify(ready)
    order: List[int] = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for successor in successors[index]:
            waiting_on[successor] -= 1
            if waiting_on[successor] == 0:
                heapq.heappush(ready, successor)
    if len(order) != len(nodes):  # a cycle: not ours to untangle
        return
    del graph.node[:]
    graph.node.extend(nodes[index] for index in order)


def _import_domains(model: onnx.ModelProto) -> None:
    """Imports com.microsoft (version 1) where nodes use it and the model does not import it (ORT's optimizer writes
    its fused nodes without always declaring their domain; ORT does not ask for it, onnx's checker does)."""
    used = {_domain(node.domain) for node in all_nodes(model.graph)}
    imported = {_domain(opset.domain) for opset in model.opset_import}
    if _MICROSOFT in used and _MICROSOFT not in imported:
        model.opset_import.append(helper.make_opsetid(_MICROSOFT, 1))


def _fill_missing_types(model: onnx.ModelProto) -> None:
    """Declares the element type of each value a node reads or writes whose type the model does not say, as ORT's
    symbolic shape inference finds it (types only: the retyping and the coverage need them, not shapes)."""
    graph = model.graph
    types = _element_types(graph)
    missing = {name for node in graph.node for name in (*node.input, *node.output) if name and name not in types}
    if not missing:
        return
    from .transformer_fusions import inferred_shapes

    for value in inferred_shapes(model).value_info:
        element = value.type.tensor_type.elem_type
        if value.name in missing and element != TensorProto.UNDEFINED:
            _declare(graph, value.name, element, None)
            missing.discard(value.name)


# ------------------------------------------------------------------------------------------------------ helpers
def _domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def _opsets(model: onnx.ModelProto) -> Dict[str, int]:
    opsets = {_domain(opset.domain): opset.version for opset in model.opset_import}
    opsets.setdefault(_MICROSOFT, 1)
    return opsets


def _covered(node: onnx.NodeProto, opsets: Dict[str, int]) -> bool:
    domain = _domain(node.domain)
    return has_bfloat16_cuda_kernel(domain, node.op_type, opsets.get(domain, 1))


def _touches(node: onnx.NodeProto, types: Dict[str, int], elements: Sequence[int]) -> bool:
    """``node`` reads or writes a tensor of one of ``elements`` (Constant nodes by the tensor they hold)."""
    if any(name and types.get(name) in elements for name in (*node.input, *node.output)):
        return True
    return any(
        attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type in elements
        for attribute in node.attribute
    )


def _attribute(node: onnx.NodeProto, name: str) -> Optional[int]:
    return next((a.i for a in node.attribute if a.name == name), None)


def _element_types(graph: onnx.GraphProto) -> Dict[str, int]:
    """The element type of each value ``graph`` says one for: inputs, outputs, value infos, initializers, Constant
    nodes' values and Casts' outputs."""
    types = {
        value.name: value.type.tensor_type.elem_type
        for value in (*graph.input, *graph.value_info, *graph.output)
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type != TensorProto.UNDEFINED
    }
    types.update({tensor.name: tensor.data_type for tensor in graph.initializer})
    for node in graph.node:
        if node.op_type == "Constant" and _domain(node.domain) == "":
            value = next((a.t for a in node.attribute if a.type == onnx.AttributeProto.TENSOR), None)
            if value is not None:
                types.setdefault(node.output[0], value.data_type)
        elif node.op_type == "Cast" and _domain(node.domain) == "":
            types.setdefault(node.output[0], _attribute(node, "to"))
    return types


def _graphs_with_types(
    graph: onnx.GraphProto, outer: Dict[str, int]
) -> Iterator[Tuple[onnx.GraphProto, Dict[str, int]]]:
    """``graph`` and each subgraph in it, with the element types each one sees (its own and those of the graphs
    around it)."""
    types = {**outer, **_element_types(graph)}
    yield graph, types
    for node in graph.node:
        for attribute in node.attribute:
            for subgraph in (
                [attribute.g]
                if attribute.type == onnx.AttributeProto.GRAPH
                else attribute.graphs
                if attribute.type == onnx.AttributeProto.GRAPHS
                else ()
            ):
                yield from _graphs_with_types(subgraph, types)


def _reads(node: onnx.NodeProto) -> List[str]:
    """What ``node`` reads: its inputs and what the nodes of its subgraphs name from outside them."""
    names = [name for name in node.input if name]
    for attribute in node.attribute:
        for subgraph in (
            [attribute.g]
            if attribute.type == onnx.AttributeProto.GRAPH
            else attribute.graphs
            if attribute.type == onnx.AttributeProto.GRAPHS
            else ()
        ):
            names.extend(name for inner in all_nodes(subgraph) for name in inner.input if name)
    return names


def _declare(graph: onnx.GraphProto, name: str, element: int, like: Optional[onnx.ValueInfoProto]) -> None:
    """Adds ``name`` to ``graph``'s value infos as a tensor of ``element``, with ``like``'s shape where given."""
    value = graph.value_info.add()
    if like is not None and like.type.HasField("tensor_type"):
        value.CopyFrom(like)
    value.name = name
    value.type.tensor_type.elem_type = element


def _on_disk(tensor: TensorProto) -> bool:
    return tensor.data_location == TensorProto.EXTERNAL and not tensor.raw_data

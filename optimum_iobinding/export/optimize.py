"""ONNX Runtime's transformer optimizer (attention and other fusions) and float16 conversion, applied to one exported
component with its weights kept on disk; and writing a model with external data where it is large."""

from __future__ import annotations

import contextlib
import logging
import os
from collections import deque
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import onnx
import torch

from ..families import FLUX_GUIDANCE, FLUX_IMAGE_IDS, FLUX_TEXT_IDS

logger = logging.getLogger(__name__)

EXTERNAL_DATA_FILE = "weights.pb"
# Protobuf cannot serialize a message over 2 GiB; keep well below it in one file.
MAX_SINGLE_FILE_BYTES = 1 << 30


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the initializers (what decides whether a model fits one protobuf; ByteSize() itself fails > 2 GiB)."""
    return sum(
        len(t.raw_data) or 4 * (len(t.float_data) + len(t.int32_data)) + 8 * len(t.int64_data)
        for t in model.graph.initializer
    )


def save_onnx(
    model: onnx.ModelProto,
    path: Path,
    threshold: int = MAX_SINGLE_FILE_BYTES,
    external_data_file: str = EXTERNAL_DATA_FILE,
) -> bool:
    """Writes ``model`` to ``path``: one file, or with its weights in one ``external_data_file`` beside it where they
    are over ``threshold`` bytes. Returns whether it wrote external data."""
    path.parent.mkdir(parents=True, exist_ok=True)
    external = weight_bytes(model) > threshold
    if external:
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=external_data_file,
            size_threshold=1024,
        )
    else:
        onnx.save_model(model, str(path))
    return external


# The inputs of a denoiser whose embeddings diffusers computes in float32 whatever the model's dtype: the sinusoidal
# embeddings of the timestep, FLUX.1 dev's guidance and SDXL's time ids (``get_timestep_embedding`` makes floats of
# them first), LCM's guidance embedding, and FLUX.1's rotary tables of the position ids. In float16 a timestep near
# 1000 times a frequency near 1 is rounded by 0.5, and its sine and cosine come out up to ~0.3 wrong.
CONDITIONING_INPUTS = ("timestep", FLUX_GUIDANCE, FLUX_IMAGE_IDS, FLUX_TEXT_IDS, "timestep_cond", "time_ids")
# Where the float32 island ends: the first layer with weights (the embedder's Linear) runs in float16, as in diffusers.
_ISLAND_ENDS = frozenset(
    {
        "MatMul",
        "Gemm",
        "Conv",
        "ConvTranspose",
        "Einsum",
        "FusedMatMul",
        "MatMulNBits",
        "Attention",
        "MultiHeadAttention",
    }
)
_FLOAT_TYPES = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
)


def float32_island(graph: onnx.GraphProto, inputs: Sequence[str] = CONDITIONING_INPUTS) -> List[str]:
    """The names of the nodes that compute from the graph inputs ``inputs`` (those the graph has) and constants only,
    up to and without the first MatMul, Gemm or Conv: the arithmetic of the sinusoidal timestep/guidance embeddings
    and of the rotary cos/sin tables, which a float16 conversion keeps in float32 (ORT's converter takes them as its
    ``node_block_list`` and casts at the island's edges).

    A node joins when one of its inputs comes from ``inputs`` or the island and every float input it has does, or is
    a constant (an initializer, or computed from initializers and Constant nodes); integer inputs (shapes of the
    latents, say) may come from anywhere: they carry no rounding. The Constant nodes and constant computations the
    island reads join too, so that its frequencies are not rounded to float16 first. Unnamed nodes cannot be named in
    a block list and are left out (the exporters name every node).

    Args:
        graph: the graph, with the element types of its intermediates in ``value_info`` where they are known (a value
            of unknown type is taken for a float).
        inputs: the graph inputs the island grows from.

    Returns:
        The island's node names, in graph order.
    """
    types = {value.name: value.type.tensor_type.elem_type for value in (*graph.input, *graph.value_info, *graph.output)}
    types.update({tensor.name: tensor.data_type for tensor in graph.initializer})
    producer = {output: node for node in graph.node for output in node.output}
    consumers: Dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    initializers = {tensor.name for tensor in graph.initializer}
    constant_memo: Dict[str, bool] = {}

    def constant(value: str) -> bool:
        if value in initializers:
            return True
        if value not in constant_memo:
            node = producer.get(value)
            constant_memo[value] = False  # a cycle is no constant
            constant_memo[value] = (
                node is not None
                and not _has_subgraph(node)
                and (
                    node.op_type == "Constant"
                    or (bool(node.input) and all(not name or constant(name) for name in node.input))
                )
            )
        return constant_memo[value]

    derived = {value.name for value in graph.input if value.name in inputs}
    island: set = set()
    queue = deque(derived)
    while queue:
        for node in consumers.get(queue.popleft(), ()):
            if id(node) in island or node.op_type in _ISLAND_ENDS or _has_subgraph(node):
                continue
            if all(
                not name
                or name in derived
                or constant(name)
                or (types.get(name) or onnx.TensorProto.FLOAT) not in _FLOAT_TYPES
                for name in node.input
            ):
                island.add(id(node))
                derived.update(node.output)
                queue.extend(node.output)
    # the constants the island reads, and the constant computations behind them
    stack = [name for node in graph.node if id(node) in island for name in node.input]
    while stack:
        node = producer.get(stack.pop())
        if node is not None and id(node) not in island and constant(node.output[0]):
            island.add(id(node))
            stack.extend(node.input)
    return [node.name for node in graph.node if id(node) in island and node.name]


def _constant_value(graph: onnx.GraphProto, name: str, opset: int, depth: int = 16) -> Optional[np.ndarray]:
    """The value of ``name`` where it depends on constants alone (initializers held in the file, Constant nodes, and
    up to ``depth`` small nodes computing from them, evaluated by onnx's reference evaluator: the TorchScript
    exporter writes ``F.pad``'s pads as such a chain), else None."""
    from onnx import helper, numpy_helper
    from onnx.external_data_helper import uses_external_data
    from onnx.reference import ReferenceEvaluator

    if any(value.name == name for value in graph.input):  # an input (one an initializer only defaults): fed
        return None
    for tensor in graph.initializer:
        if tensor.name == name:
            return None if uses_external_data(tensor) else numpy_helper.to_array(tensor)
    producer = next((node for node in graph.node if name in node.output), None)
    if (
        producer is None
        or depth == 0
        or _has_subgraph(producer)
        or (producer.op_type != "Constant" and not any(producer.input))
    ):  # RandomNormal and the like
        return None
    if producer.op_type == "Constant":
        value = next((a for a in producer.attribute if a.name == "value"), None)
        return None if value is None else numpy_helper.to_array(value.t)
    inputs = {}
    for input_name in producer.input:
        if input_name:
            value = _constant_value(graph, input_name, opset, depth - 1)
            if value is None or value.size > 4096:
                return None
            inputs[input_name] = value
    try:
        model = helper.make_model(
            helper.make_graph(
                [producer],
                "constant",
                [],
                [helper.make_tensor_value_info(name, onnx.TensorProto.UNDEFINED, None)],
                [numpy_helper.from_array(value, input_name) for input_name, value in inputs.items()],
            ),
            opset_imports=[helper.make_opsetid("", opset)],
        )
        return np.asarray(ReferenceEvaluator(model).run(None, {})[0])
    except Exception:  # an op the reference evaluator lacks: not known to be constant here
        return None


def remove_same_type_casts(model: onnx.ModelProto) -> int:
    """Removes (in place) each ``Cast`` whose input already has the type it casts to, its readers reading that input;
    returns how many it removed. A cast that makes a graph output stays.

    ORT's optimizer removes the same casts (``remove_useless_cast_nodes``: a Cast whose input and output types are
    equal), but it rewrites every node's inputs once per cast removed. The TorchScript exporter writes hundreds of
    them in a UNet's shape arithmetic (an int64 value cast to int64), so that pass grows with the square of the graph:
    SDXL's was its slowest. Here the types come from ONNX shape inference over the graph without its weights, and
    the readers are renamed in one pass; a value whose type inference leaves open keeps its cast, for ORT to
    judge. Graphs with control flow are left as they are."""
    graph = model.graph
    if any(_has_subgraph(node) for node in graph.node):  # values read inside subgraphs: not followed here
        return 0
    # the graph with its initializers as typed inputs: types are all that is asked, and no weight is copied
    light = onnx.helper.make_model(
        onnx.helper.make_graph(
            list(graph.node),
            graph.name,
            [
                *graph.input,
                *[
                    onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims))
                    for tensor in graph.initializer
                ],
            ],
            list(graph.output),
        ),
        opset_imports=list(model.opset_import),
        ir_version=model.ir_version,
    )
    try:
        inferred = onnx.shape_inference.infer_shapes(light, strict_mode=False).graph
    except Exception:  # inference refuses the graph: ORT's own pass still removes the casts
        return 0
    types: Dict[str, int] = {}
    for value in [*inferred.input, *inferred.value_info, *inferred.output]:
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            types[value.name] = value.type.tensor_type.elem_type
    for tensor in graph.initializer:
        types[tensor.name] = tensor.data_type
    outputs = {value.name for value in graph.output}
    renamed: Dict[str, str] = {}
    removed = []
    for node in graph.node:
        if node.op_type != "Cast" or node.output[0] in outputs or not node.input[0]:
            continue
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        if to is not None and types.get(node.input[0]) == to:
            renamed[node.output[0]] = node.input[0]
            removed.append(node)
    if not removed:
        return 0

    def source(name: str) -> str:
        while name in renamed:  # a cast of a cast
            name = renamed[name]
        return name

    for node in graph.node:
        for index, name in enumerate(node.input):
            if name in renamed:
                node.input[index] = source(name)
    drop = {id(node) for node in removed}
    kept = [node for node in graph.node if id(node) not in drop]
    del graph.node[:]
    graph.node.extend(kept)
    dropped_values = set(renamed)
    kept_info = [value for value in graph.value_info if value.name not in dropped_values]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    return len(removed)


def fold_pads_into_convs(model: onnx.ModelProto) -> int:
    """Folds each zero ``Pad`` of the spatial dims whose only readers are ``Conv`` nodes into those convolutions'
    own ``pads`` (in place); returns how many it folded.

    diffusers' ``Downsample2D`` without padding (the VAE encoder's) pads its input by one row and column on one side
    before a stride-2 convolution. Exported, that is a Pad node on the full activation, which ORT's CUDA Pad kernel
    copies slowly (most of the fused fp16 encoder's time: README, Real-time streams), and ORT's own Pad-into-Conv
    fusion does not fire on these graphs. A convolution takes asymmetric padding itself (ONNX Conv's ``pads`` are
    begin and end values per spatial axis), which costs nothing. Graphs with control flow are left as they are."""
    graph = model.graph
    if any(_has_subgraph(node) for node in graph.node):  # values read inside subgraphs: not followed here
        return 0
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    readers: Dict[str, List[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {value.name for value in graph.output}
    folded = []
    for pad in graph.node:
        if pad.op_type != "Pad" or pad.output[0] in outputs or len(pad.input) < 2 or len(pad.input) > 3:
            continue
        mode = next((a.s for a in pad.attribute if a.name == "mode"), b"constant")
        pads = _constant_value(graph, pad.input[1], opset)
        fill = _constant_value(graph, pad.input[2], opset) if len(pad.input) == 3 and pad.input[2] else np.zeros(1)
        convs = readers.get(pad.output[0], [])
        if (
            mode != b"constant"
            or pads is None
            or fill is None
            or np.any(fill != 0)
            or pads.ndim != 1
            or len(pads) % 2
            or np.any(pads < 0)
            or not convs
        ):
            continue
        rank = len(pads) // 2
        begin, end = pads[:rank], pads[rank:]
        if rank < 3 or np.any(begin[:2] != 0) or np.any(end[:2] != 0):  # batch and channels untouched, NC…
            continue
        if not all(
            conv.op_type == "Conv"
            and conv.input[0] == pad.output[0]
            and pad.output[0] not in conv.input[1:]
            and next((a.s for a in conv.attribute if a.name == "auto_pad"), b"NOTSET") == b"NOTSET"
            and len(_conv_pads(conv, rank)) == 2 * (rank - 2)
            for conv in convs
        ):
            continue
        spatial = [int(v) for v in begin[2:]] + [int(v) for v in end[2:]]
        for conv in convs:
            merged = [a + b for a, b in zip(_conv_pads(conv, rank), spatial)]
            attribute = next((a for a in conv.attribute if a.name == "pads"), None)
            if attribute is None:
                conv.attribute.append(onnx.helper.make_attribute("pads", merged))
            else:
                del attribute.ints[:]
                attribute.ints.extend(merged)
            conv.input[0] = pad.input[0]
        folded.append(pad)
    # the folded Pads, then what computed their pads and fill that nothing else reads now
    unread = [name for pad in folded for name in pad.input[1:] if name]
    for pad in folded:
        graph.node.remove(pad)
    inputs = {value.name for value in graph.input}
    while unread:
        name = unread.pop()
        if name in outputs or any(name in node.input for node in graph.node):
            continue
        producer = next((node for node in graph.node if name in node.output), None)
        if producer is not None and not any(
            output in outputs or any(output in node.input for node in graph.node) for output in producer.output
        ):
            graph.node.remove(producer)
            unread.extend(input_name for input_name in producer.input if input_name)
        for tensor in [t for t in graph.initializer if t.name == name and name not in inputs]:
            graph.initializer.remove(tensor)
    return len(folded)


# the largest value a folded node may compute (the exporter's index arithmetic is a few integers)
_FOLDED_SIZE = 64


def constants_folded(model: onnx.ModelProto, base_dir: Optional[Path] = None) -> onnx.ModelProto:
    """A copy of ``model`` (its weights left where they are) where each standard node that computes a small value from
    constants alone is a ``Constant`` of that value, under the same output names. The TorchScript exporter writes
    such arithmetic for a dynamic ``unflatten`` (Wan's timestep projection, ``unflatten(1, (6, -1))``: the axis
    ``3 % 2 + 1`` computed in the graph), whose shape ORT's symbolic shape inference cannot see the rank of; folded,
    it can. For shape inference only: the graph written is the exporter's.

    A constant whose value is on disk (an initializer, or a ``Constant`` node's value: past 2 GiB the TorchScript
    exporter writes each larger tensor to a file of its own, its Constant nodes' values too) is read from
    ``base_dir`` where it is small enough to fold and ``base_dir`` is given, else left as it is; a large one is never
    read."""
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    def small_value(tensor: onnx.TensorProto) -> Optional[np.ndarray]:
        if _size(tensor.dims) > _FOLDED_SIZE:
            return None
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            if base_dir is None:
                return None
            try:
                return numpy_helper.to_array(tensor, str(base_dir))
            except Exception:  # a file that is not there: not known here
                return None
        return numpy_helper.to_array(tensor)

    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    known: Dict[str, Any] = {}
    for tensor in folded.graph.initializer:
        value = small_value(tensor)
        if value is not None:
            known[tensor.name] = value
    nodes = []
    for node in folded.graph.node:
        inputs = [name for name in node.input if name]
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            tensor = next((a.t for a in node.attribute if a.name == "value"), None)
            try:  # a tensor, possibly on disk (the exporter's), or value_int, value_floats …
                value = small_value(tensor) if tensor is not None else ReferenceEvaluator(node).run(None, {})[0]
            except Exception:  # a sparse value, say: left as it is
                value = None
            if value is not None and value.size <= _FOLDED_SIZE:
                known[node.output[0]] = value
        elif inputs and node.domain in ("", "ai.onnx") and all(name in known for name in inputs):
            try:
                values = ReferenceEvaluator(node).run(None, {name: known[name] for name in inputs})
            except Exception:  # an operator the reference runtime does not compute: left as it is
                values = None
            if values is not None and all(value.size <= _FOLDED_SIZE for value in values):
                for name, value in zip(node.output, values):
                    known[name] = value
                    nodes.append(
                        onnx.helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))
                    )
                continue
        nodes.append(node)
    del folded.graph.node[:]
    folded.graph.node.extend(nodes)
    return folded


def _size(dims: Sequence[int]) -> int:
    size = 1
    for dim in dims:
        size *= dim
    return size


def _conv_pads(conv: onnx.NodeProto, rank: int) -> List[int]:
    """A Conv's own ``pads`` (zeros where it has none) for an input of ``rank`` dims."""
    attribute = next((a for a in conv.attribute if a.name == "pads"), None)
    return list(attribute.ints) if attribute is not None else [0] * (2 * (rank - 2))


def _has_subgraph(node: onnx.NodeProto) -> bool:
    return any(
        attribute.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for attribute in node.attribute
    )


def weightless(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``'s graph without its weights, nothing of them copied or read: each initializer (and each Constant
    node whose value is on disk) a graph input of its element type and shape, the nodes, inputs, outputs and
    ``value_info`` as they are. What type checks need of a model of any size."""
    from onnx import helper

    graph = model.graph
    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    light.graph.name = graph.name
    light.graph.input.extend(graph.input)
    light.graph.output.extend(graph.output)
    light.graph.value_info.extend(graph.value_info)
    inputs = {value.name for value in graph.input}

    def as_input(name: str, tensor: onnx.TensorProto, dims: Sequence[int]) -> None:
        if name not in inputs:
            light.graph.input.append(helper.make_tensor_value_info(name, tensor.data_type, list(dims)))
            inputs.add(name)

    for tensor in graph.initializer:
        as_input(tensor.name, tensor, tensor.dims)
    for sparse in graph.sparse_initializer:
        as_input(sparse.values.name, sparse.values, sparse.dims)
    for node in graph.node:
        value = next((a.t for a in node.attribute if a.name == "value"), None) if node.op_type == "Constant" else None
        if value is not None and node.domain in ("", "ai.onnx") and value.data_location == onnx.TensorProto.EXTERNAL:
            as_input(node.output[0], value, value.dims)
        else:
            light.graph.node.append(node)
    return light


def onnx_runtime_refusal(model: onnx.ModelProto) -> Optional[str]:
    """What ONNX Runtime says when it loads ``model`` (each node's types checked against its operator's type
    constraints, and against the types ``value_info`` declares, as ``InferenceSession`` checks a model before anything
    else), or None where it loads. Only the graph is loaded (:func:`weightless`): no weight is read or allocated and
    no kernel is looked for, so that a model of any size is checked in a moment, a bfloat16 one or one of CUDA-only
    fused operators too."""
    import onnxruntime
    from onnxruntime.capi import _pybind_state

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # its warnings about kernels and providers are for a session that runs
    try:  # what InferenceSession does first (initialize_session, which finds kernels and reads weights, follows)
        _pybind_state.InferenceSession(options, weightless(model).SerializeToString(), False, False)
    except Exception as error:  # ORT's Fail, InvalidGraph …: its message says which node and why
        return str(error)
    return None


def refuse_unloadable(model: onnx.ModelProto, conversion: str, why: str = "") -> None:
    """Raises where ONNX Runtime refuses to load ``model``, the result of ``conversion`` (a float16 or bfloat16
    conversion): such a graph is never written (:func:`onnx_runtime_refusal`). ``why``: what went wrong before it,
    for the message."""
    refusal = onnx_runtime_refusal(model)
    if refusal is not None:
        raise RuntimeError(
            f"the {conversion} made a graph ONNX Runtime refuses to load, so nothing is written: {refusal}"
            + (f" ({why})" if why else "")
        )


def convert_to_float16(
    model: onnx.ModelProto, shapes_known: bool = False, float32_inputs: Sequence[str] = ()
) -> onnx.ModelProto:
    """fp32 → fp16 with ORT's converter: inputs and outputs become fp16 too but for ``float32_inputs``; the ops in
    its default block list (those that need fp32) and the :func:`float32_island` of the conditioning inputs stay
    fp32 behind casts; then the casts ORT's converter puts between two float32 nodes (to float16 and straight back)
    are removed, as ORT's ``OnnxModel.convert_float_to_float16`` removes them. The converter needs every
    intermediate's type; ``shapes_known`` says the model already carries them (its own inference cannot serialize
    > 2 GiB).

    Raises:
        RuntimeError: the converted graph is one ONNX Runtime refuses to load (:func:`refuse_unloadable`)."""
    if not shapes_known:
        model = onnx.shape_inference.infer_shapes(model)
    converted = _converted_keeping_island(model, float32_inputs)
    # the types are in value_info already: no symbolic inference (it copies the model, weights and all)
    converted.disable_shape_inference()
    converted.remove_useless_cast_nodes()
    refuse_unloadable(converted.model, "float16 conversion")
    return converted.model


def _converted_keeping_island(model: onnx.ModelProto, float32_inputs: Sequence[str]) -> Any:
    """ORT's float16 converter on ``model`` (typed), all float inputs and outputs but ``float32_inputs`` float16,
    its :func:`float32_island` float32; then the converter's duplicate Casts and float16 round trips removed. Returns
    ORT's ``OnnxModel`` of it (the useless Casts, float32 to float32, are the caller's to remove)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16
    from onnxruntime.transformers.onnx_model import OnnxModel

    converted = convert_float_to_float16(
        model, keep_io_types=list(float32_inputs), disable_shape_infer=True, node_block_list=float32_island(model.graph)
    )
    # The converter casts a float16 value to float32 once for each float32 node that reads it, every Cast writing
    # the same name: identical nodes, of which an ONNX graph may have one.
    seen: set = set()
    nodes = []
    for node in converted.graph.node:
        key = node.SerializeToString() if node.op_type == "Cast" else None
        if key is None or key not in seen:
            nodes.append(node)
            seen.add(key)
    del converted.graph.node[:]
    converted.graph.node.extend(nodes)
    converted = OnnxModel(converted)
    remove_cascaded_casts(converted)
    return converted


def remove_cascaded_casts(converted: Any) -> None:
    """Points each Cast that reads another Cast at that Cast's input where this keeps the values: both cast to float
    types (along a float32 island the converter's Cast to float16 and back, or a model's own Cast to float32 between
    them, would otherwise still read a value rounded to float16), or both to the same type. Unlike ORT's
    ``OnnxModel.remove_cascaded_cast_nodes`` it leaves a float → integer → float pair alone (that one rounds) and
    removes only the Casts nobody reads afterwards."""
    graph = converted.model.graph
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
    to = lambda node: next((a.i for a in node.attribute if a.name == "to"), None)  # noqa: E731
    outputs = {value.name for value in graph.output}
    changed = True
    while changed:
        changed = False
        casts = {node.output[0]: node for node in graph.node if node.op_type == "Cast"}
        for node in graph.node:
            parent = casts.get(node.input[0]) if node.op_type == "Cast" else None
            if (
                parent is not None
                and parent is not node
                and ((to(parent) in floats and to(node) in floats) or to(parent) == to(node))
            ):
                node.input[0] = parent.input[0]
                changed = True
        read = {name for node in graph.node for name in node.input} | outputs
        for node in [n for n in graph.node if n.op_type == "Cast" and n.output[0] not in read]:
            graph.node.remove(node)


# ORT's optimizer model type of each kind of component.
OPTIMIZER_MODEL_TYPES = {
    "text_encoder": "clip",
    "text_encoder_2": "clip",
    "unet": "unet",
    "vae_encoder": "vae",
    "vae_decoder": "vae",
    "controlnet": "unet",
    "image_encoder": "clip",
}


def _kind(name: str) -> str:
    """A component's kind: ``controlnet_1``, ``controlnet_2`` … are ControlNets like ``controlnet``."""
    return "controlnet" if name.startswith("controlnet") else name


def optimizer_model_type(name: str) -> str:
    """The ``model_type`` ORT's transformer optimizer takes for the component ``name`` (``"unet"``, ``"vae"`` or
    ``"clip"``)."""
    return OPTIMIZER_MODEL_TYPES[_kind(name)]


# The hidden sizes ORT's BiasSplitGelu kernel takes (other widths must skip that fusion).
BIAS_SPLIT_GELU_HIDDEN_SIZES = (2560, 5120, 6144, 10240, 12288)


# fusions whose fused operators have CUDA kernels only
CUDA_ONLY_FUSIONS = (
    "enable_nhwc_conv",
    "enable_group_norm",
    "enable_skip_group_norm",
    "enable_bias_splitgelu",
    "enable_bias_add",
    "enable_packed_qkv",
    "enable_packed_kv",
)


def fusion_options_for(model_type: str, target: str) -> Any:
    """ORT's fusions for ``model_type`` on ``target`` (``"cpu"``: only fusions whose fused operators have CPU
    kernels, see :data:`CUDA_ONLY_FUSIONS`)."""
    from onnxruntime.transformers.fusion_options import FusionOptions

    options = FusionOptions(model_type)
    if target == "cpu":
        for flag in CUDA_ONLY_FUSIONS:
            if hasattr(options, flag):
                setattr(options, flag, False)
    return options


def fusion_options(name: str, config: Any, target: str):
    """ORT transformer-optimizer fusions for one component.

    ``target="cuda"``: every fusion ORT has for the model type, except BiasSplitGelu where the UNet's GEGLU widths
    are not among :data:`BIAS_SPLIT_GELU_HIDDEN_SIZES`, and GroupNorm for blocks narrower than ORT's kernel takes.
    ``target="cpu"``: only fusions whose fused ops have CPU kernels (attention, layer norm, GELU) — NhwcConv,
    GroupNorm, SkipGroupNorm, BiasSplitGelu and BiasAdd run on CUDA only.
    """
    name = _kind(name)
    options = fusion_options_for(optimizer_model_type(name), target)
    if target != "cpu":
        channels = (
            list(config.get("block_out_channels", []))
            if isinstance(config, dict)
            else list(getattr(config, "block_out_channels", []))
        )
        if name in ("unet", "controlnet") and not all(8 * c in BIAS_SPLIT_GELU_HIDDEN_SIZES for c in channels):
            options.enable_bias_splitgelu = False
        # ORT's CUDA GroupNorm takes only some channel counts (it refuses 32 channels in 32 groups, for one): the
        # SD-size widths it was written for, UNet blocks of ≥ 320 and VAE blocks of ≥ 128 channels
        smallest = {"unet": 320, "controlnet": 320, "vae_encoder": 128, "vae_decoder": 128}.get(name)
        if smallest is not None and channels and min(channels) < smallest:
            for flag in ("enable_group_norm", "enable_skip_group_norm"):
                if hasattr(options, flag):
                    setattr(options, flag, False)
    return options


def use_classic_attention(module: torch.nn.Module) -> None:
    """ORT's UNet attention fusion fails on graphs exported from SDPA attention (a TypeError in get_num_heads) and
    fuses the classic processor's MatMul/Softmax pattern into MultiHeadAttention: export with the classic one (a
    processor whose ``keeps_classic_steps`` is true, an IP-Adapter layer's, is kept: it takes those steps already)."""
    from diffusers.models.attention_processor import AttnProcessor

    for child in module.modules():
        if hasattr(child, "set_attn_processor") and hasattr(child, "attn_processors"):
            child.set_attn_processor(
                {
                    name: processor if getattr(processor, "keeps_classic_steps", False) else AttnProcessor()
                    for name, processor in child.attn_processors.items()
                }
            )
            return


@contextlib.contextmanager
def in_folder(folder: Path):
    """ORT's fusion and shape-inference code reads initializers with ``numpy_helper.to_array(tensor)``, which resolves
    external data relative to the working directory: run it from the model's folder. (The working directory is the
    process's: exporting is not something to run on two threads at once.)"""
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


def load_light(path: Path) -> onnx.ModelProto:
    """The model at ``path`` with every initializer over 1 KiB left on disk beside it (read on demand).

    ORT's symbolic shape inference copies the whole ModelProto, weights included, in the passes that use it (its
    ``remove_useless_reshape_nodes`` pass among them): on a UNet that multiplies the memory of the weights many times
    over and copies gigabytes in every such pass. Without the weights in the proto the same fusions need about the
    memory of the weights alone. The exporter already writes large models this way; a small one is rewritten so."""
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(path), load_external_data=False)
    if not any(uses_external_data(tensor) for tensor in model.graph.initializer):
        model = unload(model, path)
    return model


def unload(model: onnx.ModelProto, path: Path) -> onnx.ModelProto:
    """Writes ``model`` to ``path`` with its weights beside it and returns it loaded light (see :func:`load_light`)."""
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=path.stem + ".weights",
        size_threshold=1024,
    )
    return onnx.load(str(path), load_external_data=False)


def optimize_component(name: str, path: Path, options: Any, target: str, model_type: Optional[str] = None):
    """ORT's transformer optimizer on the model at ``path``, its weights left on disk while the graph is rewritten
    (:func:`load_light`; fusions that need a weight read it from there); where its attention fusion breaks on a
    graph (the VAE's attention exported by the classic processor trips ``get_num_heads_and_hidden_size``: the export
    writes the VAE's attention fused itself, see :mod:`.attention`), the component is optimized again without it.
    ``model_type``: ORT's model type (default: the one of the UNet family's component ``name``, see
    :func:`optimizer_model_type`). Returns ORT's ``OnnxModel``; initializers it did not touch are still on disk in
    ``path``'s folder: load them (``onnx.load_external_data_for_model``) before that folder goes."""
    from onnxruntime.transformers.optimizer import optimize_model

    model_type = optimizer_model_type(name) if model_type is None else model_type

    def run(fusions):
        with in_folder(path.parent):
            return optimize_model(
                load_light(path),
                model_type=model_type,
                opt_level=0,
                optimization_options=fusions,
                use_gpu=target == "cuda",
            )

    try:
        return run(options)
    except Exception as error:  # the fusion scripts raise whatever the numpy code under them raises
        if not options.enable_attention:
            raise
        logger.warning(
            "%s: ORT's attention fusion failed (%s: %s); optimizing without it", name, type(error).__name__, error
        )
        options.enable_attention = False
        return run(options)


def optimized_to_float16(optimized: Any, folder: Path, float32_inputs: Sequence[str] = ()) -> onnx.ModelProto:
    """What ORT's ``OnnxModel.convert_float_to_float16(keep_io_types=float32_inputs)`` does — symbolic type inference
    (onnx's own cannot type the fused com.microsoft ops), its float16 converter, then removing cascaded and useless
    Casts — with the weights on disk in ``folder`` for the two inference passes and in memory only for the
    conversion, and the :func:`float32_island` of the conditioning inputs kept float32 (as
    :func:`convert_to_float16`).

    The converter casts at the float32 island's edges only where it knows the types: where ORT's inference fails
    (again with the exporter's index arithmetic folded, :func:`constants_folded`), the types of ONNX's own inference
    stand in (none past a fused operator), and a converted graph that ONNX Runtime refuses to load is refused here.

    Raises:
        RuntimeError: the converted graph is one ONNX Runtime refuses to load (:func:`refuse_unloadable`)."""
    from onnx import ValueInfoProto
    from onnxruntime.transformers.onnx_model import OnnxModel
    from onnxruntime.transformers.shape_infer_helper import SymbolicShapeInferenceHelper

    model = optimized.model

    def inferred(graph_model: onnx.ModelProto) -> onnx.ModelProto:
        with in_folder(folder):
            helper = SymbolicShapeInferenceHelper(graph_model)
            return helper.infer_shapes(graph_model, auto_merge=True, guess_output_rank=False)

    failure = ""
    try:
        try:
            typed = inferred(model)
        except Exception:  # the exporter's index arithmetic (its own ``unflatten``, which the Wan export
            # replaces) may hide a Reshape's rank from it: again with that arithmetic computed. Without the types the
            # converter leaves the float32 island's edge uncast (a float32 value into a float16 Gemm: a graph ORT
            # refuses to load). The constants a large export holds on disk (Constant nodes' values too) are read from
            # the folder
            typed = inferred(constants_folded(model, folder))
    except Exception as error:
        failure = f"ORT's symbolic shape inference failed before it: {type(error).__name__}: {error}"
        logger.warning("%s; converting to float16 with the types of ONNX's own inference", failure)
        typed = onnx_typed(model)  # None: no types at all, and the check after the conversion decides
    # element types only, as ORT merges them (auto_merge may widen shapes: microsoft/onnxruntime#15521)
    known = {info.name for info in model.graph.value_info}
    for info in typed.graph.value_info if typed is not None else ():
        if info.name and info.name not in known and info.type.tensor_type.elem_type != onnx.TensorProto.UNDEFINED:
            typed_only = ValueInfoProto()
            typed_only.CopyFrom(info)
            typed_only.type.tensor_type.ClearField("shape")
            model.graph.value_info.append(typed_only)
            known.add(info.name)
    onnx.load_external_data_for_model(model, str(folder))
    converted = _converted_keeping_island(model, float32_inputs)
    converted = OnnxModel(unload(converted.model, folder / "fp16.onnx"))
    with in_folder(folder):
        converted.remove_useless_cast_nodes()
    refuse_unloadable(converted.model, "float16 conversion", failure)  # the weights still on disk: checked light
    onnx.load_external_data_for_model(converted.model, str(folder))
    return converted.model


def onnx_typed(model: onnx.ModelProto) -> Optional[onnx.ModelProto]:
    """``model``'s graph typed by ONNX's own shape inference, no weight read (:func:`weightless`; the outputs of the
    operators it has no schema for, ORT's fused ones, and what follows them left untyped), or None where it refuses
    the graph."""
    try:
        return onnx.shape_inference.infer_shapes(weightless(model), strict_mode=False)
    except Exception:
        return None

"""The parts of a UNet whose sessions and first runs a pipeline makes side by side: the cold start's longest step.

ONNX Runtime's CUDA provider sets cuDNN up for each node in a session's first run (each convolution's algorithm, each
attention shape's graph), one node after another in the thread that runs it; a session's creation is as serial. Cut
into parts, the UNet's sessions are made and set up in as many threads at once (``benchmarks/split_first_run.py``).
The export writes, beside ``unet/model.onnx``::

    unet/cold_part_<k>.onnx   part k of K: consecutive nodes with about as many convolutions and attention nodes each

Each part reads the UNet's weights under the same names (from its weights file, where the export keeps them apart:
on disk once) and what earlier parts computed of the values it needs: the float ones, handed over as the earlier
part's outputs; an integer value (a shape, an index) a part computes again itself (:func:`.step_cache.split_graph`),
so that none crosses between parts on the device. Every value's type and dims come from ORT's symbolic shape inference
(the dims as expressions of the UNet's input dims), so that a runtime sizes each part's inputs and outputs from the
UNet's input shapes before any run. The parts in turn compute what ``model.onnx`` computes (in float16 up to the
rounding of what ORT fuses across a cut in the whole graph).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set

import onnx

from ..errors import ArgumentError, ModelFileError
from ..layout import COLD_START_PART

__all__ = ["SETUP_OPERATORS", "cold_start_cuts", "graph_order", "write_cold_start_parts"]

# the nodes whose first run sets cuDNN up: what the cuts share out
SETUP_OPERATORS = frozenset({"Conv", "NhwcConv", "MultiHeadAttention", "Attention", "PackedMultiHeadAttention"})
_INTEGER_TYPES = (onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.BOOL)


def graph_order(graph: onnx.GraphProto) -> List[int]:
    """The positions of ``graph``'s nodes in their stored order, except that each comes after the makers of its inputs
    (ORT's optimizer saves some nodes it adds, casts, after the nodes that read them)."""
    nodes = list(graph.node)
    maker = {name: position for position, node in enumerate(nodes) for name in node.output if name}
    placed: Dict[int, bool] = {}
    order: List[int] = []
    for start in range(len(nodes)):
        stack = [(start, False)]
        while stack:  # depth first, without recursion: a UNet's chains are long
            position, expanded = stack.pop()
            if placed.get(position):
                continue
            if expanded:
                placed[position] = True
                order.append(position)
                continue
            if position in placed:  # on the stack below itself: a cycle
                raise ArgumentError("model", f"expected an acyclic graph, got a cycle through {nodes[position].name!r}")
            placed[position] = False
            stack.append((position, True))
            for name in reversed(nodes[position].input):
                before = maker.get(name)
                if before is not None and not placed.get(before):
                    stack.append((before, False))
    return order


def cold_start_cuts(model: onnx.ModelProto, parts: int) -> List[Optional[List[str]]]:
    """Where ``model`` is cut into ``parts`` parts, as :func:`.step_cache.split_graph` takes it: for each part but the
    last, the float values its nodes make that a later part reads; ``None`` (the graph's outputs) for the last. The
    nodes (in :func:`graph_order`) are shared out so that each part holds about as many :data:`SETUP_OPERATORS`.

    Raises:
        ArgumentError: ``parts`` is not an integer of 2 or more, or the graph has fewer such nodes than parts.
    """
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 2:
        raise ArgumentError("cold_start_parts", f"expected an integer of 2 or more, got {parts!r}")
    graph = model.graph
    nodes = [graph.node[position] for position in graph_order(graph)]
    setup = [position for position, node in enumerate(nodes) if node.op_type in SETUP_OPERATORS]
    if len(setup) < parts:
        raise ArgumentError(
            "cold_start_parts",
            f"expected at most {len(setup)} (the model's convolution and attention nodes), got {parts}",
        )
    types = {value.name: value.type.tensor_type.elem_type for value in (*graph.value_info, *graph.input)}
    starts = [0, *(setup[len(setup) * number // parts] for number in range(1, parts)), len(nodes)]
    cuts: List[Optional[List[str]]] = []
    for number in range(parts - 1):
        read_later = {name for node in nodes[starts[number + 1] :] for name in node.input}
        made = [name for node in nodes[starts[number] : starts[number + 1]] for name in node.output if name]
        cuts.append([name for name in made if name in read_later and types.get(name) not in _INTEGER_TYPES])
    cuts.append(None)
    return cuts


def constants_as_initializers(model: onnx.ModelProto) -> None:
    """Turns ``model``'s ``Constant`` nodes of a tensor value into initializers of the same names (in place), so that
    a part reads the constants it needs from its own initializers instead of taking them from an earlier part."""
    graph = model.graph
    kept = []
    for node in graph.node:
        value = [attribute for attribute in node.attribute if attribute.name == "value"]
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.attribute) == 1 and value:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(value[0].t)
            tensor.name = node.output[0]
            graph.initializer.append(tensor)
        else:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)


def batch_for_timestep(model: onnx.ModelProto) -> None:
    """Declares a UNet's ``timestep`` of the sample's batch (in place), where it has a free dim of its own: shape
    inference would otherwise name the batch of every value the time embedding reaches by either dim, and a runtime
    sizing a part's inputs from the call's shapes would take a one-row timestep's batch for theirs. A pipeline gives
    the timestep of every row; the parts' runner expands a one-row one."""
    inputs = {value.name: value for value in model.graph.input}
    sample, timestep = inputs.get("sample"), inputs.get("timestep")
    if sample is None or timestep is None:
        return
    sample_dims, timestep_dims = sample.type.tensor_type.shape.dim, timestep.type.tensor_type.shape.dim
    if len(timestep_dims) == 1 and timestep_dims[0].dim_param and sample_dims and sample_dims[0].dim_param:
        timestep_dims[0].dim_param = sample_dims[0].dim_param


_FUNCTIONS = frozenset(
    {"floor", "ceil", "min", "max", "abs", "Mod", "mod", "FloorDiv", "CeilDiv", "FloorToInt", "CeilToInt"}
    | {"floor_div", "ceil_div"}
)


def dim_names(values: Sequence[onnx.ValueInfoProto]) -> Set[str]:
    """The names the dims of ``values`` use (``batch``; ``height`` in ``floor(height/2 - 1/2) + 1``)."""
    names: Set[str] = set()
    for value in values:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", dim.dim_param))
    return names - _FUNCTIONS


def bound_names(values: Sequence[onnx.ValueInfoProto]) -> Set[str]:
    """The names a runtime learns the values of from inputs ``values``: the dims that are a name alone (a runtime
    binds an expression only under its whole text)."""
    return {
        dim.dim_param
        for value in values
        for dim in value.type.tensor_type.shape.dim
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", dim.dim_param)
    }


def check_typed(part: onnx.ModelProto, number: int, graph_inputs: Set[str]) -> None:
    """Refuses a part that takes a value of an earlier part whose type or dims ORT's shape inference did not give (a
    runtime sizes the part's inputs from them before any run)."""

    def typed(value: onnx.ValueInfoProto) -> bool:
        tensor = value.type.tensor_type
        return (
            tensor.elem_type != onnx.TensorProto.UNDEFINED
            and tensor.HasField("shape")
            and all(dim.HasField("dim_value") or dim.dim_param for dim in tensor.shape.dim)
        )

    untyped = [value.name for value in part.graph.input if value.name not in graph_inputs and not typed(value)]
    if untyped:
        raise ArgumentError(
            "cold_start_parts",
            f"part {number} takes {untyped[:3]} from an earlier part, whose type or dims ORT's shape inference did not "
            "give: expected a UNet it types throughout (export without cold-start parts)",
        )


def give_dim_names(part: onnx.ModelProto, number: int, graph_inputs: Sequence[onnx.ValueInfoProto]) -> None:
    """Adds to ``part``'s inputs (in place) those of the UNet's own inputs, the sample first, that give the names its
    dims use and its inputs do not: a runtime sizes each part's values from its inputs alone (a middle part's
    attention tokens are ``height`` × ``width`` expressions, which none of its inputs has). A part reads nothing of
    such an input; it is bound, not copied, where the caller passes the UNet's.

    Raises:
        ArgumentError: a name no input of the UNet gives.
    """
    graph = part.graph
    needed = dim_names([*graph.input, *graph.output])
    present = {value.name for value in graph.input}
    for value in sorted(graph_inputs, key=lambda value: value.name != "sample"):
        given = bound_names(graph.input)
        if needed <= given:
            return
        if value.name not in present and bound_names([value]) - given & needed:
            graph.input.append(value)
            present.add(value.name)
    missing = needed - bound_names(graph.input)
    if missing:
        raise ArgumentError(
            "cold_start_parts", f"part {number}'s dims use {sorted(missing)}, which no input of the UNet declares"
        )


def write_cold_start_parts(folder: Path, parts: int) -> List[Path]:
    """Cuts the UNet written at ``folder/model.onnx`` (its weights left where they are) into ``parts`` parts
    (:func:`cold_start_cuts`) and writes them beside it as :data:`~optimum_iobinding.layout.COLD_START_PART`; returns
    their paths. Types and dims come from ORT's symbolic shape inference, as for the step caches' parts; the constants
    are initializers (each part holds those it reads), and the first part takes the timestep of every row
    (:func:`batch_for_timestep`).

    Raises:
        ModelFileError: ORT's shape inference failed on the UNet (where it cannot read the small weights it computes
            with, for one: onnx refuses a weights file with more than one hard link).
        ArgumentError: ``parts`` cannot cut this UNet, or a part would take a value without type or dims.
        FileExistsError: the folder holds more cold-start parts than ``parts``, which would run after the new ones.
    """
    from .step_cache import add_inferred_shapes, split_graph

    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    constants_as_initializers(model)
    batch_for_timestep(model)
    try:  # the parts' dims must come from it: a part whose inputs have none cannot be sized before it runs
        add_inferred_shapes(model, folder, strict=True)
    except Exception as error:
        raise ModelFileError(
            str(folder / "model.onnx"),
            f"ORT's symbolic shape inference, which gives the cold-start parts their dims, failed: {error}",
        ) from error
    cuts = cold_start_cuts(model, parts)
    beyond = folder / COLD_START_PART.format(number=parts)
    if beyond.exists():  # a runtime would run them after the new ones
        raise FileExistsError(
            f"{folder}: expected no cold-start parts past the {parts} asked for, got {beyond.name}: remove the folder's "
            "cold_part_*.onnx first"
        )
    made = split_graph(model, cuts)
    for number, part in enumerate(made):  # every part checked before any is written
        check_typed(part, number, {value.name for value in model.graph.input})
        give_dim_names(part, number, list(model.graph.input))
    paths = [folder / COLD_START_PART.format(number=number) for number in range(len(made))]
    scratches = [path.with_name(path.name + ".partial") for path in paths]
    try:
        for part, scratch in zip(made, scratches):
            onnx.save_model(part, str(scratch))
    except BaseException:  # a disk full: no scratch file left behind
        for scratch in scratches:
            scratch.unlink(missing_ok=True)
        raise
    # an old first part out, then the first part last: no chain of new and old parts is ever there to load
    paths[0].unlink(missing_ok=True)
    for scratch, path in reversed(list(zip(scratches, paths))):
        os.replace(scratch, path)
    return paths

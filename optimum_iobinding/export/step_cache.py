"""The part graphs First-Block Cache runs, cut out of a diffusion transformer's exported graph (SD3's MMDiT, FLUX.1,
Wan's video transformers: each of Wan 2.2's two experts its own parts, in its own folder).

A cached step runs the transformer's first block, compares its residual with the last full step's, and where it
changed little skips the other blocks, adding their last residual instead; the final norm and projection always run.
On ONNX Runtime that is three graphs:

    transformer/head.onnx   the embeddings and the first block: the graph's inputs → ``first_block_input`` (the first
                            block's input hidden states), ``first_block_hidden_states``,
                            ``first_block_encoder_hidden_states`` (its outputs; Wan's blocks give no text states: the
                            text states every block reads), and what the other parts read of it
    transformer/body.onnx   the other blocks → ``blocks_output`` (the last block's image tokens, the final norm's input)
    transformer/out.onnx    the final norm and projection → the transformer's own output

Their names are marked at export: the transformer is exported with those four values as extra outputs (forward
hooks on its first block and its final norm; the blocks are diffusers' ``transformer_blocks`` then
``single_transformer_blocks``, or Wan's ``blocks``), so ORT's fusions and the project's rewrites see the same graph as
without them (the fused operators are the same), and the cut finds them by name whatever the fused nodes are
called. ``model.onnx`` is written without the extra outputs; each part is the full graph's nodes that its outputs need
and an earlier part has not computed (by position in the graph), reading the full graph's initializers under the same
names: with the weights in ``model.onnx_data`` the parts refer to that file, so the weights are on disk once, and a
runtime that owns them by name serves every part from one copy.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import onnx
import torch
from onnx import helper

from ..errors import ArgumentError
from ..layout import FIRST_BLOCK_CACHE_PARTS, FIRST_BLOCK_MARKS
from .optimize import constants_folded

__all__ = [
    "STEP_CACHE_PARTS",
    "check_first_block_cache_depth",
    "constants_folded",
    "transformer_blocks_of",
    "drop_marks",
    "marked_transformer_spec",
    "split_graph",
    "write_step_cache_parts",
]

# each part's file in the transformer's folder and the marked values it ends at (None: the graph's own outputs): the
# head at the first block's input and outputs, the body at the final norm's input
STEP_CACHE_PARTS: Tuple[Tuple[str, Any], ...] = tuple(
    zip(FIRST_BLOCK_CACHE_PARTS, (FIRST_BLOCK_MARKS[:3], FIRST_BLOCK_MARKS[3:], None), strict=True)
)


def transformer_blocks_of(transformer: torch.nn.Module) -> List[torch.nn.Module]:
    """A diffusion transformer's blocks in the order they run: SD3's and FLUX.1's ``transformer_blocks`` then FLUX.1's
    ``single_transformer_blocks``, or Wan's ``blocks``."""
    names = (
        ("transformer_blocks", "single_transformer_blocks")
        if hasattr(transformer, "transformer_blocks")
        else ("blocks",)
    )
    return [block for name in names for block in (getattr(transformer, name, None) or ())]


class _MarkedTransformer(torch.nn.Module):
    """``module`` (an export wrapper whose ``transformer`` is diffusers' SD3, FLUX.1 or Wan transformer) returning its
    output, then the :data:`FIRST_BLOCK_MARKS` values: the first block's input and outputs and the final norm's
    input, caught by forward hooks while it runs. A Wan block returns its image tokens alone: its third mark is the
    text states it reads (those every block reads)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.caught: Dict[str, Any] = {}

    def forward(self, *args):
        self.caught.clear()
        output = self.module(*args)
        return (
            output,
            self.caught["first_input"],
            self.caught["first_hidden_states"],
            self.caught["first_encoder_hidden_states"],
            self.caught["norm_input"],
        )

    def _first_block_ran(self, args: tuple, kwargs: Dict[str, Any], output: Any) -> None:
        if isinstance(output, tuple):  # SD3's and FLUX.1's blocks: (text states, image tokens)
            self.caught["first_encoder_hidden_states"], self.caught["first_hidden_states"] = output
            return
        # Wan's: the image tokens; its text states are an input, the second (Wan calls its blocks positionally)
        self.caught["first_hidden_states"] = output
        self.caught["first_encoder_hidden_states"] = kwargs.get(
            "encoder_hidden_states", args[1] if len(args) > 1 else None
        )

    @contextlib.contextmanager
    def hooked(self) -> Iterator[None]:
        """The hooks, for as long as the export runs (the caller's transformer is left without them)."""
        transformer = self.module.transformer
        first, norm = transformer_blocks_of(transformer)[0], transformer.norm_out
        handles = [
            first.register_forward_pre_hook(
                lambda module, args, kwargs: self.caught.__setitem__(
                    "first_input", kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                ),
                with_kwargs=True,
            ),
            first.register_forward_hook(
                lambda module, args, kwargs, output: self._first_block_ran(args, kwargs, output), with_kwargs=True
            ),
            norm.register_forward_pre_hook(lambda module, args: self.caught.__setitem__("norm_input", args[0])),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def check_first_block_cache_depth(transformer: torch.nn.Module, name: str = "transformer") -> None:
    """First-Block Cache runs a transformer's first block and skips the others: it needs at least two.

    Raises:
        ArgumentError: a transformer of one block (naming ``step_cache`` and the transformer's component ``name``)."""
    blocks = len(transformer_blocks_of(transformer))
    if blocks < 2:
        raise ArgumentError(
            "step_cache",
            f"expected a {name} of at least 2 blocks (First-Block Cache runs the "
            f"first and skips the others), got {blocks}",
        )


def marked_transformer_spec(spec: Dict[str, Any]) -> Tuple[Dict[str, Any], Any]:
    """The export spec of a transformer (SD3's, FLUX.1's or Wan's, as :mod:`.transformer`, :mod:`.flux` and
    :mod:`.wan` write it) with
    the :data:`FIRST_BLOCK_MARKS` as extra outputs (dynamic in batch and tokens), and the context manager factory
    that hooks the module while the exporter runs.

    Returns:
        ``(spec, hooks)``: the marked spec, and ``hooks(module)`` to wrap the export in.
    """
    marked = _MarkedTransformer(spec["module"])
    batch = next(iter(spec["dynamic_axes"][spec["input_names"][0]].values()))
    axes = dict(spec["dynamic_axes"])
    for name in FIRST_BLOCK_MARKS:
        axes[name] = {0: batch, 1: f"{name}_tokens"}
    return (
        dict(spec, module=marked, output_names=list(spec["output_names"]) + list(FIRST_BLOCK_MARKS), dynamic_axes=axes),
        lambda module: marked.hooked(),
    )


def split_graph(model: onnx.ModelProto, cuts: Sequence[Any], skippable: Sequence[int] = ()) -> List[onnx.ModelProto]:
    """``model`` cut into consecutive parts: part ``k`` is the nodes (in graph order) that the values ``cuts[k]``
    need (``None``: the graph's outputs) and no earlier part computed; its inputs are what it reads from the graph's
    inputs or from earlier parts, its outputs ``cuts[k]`` and what later parts read of it. Initializers go with each
    part that reads them, the same protos (external data stays where it is). Run in turn, feeding each part from the
    graph's inputs and the earlier parts' outputs, the parts compute what ``model`` computes (in float16 up to the
    rounding of what ONNX Runtime fuses across a cut in the whole graph).

    A part computes again the integer values it needs of earlier parts (shapes and indices: ONNX Runtime computes
    them on the host, and one handed over between parts on the device would need a copy to the host, which keeps a
    part from being captured as a CUDA graph).

    A part in ``skippable`` (indices) may be left out of a run, its ends given instead (a cached step's stand-in for
    the blocks it skips): later parts read only its ends and compute again whatever else of it they need (a small
    value the exporter computed once for several blocks, say).

    Raises:
        ArgumentError: a cut names no value of the graph.
    """
    graph = model.graph
    nodes = list(graph.node)
    producer = {output: position for position, node in enumerate(nodes) for output in node.output if output}
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    graph_outputs = [value.name for value in graph.output]
    # what the graph says of each value (type and shape: the runtime sizes a part's outputs from its inputs' dims)
    infos = {value.name: value for value in (*graph.value_info, *graph.input, *graph.output)}
    owner: Dict[int, int] = {}  # node position → the part that computes it for the parts after
    skipped_ends: Dict[str, int] = {}  # an end of a skippable part → that part
    parts: List[Tuple[List[int], List[str]]] = []
    for number, cut in enumerate(cuts):
        ends = graph_outputs if cut is None else list(cut)
        missing = [name for name in ends if name not in producer]
        if missing:
            raise ArgumentError("cuts", f"expected values the graph computes, got {missing}")
        needed, stack = set(), list(ends)
        while stack:
            name = stack.pop()
            position = producer.get(name)
            if position is None or position in needed or (name in skipped_ends and name not in ends):
                continue
            if position in owner and owner[position] not in skippable and not _is_shape_value(infos, name):
                continue
            needed.add(position)
            stack.extend(value for value in nodes[position].input if value)
        for position in needed:
            owner.setdefault(position, number)
        if number in skippable:
            skipped_ends.update(dict.fromkeys(ends, number))
        parts.append((sorted(needed), ends))
    made_by = [{output for position in positions for output in nodes[position].output} for positions, _ in parts]
    inputs_of = []
    for number, (positions, _) in enumerate(parts):
        read = [name for position in positions for name in nodes[position].input if name]
        inputs_of.append(
            list(dict.fromkeys(name for name in read if name not in made_by[number] and name not in initializers))
        )
    models = []
    for number, (positions, ends) in enumerate(parts):
        part_nodes = [nodes[position] for position in positions]
        later = {name for inputs in inputs_of[number + 1 :] for name in inputs}
        if number in skippable:
            later &= set(ends)
        else:  # what a later part reads that a skippable part between also made is read from here
            later = {name for name in later if owner.get(producer.get(name, -1)) == number}
        outputs = list(
            dict.fromkeys(
                list(ends) + [name for node in part_nodes for name in node.output if name in later and name not in ends]
            )
        )
        read = [name for node in part_nodes for name in node.input if name]
        part = helper.make_graph(
            part_nodes,
            f"{graph.name}_part{number}",
            [_value_info(infos, name) for name in inputs_of[number]],
            [_value_info(infos, name) for name in outputs],
            [initializers[name] for name in dict.fromkeys(read) if name in initializers],
        )
        models.append(
            helper.make_model(
                part, opset_imports=model.opset_import, ir_version=model.ir_version, producer_name=model.producer_name
            )
        )
    return models


def _is_shape_value(infos: Dict[str, onnx.ValueInfoProto], name: str) -> bool:
    """Whether ``name`` is an integer or boolean value (a shape, an index, a mask) by what the graph says of it."""
    info = infos.get(name)
    return info is not None and info.type.tensor_type.elem_type in (
        onnx.TensorProto.INT64,
        onnx.TensorProto.INT32,
        onnx.TensorProto.BOOL,
    )


def _value_info(infos: Dict[str, onnx.ValueInfoProto], name: str) -> onnx.ValueInfoProto:
    """A copy of what the graph says of ``name`` (an untyped, unshaped value where it says nothing)."""
    if name not in infos:
        return helper.make_tensor_value_info(name, onnx.TensorProto.UNDEFINED, None)
    info = onnx.ValueInfoProto()
    info.CopyFrom(infos[name])
    return info


def drop_marks(model: onnx.ModelProto) -> None:
    """Takes the :data:`FIRST_BLOCK_MARKS` out of ``model``'s outputs (in place): ``model.onnx`` has the
    transformer's own outputs only."""
    kept = [value for value in model.graph.output if value.name not in FIRST_BLOCK_MARKS]
    del model.graph.output[:]
    model.graph.output.extend(kept)


def add_inferred_shapes(model: onnx.ModelProto, folder: Path, strict: bool = False) -> None:
    """Puts into ``model``'s ``value_info`` (in place) the types and dims ORT's symbolic shape inference gives its
    values (a model loaded from ``folder`` without its weights), before a cut: the inferred shapes win over what is
    there, since a float16 conversion leaves value_info with types but no shapes, and the runtime sizes a part's
    outputs (for its CUDA graph) from their dims. ``strict``: where the inference fails twice (the second time with the
    exporter's index arithmetic computed), that failure raised instead of the model left as it was."""
    from .optimize import in_folder
    from .transformer_fusions import inferred_shapes

    with in_folder(folder):  # small constants inference reads may be in the weights file
        typed = inferred_shapes(model)
        if typed is model.graph:  # ORT's inference failed: again with the exporter's index arithmetic computed
            typed = inferred_shapes(constants_folded(model, folder), strict=strict)
    inferred = {value.name for value in typed.value_info}
    kept = [value for value in model.graph.value_info if value.name not in inferred]
    del model.graph.value_info[:]
    model.graph.value_info.extend([*kept, *typed.value_info])


def write_step_cache_parts(folder: Path) -> List[Path]:
    """Cuts the transformer written at ``folder/model.onnx`` (its weights left where they are) into the
    :data:`STEP_CACHE_PARTS` and writes them beside it; returns their paths. The element types of the values
    between the parts come from ORT's symbolic shape inference (a float32 export carries none)."""
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    add_inferred_shapes(model, folder)
    parts = split_graph(model, [ends for _, ends in STEP_CACHE_PARTS], skippable=[1])
    paths = []
    for (name, _), part in zip(STEP_CACHE_PARTS, parts):
        onnx.save_model(part, str(folder / name))
        paths.append(folder / name)
    return paths

"""The part graphs DeepCache runs, cut out of a Stable Diffusion UNet's exported graph (SD 1.x/2.x, SDXL, LCM).

DeepCache (Ma et al., "DeepCache: Accelerating Diffusion Models for Free"; the ``DeepCache`` package's
``DeepCacheSDHelper``) runs the whole UNet every ``cache_interval``-th step and keeps the deep features of a skip
branch; the steps between run only the shallow branch: the down blocks above the branch, the last up blocks, and
the embeddings, reading the kept features where the deep blocks' output would enter. A branch id ``3 × block +
layer`` names the down block ``block`` (an up block counts from the output: up block ``k`` of ``n`` is number
``n − 1 − k``) and a layer in it: the shallow branch runs down block ``block``'s layers before ``layer`` and its up
block's resnets numbered ``layer`` and below (counted from the block's last resnet). What it reuses is therefore the
hidden states that resnet ``r = max(resnets − 1 − layer, 0)`` of that up block concatenates with its skip connection:
the output of the attention (or resnet) before it, or, for ``r = 0``, the up block's input (the deeper up block's
output, or the mid block's). Everything the shallow branch computes besides depends only on the step's inputs.

On ONNX Runtime that is, in the UNet's folder::

    unet/model.onnx                    the UNet, as the plain export writes it (its own inputs and outputs)
    unet/deep_cache_full.onnx          the same graph with every branch's feature as an extra output, named
                                       ``deep_features.up_blocks.<k>.resnets.<r>``
    unet/deep_cache_shallow_<id>.onnx  for each branch id: what ``out_sample`` needs given that feature as an input
                                       (the UNet's inputs it reads, and the feature) — the shallow branch alone
    unet/model.onnx_data               the weights, which every graph above reads: on disk once

The features are marked at export: the UNet is exported with them as extra outputs (forward hooks on diffusers'
blocks), so ORT's fusions see one graph and keep each marked value (a graph output), and the cut finds them by name
whatever the fused nodes are called (ORT's UNet optimizer removes divisions by 1, diffusers' resnets' division by
``output_scale_factor``, without minding graph outputs: a feature such a division computes is first renamed to be the
division's input, :func:`name_marks_before_divisions_by_one`). ``model.onnx`` is that graph without the extra
outputs. A feature's batch is the sample's and its size the sample's at its block's depth (``height / 2^depth``),
declared so that a runtime sizes it before a run. A shallow graph hands nothing over from the full one but its
feature: the shapes and indices it needs it computes from its own inputs.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Sequence, Tuple

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from onnx.external_data_helper import uses_external_data

from ..errors import ArgumentError
from ..layout import DEEP_CACHE_FEATURE_PREFIX, DEEP_CACHE_FULL_PART, DEEP_CACHE_SHALLOW_PART
from .optimize import save_onnx

__all__ = [
    "WEIGHTS_FILE",
    "deep_cache_places",
    "feature_name",
    "marked_unet_spec",
    "name_marks_before_divisions_by_one",
    "shallow_graph",
    "write_unet_with_deep_cache_parts",
]

# the weights file every graph of the folder reads (optimum's name for external data)
WEIGHTS_FILE = "model.onnx_data"
# the blocks whose layers DeepCache numbers (what diffusers' SD 1.x/2.x, SDXL and LCM UNets are made of)
DOWN_BLOCKS = ("DownBlock2D", "CrossAttnDownBlock2D")
UP_BLOCKS = ("UpBlock2D", "CrossAttnUpBlock2D")
# the layers DeepCache numbers in each block (branch id = 3 × block + layer)
LAYERS_PER_BRANCH_BLOCK = 3

Place = Tuple[int, int]  # (up block index, resnet index): the hidden states that resnet concatenates with its skip


def check_deep_cache_unet(unet: torch.nn.Module) -> None:
    """Refuses a UNet whose blocks DeepCache does not number (only diffusers' down and up blocks of SD 1.x/2.x, SDXL
    and LCM, as many down blocks as up blocks).

    Raises:
        ArgumentError: naming ``step_cache`` and the block.
    """
    down, up = list(getattr(unet, "down_blocks", [])), list(getattr(unet, "up_blocks", []))
    strange = [type(block).__name__ for block in down if type(block).__name__ not in DOWN_BLOCKS]
    strange += [type(block).__name__ for block in up if type(block).__name__ not in UP_BLOCKS]
    if strange or not up or len(down) != len(up):
        raise ArgumentError(
            "step_cache",
            f"expected a UNet of {DOWN_BLOCKS} down and {UP_BLOCKS} up blocks, as many "
            f"of each, for DeepCache's parts; got down blocks "
            f"{[type(b).__name__ for b in down]} and up blocks "
            f"{[type(b).__name__ for b in up]}",
        )


def deep_cache_places(unet: torch.nn.Module) -> Dict[int, Place]:
    """Every branch id of ``unet`` (diffusers' ``UNet2DConditionModel``) → the place of the feature its shallow
    steps reuse: ``(k, r)``, the hidden states up block ``k``'s resnet ``r`` concatenates with its skip connection
    (see the module's docstring for DeepCache's numbering)."""
    check_deep_cache_unet(unet)
    blocks = len(unet.up_blocks)
    places = {}
    for branch in range(LAYERS_PER_BRANCH_BLOCK * blocks):
        block, layer = divmod(branch, LAYERS_PER_BRANCH_BLOCK)
        up = blocks - 1 - block
        places[branch] = (up, max(len(unet.up_blocks[up].resnets) - 1 - layer, 0))
    return places


def feature_name(place: Place) -> str:
    """The graph value of the feature at ``place``."""
    up, resnet = place
    return f"{DEEP_CACHE_FEATURE_PREFIX}up_blocks.{up}.resnets.{resnet}"


class _MarkedUNet(torch.nn.Module):
    """``module`` (the UNet export wrapper, whose ``unet`` is diffusers' UNet) returning its output, then the
    features at ``places`` in order, caught by forward hooks while it runs."""

    def __init__(self, module: torch.nn.Module, places: Sequence[Place]):
        super().__init__()
        self.module = module
        self.places = list(places)
        self.caught: Dict[Place, torch.Tensor] = {}

    def forward(self, *args):
        self.caught.clear()
        output = self.module(*args)
        return (output, *(self.caught[place] for place in self.places))

    def _catch(self, place: Place) -> Callable[..., None]:
        def output_hook(module, args, output):
            self.caught[place] = output[0] if isinstance(output, (tuple, list)) else output

        return output_hook

    def _catch_input(self, place: Place) -> Callable[..., None]:
        def input_hook(module, args, kwargs):
            self.caught[place] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

        return input_hook

    @contextlib.contextmanager
    def hooked(self) -> Iterator[None]:
        """The hooks, for as long as the export runs (the caller's UNet is left without them)."""
        handles = []
        for place in self.places:
            up, resnet = place
            block = self.module.unet.up_blocks[up]
            if resnet == 0:  # the block's input: the deeper up block's (or the mid block's) output
                handles.append(block.register_forward_pre_hook(self._catch_input(place), with_kwargs=True))
            else:  # what the layer before the resnet gives: its attention's output, or its resnet's
                layers = getattr(block, "attentions", None) or block.resnets
                handles.append(layers[resnet - 1].register_forward_hook(self._catch(place)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _scaled_dim(name: str, depth: int) -> str:
    return name if depth == 0 else f"{name} / {2**depth}"


def marked_unet_spec(
    spec: Dict[str, Any],
) -> Tuple[Dict[str, Any], Callable[[torch.nn.Module], ContextManager], Dict[int, str]]:
    """The export spec of a UNet (as :mod:`.unet` writes it: ``module.unet`` is diffusers' UNet) with every branch's
    feature as an extra output, one per distinct place, dynamic in batch and size (the sample's at the place's
    depth).

    Returns:
        ``(spec, hooks, branches)``: the marked spec, ``hooks(module)`` to wrap the export in, and each branch id's
        feature name.

    Raises:
        ArgumentError: a UNet whose blocks DeepCache does not number (:func:`check_deep_cache_unet`).
    """
    unet = spec["module"].unet
    places = deep_cache_places(unet)
    distinct = list(dict.fromkeys(places.values()))
    marked = _MarkedUNet(spec["module"], distinct)
    axes = dict(spec["dynamic_axes"])
    blocks = len(unet.up_blocks)
    for place in distinct:
        depth = blocks - 1 - place[0]  # up block k works at the depth of down block n − 1 − k
        axes[feature_name(place)] = {0: "batch", 2: _scaled_dim("height", depth), 3: _scaled_dim("width", depth)}
    marked_spec = dict(
        spec,
        module=marked,
        output_names=list(spec["output_names"]) + [feature_name(p) for p in distinct],
        dynamic_axes=axes,
    )
    return (
        marked_spec,
        lambda module: marked.hooked(),
        {branch: feature_name(place) for branch, place in places.items()},
    )


def _is_constant_one(model: onnx.ModelProto, name: str) -> bool:
    """Whether the value ``name`` is a constant (an initializer or a Constant node's output) equal to 1."""
    for tensor in model.graph.initializer:
        if tensor.name == name:
            return bool(np.all(numpy_helper.to_array(tensor) == 1)) if not uses_external_data(tensor) else False
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            value = next((attribute.t for attribute in node.attribute if attribute.name == "value"), None)
            return value is not None and bool(np.all(numpy_helper.to_array(value) == 1))
    return False


def name_marks_before_divisions_by_one(model: onnx.ModelProto, features: Sequence[str]) -> bool:
    """Renames (in place) each feature that a division by 1 computes to be that division's input, the division now
    computing a value of its own that its readers read: ORT's UNet optimizer removes every division by 1 (diffusers'
    resnets divide by ``output_scale_factor``, 1) by pointing its readers at its input, which would leave a graph
    output that nothing computes. The values are the same. Returns whether it renamed any."""
    renamed = False
    for feature in features:
        node = next((node for node in model.graph.node if feature in node.output), None)
        if node is None or node.op_type != "Div" or not _is_constant_one(model, node.input[1]):
            continue
        source, divided = node.input[0], f"{feature}/divided_by_one"
        for reader in model.graph.node:  # the division's readers read its new output; its input becomes the feature
            for position, name in enumerate(reader.input):
                if name == feature:
                    reader.input[position] = divided
        node.output[0] = divided
        for other in model.graph.node:
            for position, name in enumerate(other.input):
                if name == source:
                    other.input[position] = feature
            for position, name in enumerate(other.output):
                if name == source:
                    other.output[position] = feature
        renamed = True
    return renamed


def _read_names(node: onnx.NodeProto) -> List[str]:
    """The values ``node`` reads: its inputs and what the subgraphs of its attributes read from outside them."""
    names = [name for name in node.input if name]
    for attribute in node.attribute:
        for graph in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs):
            made = {output for inner in graph.node for output in inner.output}
            names += [name for inner in graph.node for name in _read_names(inner) if name not in made]
    return names


def shallow_graph(model: onnx.ModelProto, feature: str, outputs: Sequence[str]) -> onnx.ModelProto:
    """What the values ``outputs`` of ``model`` need when the value ``feature`` is given: the nodes (in graph order)
    that compute them without computing ``feature``, whose inputs are the graph inputs they read and ``feature``
    (typed as ``model`` declares it), and the initializers they read (the same protos: external data stays where it
    is).

    Raises:
        ArgumentError: ``feature`` is no output of ``model``, or the outputs cannot be computed without computing
            ``feature`` (its node is also needed for something else: a fusion across the mark).
    """
    graph = model.graph
    declared = {value.name: value for value in graph.output}
    if feature not in declared:
        raise ArgumentError("feature", f"expected one of the graph's outputs {list(declared)}, got {feature!r}")
    nodes = list(graph.node)
    producer = {output: position for position, node in enumerate(nodes) for output in node.output if output}
    needed, stack = set(), list(outputs)
    while stack:
        name = stack.pop()
        position = producer.get(name)
        if name == feature or position is None or position in needed:
            continue
        needed.add(position)
        stack.extend(_read_names(nodes[position]))
    if producer[feature] in needed:
        raise ArgumentError(
            "feature",
            f"{feature!r} cannot be cut out: node {nodes[producer[feature]].name!r}, which "
            f"computes it, is needed by the outputs {list(outputs)} for something else",
        )
    part_nodes = [nodes[position] for position in sorted(needed)]
    read = list(dict.fromkeys(name for node in part_nodes for name in _read_names(node)))
    read_set = set(read)
    initializers = [tensor for tensor in graph.initializer if tensor.name in read_set]
    known = {tensor.name for tensor in initializers}
    inputs = [value for value in graph.input if value.name in read_set and value.name not in known]
    made = {output for node in part_nodes for output in node.output}
    part = helper.make_graph(
        part_nodes,
        f"{graph.name}_shallow",
        [*inputs, declared[feature]],
        [declared[name] for name in outputs],
        initializers,
        value_info=[value for value in graph.value_info if value.name in made],
    )
    shallow = helper.make_model(
        part, opset_imports=model.opset_import, ir_version=model.ir_version, producer_name=model.producer_name
    )
    shallow.functions.extend(model.functions)
    return shallow


def write_unet_with_deep_cache_parts(model: onnx.ModelProto, folder: Path, branches: Dict[int, str]) -> List[Path]:
    """Writes the UNet ``model`` (exported from :func:`marked_unet_spec`'s spec: its own outputs, then the features)
    as ``folder/model.onnx`` without the features, its weights in :data:`WEIGHTS_FILE` whatever their size, and the
    parts beside it (the module's docstring): :data:`~optimum_iobinding.layout.DEEP_CACHE_FULL_PART` and one
    :data:`~optimum_iobinding.layout.DEEP_CACHE_SHALLOW_PART` per branch of ``branches`` (branch id → feature name).
    Returns the parts' paths."""
    features = set(branches.values())
    marks = [value for value in model.graph.output if value.name in features]
    own = [value for value in model.graph.output if value.name not in features]
    del model.graph.output[:]
    model.graph.output.extend(own)
    save_onnx(model, folder / "model.onnx", 0, WEIGHTS_FILE)
    # the graph again, its initializers now naming the weights file, with the features as outputs once more
    full = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    full.graph.output.extend(marks)
    onnx.save_model(full, str(folder / DEEP_CACHE_FULL_PART))
    paths = [folder / DEEP_CACHE_FULL_PART]
    outputs = [value.name for value in own]
    for branch, feature in sorted(branches.items()):
        path = folder / DEEP_CACHE_SHALLOW_PART.format(branch=branch)
        onnx.save_model(shallow_graph(full, feature, outputs), str(path))
        paths.append(path)
    return paths

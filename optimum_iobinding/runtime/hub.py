"""Where a model's files are: a local file or folder, or a Hugging Face Hub repository; the external-data files an
.onnx file references; its graph read without its weights."""

from __future__ import annotations

import mmap
import os
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import onnx

from ..errors import ArgumentError, ArgumentPathError, ArgumentTypeError, did_you_mean
from ..layout import download_from_hub

# snapshot_download's own parameters that a loader sets itself: never the caller's to pass
_HUB_OWN = {"repo_id", "allow_patterns", "ignore_patterns", "tqdm_class", "dry_run"}


def hub_keywords() -> List[str]:
    """The keywords this huggingface_hub's ``snapshot_download`` takes for loading (revision, token, cache_dir …)."""
    import inspect

    from huggingface_hub import snapshot_download

    return [
        name
        for name, parameter in inspect.signature(snapshot_download).parameters.items()
        if name not in _HUB_OWN and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    ]


def keywords_of(function: Any) -> List[str]:
    """The parameters ``function`` takes by keyword, in its order (its ``**kwargs`` not among them)."""
    import inspect

    return [
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    ]


def check_hub_kwargs(where: str, hub_kwargs: Mapping[str, Any], own: Sequence[str] = ()) -> None:
    """Unknown keywords are an error naming them, not silently passed on or dropped (a misspelled ``io_bindng``):
    the keywords left for the hub download pass only if this huggingface_hub's ``snapshot_download`` takes them.
    The refusal names, for each unknown keyword, the keyword it likely misspells among ``own`` (the caller's own
    keywords) and the download's; where none is close it lists the caller's own keywords first, then the
    download's."""
    if not hub_kwargs:
        return
    known = hub_keywords()
    unknown = sorted(set(hub_kwargs) - set(known))
    if not unknown:
        return
    own = [name for name in own if name not in known]
    function = where.rsplit(".", 1)[-1]
    hints = []
    for name in unknown:
        suggestion = did_you_mean(name, [*own, *known])
        hints.append(f"{name}: not a keyword of {function}; {suggestion}" if suggestion else "")
    reason = f"got unexpected keyword argument(s) {unknown}"
    if all(hints):
        reason += "; " + "; ".join(hints)
    else:
        reason += "; " + "".join(f"{hint}; " for hint in hints if hint)
        reason += (
            f"its own keywords are {own}; besides them it takes huggingface_hub's download keywords {known}"
            if own
            else f"besides its own arguments it takes huggingface_hub's download keywords {known}"
        )
    raise ArgumentTypeError(where, reason)


def check_model_file(path: str) -> None:
    """The checks that cost no parse: a file is at ``path``, and it is not empty; errors name the file.

    Raises:
        FileNotFoundError: nothing (or a folder) at ``path``.
        ValueError: the file is empty.
    """
    if os.path.isdir(path):
        raise ArgumentPathError("path", f"expected an .onnx file, got the folder {path!r}")
    if not os.path.isfile(path):
        raise ArgumentPathError("path", f"expected an .onnx file, found nothing at {path!r}")
    if os.path.getsize(path) == 0:
        raise ArgumentError("path", f"{path!r} is empty (0 bytes), expected an ONNX model; export or download it again")


def unreadable_reason(path: str) -> Optional[str]:
    """Why the file at ``path`` is not an ONNX model (it is empty, does not parse, or holds no graph), or ``None``
    where its graph parses. Parses the file (without external data): for diagnosing a failure, not on a fast path."""
    try:
        if os.path.getsize(path) == 0:
            return "it is empty (0 bytes)"
        model = onnx.load(path, load_external_data=False)
    except Exception as error:  # protobuf's DecodeError and friends
        return f"{type(error).__name__}: {error}"
    if not model.HasField("graph") or not (model.graph.node or model.graph.output):
        return "it parses as a protobuf message but holds no ONNX graph"
    return None


def load_graph(path: str) -> onnx.ModelProto:
    """The graph of an .onnx file without its external weights, with errors that name the file."""
    check_model_file(path)
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as error:  # protobuf's DecodeError and friends
        raise ArgumentError(
            "path", f"{path!r} is not a readable ONNX model: {type(error).__name__}: {error}"
        ) from error
    if not model.HasField("graph") or not (model.graph.node or model.graph.output):
        raise ArgumentError(
            "path", f"{path!r} is not a readable ONNX model: it parses as a protobuf message but holds no ONNX graph"
        )
    return model


# protobuf field numbers of the parts of an ONNX file that say what a graph takes and gives (onnx.proto)
_MODEL_GRAPH, _GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_INPUT, _GRAPH_OUTPUT, _TENSOR_NAME = 7, 1, 5, 11, 12, 8


def _varint(buffer: Any, position: int) -> Tuple[int, int]:
    result = shift = 0
    while True:
        byte = buffer[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, position
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than ten bytes")


def _fields(buffer: Any, start: int, end: int) -> Iterator[Tuple[int, int, Any]]:
    """The fields of the protobuf message at ``buffer[start:end]``: (number, wire type, the value of a varint or the
    ``(start, end)`` of a length-delimited payload), the payloads not decoded."""
    position = start
    while position < end:
        key, position = _varint(buffer, position)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, position = _varint(buffer, position)
            yield field, wire, value
        elif wire == 2:
            length, position = _varint(buffer, position)
            if position + length > end:
                raise ValueError("a field runs past the end of its message")
            yield field, wire, (position, position + length)
            position += length
        elif wire in (1, 5):
            position += 8 if wire == 1 else 4
        else:
            raise ValueError(f"wire type {wire}")
    if position != end:
        raise ValueError("a message ends inside a field")


def load_declared_graph(path: str) -> onnx.ModelProto:
    """What an .onnx file's graph takes and gives, read without decoding its weights or nodes: a model whose graph
    holds the file's ``input`` and ``output`` value infos and its initializers' names only (older IR versions list
    initializers among the inputs). A file whose weights are inside it (a text encoder, a VAE) reads in a millisecond
    instead of the whole parse :func:`load_graph` makes. Anything this reader does not follow is read by
    :func:`load_graph`, with its errors that name the file."""
    check_model_file(path)
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            model, nodes, graphs = onnx.ModelProto(), 0, 0
            graph = model.graph
            for field, wire, value in _fields(buffer, 0, len(buffer)):
                if field != _MODEL_GRAPH or wire != 2:
                    continue
                graphs += 1
                for graph_field, graph_wire, payload in _fields(buffer, *value):
                    if graph_wire != 2:
                        continue
                    if graph_field == _GRAPH_NODE:
                        nodes += 1
                    elif graph_field in (_GRAPH_INPUT, _GRAPH_OUTPUT):
                        info = onnx.ValueInfoProto.FromString(buffer[payload[0] : payload[1]])
                        (graph.input if graph_field == _GRAPH_INPUT else graph.output).append(info)
                    elif graph_field == _GRAPH_INITIALIZER:
                        for tensor_field, tensor_wire, name in _fields(buffer, *payload):
                            if tensor_field == _TENSOR_NAME and tensor_wire == 2:
                                graph.initializer.add().name = bytes(buffer[name[0] : name[1]]).decode("utf-8")
    except Exception:  # not a protobuf this reader follows (or an empty file): the whole parse says what is wrong
        return load_graph(path)
    if graphs != 1 or not (nodes or graph.output):
        return load_graph(path)
    return model


def copy_graphs(graphs: Sequence[Path], folder: Path) -> None:
    """Copies each of ``graphs`` (.onnx files of one folder) into ``folder``, with the external-data files it
    references that are not there yet (a part reading its model's weights file finds the one saved with the model)."""
    for graph in graphs:
        for location in external_data_locations(graph):
            if not (folder / location).exists():
                (folder / location).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(graph.parent / location, folder / location)
        shutil.copyfile(graph, folder / graph.name)


def external_data_locations(model_path: Union[str, os.PathLike]) -> List[str]:
    """The relative paths of the external-data files an .onnx file references, in first-use order."""
    model = onnx.load(os.fspath(model_path), load_external_data=False)
    locations: "OrderedDict[str, None]" = OrderedDict()
    for tensor in _all_tensors(model.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    locations[entry.value] = None
    return list(locations)


def _all_tensors(graph: onnx.GraphProto):
    """Initializers and tensor attributes of a graph and of its subgraphs (If/Loop/Scan bodies)."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("g"):
                yield from _all_tensors(attribute.g)
            for subgraph in attribute.graphs:
                yield from _all_tensors(subgraph)


def resolve_model_file(
    model_id: Union[str, os.PathLike], subfolder: Optional[str], file_name: str, **hub_kwargs: Any
) -> str:
    """Finds ``model_id[/subfolder]/file_name`` locally, or downloads that folder from the Hugging Face Hub."""
    model_id = os.fspath(model_id)
    if os.path.isfile(model_id):
        return model_id
    if os.path.isdir(model_id):
        path = os.path.join(model_id, subfolder or "", file_name)
        if not os.path.isfile(path):
            raise ArgumentPathError(
                "model_id", f"expected {file_name!r} in {os.path.join(model_id, subfolder or '')!r}, found no such file"
            )
        return path
    pattern = f"{subfolder}/*" if subfolder else "*"
    folder = download_from_hub(model_id, [pattern], "model_id", **hub_kwargs)
    path = os.path.join(folder, subfolder or "", file_name)
    if not os.path.isfile(path):
        raise ArgumentPathError(
            "model_id", f"hub repository {model_id!r} has no {os.path.join(subfolder or '', file_name)!r}"
        )
    return path

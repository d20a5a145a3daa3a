"""Output-shape inference: size every output before a run so that it can be bound to a preallocated buffer.

Pure functions plus one small cache; nothing here touches an ``IOBinding``. ORT reports each input and output dim
as an ``int`` (static), a ``str`` (a symbolic name, or an expression an exporter wrote such as ``"2*batch"``) or
``None`` (unnamed). Given the concrete shapes of the inputs, :func:`infer_output_shapes` resolves each output dim

(a) by name, when an input has a dim of that name (or an expression, when an input has a dim written the same);
(b) by evaluating an expression over those names with :func:`evaluate_dim_expression` (never Python ``eval``);
(c) otherwise by ONNX shape inference of the model with the input shapes fixed (cached per input signature);
(d) and returns ``None`` for an output whose shape still depends on data (e.g. the output of ``NonZero``).

Each new input signature is also checked, once (its result is cached): a dim that both the declaration (a, b) and
ONNX shape inference give must agree — a declaration that contradicts the graph would size a buffer ORT cannot
write — and, where a bound is set (:meth:`ShapeInferencer.bound_outputs`; a model sets the free memory of its
device), no output may need more bytes than the bound: an enormous declared dim is an error naming the output
before anything is allocated.
"""

from __future__ import annotations

import ast
import math
import operator
import os
import threading
import weakref
from collections import OrderedDict
from fractions import Fraction
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import onnx

from ..errors import ArgumentError, ArgumentPathError, ModelFileError

Dim = Union[int, str, None]
Shape = Tuple[int, ...]

__all__ = [
    "DimExpressionError",
    "evaluate_dim_expression",
    "bind_input_dims",
    "infer_output_shapes",
    "ShapeInferencer",
]


class DimExpressionError(ValueError):
    """A dim string that is not an arithmetic expression over known names."""


# Names exporters use in dim expressions: plain math (torch.onnx, optimum) and sympy's spelling (dynamo export).
_FUNCTIONS = {
    "floor": lambda x: Fraction(math.floor(x)),
    "ceil": lambda x: Fraction(math.ceil(x)),
    "FloorToInt": lambda x: Fraction(math.floor(x)),
    "CeilToInt": lambda x: Fraction(math.ceil(x)),
    "floor_div": lambda a, b: Fraction(math.floor(a / b)),
    "FloorDiv": lambda a, b: Fraction(math.floor(a / b)),
    "ceil_div": lambda a, b: Fraction(math.ceil(a / b)),
    "CeilDiv": lambda a, b: Fraction(math.ceil(a / b)),
    "Mod": lambda a, b: a - b * math.floor(a / b),
    "mod": lambda a, b: a - b * math.floor(a / b),
    "min": min,
    "Min": min,
    "max": max,
    "Max": max,
    "abs": abs,
    "Abs": abs,
}
_MAX_EXPRESSION_LENGTH = 256
_MAX_EXPONENT = 64
# Every intermediate value's numerator and denominator must fit in this many bits: a dim is a size, and with the
# bound checked before each power no expression of 256 characters can take more than a few microseconds or any memory
# (((h**64)**64)**64 would otherwise grow to billions of digits and hang the process).
MAX_VALUE_BITS = 256


def evaluate_dim_expression(expression: str, symbols: Mapping[str, int]) -> int:
    """Evaluates a dim expression such as ``"latent_height * 8"`` or ``"floor(h / 2)"`` with exact arithmetic.

    The expression is parsed with :mod:`ast` and walked by hand: only integer literals, names from ``symbols``,
    ``+ - * / // % **`` (small non-negative integer exponents), unary ``+``/``-`` and the functions floor, ceil,
    min, max, abs, Mod, FloorDiv, CeilDiv (and sympy's CeilToInt/FloorToInt) are accepted.

    Args:
        expression: the dim string as the model declares it.
        symbols: concrete values of the named dims.

    Returns:
        The value, which must be a whole number.

    Raises:
        DimExpressionError: if the string is not such an expression, names an unknown symbol, divides by zero or
            does not come out as an integer.
    """
    if len(expression) > _MAX_EXPRESSION_LENGTH:
        raise DimExpressionError(f"dim expression longer than {_MAX_EXPRESSION_LENGTH} characters: {expression!r}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise DimExpressionError(f"dim {expression!r} is not an arithmetic expression") from error
    try:
        value = _evaluate(tree.body, symbols, expression)
    except ZeroDivisionError as error:
        raise DimExpressionError(f"dim {expression!r} divides by zero") from error
    except RecursionError as error:
        raise DimExpressionError(f"dim {expression!r} nests too deeply") from error
    if value.denominator != 1:
        raise DimExpressionError(f"dim {expression!r} evaluates to {value}, not a whole number")
    return int(value)


def value_bits(value: Fraction) -> int:
    """The size of an exact value in bits: the longer of its numerator's and its denominator's."""
    return max(abs(value.numerator).bit_length(), value.denominator.bit_length())


def bounded(value: Fraction, expression: str) -> Fraction:
    """``value`` itself, if it fits :data:`MAX_VALUE_BITS`; the evaluator passes every intermediate value through
    here.

    Raises:
        DimExpressionError: the value is larger, naming ``expression``.
    """
    if value_bits(value) > MAX_VALUE_BITS:
        raise DimExpressionError(
            f"dim {expression!r}: an intermediate value exceeds {MAX_VALUE_BITS} bits, far beyond any tensor size"
        )
    return value


def _evaluate(node: ast.AST, symbols: Mapping[str, int], expression: str) -> Fraction:
    return bounded(_evaluate_unbounded(node, symbols, expression), expression)


def _evaluate_unbounded(node: ast.AST, symbols: Mapping[str, int], expression: str) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.Name):
        if node.id not in symbols:
            raise DimExpressionError(f"dim {expression!r} uses {node.id!r}, which no input dim defines")
        return Fraction(symbols[node.id])
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _evaluate(node.operand, symbols, expression)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        left = _evaluate(node.left, symbols, expression)
        right = _evaluate(node.right, symbols, expression)
        op = node.op
        if isinstance(op, ast.Add):
            return left + right
        if isinstance(op, ast.Sub):
            return left - right
        if isinstance(op, ast.Mult):
            return left * right
        if isinstance(op, ast.Div):
            return left / right
        if isinstance(op, ast.FloorDiv):
            return Fraction(math.floor(left / right))
        if isinstance(op, ast.Mod):
            return left - right * math.floor(left / right)
        if isinstance(op, ast.Pow):
            if right.denominator != 1 or not 0 <= right <= _MAX_EXPONENT:
                raise DimExpressionError(f"dim {expression!r}: exponent {right} is not an integer in [0, 64]")
            # checked before computing it
            if value_bits(left) > 1 and (value_bits(left) - 1) * int(right) > MAX_VALUE_BITS:
                raise DimExpressionError(
                    f"dim {expression!r}: an intermediate value exceeds {MAX_VALUE_BITS} bits, "
                    "far beyond any tensor size"
                )
            return left ** int(right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        function = _FUNCTIONS.get(node.func.id)
        if function is not None and node.args:
            args = [_evaluate(arg, symbols, expression) for arg in node.args]
            try:
                return Fraction(function(*args))
            except TypeError as error:
                raise DimExpressionError(f"dim {expression!r}: wrong number of arguments to {node.func.id}") from error
    raise DimExpressionError(f"dim {expression!r} contains {ast.dump(node)[:60]}, which is not allowed in a dim")


def bind_input_dims(
    declared: Mapping[str, Optional[Sequence[Dim]]], input_shapes: Mapping[str, Sequence[int]]
) -> Dict[str, int]:
    """Checks concrete input shapes against the declared ones and returns the value of every named dim.

    A name that two inputs give different sizes (diffusers' exports call the timestep's dim ``"batch"`` and pass
    ``[t]`` with a batch-2 sample, which ORT broadcasts) is left out: dims using it fall to ONNX shape inference.

    Args:
        declared: input name → dims as ORT reports them (int, str or None); ``None`` for an undeclared rank.
        input_shapes: input name → concrete shape. Every name must be declared.

    Returns:
        Symbol name → value, for every input dim declared as a name (or an expression, under its text) that the
        inputs agree on.

    Raises:
        ValueError: wrong rank or a static dim mismatch, naming the input, the expected and the received shape.
    """
    symbols: Dict[str, int] = {}
    ambiguous = set()
    for name, shape in input_shapes.items():
        dims = declared[name]
        shape = tuple(int(d) for d in shape)
        if dims is None:  # rank not declared: nothing to check or bind
            continue
        if len(shape) != len(dims):
            raise ValueError(
                f"input {name!r}: expected rank {len(dims)} (shape {_format_dims(dims)}), "
                f"got rank {len(shape)} (shape {list(shape)})"
            )
        for axis, (dim, size) in enumerate(zip(dims, shape)):
            if isinstance(dim, int) and dim >= 0 and dim != size:
                raise ValueError(
                    f"input {name!r}: expected size {dim} in dim {axis} (shape {_format_dims(dims)}), "
                    f"got {size} (shape {list(shape)})"
                )
            # a name binds its size; so does an expression as written (a graph cut out of a larger one declares
            # its inputs and outputs with the same expressions of the larger graph's input names)
            if isinstance(dim, str) and dim:
                if symbols.get(dim, size) != size:
                    ambiguous.add(dim)
                symbols[dim] = size
    for dim in ambiguous:
        del symbols[dim]
    return symbols


def checked_shape(name: str, shape: Any) -> Shape:
    """``shape`` as a tuple of non-negative ints; an error naming the input for anything else (a negative or
    fractional size, a float, a bool, a string)."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(
            f"input {name!r}: expected a shape (a sequence of non-negative integers), got "
            f"{type(shape).__name__} {shape!r}"
        ) from None
    checked = []
    for axis, size in enumerate(dims):
        try:  # ints, numpy and torch integers; not floats (1.5, and 2.0 too), strings or bools
            if type(size).__name__ in ("bool", "bool_"):
                raise TypeError
            size = operator.index(size)
        except TypeError:
            raise TypeError(
                f"input {name!r}: expected non-negative integer sizes, got {size!r} in dim {axis} (shape {list(dims)})"
            ) from None
        if size < 0 or size >= 2**62:
            raise ValueError(
                f"input {name!r}: expected non-negative integer sizes below 2**62, got {size} in dim "
                f"{axis} (shape {list(dims)})"
            )
        checked.append(int(size))
    return tuple(checked)


def _format_dims(dims: Optional[Sequence[Dim]]) -> str:
    if dims is None:
        return "(rank not declared)"
    return "[" + ", ".join("?" if d is None else repr(d) if isinstance(d, str) else str(d) for d in dims) + "]"


def _format_bytes(size: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size} bytes, {size / scale:.1f} {unit}"
    return f"{size} bytes"


# Outputs up to this size are never checked against the bound: no memory query for the everyday signature (on
# CUDA the query waits for any graph capture under way), and no machine lacks this much.
UNCHECKED_OUTPUT_BYTES = 16 << 20


def resolve_dims(dims: Optional[Sequence[Dim]], symbols: Mapping[str, int]) -> Optional[Tuple[Optional[int], ...]]:
    """Resolves output dims from names and expressions (cases a, b); ``None`` marks a dim left unresolved."""
    if dims is None:
        return None
    resolved = []
    for dim in dims:
        if isinstance(dim, int) and dim >= 0:
            resolved.append(dim)
        elif isinstance(dim, str):
            if dim in symbols:
                resolved.append(symbols[dim])
                continue
            try:
                value = evaluate_dim_expression(dim, symbols)
            except DimExpressionError:
                value = None
            resolved.append(value if value is not None and value >= 0 else None)
        else:
            resolved.append(None)
    return tuple(resolved)


class ShapeInferencer:
    """Owns what output-shape inference of one model needs: declared dims, a light copy of the graph for ONNX
    shape inference (loaded on first need), and a cache of results per input signature.

    Args:
        input_dims / output_dims: name → dims as ORT reports them, in session order.
        model_source: a path to the .onnx file, its bytes, a ``ModelProto``, or ``None`` (the default) when unknown:
            then ONNX shape inference never runs, and dims that names and expressions cannot resolve are reported as
            data-dependent.
        max_cached_signatures: how many input signatures keep their result (the least recently used goes first).

    Attributes:
        max_cached_signatures: the bound given above.
    """

    def __init__(
        self,
        input_dims: Mapping[str, Optional[Sequence[Dim]]],
        output_dims: Mapping[str, Optional[Sequence[Dim]]],
        model_source: Union[str, os.PathLike, bytes, onnx.ModelProto, None] = None,
        max_cached_signatures: int = 64,
    ):
        self.input_dims = {name: None if dims is None else list(dims) for name, dims in input_dims.items()}
        self.output_dims = {name: None if dims is None else list(dims) for name, dims in output_dims.items()}
        self._model_source = model_source
        self._skeleton: Optional[onnx.ModelProto] = None
        self._cache: "OrderedDict[Tuple, Dict[str, Optional[Shape]]]" = OrderedDict()
        self.max_cached_signatures = max_cached_signatures
        self._lock = threading.Lock()
        self._element_sizes: Dict[str, int] = {}
        self._byte_limit: Optional[Callable[[], Tuple[int, str]]] = None

    def bound_outputs(self, element_sizes: Mapping[str, int], byte_limit: Callable[[], Tuple[int, str]]) -> None:
        """Makes each new input signature check every output's size before its shapes are returned (and anything
        is allocated): an output of more bytes than ``byte_limit()`` is an error naming it.

        Args:
            element_sizes: output name → bytes per element.
            byte_limit: returns ``(bytes, what they are)``, e.g. ``(free, "the free memory of cuda:0")``; called once
                per new signature, and only where an output is larger than :data:`UNCHECKED_OUTPUT_BYTES`.
        """
        self._element_sizes = dict(element_sizes)
        self._byte_limit = byte_limit

    @property
    def cached_signatures(self) -> Tuple[Tuple[Tuple[str, Shape], ...], ...]:
        """The input signatures whose results are cached, least recently used first; each is a tuple of
        ``(input name, shape)`` pairs sorted by name."""
        with self._lock:
            return tuple(self._cache)

    def __call__(self, input_shapes: Mapping[str, Sequence[int]]) -> Dict[str, Optional[Shape]]:
        signature = tuple(sorted((name, checked_shape(name, shape)) for name, shape in input_shapes.items()))
        with self._lock:
            cached = self._cache.get(signature)
            if cached is not None:
                self._cache.move_to_end(signature)
                return dict(cached)
        result = self._infer(dict(signature))
        with self._lock:
            self._cache[signature] = result
            while len(self._cache) > self.max_cached_signatures:
                self._cache.popitem(last=False)
        return dict(result)

    def _infer(self, input_shapes: Dict[str, Shape]) -> Dict[str, Optional[Shape]]:
        unknown = sorted(set(input_shapes) - set(self.input_dims))
        if unknown:
            raise ValueError(f"unknown input {unknown[0]!r}: the model's inputs are {list(self.input_dims)}")
        symbols = bind_input_dims(self.input_dims, input_shapes)
        resolved = {name: resolve_dims(dims, symbols) for name, dims in self.output_dims.items()}
        # run for every new signature (the result is cached): it fills the dims (a) and (b) leave open, and checks
        # the ones they resolve against what the graph computes
        inferred = self._onnx_shape_inference(input_shapes)
        result: Dict[str, Optional[Shape]] = {}
        for name, dims in resolved.items():
            from_onnx = inferred.get(name)
            if dims is None:
                dims = from_onnx
            elif from_onnx is not None:
                self._check_declaration(name, dims, from_onnx)
                dims = tuple(d if d is not None else o for d, o in zip(dims, from_onnx))
            result[name] = tuple(dims) if dims is not None and None not in dims else None  # type: ignore[misc]
        self._check_sizes(result)
        return result

    def _check_declaration(
        self, name: str, declared: Tuple[Optional[int], ...], inferred: Tuple[Optional[int], ...]
    ) -> None:
        """The declared dims (resolved for this signature) must agree with ONNX shape inference wherever both give
        a size."""
        conflict = len(declared) != len(inferred) or any(
            d is not None and o is not None and d != o for d, o in zip(declared, inferred)
        )
        if conflict:
            reported = _format_dims(self.output_dims[name])
            in_file = self._declared_in_file(name)
            declaration = reported if in_file in (None, reported) else f"{in_file} (onnxruntime reads it as {reported})"
            raise ValueError(
                f"output {name!r}: the model declares shape {declaration}, which is "
                f"{_format_dims(declared)} for these inputs, but its graph computes {_format_dims(inferred)} (ONNX "
                "shape inference); expected the declared output shape to match the graph: the file's output "
                "declaration is wrong (export the model again)"
            )

    def _declared_in_file(self, name: str) -> Optional[str]:
        """The output's dims as the model file writes them (ORT reports its own merge of them with its inference)."""
        skeleton = self._skeleton
        for value_info in skeleton.graph.output if skeleton is not None else ():
            if value_info.name == name and value_info.type.tensor_type.HasField("shape"):
                return _format_dims(
                    [
                        d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                        for d in value_info.type.tensor_type.shape.dim
                    ]
                )
        return None

    def _check_sizes(self, shapes: Mapping[str, Optional[Shape]]) -> None:
        """Each output's bytes against the bound of :meth:`bound_outputs`, before anything is allocated."""
        if self._byte_limit is None:
            return
        limit: Optional[Tuple[int, str]] = None
        for name, shape in shapes.items():
            if shape is None:
                continue
            size = math.prod(shape) * self._element_sizes.get(name, 1)
            if size <= UNCHECKED_OUTPUT_BYTES:
                continue
            if limit is None:
                limit = self._byte_limit()
            if size > limit[0]:
                raise ValueError(
                    f"output {name!r}: expected an output that fits in {limit[1]} ({_format_bytes(limit[0])}), got "
                    f"shape {list(shape)} ({_format_bytes(size)}) from the model's declared dims "
                    f"{_format_dims(self.output_dims[name])}; nothing was allocated. The declaration is probably "
                    "wrong (or the inputs far larger than meant)"
                )

    def _onnx_shape_inference(
        self, input_shapes: Mapping[str, Shape]
    ) -> Dict[str, Optional[Tuple[Optional[int], ...]]]:
        skeleton = self._load_skeleton()
        if skeleton is None:
            return {}
        model = onnx.ModelProto()
        model.CopyFrom(skeleton)
        for value_info in model.graph.input:
            shape = input_shapes.get(value_info.name)
            if shape is None:
                continue
            tensor_shape = value_info.type.tensor_type.shape
            tensor_shape.ClearField("dim")
            for size in shape:
                tensor_shape.dim.add().dim_value = size
        for value_info in model.graph.output:
            value_info.type.tensor_type.ClearField("shape")
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
        except Exception:  # an op onnx cannot infer: leave the dims to ORT (allocated on the device at run time)
            return {}
        shapes: Dict[str, Optional[Tuple[Optional[int], ...]]] = {}
        for value_info in inferred.graph.output:
            tensor_type = value_info.type.tensor_type
            if not tensor_type.HasField("shape"):
                shapes[value_info.name] = None
                continue
            shapes[value_info.name] = tuple(
                d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim
            )
        return shapes

    def _load_skeleton(self) -> Optional[onnx.ModelProto]:
        with self._lock:
            if self._skeleton is None and self._model_source is not None:
                self._skeleton = model_skeleton(self._model_source)
                self._model_source = None  # the skeleton is all that is needed from now on
            return self._skeleton


# Initializers larger than this are replaced by typed graph inputs for shape inference: their values (weights)
# never decide a shape, and leaving them out keeps inference fast on multi-GB models and avoids reading external data.
_SKELETON_MAX_INITIALIZER_ELEMENTS = 4096


def model_skeleton(source: Union[str, os.PathLike, bytes, onnx.ModelProto]) -> onnx.ModelProto:
    """Returns the model with its large initializers replaced by typed graph inputs.

    Small initializers (shape constants, axes) keep their values, loaded from external data where they live there.

    Raises:
        ModelFileError: such a value cannot be read (its file not there, or one onnx refuses: several hard links).
    """
    base_dir = None
    if isinstance(source, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(source)
    elif isinstance(source, (bytes, bytearray)):
        model = onnx.load_model_from_string(bytes(source))
    else:
        path = os.fspath(source)
        model = onnx.load(path, load_external_data=False)
        base_dir = os.path.dirname(os.path.abspath(path))
    graph = model.graph
    kept = []
    moved = []
    for tensor in graph.initializer:
        elements = math.prod(tensor.dims) if tensor.dims else 1
        if elements > _SKELETON_MAX_INITIALIZER_ELEMENTS:
            moved.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
            continue
        if tensor.data_location == onnx.TensorProto.EXTERNAL and base_dir is not None:
            from onnx.external_data_helper import load_external_data_for_tensor

            try:
                load_external_data_for_tensor(tensor, base_dir)
            except Exception as error:  # onnx's own refusals (a file with several hard links), a file not there
                raise ModelFileError(
                    os.fspath(source), f"cannot read the weight {tensor.name!r} from its weights file: {error}"
                ) from error
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
        kept.append(tensor)
    graph.ClearField("initializer")
    graph.initializer.extend(kept)
    graph.input.extend(moved)
    return model


def infer_output_shapes(model: Any, input_shapes: Mapping[str, Sequence[int]]) -> Dict[str, Optional[Shape]]:
    """Returns each output's concrete shape for the given concrete input shapes, before anything runs.

    Args:
        model: an :class:`~optimum_iobinding.IOBindingORTModel`, an ``onnxruntime.InferenceSession``, a path to an
            .onnx file, or an ``onnx.ModelProto``.
        input_shapes: input name → shape, for every input of the model.

    Returns:
        Output name → shape tuple, in the model's output order; ``None`` for an output whose shape depends on the
        input data (for example the output of ``NonZero``).

    Raises:
        ValueError: unknown or missing input, wrong rank, a static dim mismatch.
    """
    inferencer = _inferencer_for(model)
    missing = [name for name in inferencer.input_dims if name not in input_shapes]
    if missing:
        raise ValueError(
            f"missing input {missing[0]!r}: input_shapes must give the shape of every input "
            f"{list(inferencer.input_dims)}"
        )
    return inferencer(input_shapes)


# Sessions are keyed weakly: the cache must never keep a session (and its GPU memory) alive.
_session_inferencers: "weakref.WeakKeyDictionary[Any, ShapeInferencer]" = weakref.WeakKeyDictionary()
_session_inferencers_lock = threading.Lock()


def _inferencer_for(model: Any) -> ShapeInferencer:
    existing = getattr(model, "shape_inferencer", None)
    if isinstance(existing, ShapeInferencer):
        return existing
    if hasattr(model, "get_inputs") and hasattr(model, "get_outputs"):  # an onnxruntime.InferenceSession
        with _session_inferencers_lock:
            inferencer = _session_inferencers.get(model)
            if inferencer is None:
                inferencer = _session_inferencers[model] = inferencer_from_session(model)
        return inferencer
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        return inferencer_from_model_proto(_read_graph(path), source=path)
    if isinstance(model, onnx.ModelProto):
        return inferencer_from_model_proto(model, source=model)
    raise TypeError(
        "model: expected an IOBindingORTModel, an onnxruntime.InferenceSession, a path to an .onnx file or an "
        f"onnx.ModelProto, got {type(model).__name__}"
    )


def _read_graph(path: str) -> onnx.ModelProto:
    """The graph of the .onnx file ``path`` (without external data), with errors that name the file."""
    if not os.path.isfile(path):
        raise ArgumentPathError("model", f"expected an .onnx file, found nothing at {path!r}")
    if os.path.getsize(path) == 0:
        raise ArgumentError("model", f"{path!r} is empty (0 bytes), expected an ONNX model")
    try:
        graph = onnx.load(path, load_external_data=False)
    except Exception as error:  # protobuf's DecodeError and friends
        raise ArgumentError(
            "model", f"{path!r} is not a readable ONNX model: {type(error).__name__}: {error}"
        ) from error
    if not graph.HasField("graph"):
        raise ArgumentError("model", f"{path!r} is not a readable ONNX model: it holds no graph")
    return graph


def session_source(session: Any) -> Union[str, bytes, None]:
    """The path or the bytes a live ``onnxruntime.InferenceSession`` was made from (``None`` where it tells
    neither). ONNX Runtime keeps them only in private attributes, with no public accessor: this is the one place
    the package reads them."""
    return getattr(session, "_model_path", None) or getattr(session, "_model_bytes", None)


def inferencer_from_session(session: Any, source: Union[str, bytes, None] = None) -> ShapeInferencer:
    """Builds the inferencer of a live session: dims as ORT reports them, the model from its path or bytes
    (``source``; by default what the session was made from, :func:`session_source`)."""
    if source is None:
        source = session_source(session)
    return ShapeInferencer(
        {i.name: i.shape for i in session.get_inputs()},
        {o.name: o.shape for o in session.get_outputs()},
        source,
    )


def inferencer_from_model_proto(model: onnx.ModelProto, source: Any) -> ShapeInferencer:
    """Builds an inferencer from the graph's declared inputs and outputs; ``source`` is loaded for shape inference."""
    initializers = {t.name for t in model.graph.initializer}

    def dims_of(value_info: onnx.ValueInfoProto) -> Optional[list]:
        tensor_type = value_info.type.tensor_type
        if not tensor_type.HasField("shape"):
            return None
        return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim]

    return ShapeInferencer(
        {vi.name: dims_of(vi) for vi in model.graph.input if vi.name not in initializers},
        {vi.name: dims_of(vi) for vi in model.graph.output},
        source,
    )

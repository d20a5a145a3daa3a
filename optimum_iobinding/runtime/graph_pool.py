"""The graph pool: input signature → what runs it on CUDA (a captured CUDA graph, or a fixed-shape session without
one), all in sessions of one recipe, so that a signature never costs another copy of the weights."""

from __future__ import annotations

import logging
import threading
import warnings
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import onnxruntime as ort
import torch

from .cuda_policy import (
    DEVICE_SETUP,
    DISABLE_SYNC_RUN_OPTION,
    GRAPH_ID_RUN_OPTION,
    PLACEMENT_REFUSAL,
    free_dimension_overrides,
    tensorrt_profile_options,
)
from .dtypes import TORCH_TO_ONNX
from .graph_refusals import refusals_path, remember_refusal, remembered_refusal
from .options import CudaGraphSetting
from .shared_arena import SHARED_ARENAS

if TYPE_CHECKING:  # pragma: no cover
    from .session import SessionRecipe

logger = logging.getLogger(__name__)

# a runner's first runs in a thread: ORT makes one regular run before it captures (allocations), then captures and
# replays. ORT's CUDA EP keeps its graphs per thread (its PerThreadContext): a session run from a new thread makes a
# regular run and captures again there, so every thread's first runs are gated, not only the runner's first. A recipe
# with a session thread makes all its runs there, so its runners count their runs, not each caller thread's. The first
# runs without a graph where it can (a first run, :meth:`SetupGate.first_run`); the next two may capture, alone.
_CAPTURE_RUNS = 3
# the run option value that makes ORT's CUDA EP run without capturing or replaying a graph
_NO_GRAPH_ID = "-1"


class CudaGraphRunner:
    """One session whose free dims are fixed to one input signature, run from fixed buffers so that ORT captures
    it as a CUDA graph on its first run and replays it afterwards.

    New inputs are copied into ``input_buffers`` (on the caller's stream, so in order with the replay); results
    are left in ``output_buffers`` — the same tensors every call. ORT captures once per thread that runs the
    session (the same buffers, so the same results; a recipe with a session thread runs every call there, so once).
    The first run in ORT's thread (each calling thread's, or with ``one_thread`` the runner's) is made without a graph
    where the runner has ``warm_options`` (ORT counts regular runs per thread, not per graph: a later signature's
    first run under its graph's id captures at once): a first run, beside set-ups and other first runs; the next two
    runs may capture, and wait until nothing else runs (:data:`~.cuda_policy.DEVICE_SETUP`).

    With ``warm_options`` (run options that make ORT run without a graph: the CUDA EP), :meth:`warm` makes the first
    run's host work — cuDNN builds a plan for each convolution and attention shape, the arena grows — ahead of the
    first call, from any thread (a pipeline's denoiser while its text encoder runs, its VAE decoder during the denoising
    loop), so that the call's own first runs find it done.

    ``run_session(session, binding, run_options)`` makes each ORT run (the recipe's :meth:`SessionRecipe.run
    <optimum_iobinding.runtime.session.SessionRecipe.run>`: on its session thread); ``None``: here. ``one_thread``:
    every ORT run of the session is made on one thread (a session thread), so a new caller thread's runs replay the
    graph captured already, and a :meth:`warm` run is the first call's first run. ``input_buffers``: tensors of the
    caller's (by input name, each of its input's spec) that the graph reads instead of buffers of its own.
    """

    def __init__(
        self,
        session: ort.InferenceSession,
        input_specs: Mapping[str, Tuple[Tuple[int, ...], torch.dtype]],
        output_specs: Mapping[str, Tuple[Tuple[int, ...], torch.dtype]],
        device: torch.device,
        run_options: ort.RunOptions,
        warm_options: Optional[ort.RunOptions] = None,
        run_session: Optional[Callable[[ort.InferenceSession, Any, Any], None]] = None,
        one_thread: bool = False,
        input_buffers: Optional[Mapping[str, torch.Tensor]] = None,
    ):
        self.session = session
        self.one_thread = one_thread
        self.device = device
        self.run_options = run_options
        self.warm_options = warm_options
        self._run_session = run_session or _run_here
        # normal tensors even when the first call runs under torch.inference_mode: inputs are copied into them on
        # every later call, and an inference tensor refuses in-place writes outside inference mode
        with torch.inference_mode(False):
            given = input_buffers or {}
            self.input_buffers = {
                n: given[n] if n in given else torch.zeros(s, dtype=d, device=device)
                for n, (s, d) in input_specs.items()
            }
            self.output_buffers = {n: torch.empty(s, dtype=d, device=device) for n, (s, d) in output_specs.items()}
        self.binding = session.io_binding()
        for buffers, bind in (
            (self.input_buffers, self.binding.bind_input),
            (self.output_buffers, self.binding.bind_output),
        ):
            for name, tensor in buffers.items():
                bind(
                    name, "cuda", device.index or 0, TORCH_TO_ONNX[tensor.dtype], list(tensor.shape), tensor.data_ptr()
                )
        self.runs = 0  # calls, in every thread
        self._thread = threading.local()  # .runs: this thread's
        self._ort_runs = 0  # ORT's runs of the graph's session, a warm one included (one_thread: all on one thread)

    def run(self, inputs: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        for name, tensor in inputs.items():
            buffer = self.input_buffers[name]
            if tensor.data_ptr() != buffer.data_ptr():
                buffer.copy_(tensor, non_blocking=True)
        # ORT counts its runs per thread: with every run on one session thread the runner's count is ORT's
        runs = self._ort_runs if self.one_thread else getattr(self._thread, "runs", 0)
        if runs == 0 and self.warm_options is not None:
            # a thread's first run without a graph: ORT counts regular runs per thread, not per graph, so a run under
            # the graph's id may capture at once (a later signature's first); one that captures must be alone
            with DEVICE_SETUP.first_run():
                self._run_session(self.session, self.binding, self.warm_options)
        else:
            if runs < _CAPTURE_RUNS:  # may capture: alone, and no session joins the shared arena after it
                with DEVICE_SETUP.capture():
                    SHARED_ARENAS.close(self.device.index or 0)
                    self._run_session(self.session, self.binding, self.run_options)
            else:
                self._run_session(self.session, self.binding, self.run_options)
        self._thread.runs = getattr(self._thread, "runs", 0) + 1
        self._ort_runs += 1
        self.runs += 1
        return self.output_buffers

    @property
    def first_run_made(self) -> bool:
        """Whether ORT has run the graph's session for this runner (a :meth:`warm` run or a call's)."""
        return self._ort_runs > 0

    def warm(self) -> None:
        """Runs the graph's session once from its buffers without capturing (nothing where the runner has no
        ``warm_options``): what ORT's regular run before a capture builds is then ready for it, and with
        ``one_thread`` it is the first run of the runner's first call. The run is a first run
        (:meth:`~.cuda_policy.SetupGate.first_run`): beside set-ups and other first runs, never beside a session being
        made or a capture."""
        if self.warm_options is not None:
            with DEVICE_SETUP.first_run():
                self._run_session(self.session, self.binding, self.warm_options)
            self._ort_runs += 1


def _run_here(session: ort.InferenceSession, binding: Any, run_options: Any) -> None:
    session.run_with_iobinding(binding, run_options)


Signature = Tuple[Tuple[str, Tuple[int, ...]], ...]


def signature_of(input_shapes: Mapping[str, Sequence[int]]) -> Signature:
    """A hashable key for one set of input shapes."""
    return tuple(sorted((name, tuple(int(d) for d in shape)) for name, shape in input_shapes.items()))


class FixedShapeSession:
    """A session whose free dims are fixed to one input signature, run without a graph (bound per call).

    Its convolutions keep the algorithms chosen for that one shape: ORT's CUDA EP searches again whenever a session's
    input shape changes, even back to one it ran before."""

    def __init__(self, session: ort.InferenceSession):
        self.session = session
        self.binding = session.io_binding()


class GraphPool:
    """Input signature → what runs it on CUDA: a :class:`CudaGraphRunner` (captured on its first run, replayed
    after), or a :class:`FixedShapeSession` where capture is off or failed.

    Where it can, the pool keeps **one** session for every signature: a session with dynamic dims and graph capture
    on, each signature captured as its own graph selected by the run option ``gpu_graph_id`` (the way ONNX Runtime's
    own stable_diffusion demo binds several shapes). Its graphs share the session's one arena, so a new signature
    costs the activations the arena does not already hold, and the device holds the largest signature's activations
    rather than their sum, as a session per signature would. ORT refuses such a session when a node must run on the
    CPU between CUDA nodes (an ArgMax over integer ids, which some exporters write); that model's signatures then get
    a session each, with the free dims fixed so that ORT folds the shape arithmetic. Either way every session comes
    from the model's :class:`~optimum_iobinding.runtime.session.SessionRecipe`: a signature never costs another copy
    of the weights.
    Where the recipe owns its weights on need (the default), the one session loads them itself from the file (ONNX
    Runtime's own loading puts it up sooner); before the pool makes any other session, the weights become owned
    tensors, the one session (and the graphs captured in it) is dropped and made again around them, once, so that
    all sessions read one copy.

    Args:
        recipe: makes the sessions.
        cuda_graph: ``"auto"`` captures where it can and runs without a graph where it cannot, with one INFO log line
            per signature saying why; ``True`` the same with a warning; ``False`` never captures.
        max_signatures: how many signatures keep their entry (least recently used dropped first); ``None``: all
            (bounded by memory).
        output_dtypes: the model's outputs in session order.
        run_options: the model's run options (no host synchronization).
        name: how log lines name the model.
        one_session: try the one session with a graph per signature first (CUDA EP); ``False``: a session per
            signature (TensorRT always: an engine profile per signature).
    """

    def __init__(
        self,
        recipe: "SessionRecipe",
        cuda_graph: CudaGraphSetting,
        max_signatures: Optional[int],
        output_dtypes: Mapping[str, torch.dtype],
        run_options: ort.RunOptions,
        name: str = "model",
        one_session: bool = True,
    ):
        self.recipe = recipe
        self.cuda_graph = cuda_graph
        self.max_signatures = max_signatures
        self.output_dtypes = dict(output_dtypes)
        self.run_options = run_options
        self.name = name
        self.entries: "OrderedDict[Signature, Union[CudaGraphRunner, FixedShapeSession, None]]" = OrderedDict()
        self.fallbacks: Dict[Signature, str] = {}
        self._overrides: Dict[Signature, Dict[str, int]] = {}  # the free dims fixed for each signature
        self.lock = threading.RLock()
        self.one_session = one_session and recipe.providers[0] == "CUDAExecutionProvider"
        self._shared: Optional[ort.InferenceSession] = None  # the one session whose graphs every signature shares
        self.shared_updates = {"enable_cuda_graph": "1"}  # the first provider's options for it
        self.shared_refused: Optional[str] = None  # why ORT refused it (then: a session per signature)
        self._next_graph_id = 1  # never reused: a dropped signature's graph keeps the addresses it captured
        # why ORT refused graph capture for a fixed-shape session (a node it keeps on the CPU): later signatures go
        # straight to a session without a graph instead of paying for another refused session
        self.placement_refused: Optional[str] = None

    def entry(
        self,
        declared: Mapping[str, Optional[Sequence[Any]]],
        input_specs: Mapping[str, Tuple[Tuple[int, ...], torch.dtype]],
        output_shapes: Mapping[str, Optional[Tuple[int, ...]]],
        input_buffers: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> Union[CudaGraphRunner, FixedShapeSession, None]:
        """The entry of this signature, made on first use; ``None`` means "the model's dynamic session".
        ``input_buffers``: where the entry is made now as a graph, the tensors it reads those inputs from."""
        signature = signature_of({name: shape for name, (shape, _) in input_specs.items()})
        with self.lock:
            if signature in self.entries:
                self.entries.move_to_end(signature)
                return self.entries[signature]
            entry = self._make(signature, declared, input_specs, output_shapes, input_buffers)
            self.entries[signature] = entry
            while self.max_signatures is not None and len(self.entries) > self.max_signatures:
                evicted, _ = self.entries.popitem(last=False)
                self._overrides.pop(evicted, None)
            return entry

    def drop(self, signature: Signature, reason: str) -> Union[FixedShapeSession, None]:
        """A captured graph failed on its first run: the signature runs without a graph from now on."""
        with self.lock:
            self._report(signature, reason)
            entry = self._fixed_session(signature, self._overrides.get(signature, {}))
            self.entries[signature] = entry
            return entry

    @property
    def captured(self) -> List[Signature]:
        with self.lock:
            return [signature for signature, entry in self.entries.items() if isinstance(entry, CudaGraphRunner)]

    def own_weights(self, why: str) -> None:
        """Every session from now on reads the recipe's owned weights. The one graph session, if it loaded its
        weights itself, is dropped with the graphs captured in it (each signature captures again on its next call),
        so that the device never holds two copies of the weights."""
        with self.lock:
            if self.recipe.weights.owned:
                return
            shared, self._shared = self._shared, None
            if shared is not None:
                dropped = [
                    signature
                    for signature, entry in self.entries.items()
                    if isinstance(entry, CudaGraphRunner) and entry.session is shared
                ]
                for signature in dropped:
                    del self.entries[signature]
                    self._overrides.pop(signature, None)
                logger.info(
                    "%s: %s, so its weights become tensors the project owns, read by every session: the one "
                    "graph session (which loaded them from the file) is made again around them, and its %d "
                    "graph(s) captured again on their next call",
                    self.name,
                    why,
                    len(dropped),
                )
                del shared, dropped
            self.recipe.weights.start_owning()

    def before_another_session(self, why: str) -> None:
        """Called before a session of the recipe other than the one graph session is made (by the pool, or by the
        model for its dynamic session): where the weights are owned on need, they become owned now."""
        if self.recipe.weights.on_need and not self.recipe.weights.owned:
            self.own_weights(why)

    def _make(self, signature, declared, input_specs, output_shapes, input_buffers=None):
        input_shapes = {name: shape for name, (shape, _) in input_specs.items()}
        overrides, problems = free_dimension_overrides(declared, input_shapes)
        self._overrides[signature] = overrides
        if self.cuda_graph:
            dynamic = [name for name, shape in output_shapes.items() if shape is None]
            try:
                if dynamic:
                    raise RuntimeError(f"output {dynamic[0]!r} has a data-dependent shape, which a graph cannot replay")
                return self._graph_runner(overrides, problems, input_specs, output_shapes, input_buffers)
            except Exception as error:  # capture refused (nodes left on the CPU, unsupported op): run without
                self._report(signature, str(error))
        return self._fixed_session(signature, overrides)

    @property
    def shared_tried(self) -> bool:
        """Whether the one graph session was made or refused already."""
        return self._shared is not None or self.shared_refused is not None

    def shared_session(self) -> Optional[ort.InferenceSession]:
        """The one session with graph capture on whose graphs every signature shares (made on first use), or
        ``None`` where ORT refused it (:attr:`shared_refused` says why) or the pool does not use one."""
        with self.lock:
            if self.one_session and self._shared is None and self.shared_refused is None:
                # remembered per file, provider and its options; not where the user's sess_options may place nodes
                # otherwise
                remember = isinstance(self.recipe.source, str) and self.recipe.sess_options is None
                source = self.recipe.source if remember else None
                provider, options = self.recipe.providers[0], self.recipe.provider_options[0]
                remembered = remembered_refusal(source, provider, options) if source is not None else None
                if remembered is not None:  # ORT refused this very file at an earlier load: not asked again
                    self.shared_refused = remembered
                    logger.info(
                        "%s: one session cannot capture a graph for every input shape (ORT refused it at an "
                        "earlier load of this file, remembered in %s), so each shape gets a session of its own "
                        "(all reading the same weights). Why: %s",
                        self.name,
                        refusals_path(),
                        remembered,
                    )
                    return None
                try:
                    self._shared = self.recipe.create(provider_updates=self.shared_updates, quiet=True)
                    self.recipe.weights.release_parse()  # the session loaded the weights itself (unless they are owned)
                except Exception as error:  # a node left on the CPU: ORT refuses capture for the whole session
                    self.shared_refused = str(error)
                    if source is not None and PLACEMENT_REFUSAL in str(error):
                        remember_refusal(source, provider, str(error), options)
                    logger.info(
                        "%s: one session cannot capture a graph for every input shape, so each shape gets a "
                        "session of its own (all reading the same weights). Why: %s",
                        self.name,
                        error,
                    )
            return self._shared

    def _graph_run_options(self, graph_id: Union[int, str]) -> ort.RunOptions:
        options = ort.RunOptions()
        try:
            options.add_run_config_entry(
                DISABLE_SYNC_RUN_OPTION, self.run_options.get_run_config_entry(DISABLE_SYNC_RUN_OPTION)
            )
        except RuntimeError:  # the model's runs synchronize (no shared stream)
            pass
        options.add_run_config_entry(GRAPH_ID_RUN_OPTION, str(graph_id))
        return options

    def _warm_options(self) -> Optional[ort.RunOptions]:
        """Run options for a run without a graph before a capture (CUDA EP; TensorRT's engines capture their own)."""
        if self.recipe.providers[0] != "CUDAExecutionProvider":
            return None
        return self._graph_run_options(_NO_GRAPH_ID)

    def _graph_runner(self, overrides, problems, input_specs, output_shapes, input_buffers=None) -> CudaGraphRunner:
        output_specs = {name: (tuple(output_shapes[name]), dtype) for name, dtype in self.output_dtypes.items()}
        shared = self.shared_session()
        if shared is not None:
            graph_id, self._next_graph_id = self._next_graph_id, self._next_graph_id + 1
            return CudaGraphRunner(
                shared,
                dict(input_specs),
                output_specs,
                self.recipe.device,
                self._graph_run_options(graph_id),
                self._warm_options(),
                self.recipe.run,
                self.recipe.thread is not None,
                input_buffers,
            )
        if self.recipe.providers[0] == "TensorrtExecutionProvider":
            updates = dict(
                trt_cuda_graph_enable="1",
                **tensorrt_profile_options({name: shape for name, (shape, _) in input_specs.items()}),
            )
        else:
            updates = {"enable_cuda_graph": "1"}
        if self.placement_refused is not None:
            # a node stayed on the CPU with one signature's dims fixed: it stays there with any other's
            raise RuntimeError(self.placement_refused)
        self.before_another_session("it needs a session per input signature")
        try:
            session = self.recipe.create(overrides, updates, quiet=True)
        except ValueError as error:
            reason = f"{error}{'; ' + '; '.join(problems) if problems else ''}"
            if PLACEMENT_REFUSAL in str(error):
                self.placement_refused = reason
            raise RuntimeError(reason) from error
        return CudaGraphRunner(
            session,
            dict(input_specs),
            output_specs,
            self.recipe.device,
            self.run_options,
            self._warm_options(),
            self.recipe.run,
            self.recipe.thread is not None,
            input_buffers,
        )

    def _fixed_session(self, signature: Signature, overrides: Mapping[str, int]) -> Optional[FixedShapeSession]:
        try:
            self.before_another_session(f"input shapes {dict(signature)} need a session without a graph")
            return FixedShapeSession(self.recipe.create(overrides))
        except Exception as error:  # the dynamic session can still run it
            logger.info(
                "%s: input shapes %s run in the model's dynamic session; a fixed-shape one failed: %s",
                self.name,
                dict(signature),
                error,
            )
            return None

    def _report(self, signature: Signature, reason: str) -> None:
        self.fallbacks[signature] = reason
        message = f"{self.name}: no CUDA graph for input shapes {dict(signature)}; running without one. Why: {reason}"
        if self.cuda_graph == "auto":
            logger.info(message)
        else:
            warnings.warn(message, RuntimeWarning, stacklevel=6)

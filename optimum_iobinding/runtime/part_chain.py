"""A model run as its consecutive parts: the cold-start parts an export writes beside a UNet
(:data:`~optimum_iobinding.layout.COLD_START_PART`), each a graph of the UNet's nodes reading its weights.

ONNX Runtime's CUDA provider makes a session, and sets cuDNN up in its first run, one node after another in one
thread: the UNet's is the cold start's longest step. Its parts are sessions of their own, made side by side in
background threads, and their first runs go side by side too (the device gate lets first runs go together), each
part's input shapes known before any runs from the declared dims of the parts before it. A call runs the parts in
turn on the model's stream, each from the given inputs it reads and the outputs of the parts before; each part has
its own graph pool (a CUDA graph per signature), its own output buffers, and its weights: where the whole model's
weights are owned (runtime LoRA) the parts read those tensors (:meth:`IOBindingORTModel.part`), else each loads its
own from the file.

The first part takes the timestep of every row (the export declares it so): a call giving one row for all has it
expanded.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from ..errors import ModelFileError

logger = logging.getLogger(__name__)

Shape = Tuple[int, ...]

TIMESTEP = "timestep"


class PartChain:
    """The parts of one model, in order, run in turn. ``make(path, shared)`` makes a part's model: reading the whole
    model's owned weights where ``shared``, loading its own from the file otherwise."""

    def __init__(self, paths: Sequence[str], make: Callable[[str, bool], Any], shared: bool):
        self.paths = list(paths)
        self._make = make
        self._lock = threading.RLock()
        self._linked_lock = threading.Lock()  # not the run's: a prepare thread links while a call may run
        self._linked: Set[Tuple] = set()  # the signatures whose parts' graphs were made reading each other's buffers
        self.shared = shared
        self.models: List[Any] = [make(path, shared) for path in self.paths]
        # the first part takes the timestep of every row where it declares the timestep of the sample's batch
        first = self.models[0].input_dims
        timestep, sample = first.get(TIMESTEP) or [], first.get("sample") or []
        self._expands = (
            len(timestep) == 1 and isinstance(timestep[0], str) and bool(sample) and timestep[0] == sample[0]
        )

    def share_weights(self) -> None:
        """Makes the parts again reading the whole model's owned weights (they were loading their own): what a change
        of those tensors in place (a LoRA) must reach. Their sessions and graphs are made again on their next call."""
        with self._lock:  # reentrant: making a part that reads owned weights asks for them again
            if not self.shared:
                self.shared = True
                try:
                    self.models = [self._make(path, True) for path in self.paths]
                except BaseException:  # the parts as they were, and asked again next time
                    self.shared = False
                    raise
                with self._linked_lock:  # new parts: their graphs are linked again as they are made
                    self._linked.clear()

    def _timestep_rows(self, shapes: Mapping[str, Sequence[int]]) -> Optional[int]:
        """The rows the first part's timestep must have where the given one has fewer (one for all), else ``None``."""
        if not self._expands or TIMESTEP not in shapes or "sample" not in shapes:
            return None
        given, rows = tuple(shapes[TIMESTEP]), int(shapes["sample"][0])
        return rows if len(given) == 1 and given[0] == 1 and rows != 1 else None

    def input_shapes(self, shapes: Mapping[str, Sequence[int]]) -> List[Dict[str, Shape]]:
        """Each part's input shapes for a call with these (the whole model's input shapes), from the parts' declared
        output dims."""
        known: Dict[str, Shape] = {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
        rows = self._timestep_rows(known)
        if rows is not None:
            known[TIMESTEP] = (rows,)
        result = []
        for number, model in enumerate(self.models):
            unknown = [name for name in model.input_names if name not in known]
            if unknown:  # parts that do not belong together, or written without their inputs' dims
                raise ModelFileError(
                    str(self.paths[number]),
                    f"takes {unknown[:3]}, whose dims neither the call's inputs nor the parts before it give (parts "
                    "of another export, or a value whose shape depends on the data): export the UNet's cold-start "
                    "parts again",
                )
            inputs = {name: known[name] for name in model.input_names}
            result.append(inputs)
            for name, shape in model.shape_inferencer(inputs).items():
                if shape is not None:
                    known[name] = tuple(shape)
        return result

    def run(self, inputs: Mapping[str, Any]) -> List[torch.Tensor]:
        """The last part's outputs for these inputs (the whole model's), the parts run in turn."""
        values: Dict[str, Any] = dict(inputs)
        timestep = values.get(TIMESTEP)
        if timestep is not None and "sample" in values:
            timestep = timestep if isinstance(timestep, torch.Tensor) else torch.as_tensor(np.asarray(timestep))
            rows = self._timestep_rows({TIMESTEP: tuple(timestep.shape), "sample": tuple(np.shape(values["sample"]))})
            if rows is not None:
                values[TIMESTEP] = timestep.expand(rows).contiguous()
        # one call at a time: a part's captured graph writes the same output buffers for every caller, which the next
        # part reads
        with self._lock:
            shapes = {name: tuple(np.shape(value)) for name, value in inputs.items()}
            if not self._is_linked(shapes):  # a signature no prepare_signature linked: its graphs made linked here
                self._link_all(shapes)
            outputs: List[torch.Tensor] = []
            for model in self.models:
                outputs = model(**{name: values[name] for name in model.input_names})
                values.update(zip(model.output_names, outputs))
            return outputs

    @staticmethod
    def _signature(shapes: Mapping[str, Sequence[int]]) -> Tuple:
        return tuple(sorted((name, tuple(int(d) for d in shape)) for name, shape in shapes.items()))

    def _is_linked(self, shapes: Mapping[str, Sequence[int]]) -> bool:
        with self._linked_lock:
            return self._signature(shapes) in self._linked

    def _link_all(
        self, shapes: Mapping[str, Sequence[int]], then: Optional[Callable[[Any, Dict], None]] = None
    ) -> None:
        """Links each part's graph of a call with these shapes (:meth:`_link`), in order, calling ``then(part, its
        input shapes)`` after each; the signature then counts as linked (tried once: what failed runs on copies). A
        prepare thread and a call may link the same signature at once: a graph made by one is found by the other."""
        try:
            written: Dict[str, torch.Tensor] = {}
            for model, part_shapes in zip(self.models, self.input_shapes(shapes)):
                self._link(model, part_shapes, written)
                if then is not None:
                    then(model, part_shapes)
        except Exception as error:  # the parts run as before, each graph copying its inputs into its own buffers
            logger.debug("cold-start parts: linking the graphs of %s failed: %s", dict(shapes), error)
            if then is not None:
                raise
        finally:
            with self._linked_lock:
                self._linked.add(self._signature(shapes))

    @staticmethod
    def _link(model: Any, shapes: Mapping[str, Shape], written: Dict[str, torch.Tensor]) -> None:
        """Makes ``model``'s graph of these input shapes (where it has none yet) read the buffers in ``written``,
        which the graphs of the parts before it write, for the inputs it takes from them; then adds the buffers its
        own graph writes to ``written``. A value that crosses a cut is then held once and copied by no call. Where
        the part makes no graph, or a buffer does not fit, the graph keeps buffers of its own (and a call copies)."""
        taken = {name: written[name] for name in model.input_names if name in written}
        try:
            model.adopt_graph_inputs(shapes, taken)
        except ValueError as error:  # shapes or dtypes the parts' files declare differently: copied, as before
            logger.debug("cold-start parts: %s reads buffers of its own: %s", model.model_path, error)
            model.adopt_graph_inputs(shapes, {})
        runner = model.graph_runner(shapes)
        if runner is not None:
            written.update(runner.output_buffers)

    def prepare(self, wait: bool) -> List[threading.Thread]:
        """Each part's shape-free session (:meth:`IOBindingORTModel.prepare`), side by side where not ``wait``."""
        threads = [model.prepare(wait=wait) for model in self.models]
        return [thread for thread in threads if thread is not None]

    def prepare_signature(self, shapes: Mapping[str, Sequence[int]]) -> threading.Thread:
        """Each part's graph of these input shapes (the whole model's), linked (:meth:`_link`), and its first run
        (:meth:`IOBindingORTModel.prepare_signature`), from a thread that works out their shapes (the caller goes on
        at once) and ends when they are made. The first signature's first runs (the cold start's: no part has an
        entry yet) each in a thread of its own at once; a later signature's one part after another: first runs side
        by side hold the sum of the parts' activations at once in the arena they share, which keeps what it grew to,
        and a later batch size's is larger."""
        started: List[threading.Thread] = []
        side_by_side: List[bool] = []

        def first_run(model: Any, inputs: Dict) -> None:
            thread = model.prepare_signature(inputs)
            if thread is not None and not side_by_side[0]:
                thread.join()
            elif thread is not None:
                started.append(thread)

        def prepare() -> None:
            self.prepare(wait=False)  # the parts' sessions side by side, where the load did not start them
            # asked here, not in the caller's thread: a part's pool is locked while its session is being made
            side_by_side.append(not any(model.signatures for model in self.models))
            try:
                self._link_all(shapes, then=first_run)
            except Exception as error:  # the first call with these shapes makes them, and reports what fails
                logger.debug("cold-start parts: preparing %s failed: %s", dict(shapes), error)
                return
            finally:
                for thread in started:
                    thread.join()

        # not a daemon: the interpreter waits for runs being made rather than tearing ORT down under them
        thread = threading.Thread(target=prepare, name="prepare signature (cold-start parts)")
        thread.start()
        return thread

    def first_part_buffers(self, shapes: Mapping[str, Sequence[int]]) -> Optional[Dict[str, torch.Tensor]]:
        """The first part's graph input buffers for a call with these shapes (the inputs it reads), or ``None``."""
        return self.models[0].graph_input_buffers(self.input_shapes(shapes)[0])

    def adopt_first_part_inputs(self, shapes: Mapping[str, Sequence[int]], buffers: Mapping[str, torch.Tensor]) -> bool:
        """The first part's graph made reading ``buffers`` (those of the inputs it reads) in place."""
        first = self.models[0]
        return first.adopt_graph_inputs(
            self.input_shapes(shapes)[0],
            {name: tensor for name, tensor in buffers.items() if name in first.input_names},
        )

    @property
    def graph_fallbacks(self) -> Dict[Tuple, str]:
        """Each part's signatures that run without a CUDA graph, and why (the part's number in front)."""
        return {
            (number, *signature): why
            for number, model in enumerate(self.models)
            for signature, why in model.graph_fallbacks.items()
        }

    @property
    def sessions_created(self) -> int:
        return sum(model.sessions_created for model in self.models)

    @property
    def session_creation_log(self) -> List[Tuple[str, float]]:
        return [entry for model in self.models for entry in model.session_creation_log]

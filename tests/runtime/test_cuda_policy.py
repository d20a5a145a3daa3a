"""The CUDA policy's pure parts, checked on any machine: provider defaults, free-dimension overrides, TensorRT
profiles, and the refusals of cuda_graph where it cannot work."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

from optimum_iobinding import IOBindingORTModel
from optimum_iobinding.runtime.cuda_policy import (
    CUDA_DIFFUSION_DEFAULTS,
    free_dimension_overrides,
    tensorrt_profile_options,
    with_diffusion_defaults,
)


def test_diffusion_defaults_fill_in_under_the_users_options():
    (cuda, cpu) = with_diffusion_defaults(
        ["CUDAExecutionProvider", "CPUExecutionProvider"],
        [{"cudnn_conv_algo_search": "HEURISTIC", "device_id": "1"}, {}],
    )
    assert cuda["cudnn_conv_algo_search"] == "HEURISTIC" and cuda["device_id"] == "1"
    assert cuda["arena_extend_strategy"] == CUDA_DIFFUSION_DEFAULTS["arena_extend_strategy"]
    assert cpu == {}


def test_tensorrt_gets_an_engine_cache_and_fp16_by_default():
    (trt,) = with_diffusion_defaults(["TensorrtExecutionProvider"], [{}])
    assert trt["trt_fp16_enable"] == "1" and trt["trt_engine_cache_enable"] == "1" and trt["trt_engine_cache_path"]


def test_free_dimension_overrides_fix_every_named_dim_of_a_signature():
    declared = {
        "sample": ["batch", 4, "height", "width"],
        "timestep": ["timestep_batch"],
        "encoder_hidden_states": ["batch", "sequence", 768],
    }
    overrides, problems = free_dimension_overrides(
        declared, {"sample": (2, 4, 64, 64), "timestep": (2,), "encoder_hidden_states": (2, 77, 768)}
    )
    assert overrides == {"batch": 2, "height": 64, "width": 64, "timestep_batch": 2, "sequence": 77}
    assert problems == []


def test_free_dimension_overrides_report_what_cannot_be_fixed():
    declared = {"sample": ["batch", None], "timestep": ["batch"]}
    overrides, problems = free_dimension_overrides(declared, {"sample": (2, 3), "timestep": (1,)})
    assert overrides == {}
    assert "input 'sample' dim 1 is unnamed" in problems
    assert "inputs give dim 'batch' different sizes" in problems


def test_tensorrt_profile_is_the_first_shapes_as_min_opt_and_max():
    options = tensorrt_profile_options({"sample": (2, 4, 64, 64), "timestep": (2,)})
    assert options["trt_profile_min_shapes"] == "sample:2x4x64x64,timestep:2"
    assert options["trt_profile_opt_shapes"] == options["trt_profile_max_shapes"] == options["trt_profile_min_shapes"]


def test_cuda_graph_on_a_cpu_session_is_refused_with_the_reason(make_model, make_session, tensor):
    model = make_model(
        [helper.make_node("Identity", ["x"], ["y"])],
        [tensor("x", TensorProto.FLOAT, [1])],
        [tensor("y", TensorProto.FLOAT, [1])],
    )
    with pytest.raises(ValueError, match=r"cuda_graph: needs a CUDA session with io_binding=True, got device cpu"):
        IOBindingORTModel(make_session(model), cuda_graph=True)


def test_a_stream_with_a_ready_made_session_is_refused(make_model, make_session, tensor):
    model = make_model(
        [helper.make_node("Identity", ["x"], ["y"])],
        [tensor("x", TensorProto.FLOAT, [1])],
        [tensor("y", TensorProto.FLOAT, [1])],
    )
    with pytest.raises(ValueError, match=r"stream: a stream is set when a session is created"):
        IOBindingORTModel(make_session(model), stream=object())


def test_the_first_graph_runs_in_every_thread_wait_for_the_device_set_ups_of_other_threads(monkeypatch):
    # ORT's CUDA EP keeps its graphs per thread: a session run from another thread makes a regular run and captures
    # again there, so that thread's first runs are gated as the runner's very first were; without a run that makes no
    # graph (TensorRT's engines), each of the first three may capture: alone
    import contextlib
    import threading

    import torch

    from optimum_iobinding.runtime import graph_pool
    from optimum_iobinding.runtime.cuda_policy import SetupGate

    class RecordingGate(SetupGate):
        inside = None

        def recording(self, kind, entered):
            @contextlib.contextmanager
            def gate():
                with entered():
                    self.inside = kind
                    try:
                        yield
                    finally:
                        self.inside = None

            return gate()

        def capture(self):
            return self.recording("capture", super().capture)

        def first_run(self):
            return self.recording("first run", super().first_run)

    gate = RecordingGate()
    monkeypatch.setattr(graph_pool, "DEVICE_SETUP", gate)
    seen = []

    class Binding:
        def bind_input(self, *args):
            pass

        bind_output = bind_input

    class Session:
        def io_binding(self):
            return Binding()

        def run_with_iobinding(self, binding, run_options):
            seen.append((threading.current_thread().name, gate.inside))

    runner = graph_pool.CudaGraphRunner(
        Session(), {"x": ((2,), torch.float32)}, {"y": ((2,), torch.float32)}, torch.device("cpu"), None
    )
    x = torch.ones(2)
    for _ in range(4):
        runner.run({"x": x})
    other = threading.Thread(target=lambda: [runner.run({"x": x}) for _ in range(4)], name="other")
    other.start()
    other.join(60)
    runner.run({"x": x})
    main = threading.current_thread().name
    first = [("capture",), ("capture",), ("capture",), (None,)]  # no run without a graph to make first: all gated
    assert seen == [(main, *k) for k in first] + [("other", *k) for k in first] + [(main, None)]
    assert runner.runs == 9


def test_a_graph_runner_given_input_buffers_binds_and_reads_them_and_copies_other_inputs_into_them():
    import torch

    from optimum_iobinding.runtime import graph_pool

    bound = {}

    class Binding:
        def bind_input(self, name, device, index, element_type, shape, pointer):
            bound[name] = pointer

        bind_output = bind_input

    class Session:
        def io_binding(self):
            return Binding()

        def run_with_iobinding(self, binding, run_options):
            pass

    given = torch.zeros(3)
    specs = {"past": ((3,), torch.float32), "x": ((2,), torch.float32)}
    runner = graph_pool.CudaGraphRunner(
        Session(), specs, {"y": ((2,), torch.float32)}, torch.device("cpu"), None, input_buffers={"past": given}
    )
    assert runner.input_buffers["past"] is given and bound["past"] == given.data_ptr()
    assert runner.input_buffers["x"] is not given and bound["x"] == runner.input_buffers["x"].data_ptr()
    given.fill_(5.0)
    runner.run({"past": given, "x": torch.ones(2)})  # the buffer itself: nothing copied over it
    assert given.tolist() == [5.0, 5.0, 5.0]
    runner.run({"past": torch.arange(3.0), "x": torch.ones(2)})  # another tensor: copied into the given one
    assert given.tolist() == [0.0, 1.0, 2.0] and bound["past"] == given.data_ptr()


@pytest.fixture
def add_model(tmp_path, make_model, tensor):
    """``y = past + x`` of any length, saved as an .onnx file: its path."""
    import onnx

    path = tmp_path / "add.onnx"
    onnx.save(
        make_model(
            [helper.make_node("Add", ["past", "x"], ["y"])],
            [tensor(name, TensorProto.FLOAT, ["n"]) for name in ("past", "x")],
            [tensor("y", TensorProto.FLOAT, ["n"])],
        ),
        path,
    )
    return str(path)


def test_adopting_graph_inputs_names_a_wrong_buffer_and_off_cuda_makes_no_graph(add_model):
    import torch

    from optimum_iobinding.errors import ArgumentError, ArgumentTypeError

    model = IOBindingORTModel(add_model, provider="CPUExecutionProvider")
    shapes = {"past": (3,), "x": (3,)}
    with pytest.raises(
        ArgumentError, match=r"^buffers: expected some of the model's inputs \['past', 'x'\], got \['z'\]"
    ):
        model.adopt_graph_inputs(shapes, {"z": torch.zeros(3)})
    with pytest.raises(ArgumentError, match=r"^input_shapes: missing input 'x'"):
        model.adopt_graph_inputs({"past": (3,)}, {"past": torch.zeros(3)})
    with pytest.raises(ArgumentError, match=r"^buffers\['past'\]: expected a contiguous tensor of shape \(3,\) and dtype "
                       r"torch.float32 on cpu, got one of shape \(4,\)"):  # fmt: skip
        model.adopt_graph_inputs(shapes, {"past": torch.zeros(4)})
    with pytest.raises(ArgumentError, match=r"got a non-contiguous one of shape \(3,\)"):
        model.adopt_graph_inputs(shapes, {"past": torch.zeros(6)[::2]})
    with pytest.raises(ArgumentTypeError, match=r"^buffers\['past'\]: expected a torch tensor, got list"):
        model.adopt_graph_inputs(shapes, {"past": [0.0, 0.0, 0.0]})
    assert model.adopt_graph_inputs(shapes, {"past": torch.zeros(3)}) is False  # no graph on the CPU
    assert model(past=torch.ones(3), x=torch.ones(3))[0].tolist() == [2.0, 2.0, 2.0]


def test_a_graph_session_is_made_without_orts_memory_pattern_unless_the_user_gives_session_options(
    add_model, monkeypatch
):
    # the pattern's block per input shape, allocated at the capture beside the chunks the first run freed, held the
    # memory twice; a replay allocates nothing, so the pattern saves a graph session nothing
    import onnxruntime as ort

    from optimum_iobinding.runtime import session
    from optimum_iobinding.runtime.options import ModelOptions

    made = []
    monkeypatch.setattr(
        session, "create_session", lambda source, providers, options, sess_options: made.append(sess_options)
    )
    # ORT's defaults, whatever the test run's own session options are (the suite turns the pattern off everywhere)
    monkeypatch.setattr(session, "copy_session_options", lambda base: ort.SessionOptions() if base is None else base)
    recipe = session.SessionRecipe(add_model, ModelOptions.resolve(provider="CPUExecutionProvider"))
    recipe.create(provider_updates={"enable_cuda_graph": "1"})
    recipe.create()
    assert [options.enable_mem_pattern for options in made] == [False, True]
    users = ort.SessionOptions()
    users.enable_mem_pattern = True
    recipe = session.SessionRecipe(add_model, ModelOptions.resolve(provider="CPUExecutionProvider", sess_options=users))
    recipe.create(provider_updates={"enable_cuda_graph": "1"})
    assert made[-1] is users and users.enable_mem_pattern is True

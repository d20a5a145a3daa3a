"""Fast by default, on the CPU: "auto" graphs mean nothing (and say nothing) off CUDA; the graph pool's sessions share
one copy of the weights and are made once per signature; warm-up; options checked in one place. The CUDA side of the
same behaviours is in tests/gpu/test_gpu.py."""

from __future__ import annotations

import logging
import threading
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from optimum_iobinding import IOBindingORTModel
from optimum_iobinding.runtime.graph_pool import CudaGraphRunner, FixedShapeSession, GraphPool
from optimum_iobinding.runtime.options import ModelOptions
from optimum_iobinding.runtime.session import SessionRecipe


@pytest.fixture
def matmul_model(make_model):
    """``matmul_model(rows=64, columns=32)``: y = x @ W + b with a weight large enough to be owned (≥ 1024 elements)
    and a bias too small to be."""

    def build(rows: int = 64, columns: int = 32) -> onnx.ModelProto:
        weight = np.random.RandomState(0).randn(rows, columns).astype(np.float32)
        bias = np.arange(columns, dtype=np.float32)
        return make_model(
            [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])],
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", rows])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", columns])],
            initializers=[numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "b")],
        )

    return build


@pytest.fixture
def matmul_path(tmp_path, matmul_model):
    path = tmp_path / "matmul.onnx"
    onnx.save(matmul_model(), str(path))
    return path


def test_auto_on_the_cpu_means_no_graph_and_says_nothing(matmul_path, caplog):
    caplog.set_level(logging.DEBUG, logger="optimum_iobinding")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = IOBindingORTModel(matmul_path)
        model(x=torch.randn(3, 64))
    assert model.cuda_graph is False and model.graph_signatures == [] and not model.keeps_session_per_signature
    assert caplog.records == []


def test_cuda_graph_must_be_auto_true_or_false(matmul_path):
    with pytest.raises(ValueError, match=r"cuda_graph: expected 'auto', True or False, got 'yes'"):
        IOBindingORTModel(matmul_path, cuda_graph="yes")


def test_one_session_on_the_cpu_serves_every_shape(matmul_path):
    model = IOBindingORTModel(matmul_path)
    for batch in (1, 4, 8, 2, 1, 4):
        model(x=torch.randn(batch, 64))
    assert model.sessions_created == 1


def cpu_pool(path, cuda_graph=False, max_signatures=None):
    recipe = SessionRecipe(str(path), ModelOptions.resolve(share_weights=True))
    return recipe, GraphPool(recipe, cuda_graph, max_signatures, {"y": torch.float32}, ort.RunOptions())


def on_need_options():
    """The CUDA default (weights owned on first need), on the CPU: what a CUDA model's recipe is made with."""
    return ModelOptions(("CPUExecutionProvider",), ({},), share_weights=None)


def run_entry(entry, x):
    return entry.session.run(None, {"x": x.numpy()})[0]


def test_pool_sessions_share_one_copy_of_the_weights(matmul_path):
    recipe, pool = cpu_pool(matmul_path)
    declared = {"x": ["batch", 64]}
    x = {batch: torch.randn(batch, 64, generator=torch.Generator().manual_seed(batch)) for batch in (1, 4, 8)}
    entries = {batch: pool.entry(declared, {"x": ((batch, 64), torch.float32)}, {"y": (batch, 32)}) for batch in x}
    assert all(isinstance(entry, FixedShapeSession) for entry in entries.values())
    (weight,) = recipe.weights.tensors.values()  # W is owned; the 32-element bias is not
    assert list(recipe.weights.tensors) == ["W"]
    reference = ort.InferenceSession(str(matmul_path), providers=["CPUExecutionProvider"])
    for batch, entry in entries.items():
        np.testing.assert_allclose(
            run_entry(entry, x[batch]), reference.run(None, {"x": x[batch].numpy()})[0], rtol=1e-6, atol=1e-5
        )
    weight.mul_(2.0)  # one in-place change, seen by every session: they read the same memory
    bias = np.arange(32, dtype=np.float32)
    for batch, entry in entries.items():
        expected = x[batch].numpy() @ weight.numpy() + bias
        np.testing.assert_allclose(run_entry(entry, x[batch]), expected, rtol=1e-5, atol=1e-4)


def test_a_cycle_of_signatures_creates_no_session_after_the_first_round(matmul_path):
    recipe, pool = cpu_pool(matmul_path)
    declared = {"x": ["batch", 64]}
    for round_index in range(3):
        for batch in (1, 4, 8, 2, 3, 5, 6, 7):  # eight signatures: all kept (no small LRU)
            pool.entry(declared, {"x": ((batch, 64), torch.float32)}, {"y": (batch, 32)})
        if round_index == 0:
            after_first_round = recipe.sessions_created
    assert after_first_round == 8 and recipe.sessions_created == 8 and len(pool.entries) == 8


def test_a_bounded_pool_drops_the_least_recently_used_signature(matmul_path):
    recipe, pool = cpu_pool(matmul_path, max_signatures=2)
    declared = {"x": ["batch", 64]}
    for batch in (1, 2, 1, 3):
        pool.entry(declared, {"x": ((batch, 64), torch.float32)}, {"y": (batch, 32)})
    assert [dict(signature)["x"][0] for signature in pool.entries] == [1, 3]


def test_a_signature_whose_capture_fails_runs_without_a_graph_with_an_info_line(matmul_path, caplog):
    # an output whose shape depends on the data (None) cannot be replayed: the signature gets a fixed-shape session
    caplog.set_level(logging.INFO, logger="optimum_iobinding")
    recipe, pool = cpu_pool(matmul_path, cuda_graph="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        entry = pool.entry({"x": ["batch", 64]}, {"x": ((2, 64), torch.float32)}, {"y": None})
    assert isinstance(entry, FixedShapeSession)
    assert "data-dependent shape" in next(iter(pool.fallbacks.values()))
    assert [r.levelname for r in caplog.records] == ["INFO"] and "no CUDA graph" in caplog.records[0].getMessage()
    _, strict = cpu_pool(matmul_path, cuda_graph=True)
    with pytest.warns(RuntimeWarning, match="no CUDA graph for input shapes"):
        strict.entry({"x": ["batch", 64]}, {"x": ((2, 64), torch.float32)}, {"y": None})


def test_the_one_session_loads_its_weights_itself_until_a_second_session_needs_them_owned(matmul_path, caplog):
    # the CUDA default (share_weights=None), run on the CPU: the one graph session is made by ORT from the file; the
    # first other session makes the weights owned, and the one session (with the graphs captured in it) is dropped
    # and made again around them, so that both read one copy
    caplog.set_level(logging.INFO, logger="optimum_iobinding")
    recipe = SessionRecipe(str(matmul_path), on_need_options())
    recipe.weights.adopt(onnx.load(str(matmul_path)))
    pool = GraphPool(recipe, "auto", None, {"y": torch.float32}, ort.RunOptions())
    pool.one_session, pool.shared_updates = True, {}  # as on CUDA, without the CUDA option
    shared = pool.shared_session()
    assert recipe.sessions_created == 1 and recipe.weights.tensors == {} and not recipe.weights.owned
    assert not recipe.weights.parse_kept  # the parse kept for owned weights is released: ORT loaded them itself
    captured = CudaGraphRunner.__new__(CudaGraphRunner)  # what a capture in the one session leaves in the pool
    captured.session = shared
    pool.entries[(("x", (4, 64)),)] = captured
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    native = shared.run(None, {"x": x.numpy()})[0]
    del shared
    # an output of data-dependent shape: this signature needs a session without a graph, a second session
    entry = pool.entry({"x": ["batch", 64]}, {"x": ((2, 64), torch.float32)}, {"y": None})
    assert isinstance(entry, FixedShapeSession) and recipe.weights.owned and list(recipe.weights.tensors) == ["W"]
    assert list(pool.entries) == [(("x", (2, 64)),)]  # the graph captured in the dropped session is gone
    assert not pool.shared_tried and recipe.sessions_created == 2
    remade = [r.getMessage() for r in caplog.records if "made again around them" in r.getMessage()]
    assert len(remade) == 1 and "1 graph(s)" in remade[0]
    again = pool.shared_session()
    assert recipe.sessions_created == 3
    np.testing.assert_allclose(run_entry(entry, x), native, rtol=1e-6, atol=1e-5)
    recipe.weights.tensors["W"].mul_(2.0)  # both sessions read the owned copy
    expected = x.numpy() @ recipe.weights.tensors["W"].numpy() + np.arange(32, dtype=np.float32)
    for got in (run_entry(entry, x), again.run(None, {"x": x.numpy()})[0]):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


def test_weights_owned_on_need_never_load_while_one_session_serves(matmul_path):
    # share_weights=False never owns them; None owns them on need; a recipe for the CPU owns them only when asked
    assert SessionRecipe(str(matmul_path), ModelOptions.resolve()).weights.on_need is False
    never = SessionRecipe(str(matmul_path), ModelOptions.resolve(share_weights=False))
    assert not never.weights.on_need and never.weights.tensors == {}
    on_need = SessionRecipe(str(matmul_path), on_need_options())
    on_need.create()
    assert on_need.weights.on_need and on_need.weights.tensors == {}
    on_need.weights.start_owning()
    assert not on_need.weights.on_need and list(on_need.weights.tensors) == ["W"]


def test_a_capture_never_overlaps_a_device_setup():
    # set-ups (weights uploaded, buffers allocated) run side by side; a capture waits until none runs, and a set-up
    # that comes during a capture waits for it: another thread's cudaMalloc would fail the capture
    from optimum_iobinding.runtime.cuda_policy import SetupGate

    gate, log = SetupGate(), []
    in_setup, release, in_capture, capture_release = (threading.Event() for _ in range(4))

    def holding(enter, name, entered, released):
        """A thread's target: inside ``enter()`` it logs ``name``, says so, and stays until released."""

        def hold():
            with enter():
                log.append(name)
                entered.set()
                assert released.wait(60)
                log.append(f"{name} done")

        return hold

    def late_setup():
        with gate.setup():
            log.append("late setup")

    first = threading.Thread(target=holding(gate.setup, "setup", in_setup, release))
    first.start()
    assert in_setup.wait(60)
    capturing = threading.Thread(target=holding(gate.capture, "capture", in_capture, capture_release))
    capturing.start()
    with gate.setup():  # a second set-up beside the first, while the capture waits
        log.append("second setup")
    release.set()
    first.join(60)
    assert in_capture.wait(60)
    late = threading.Thread(target=late_setup)
    late.start()
    capture_release.set()
    capturing.join(60)
    late.join(60)
    assert log == ["setup", "second setup", "setup done", "capture", "capture done", "late setup"]


def test_first_runs_go_side_by_side_and_beside_setups_but_never_beside_a_build_or_a_capture():
    # a graph's first run (ORT's regular run before its capture) and a run ahead of a first call build cuDNN's plans,
    # a second of host work for a UNet: two models' go together (the UNet's beside the text encoder's), and a memory
    # query or a buffer allocated goes beside them; a session being made crashed beside a run, a capture must be alone
    from optimum_iobinding.runtime.cuda_policy import SetupGate

    gate, log = SetupGate(), []
    events = {name: (threading.Event(), threading.Event()) for name in ("first", "second", "build", "capture")}

    def hold(name, enter):
        entered, released = events[name]

        def target():
            with enter():
                log.append(name)
                entered.set()
                assert released.wait(60)
                log.append(f"{name} done")

        thread = threading.Thread(target=target)
        thread.start()
        return thread

    first = hold("first", gate.first_run)
    assert events["first"][0].wait(60)
    second = hold("second", gate.first_run)  # enters beside the first
    assert events["second"][0].wait(60)
    with gate.setup():  # and a set-up beside both
        log.append("setup")
    build = hold("build", gate.build)
    capture = hold("capture", gate.capture)
    events["first"][1].set()
    first.join(60)
    events["second"][1].set()
    second.join(60)
    for name in ("build", "capture"):
        events[name][1].set()
    build.join(60)
    capture.join(60)
    assert log[:5] == ["first", "second", "setup", "first done", "second done"]
    assert log[5:] in (
        ["build", "build done", "capture", "capture done"],
        ["capture", "capture done", "build", "build done"],
    )


@pytest.fixture
def recorded_runners(monkeypatch):
    """Graph runners on a fake ORT session: ``log`` records the device gate each run takes and the options it ran
    with ("warm": ORT's run without a graph; "graph": the graph's id); ``make(ahead=True, **kwargs)`` a runner, with a
    run it can make ahead of its first call (the CUDA EP's) or without one (TensorRT's engines)."""
    import contextlib
    from types import SimpleNamespace

    from optimum_iobinding.runtime import graph_pool

    log = []

    def recording(kind):
        @contextlib.contextmanager
        def gate(self):
            log.append(kind)
            yield

        return gate

    class Gate:  # records which gate each run asks for
        setup, capture, first_run = recording("setup"), recording("capture"), recording("first run")

    graph, warm = ort.RunOptions(), ort.RunOptions()

    class Session:  # what the runner asks of ONNX Runtime's session, recording each run's options
        def io_binding(self):
            return type("Binding", (), {"bind_input": lambda *a: None, "bind_output": lambda *a: None})()

        def run_with_iobinding(self, binding, options):
            log.append("warm" if options is warm else "graph")

    monkeypatch.setattr(graph_pool, "DEVICE_SETUP", Gate())
    specs = ({"x": ((2, 3), torch.float32)}, {"y": ((2, 3), torch.float32)})

    def make(ahead=True, **kwargs):
        return CudaGraphRunner(Session(), *specs, torch.device("cpu"), graph, warm if ahead else None, **kwargs)

    return SimpleNamespace(log=log, make=make)


def test_a_graphs_first_runs_and_a_run_ahead_take_the_device_gates(recorded_runners):
    # a thread's first run (ORT keeps its graphs per thread) and a run ahead of the first call (warm) are runs without
    # a graph, which wait until no session is being made; the next two runs may capture, alone; a replay takes no gate;
    # a runner without such options (TensorRT's engines) runs nothing ahead, and its first runs may all capture
    log = recorded_runners.log
    runner = recorded_runners.make()
    runner.warm()  # ahead of a first call, from any thread
    assert log == ["first run", "warm"]
    for _ in range(4):
        runner.run({"x": torch.ones(2, 3)})
    # a thread's first run is made without a graph (under the graph's id it may capture: ORT counts regular runs per
    # thread), the next two may capture
    assert log[2:] == ["first run", "warm"] + ["capture", "graph"] * 2 + ["graph"] and runner.runs == 4
    other = threading.Thread(target=lambda: runner.run({"x": torch.ones(2, 3)}))
    other.start()
    other.join(60)
    assert log[-2:] == ["first run", "warm"] and runner.runs == 5
    log.clear()
    plain = recorded_runners.make(ahead=False)
    plain.warm()  # nothing without a run that makes no graph (TensorRT's engines): every first run may capture
    plain.run({"x": torch.ones(2, 3)})
    assert log == ["capture", "graph"]


def test_a_runner_on_a_session_thread_counts_its_own_runs_and_a_warm_one_is_its_first(recorded_runners):
    # every ORT run of a session on one session thread: ORT has one graph per signature whichever thread calls, so a
    # new caller thread replays it (no run without a graph, no gate), and a run made ahead of the first call is that
    # call's run without a graph
    log = recorded_runners.log
    runner = recorded_runners.make(one_thread=True)
    runner.warm()
    for _ in range(3):
        runner.run({"x": torch.ones(2, 3)})
    assert log == ["first run", "warm"] + ["capture", "graph"] * 2 + ["graph"] and runner.runs == 3
    log.clear()
    other = threading.Thread(target=lambda: runner.run({"x": torch.ones(2, 3)}))
    other.start()
    other.join(60)
    assert log == ["graph"] and runner.runs == 4


def test_a_sibling_shares_the_owned_weights(matmul_path):
    model = IOBindingORTModel(matmul_path, share_weights=True)
    twin = model.sibling()
    assert twin.owned_weights["W"].data_ptr() == model.owned_weights["W"].data_ptr()
    x = torch.randn(2, 64)
    model.owned_weights["W"].mul_(0.5)
    torch.testing.assert_close(twin(x=x)[0], model(x=x)[0])
    torch.testing.assert_close(model(x=x)[0], x @ model.owned_weights["W"] + torch.arange(32.0))


def test_buffers_of_threads_that_ran_one_after_another_are_never_shared(matmul_path, matmul_model):
    # Python reuses thread idents: buffers keyed by ident were handed to the next thread, which overwrote them
    model = IOBindingORTModel(matmul_path)
    results = [None] * 6

    def call(index):
        results[index] = model(x=torch.full((1, 64), float(index)))[0]

    for index in range(6):
        thread = threading.Thread(target=call, args=(index,))
        thread.start()
        thread.join()
    weight = numpy_helper.to_array(matmul_model().graph.initializer[0])
    for index, result in enumerate(results):
        expected = np.full((1, 64), float(index), np.float32) @ weight + np.arange(32, dtype=np.float32)
        np.testing.assert_allclose(result.numpy(), expected, rtol=1e-5, atol=1e-4)


def test_model_warmup_runs_each_signature(matmul_path):
    model = IOBindingORTModel(matmul_path)
    model.warmup({"x": (1, 64)}, {"x": (4, 64)}, runs=1)
    assert model.output_signatures == 2
    with pytest.raises(ValueError, match="unknown input 'y'"):
        model.warmup({"y": (1, 64)})


# ------------------------------------------------------------------------------------------------------ pipelines
def test_pipeline_defaults_to_auto_graphs_for_every_component(tiny_folder):
    from optimum_iobinding import OnnxStableDiffusionPipeline

    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    # on the CPU "auto" resolves to no graph; the setting reached every component
    assert {name: model.cuda_graph for name, model in pipe.onnx_models.items()} == {
        name: False for name in pipe.onnx_models
    }
    assert set(pipe.onnx_models) == {"vae_encoder", "vae_decoder", "text_encoder", "unet"}


def test_per_component_options_are_read_in_one_place_and_checked(tiny_folder):
    from optimum_iobinding import OnnxStableDiffusionPipeline

    pipe = OnnxStableDiffusionPipeline.from_pretrained(
        tiny_folder, component_options={"unet": {"reuse_outputs": False, "max_output_signatures": 2}}
    )
    assert pipe.unet.reuse_outputs is False and pipe.unet.max_output_signatures == 2
    assert pipe.vae_decoder.reuse_outputs is True
    with pytest.raises(ValueError, match=r"component_options: expected components among .*got \['unte'\]"):
        OnnxStableDiffusionPipeline.from_pretrained(tiny_folder, component_options={"unte": {}})
    with pytest.raises(ValueError, match=r"component_options\['unet'\]: expected settings among .*got \['graph'\]"):
        OnnxStableDiffusionPipeline.from_pretrained(tiny_folder, component_options={"unet": {"graph": True}})
    with pytest.raises(ValueError, match="cuda_graph: expected 'auto', True or False, got 'on'"):
        OnnxStableDiffusionPipeline.from_pretrained(tiny_folder, cuda_graph="on")


@pytest.mark.parametrize("keyword", ["io_bindng", "cuda_grpah"])
def test_a_misspelled_keyword_is_a_type_error_naming_it(tiny_folder, keyword):
    from optimum_iobinding import OnnxStableDiffusionPipeline

    with pytest.raises(TypeError, match=rf"unexpected keyword argument\(s\) \['{keyword}'\]"):
        OnnxStableDiffusionPipeline.from_pretrained(tiny_folder, **{keyword: False})
    with pytest.raises(TypeError, match=rf"\['{keyword}'\]"):
        IOBindingORTModel.from_pretrained(tiny_folder, subfolder="unet", **{keyword: False})


@pytest.mark.parametrize("image_to_image", [False, True], ids=["text-to-image", "image-to-image"])
def test_the_load_starts_the_sessions_a_call_of_the_family_runs(tiny_folder, monkeypatch, image_to_image):
    # each component's shape-free session starts building as it loads (a no-op on the CPU, where one session serves
    # every shape); the VAE encoder's only for a family that encodes images
    from optimum_iobinding import OnnxStableDiffusionImg2ImgPipeline, OnnxStableDiffusionPipeline

    started = []
    monkeypatch.setattr(IOBindingORTModel, "prepare", lambda model, wait=True: started.append((model, wait)))
    family = OnnxStableDiffusionImg2ImgPipeline if image_to_image else OnnxStableDiffusionPipeline
    pipe = family.from_pretrained(tiny_folder)
    names = {model: name for name, model in pipe.onnx_models.items()}
    assert {names[model] for model, _ in started} == {"text_encoder", "unet", "vae_decoder"} | (
        {"vae_encoder"} if image_to_image else set()
    )
    # (the load also hands every component to prepare_sessions, which starts what it has not: prepare is a no-op for a
    # session made or being made)
    assert len({id(model) for model, _ in started}) == len(names) - (not image_to_image)
    assert all(wait is False for _, wait in started)


def test_the_denoiser_loads_first(tiny_folder):
    # its session and first run are the first image's longest wait, so its session is the first one started (on the
    # CPU each component's one session is made as it loads, in the order the timeline records)
    from optimum_iobinding import OnnxStableDiffusionPipeline
    from optimum_iobinding.runtime import timeline

    with timeline.recording() as record:
        OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    sessions = [step.what.split("/")[-2] for step in record.steps if step.what.startswith("session ")]
    assert sessions[0] == "unet"
    assert sorted(sessions) == ["text_encoder", "unet", "vae_decoder", "vae_encoder"]


def test_a_load_that_a_lora_follows_owns_the_weights_a_lora_changes(tiny_folder):
    from optimum_iobinding import OnnxStableDiffusionPipeline

    options = OnnxStableDiffusionPipeline.weights_owned_from_load(
        tiny_folder, {"unet": {"share_weights": False, "cuda_graph": False}, "vae_decoder": {"cuda_graph": False}}
    )
    assert options == {
        "unet": {"share_weights": False, "cuda_graph": False},  # the caller's own setting stays
        "vae_decoder": {"cuda_graph": False},
        "text_encoder": {"share_weights": True},
    }
    pipe = OnnxStableDiffusionPipeline.from_pretrained(
        tiny_folder, component_options=OnnxStableDiffusionPipeline.weights_owned_from_load(tiny_folder)
    )
    assert pipe.unet.options.share_weights is True and pipe.text_encoder.options.share_weights is True
    assert pipe.vae_decoder.options.share_weights is not True


@pytest.mark.parametrize("output_type", ["np", "latent"])
def test_the_loop_starts_the_vae_decoders_first_run_for_one_image_when_the_call_decodes(
    tiny_folder, monkeypatch, output_type
):
    from optimum_iobinding import OnnxStableDiffusionPipeline

    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    pipe.set_progress_bar_config(disable=True)
    asked = []
    monkeypatch.setattr(
        IOBindingORTModel, "prepare_signature", lambda model, shapes: asked.append((model, dict(shapes)))
    )
    pipe(["a cat", "a dog"], height=64, width=32, num_inference_steps=2, output_type=output_type)
    channels = pipe.unet.input_dims["sample"][1]
    expected = [(pipe.vae_decoder, {"latent_sample": (1, channels, 8, 4)})] if output_type == "np" else []
    assert [(model, shapes) for model, shapes in asked if model is pipe.vae_decoder] == expected
    asked.clear()
    pipe.enable_vae_tiling(tile_sample_size=16)  # decoded tile by tile: the whole image's run is never made
    pipe("a cat", height=64, width=64, num_inference_steps=2, output_type="np")
    assert [model for model, _ in asked if model is pipe.vae_decoder] == []


@pytest.mark.parametrize(
    "call",
    [
        dict(prompt=["a cat", "a dog"], height=64, width=32),
        dict(prompt="a cat", height=32, width=64, guidance_scale=1.0, num_images_per_prompt=3),
        dict(prompt="a cat", negative_prompt="blurry", height=64, width=64, num_images_per_prompt=2),
        dict(prompt_embeds="given", height=32, width=32),
    ],
    ids=["two-prompts", "unguided-three-images", "negative-two-images", "prompt-embeds"],
)
def test_the_unets_first_run_starts_before_the_prompt_is_encoded_with_the_first_steps_shapes(
    tiny_folder, monkeypatch, call
):
    # the UNet's first run (cuDNN's plans: a second of host work at 512²) goes beside the text encoder's, so the
    # shapes it is started with must be the ones the loop's first step runs, known before any text is encoded
    from optimum_iobinding import OnnxStableDiffusionPipeline

    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    pipe.set_progress_bar_config(disable=True)
    if call.get("prompt_embeds") == "given":
        call = {**call, "prompt_embeds": pipe.encode_prompt("a cat", 1, False).cpu().numpy()}
    asked = []
    monkeypatch.setattr(
        IOBindingORTModel,
        "prepare_signature",
        lambda model, shapes: asked.append((model, dict(shapes), len(text_runs))),
    )
    with pipe.text_encoder.watch_runs() as text_runs, pipe.unet.watch_runs() as unet_runs:
        pipe(num_inference_steps=2, output_type="latent", **call)
    started = [(shapes, encoded) for model, shapes, encoded in asked if model is pipe.unet]
    assert started == [(unet_runs[0].input_shapes, 0)]  # before the text encoder's first run
    assert all(run.input_shapes == unet_runs[0].input_shapes for run in unet_runs)


def test_the_unets_first_run_is_not_started_ahead_without_background_preparation(tiny_folder, monkeypatch):
    from optimum_iobinding import OnnxStableDiffusionPipeline

    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder, prepare_in_background=False)
    pipe.set_progress_bar_config(disable=True)
    asked = []
    monkeypatch.setattr(IOBindingORTModel, "prepare_signature", lambda model, shapes: asked.append(model))
    pipe("a cat", height=32, width=32, num_inference_steps=2, output_type="latent")
    assert pipe.unet not in asked


def test_pipeline_warmup_makes_every_later_call_of_those_sizes_create_no_session(tiny_folder):
    from optimum_iobinding import OnnxStableDiffusionPipeline

    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    pipe.set_progress_bar_config(disable=True)
    pipe.warmup(heights=64, batch_sizes=[1, 2])
    created = pipe.sessions_created
    for batch in (1, 2, 1):
        pipe(["a cat"] * batch, height=64, width=64, num_inference_steps=2, output_type="np")
    assert pipe.sessions_created == created
    with pytest.raises(ValueError, match=r"batch_sizes: expected positive integers, got \[1, 0\]"):
        pipe.warmup(heights=64, batch_sizes=[1, 0])
    with pytest.raises(ValueError, match=r"height and width: expected multiples of 16"):
        pipe.warmup(heights=[64, 72])
    assert pipe.sessions_created == created  # refused before any call


def test_the_loop_writes_its_inputs_into_the_graph_buffers_and_copies_constant_ones_once(tiny_folder, monkeypatch):
    # A UNet graph reads its inputs from buffers of its own: the loop concatenates the guidance batch straight into
    # the "sample" buffer and copies the prompt embeddings in once, not each step (one kernel fewer each between
    # two replays on the GPU). On the CPU there is no graph; the UNet is made to report buffers as a graph would,
    # and binds them like any tensor: the images must not change, and the calls must pass the buffers themselves.
    from optimum_iobinding import OnnxStableDiffusionPipeline

    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    pipe.set_progress_bar_config(disable=True)

    def nudge(pipeline, step, timestep, tensors):
        if step == 1:
            tensors["prompt_embeds"].add_(0.5)  # in place: the copy in the buffer is stale from here on
        return tensors

    def generate():
        return pipe(
            "a cat",
            height=64,
            width=64,
            num_inference_steps=4,
            output_type="np",
            generator=np.random.RandomState(0),
            callback_on_step_end=nudge,
            callback_on_step_end_tensor_inputs=["prompt_embeds"],
        ).images

    expected = generate()
    buffers = {}

    def graph_input_buffers(input_shapes):
        if not buffers:
            with torch.inference_mode(False):  # as CudaGraphRunner makes its buffers
                buffers.update(
                    {
                        name: torch.full(shape, float("nan"), dtype=pipe.unet.input_dtypes[name])
                        for name, shape in input_shapes.items()
                    }
                )
        return dict(buffers)

    monkeypatch.setattr(pipe.unet, "graph_input_buffers", graph_input_buffers)
    copies = []
    copy = torch.Tensor.copy_
    monkeypatch.setattr(
        torch.Tensor, "copy_", lambda self, *a, **k: copies.append(self.data_ptr()) or copy(self, *a, **k)
    )
    with pipe.unet.watch_runs() as runs, torch.inference_mode():  # as benchmarks and services call it
        images = generate()
    monkeypatch.undo()
    passed = [{name: run.inputs[name] for name in ("sample", "encoder_hidden_states")} for run in runs]
    np.testing.assert_allclose(images, expected, rtol=0, atol=1e-6)
    pointers = {name: tensor.data_ptr() for name, tensor in buffers.items()}
    assert len(passed) == len(pipe.scheduler.timesteps) > 2
    assert passed[0]["sample"] != pointers["sample"]  # the first call has no graph yet
    assert all(call == {name: pointers[name] for name in call} for call in passed[1:])
    # the embeddings went in after the first call and again after each step callback (it may change them in place,
    # as step 1's does): once a step here, where a callback runs every step
    assert copies.count(pointers["encoder_hidden_states"]) == len(passed) - 1
    # without a callback: once a call
    copies.clear()
    monkeypatch.setattr(pipe.unet, "graph_input_buffers", graph_input_buffers)
    monkeypatch.setattr(
        torch.Tensor, "copy_", lambda self, *a, **k: copies.append(self.data_ptr()) or copy(self, *a, **k)
    )
    pipe("a cat", height=64, width=64, num_inference_steps=4, output_type="np", generator=np.random.RandomState(0))
    monkeypatch.undo()
    assert copies.count(pointers["encoder_hidden_states"]) == 1


def test_warmup_leaves_the_callers_random_state_alone(tiny_folder):
    from optimum_iobinding import OnnxStableDiffusionPipeline

    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    pipe.set_progress_bar_config(disable=True)
    np.random.seed(3)
    torch.manual_seed(3)
    expected = (np.random.rand(), torch.rand(1).item())
    np.random.seed(3)
    torch.manual_seed(3)
    pipe.warmup(heights=64)
    assert (np.random.rand(), torch.rand(1).item()) == expected


def test_warmup_shows_no_progress_bar_and_the_calls_after_it_do(tiny_folder, capfd):
    """``pipe.warmup(heights=..., batch_sizes=[1, 2, 4])`` printed three unlabelled progress bars, one per warm-up
    call; the calls after it show theirs as before."""
    from optimum_iobinding import OnnxStableDiffusionPipeline

    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    capfd.readouterr()
    pipe.warmup(heights=64, batch_sizes=[1, 2])
    assert capfd.readouterr().err == ""
    pipe("a cat", height=64, width=64, num_inference_steps=2, output_type="np")
    assert "100%|" in capfd.readouterr().err  # its steps counted as the scheduler runs them


# --------------------------------------------------------------------------------------------- owned weights
def test_owned_weights_are_read_straight_from_external_data(tmp_path, matmul_model):
    from optimum_iobinding.runtime.weights import load_owned_weights

    expected = numpy_helper.to_array(matmul_model().graph.initializer[0])
    inline, external = tmp_path / "inline.onnx", tmp_path / "external.onnx"
    onnx.save(matmul_model(), str(inline))
    onnx.save_model(
        matmul_model(),
        str(external),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights.pb",
        size_threshold=0,
    )
    for path in (inline, external):
        weights = load_owned_weights(str(path), torch.device("cpu"))
        assert list(weights) == ["W"]  # the 32-element bias stays with each session
        np.testing.assert_array_equal(weights["W"].numpy(), expected)
    escaping = onnx.load(str(external), load_external_data=False)
    for entry in escaping.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "../../etc/passwd"
    onnx.save(escaping, str(tmp_path / "escaping.onnx"))
    with pytest.raises(ValueError, match=r"names external data outside the model's folder: '../../etc/passwd'"):
        load_owned_weights(str(tmp_path / "escaping.onnx"), torch.device("cpu"))
    misdeclared = onnx.load(str(external), load_external_data=False)
    misdeclared.graph.initializer[0].external_data.add(key="length", value="100")
    onnx.save(misdeclared, str(tmp_path / "misdeclared.onnx"))
    with pytest.raises(ValueError, match=r"initializer 'W' needs 8192 bytes at offset 0, the model declares 100"):
        load_owned_weights(str(tmp_path / "misdeclared.onnx"), torch.device("cpu"))
    (tmp_path / "weights.pb").write_bytes(b"short")
    with pytest.raises(ValueError, match=r"initializer 'W' needs 8192 bytes at offset 0, the file gives 5"):
        load_owned_weights(str(external), torch.device("cpu"))


def test_weights_load_from_the_parse_the_model_adopted_and_parse_no_file(matmul_path):
    from optimum_iobinding.runtime import timeline
    from optimum_iobinding.runtime.weights import OwnedWeights

    parsed = onnx.load(str(matmul_path))
    owned = OwnedWeights(str(matmul_path), torch.device("cpu"), share_weights=True)
    owned.adopt(parsed)
    with timeline.recording() as record:
        np.testing.assert_array_equal(owned.tensors["W"].numpy(), numpy_helper.to_array(parsed.graph.initializer[0]))
    assert [step.what for step in record.steps] == [f"weights {matmul_path}"]  # no parse of the file
    # weights that are not shared keep no parse
    plain = OwnedWeights(str(matmul_path), torch.device("cpu"), share_weights=False)
    plain.adopt(parsed)
    assert not plain.parse_kept
    plain.start_owning()  # turned on later (the CPU's first LoRA): the weights come from the file
    with timeline.recording() as record:
        assert list(plain.tensors) == ["W"]
    assert [step.what for step in record.steps] == [f"parse {matmul_path}", f"weights {matmul_path}"]


def test_what_the_graph_declares_is_what_ort_reports(tiny_folder):
    # on CUDA a model with a graph pool reads its inputs and outputs from the graph instead of a session
    from optimum_iobinding.runtime.session import declared_types
    from optimum_iobinding.runtime.shapes import inferencer_from_model_proto, inferencer_from_session

    for component in ("text_encoder", "unet", "vae_encoder", "vae_decoder"):
        path = str(tiny_folder / component / "model.onnx")
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        graph = onnx.load(path, load_external_data=False)
        inputs, outputs = declared_types(graph)
        assert inputs == {i.name: i.type for i in session.get_inputs()}
        assert outputs == {o.name: o.type for o in session.get_outputs()}
        from_graph, from_session = inferencer_from_model_proto(graph, path), inferencer_from_session(session)
        assert from_graph.input_dims == from_session.input_dims
        assert from_graph.output_dims == from_session.output_dims


@pytest.mark.parametrize("staging_bytes", [4096, 16384, 1 << 20])  # some direct; buffers refilled; all staged
def test_staged_uploads_keep_every_weight_whatever_the_buffer_size(staging_bytes):
    # the CUDA path's staging (two buffers, refilled in turn; arrays larger than one go up directly), run on the CPU
    from optimum_iobinding.runtime.weights import WeightUploader

    rng = np.random.RandomState(0)
    arrays = [
        (rng.randn(*shape).astype(dtype), torch_dtype)
        for shape, dtype, torch_dtype in [
            ((32, 16), np.float16, torch.float16),
            ((3, 1000), np.float32, torch.float32),
            ((1025,), np.float64, torch.float64),
            ((40, 40), np.float32, torch.float32),
            ((7, 300), np.float16, torch.float16),
        ]
    ]
    bfloat = torch.randn(33, 40).to(torch.bfloat16)
    arrays.append((bfloat.view(torch.int16).numpy().view(np.uint16), torch.bfloat16))
    uploader = WeightUploader(torch.device("cpu"), staging_bytes, staged=True)
    for array, _ in arrays:
        array.setflags(write=False)  # as read from the model's bytes
    tensors = [uploader.put(array, dtype) for array, dtype in arrays]
    uploader.finish()
    for (array, dtype), tensor in zip(arrays[:-1], tensors[:-1]):
        assert tensor.dtype == dtype and tensor.shape == array.shape
        np.testing.assert_array_equal(tensor.numpy(), array)
    assert torch.equal(tensors[-1], bfloat)
    # each tensor owns its memory: the staging buffers are reused, the weights are not overwritten
    assert len({t.data_ptr() for t in tensors}) == len(tensors)


@pytest.mark.parametrize("staging_bytes", [0, 4096, 16384, 1 << 20])  # none; pieces; buffers refilled; all staged
def test_weights_read_from_a_file_through_the_staging_buffers_equal_its_bytes(tmp_path, staging_bytes):
    # each weight read straight from the file into the staging buffers (a buffer's size at a time where larger), at
    # any offset, then uploaded: the CUDA path run on the CPU
    from optimum_iobinding.runtime.weights import WeightUploader

    rng = np.random.RandomState(1)
    weights = [
        torch.from_numpy(rng.randn(32, 16).astype(np.float16)),
        torch.from_numpy(rng.randn(3, 1000).astype(np.float32)),
        torch.randn(33, 40).to(torch.bfloat16),
        torch.from_numpy(rng.randn(1025).astype(np.float64)),
        torch.from_numpy(rng.randn(7, 300).astype(np.float16)),
    ]
    path, offsets = tmp_path / "weights.bin", []
    with open(path, "wb") as out:
        for tensor in weights:
            out.write(b"x" * 3)  # odd offsets: no alignment is assumed of the file
            offsets.append(out.tell())
            out.write(tensor.view(torch.uint8).numpy().tobytes())
    uploader = WeightUploader(torch.device("cpu"), staging_bytes, staged=staging_bytes > 0)
    targets = [torch.empty(tensor.numel() * tensor.element_size(), dtype=torch.uint8) for tensor in weights]
    with open(path, "rb", buffering=0) as handle:
        counts = [uploader.read(handle, offset, target) for offset, target in zip(offsets, targets)]
        short = uploader.read(handle, path.stat().st_size - 10, torch.empty(32, dtype=torch.uint8))
    uploader.finish()
    assert counts == [target.numel() for target in targets]
    for tensor, target in zip(weights, targets):
        assert torch.equal(target.view(tensor.dtype).view(tensor.shape), tensor)
    assert short == 10  # the file ends 10 bytes in: what was there


@pytest.mark.parametrize("threads", [2, 3, 50])  # more threads than weights: a weight each
def test_owned_weights_read_by_several_threads_equal_one_threads(tiny_folder, tiny_unet_external, threads):
    from optimum_iobinding.runtime.weights import load_owned_weights

    inline, external = str(tiny_folder / "unet" / "model.onnx"), tiny_unet_external
    expected = load_owned_weights(inline, torch.device("cpu"))  # from the model's bytes
    got = load_owned_weights(str(external), torch.device("cpu"), read_threads=threads)
    assert list(got) == list(expected) and len(got) > 10  # in the model's order
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    # a file that ends early: the weight it cuts is named, whichever thread read it
    weights_file = external.parent / "model.weights"
    weights_file.write_bytes(weights_file.read_bytes()[: weights_file.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"initializer '.+' needs \d+ bytes at offset \d+, the file gives \d+"):
        load_owned_weights(str(external), torch.device("cpu"), read_threads=threads)


@pytest.mark.parametrize(
    "declared, expected_row",
    [([], ()), ([1], (1,)), (["batch"], (3,)), ([3], (3,))],
    ids=["scalar", "one", "rows", "fixed-rows"],
)
def test_the_timestep_input_of_each_step_has_the_shape_the_model_declares(declared, expected_row):
    # made once for every step (row i is step i's), in the shape the UNet's first step is predicted with
    from types import SimpleNamespace

    from optimum_iobinding.pipelines.denoisers import timestep_inputs, timestep_shape

    model = SimpleNamespace(input_dims={"timestep": declared}, input_dtypes={"timestep": torch.float16})
    timesteps = torch.tensor([999.0, 500.0, 1.0])
    rows = timestep_inputs(model, timesteps, 3, torch.device("cpu"))
    assert timestep_shape(model, 3) == expected_row
    assert rows.shape == (3, *expected_row) and rows.dtype == torch.float16 and rows.is_contiguous()
    for step, value in enumerate(timesteps.tolist()):
        assert torch.equal(rows[step], torch.full(expected_row, value, dtype=torch.float16))

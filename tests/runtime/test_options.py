"""Options are resolved once: every setting is checked where it enters, with an error naming it, and handed down as one
object (a model's ModelOptions, a pipeline's PipelineOptions)."""

from __future__ import annotations

import inspect
import logging
import warnings

import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from optimum_iobinding import IOBindingORTModel, ModelOptions, PipelineOptions
from optimum_iobinding.runtime.graph_pool import GraphPool
from optimum_iobinding.runtime.options import MODEL_KEYWORDS, NOT_GIVEN
from optimum_iobinding.runtime.session import SessionRecipe

COMPONENTS = ("text_encoder", "unet", "vae_encoder", "vae_decoder")
# a pipeline in the abstract: its denoiser is the component that must be captured
DENOISER, CODEC = "denoiser", "codec"


@pytest.fixture
def identity_path(tmp_path, make_model, tensor):
    """y = x over a free batch dim: any small model with a dynamic input."""
    path = tmp_path / "model.onnx"
    onnx.save(
        make_model(
            [helper.make_node("Identity", ["x"], ["y"])],
            [tensor("x", TensorProto.FLOAT, ["batch", 4])],
            [tensor("y", TensorProto.FLOAT, ["batch", 4])],
        ),
        str(path),
    )
    return path


@pytest.mark.parametrize(
    "setting, value, error, message",
    [
        ("cuda_graph", "yes", ValueError, "cuda_graph: expected 'auto', True or False, got 'yes'"),
        ("max_graph_signatures", 0, ValueError, "max_graph_signatures: expected None or an integer ≥ 1, got 0"),
        ("max_output_signatures", 0, ValueError, "max_output_signatures: expected an integer ≥ 1, got 0"),
        ("max_output_signatures", True, ValueError, "max_output_signatures: expected an integer ≥ 1, got True"),
        ("io_binding", "no", TypeError, "io_binding: expected True or False, got 'no'"),
        ("reuse_outputs", 1, TypeError, "reuse_outputs: expected True or False, got 1"),
        ("share_weights", "yes", TypeError, "share_weights: expected None, True or False, got 'yes'"),
        ("sess_options", {}, TypeError, "sess_options: expected an onnxruntime.SessionOptions or None"),
        ("provider", 3, TypeError, "provider: expected a provider name"),
        ("provider", "NoSuchExecutionProvider", ValueError, "provider: 'NoSuchExecutionProvider' is not available"),
        ("provider_options", [{}, {}], ValueError, "provider_options: expected 1 dict(s), one per provider"),
    ],
)
def test_each_model_setting_is_refused_with_its_name(setting, value, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace("'", "'")):
        ModelOptions.resolve(**{setting: value})


def test_a_model_checks_its_settings_before_it_reads_the_file():
    # the file does not exist: the setting's error comes first
    with pytest.raises(ValueError, match="cuda_graph: expected"):
        IOBindingORTModel.from_pretrained("/nowhere/model.onnx", cuda_graph="yes")


def test_resolved_options_and_single_settings_are_not_taken_together(tmp_path):
    options = ModelOptions.resolve()
    with pytest.raises(TypeError, match=r"options: expected either options or the settings \['cuda_graph'\], got both"):
        IOBindingORTModel(tmp_path / "model.onnx", options=options, cuda_graph=False)
    with pytest.raises(TypeError, match="options: expected a ModelOptions, got dict"):
        IOBindingORTModel(tmp_path / "model.onnx", options={"cuda_graph": False})


def test_cpu_options_resolve_to_no_stream_and_weights_never_owned_on_need():
    options = ModelOptions.resolve()
    assert options.providers == ("CPUExecutionProvider",) and options.stream is None
    assert options.share_weights is False and not options.cuda_like
    assert ModelOptions.resolve(share_weights=True).share_weights is True


def test_a_stream_needs_a_cuda_provider_with_binding():
    class NotAStream:
        pass

    with pytest.raises(ValueError, match="stream: a CUDA stream needs a CUDA-like provider with io_binding=True"):
        ModelOptions.resolve(stream=NotAStream())


def test_the_users_sess_options_object_is_handed_down_as_it_is():
    sess_options = ort.SessionOptions()
    assert ModelOptions.resolve(sess_options=sess_options).sess_options is sess_options


def test_replace_checks_what_it_changes_and_keeps_the_rest():
    options = ModelOptions.resolve(max_output_signatures=3)
    changed = options.replace(cuda_graph=False, max_graph_signatures=2)
    assert (changed.cuda_graph, changed.max_graph_signatures, changed.max_output_signatures) == (False, 2, 3)
    assert changed.providers == options.providers
    with pytest.raises(ValueError, match="max_graph_signatures: expected None or an integer ≥ 1, got -1"):
        options.replace(max_graph_signatures=-1)
    with pytest.raises(TypeError, match=r"settings: expected names among .*, got \['provider'\]"):
        options.replace(provider="CPUExecutionProvider")


def test_component_options_override_the_pipelines_for_that_component_only():
    options = PipelineOptions.resolve(
        COMPONENTS, component_options={"unet": {"max_graph_signatures": 2, "reuse_outputs": False}}
    )
    unet, decoder = options.for_component("unet"), options.for_component("vae_decoder")
    assert (unet.max_graph_signatures, unet.reuse_outputs) == (2, False)
    assert (decoder.max_graph_signatures, decoder.reuse_outputs) == (None, True)
    assert unet.providers == decoder.providers and unet.stream is decoder.stream


def test_cuda_graph_true_binds_the_component_that_must_capture_and_lets_the_others_capture_where_they_can():
    options = PipelineOptions.resolve((DENOISER, CODEC), cuda_graph=True)
    assert options.for_component(DENOISER, must_capture=True).cuda_graph is True
    assert options.for_component(CODEC).cuda_graph == "auto"
    # the name decides nothing: a component named like the denoiser of one family is just a component
    assert PipelineOptions.resolve(COMPONENTS, cuda_graph=True).for_component("unet").cuda_graph == "auto"
    assert PipelineOptions.resolve(COMPONENTS, cuda_graph=True).for_component("vae_decoder", True).cuda_graph is True


@pytest.mark.parametrize("cuda_graph", ["auto", False])
def test_without_cuda_graph_true_every_component_takes_the_pipelines_setting(cuda_graph):
    options = PipelineOptions.resolve((DENOISER, CODEC), cuda_graph=cuda_graph)
    assert options.for_component(DENOISER, must_capture=True).cuda_graph == cuda_graph
    assert options.for_component(CODEC).cuda_graph == cuda_graph


def test_a_components_own_cuda_graph_setting_wins_over_must_capture():
    options = PipelineOptions.resolve(
        (DENOISER, CODEC),
        cuda_graph=True,
        component_options={DENOISER: {"cuda_graph": False}, CODEC: {"cuda_graph": True}},
    )
    assert options.for_component(DENOISER, must_capture=True).cuda_graph is False
    assert options.for_component(CODEC).cuda_graph is True


def test_with_cuda_graph_true_only_the_component_that_must_capture_refuses_a_device_without_graphs(identity_path):
    # on the CPU no graph can be captured: the must-capture component's True is an error, the others' "auto" is not
    options = PipelineOptions.resolve((DENOISER, CODEC), cuda_graph=True)
    with pytest.raises(ValueError, match=r"cuda_graph: needs a CUDA session with io_binding=True, got device cpu"):
        IOBindingORTModel(identity_path, options=options.for_component(DENOISER, must_capture=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        codec = IOBindingORTModel(identity_path, options=options.for_component(CODEC))
    assert codec.cuda_graph is False and codec(x=torch.ones(2, 4))[0].tolist() == [[1.0] * 4] * 2


def test_a_capture_fallback_warns_for_the_component_that_must_capture_and_is_an_info_line_for_the_others(
    identity_path, caplog
):
    # the graph pool reads the component's resolved cuda_graph, never its name; a data-dependent output (None)
    # cannot be replayed, so the signature runs without a graph
    caplog.set_level(logging.INFO, logger="optimum_iobinding")
    options = PipelineOptions.resolve(
        (DENOISER, CODEC),
        cuda_graph=True,
        component_options={DENOISER: {"share_weights": True}, CODEC: {"share_weights": True}},
    )

    def fallback(component_options):
        pool = GraphPool(
            SessionRecipe(str(identity_path), component_options),
            component_options.cuda_graph,
            None,
            {"y": torch.float32},
            ort.RunOptions(),
        )
        pool.entry({"x": ["batch", 4]}, {"x": ((2, 4), torch.float32)}, {"y": None})

    with pytest.warns(RuntimeWarning, match="no CUDA graph for input shapes"):
        fallback(options.for_component(DENOISER, must_capture=True))
    caplog.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fallback(options.for_component(CODEC))
    assert [r.levelname for r in caplog.records] == ["INFO"] and "no CUDA graph" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    "component_options, error, message",
    [
        ({"unet": {"cuda_graphs": True}}, ValueError, r"component_options\['unet'\]: expected settings among"),
        ({"vae": {}}, ValueError, r"component_options: expected components among .*, got \['vae'\]"),
        ({"unet": True}, TypeError, "component_options: expected a dict of dicts"),
        (
            {"unet": {"max_graph_signatures": 0}},
            ValueError,
            r"component_options\['unet'\]: max_graph_signatures: expected None or an integer ≥ 1, got 0",
        ),
    ],
)
def test_a_wrong_component_option_is_named(component_options, error, message):
    with pytest.raises(error, match=message):
        PipelineOptions.resolve(COMPONENTS, component_options=component_options)


def test_numbered_copies_of_a_component_take_its_options_unless_given_their_own():
    options = PipelineOptions.resolve(
        ("unet", "controlnet"),
        numbered=("controlnet",),
        component_options={"controlnet": {"reuse_outputs": False}, "controlnet_2": {"max_output_signatures": 3}},
    )
    assert options.for_component("controlnet_1").reuse_outputs is False
    assert (
        options.for_component("controlnet_2").reuse_outputs,
        options.for_component("controlnet_2").max_output_signatures,
    ) == (True, 3)
    assert options.for_component("unet_1").reuse_outputs is True
    with pytest.raises(ValueError, match="component_options: expected components among"):
        PipelineOptions.resolve(COMPONENTS, component_options={"controlnet_1": {}})


def test_only_the_components_the_caller_numbers_come_in_numbered_copies():
    for numbered in ((), ("unet",)):
        with pytest.raises(ValueError, match=r"component_options: expected components among .*got \['controlnet_1'\]"):
            PipelineOptions.resolve(("unet", "controlnet"), numbered=numbered, component_options={"controlnet_1": {}})
    with pytest.raises(ValueError, match=r"numbered: expected components among \['unet'\], got \['controlnet'\]"):
        PipelineOptions.resolve(("unet",), numbered=("controlnet",))
    # a declared component named like a copy is itself, not a copy
    options = PipelineOptions.resolve(
        ("encoder", "encoder_2"), numbered=("encoder",), component_options={"encoder": {"reuse_outputs": False}}
    )
    assert options.for_component("encoder_2").reuse_outputs is True


def test_settings_not_given_take_the_defaults_declared_once_in_model_options():
    resolved = ModelOptions.resolve()
    assert resolved == ModelOptions(share_weights=False)  # off CUDA no graph pool can need owned weights
    assert (
        resolved.io_binding,
        resolved.reuse_outputs,
        resolved.max_output_signatures,
        resolved.cuda_graph,
        resolved.max_graph_signatures,
    ) == (
        ModelOptions.io_binding,
        ModelOptions.reuse_outputs,
        ModelOptions.max_output_signatures,
        ModelOptions.cuda_graph,
        ModelOptions.max_graph_signatures,
    )
    assert ModelOptions.resolve(provider=None, provider_options=None) == resolved


def test_every_door_leaves_its_settings_not_given_so_that_defaults_come_from_model_options():
    doors = [
        ModelOptions.resolve,
        IOBindingORTModel.__init__,
        IOBindingORTModel.from_pretrained,
        IOBindingORTModel.load_model,
        PipelineOptions.resolve,
    ]
    for door in doors:
        parameters = inspect.signature(door).parameters
        settings = [name for name in MODEL_KEYWORDS if name in parameters]
        assert settings, door
        assert {name: parameters[name].default for name in settings} == dict.fromkeys(settings, NOT_GIVEN), door


def test_a_model_made_without_settings_runs_with_the_defaults(identity_path, make_session):
    assert IOBindingORTModel(identity_path).options == ModelOptions.resolve()
    assert IOBindingORTModel.from_pretrained(identity_path).options == ModelOptions.resolve()
    from_session = IOBindingORTModel(make_session(onnx.load(str(identity_path)))).options
    assert (
        from_session.io_binding,
        from_session.reuse_outputs,
        from_session.max_output_signatures,
        from_session.cuda_graph,
        from_session.share_weights,
    ) == (True, True, 8, "auto", False)
    assert isinstance(from_session.sess_options, ort.SessionOptions)


def test_a_setting_equal_to_its_default_may_come_beside_resolved_options(identity_path):
    options = ModelOptions.resolve(max_output_signatures=3)
    model = IOBindingORTModel(identity_path, options=options, cuda_graph="auto", provider=None, io_binding=True)
    assert model.options is options
    with pytest.raises(
        TypeError,
        match=r"options: expected either options or the settings \['io_binding', "
        r"'provider'\], got both",
    ):
        IOBindingORTModel.from_pretrained(
            identity_path, options=options, provider="CPUExecutionProvider", io_binding=False
        )


def test_a_pipeline_gives_each_component_the_options_it_resolved(tiny_folder):
    from optimum_iobinding import OnnxStableDiffusionPipeline

    pipe = OnnxStableDiffusionPipeline.from_pretrained(
        tiny_folder, component_options={"unet": {"max_output_signatures": 2, "reuse_outputs": False}}
    )
    assert (pipe.unet.options.max_output_signatures, pipe.unet.options.reuse_outputs) == (2, False)
    assert (pipe.vae_decoder.options.max_output_signatures, pipe.vae_decoder.options.reuse_outputs) == (8, True)
    assert {model.options.providers for model in pipe.onnx_models.values()} == {("CPUExecutionProvider",)}

"""Options are resolved once: every setting is checked where it enters, with an error naming it, and handed down as one
object (a model's ModelOptions, a pipeline's PipelineOptions)."""

from __future__ import annotations

import onnxruntime as ort
import pytest

from optimum_iobinding import IOBindingORTModel, ModelOptions, PipelineOptions

COMPONENTS = ("text_encoder", "unet", "vae_encoder", "vae_decoder")


@pytest.mark.parametrize("setting, value, error, message", [
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
])
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
    options = PipelineOptions.resolve(COMPONENTS, component_options={"unet": {"max_graph_signatures": 2,
                                                                               "reuse_outputs": False}})
    unet, decoder = options.for_component("unet"), options.for_component("vae_decoder")
    assert (unet.max_graph_signatures, unet.reuse_outputs) == (2, False)
    assert (decoder.max_graph_signatures, decoder.reuse_outputs) == (None, True)
    assert unet.providers == decoder.providers and unet.stream is decoder.stream


def test_cuda_graph_true_binds_the_unet_and_lets_the_other_components_capture_where_they_can():
    options = PipelineOptions.resolve(COMPONENTS, cuda_graph=True)
    assert options.for_component("unet").cuda_graph is True
    assert options.for_component("text_encoder").cuda_graph == "auto"
    assert PipelineOptions.resolve(COMPONENTS, cuda_graph=False).for_component("text_encoder").cuda_graph is False


@pytest.mark.parametrize("component_options, error, message", [
    ({"unet": {"cuda_graphs": True}}, ValueError, r"component_options\['unet'\]: expected settings among"),
    ({"vae": {}}, ValueError, r"component_options: expected components among .*, got \['vae'\]"),
    ({"unet": True}, TypeError, "component_options: expected a dict of dicts"),
    ({"unet": {"max_graph_signatures": 0}}, ValueError,
     r"component_options\['unet'\]: max_graph_signatures: expected None or an integer ≥ 1, got 0"),
])
def test_a_wrong_component_option_is_named(component_options, error, message):
    with pytest.raises(error, match=message):
        PipelineOptions.resolve(COMPONENTS, component_options=component_options)


def test_extra_controlnets_take_the_controlnets_options():
    options = PipelineOptions.resolve(("unet", "controlnet"), component_options={"controlnet": {"reuse_outputs": False}})
    assert options.for_component("controlnet_1").reuse_outputs is False
    with pytest.raises(ValueError, match="component_options: expected components among"):
        PipelineOptions.resolve(COMPONENTS, component_options={"controlnet_1": {}})


def test_a_pipeline_gives_each_component_the_options_it_resolved(tiny_folder):
    from optimum_iobinding import OnnxStableDiffusionPipeline

    pipe = OnnxStableDiffusionPipeline.from_pretrained(
        tiny_folder, component_options={"unet": {"max_output_signatures": 2, "reuse_outputs": False}})
    assert (pipe.unet.options.max_output_signatures, pipe.unet.options.reuse_outputs) == (2, False)
    assert (pipe.vae_decoder.options.max_output_signatures, pipe.vae_decoder.options.reuse_outputs) == (8, True)
    assert {model.options.providers for model in pipe.onnx_models.values()} == {("CPUExecutionProvider",)}

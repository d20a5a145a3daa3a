"""Misspelled names are refused with the name they likely mean: the one helper every surface words it with, and
the execution providers."""

import onnxruntime as ort
import pytest

from optimum_iobinding.errors import ArgumentError, close_matches, did_you_mean
from optimum_iobinding.runtime.options import ModelOptions, normalize_providers


def test_did_you_mean_names_the_closest_choice_or_nothing():
    choices = ["io_binding", "provider", "provider_options", "cuda_graph"]
    assert did_you_mean("io_bindng", choices) == "did you mean io_binding?"
    assert did_you_mean("CUDA_GRAPH", choices) == "did you mean cuda_graph?"  # case alone
    assert did_you_mean("zzz", choices) == ""
    assert did_you_mean("provider_option", choices, n=2) == "did you mean provider_options or provider?"
    assert close_matches("provider", choices) == ["provider_options"]  # never the word itself


@pytest.mark.parametrize(
    "name", ["cuda", "CUDA", "Cuda", "CudaExecutionProvider", "CUDAExecutionProvder", "CUDAExcutionProvider"]
)
def test_a_cuda_provider_named_otherwise_points_to_cuda_execution_provider(name):
    with pytest.raises(ArgumentError) as caught:
        normalize_providers(name)
    assert caught.value.argument == "provider"
    assert f"{name!r} is not available in this onnxruntime build" in str(caught.value)
    assert "did you mean CUDAExecutionProvider?" in str(caught.value)
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        assert "install onnxruntime-gpu" in str(caught.value)


@pytest.mark.parametrize(
    "name, meant",
    [
        ("cpu", "CPUExecutionProvider"),
        ("tensorrt", "TensorrtExecutionProvider"),
        ("TensorRT", "TensorrtExecutionProvider"),
        ("rocm", "ROCMExecutionProvider"),
        ("openvino", "OpenVINOExecutionProvider"),
    ],
)
def test_a_short_provider_name_points_to_ort_s_name(name, meant):
    with pytest.raises(ArgumentError, match=rf"did you mean {meant}\?"):
        ModelOptions.resolve(provider=[name, "CPUExecutionProvider"])


def test_a_provider_near_none_is_refused_without_a_guess():
    with pytest.raises(ArgumentError) as caught:
        normalize_providers("NoSuchExecutionProvider")
    assert "did you mean" not in str(caught.value)
    assert "no execution provider onnxruntime knows" in str(caught.value)
    assert f"available: {ort.get_available_providers()}" in str(caught.value)


def test_a_known_provider_this_build_lacks_keeps_its_refusal_without_a_guess():
    missing = next(
        name
        for name in ("CUDAExecutionProvider", "TensorrtExecutionProvider", "CoreMLExecutionProvider")
        if name not in ort.get_available_providers()
    )
    with pytest.raises(ArgumentError) as caught:
        normalize_providers(missing, io_binding=False)
    message = str(caught.value)
    assert message.startswith(f"provider: {missing!r} is not available in this onnxruntime build")
    assert "did you mean" not in message and "no execution provider" not in message


def test_an_available_provider_is_taken_as_it_is():
    assert normalize_providers("CPUExecutionProvider") == (["CPUExecutionProvider"], [{}])

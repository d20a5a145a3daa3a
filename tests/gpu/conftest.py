"""Fixtures of the GPU tests."""

from __future__ import annotations

import gc
import threading
import warnings

import pytest


@pytest.fixture(autouse=True, scope="session")
def refusals_of_this_run(tmp_path_factory):
    """The one-graph-session refusals ORT gives the GPU tests are remembered in a folder of this run, not in the
    user's cache (runtime/graph_refusals.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(autouse=True)
def nothing_left_running_into_the_next_test():
    """A test's background set-up work (a pipeline starts building its sessions as it loads; the VAE decoder's first
    run goes beside the loop: threads named "prepare …") ends with the test, and its garbage is collected then: none
    of it frees or takes device memory, or waits for the device, in the middle of a later test's measure."""
    yield
    for thread in threading.enumerate():
        if thread.name.startswith("prepare ") and thread is not threading.current_thread():
            thread.join(600)
    gc.collect()


@pytest.fixture
def captures_the_transformer_as_required():
    """Checks a diffusion-transformer pipeline loaded with ``cuda_graph=True``: the transformer (the family's
    denoiser) is the component that must be captured and the others capture where they can; ``run`` (a call of the
    pipeline) makes no fallback warning and the transformer replays a graph."""

    def check(pipe, run) -> None:
        assert pipe.transformer.options.cuda_graph is True
        others = {name: model.options.cuda_graph for name, model in pipe.onnx_models.items() if name != "transformer"}
        assert others == {name: "auto" for name in others}
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a fallback of the transformer would warn
            run()
        assert pipe.transformer.graph_signatures and not pipe.transformer.graph_fallbacks

    return check


@pytest.fixture
def fused_adds_no_error_beyond_fp16():
    """``check(folders, component, feed)``: component ``component`` of the fused float16 export (``folders["fused"]``)
    is as close to the float32 export's (``folders["fp32"]``) as the plain float16 one (``folders["fp16"]``) is, give
    or take float16 noise: each run on CUDA with fp32 matmuls (no TF32) on the same ``feed``, first outputs compared.
    Component by component, since a whole random-weights pipeline amplifies float16 noise step after step."""
    from optimum_iobinding import IOBindingORTModel

    def check(folders, component, feed) -> None:
        outputs = {}
        for name in ("fp32", "fp16", "fused"):
            model = IOBindingORTModel.from_pretrained(
                folders[name], subfolder=component, provider="CUDAExecutionProvider", provider_options={"use_tf32": "0"}
            )
            cast = {key: value.to(model.device, model.input_dtypes[key]) for key, value in feed.items()}
            outputs[name] = model(**cast)[0].float().cpu().clone()
        plain_error = (outputs["fp16"] - outputs["fp32"]).abs().max().item()
        fused_error = (outputs["fused"] - outputs["fp32"]).abs().max().item()
        assert fused_error <= 2 * plain_error + 2e-3, (component, fused_error, plain_error)

    return check

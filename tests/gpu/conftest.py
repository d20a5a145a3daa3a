"""Fixtures of the GPU tests."""

from __future__ import annotations

import warnings

import pytest


@pytest.fixture(autouse=True, scope="session")
def refusals_of_this_run(tmp_path_factory):
    """The one-graph-session refusals ORT gives the GPU tests are remembered in a folder of this run, not in the
    user's cache (runtime/graph_refusals.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


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

"""The fixtures the pipelines' tests share: the tiny random Stable Diffusion and image-conditioned FLUX.1 exports
that several of them run on (SDXL's is the whole suite's, in tests/conftest.py), and what they ask of a pipeline (how
many sessions are open, whether a refusal ran a component) and of a folder (a copy with a changed VAE config)."""

from __future__ import annotations

import contextlib
import gc
import json
import shutil

import onnxruntime as ort
import pytest


@pytest.fixture(scope="module")
def sd(shared_export, vae_encodes_its_mode):
    """The tiny random Stable Diffusion pipeline: diffusers' torch pipeline (the module's own; its VAE encoder giving
    the mode, as the export's does) and its export (shared: the builder is seeded)."""
    from optimum_iobinding.export import export_pipeline
    from optimum_iobinding.export.tiny import build_tiny_random_pipeline

    torch_pipe = build_tiny_random_pipeline()
    torch_pipe.set_progress_bar_config(disable=True)
    folder = shared_export(
        "sd", lambda target: export_pipeline(None, target, torch_pipeline=torch_pipe, progress=False)
    )
    return vae_encodes_its_mode(torch_pipe), folder


def _flux_variant(kind: str, shared_export, vae_encodes_its_mode):
    """Diffusers' tiny random pipeline of an image-conditioned FLUX.1 ``kind`` (the module's own; its VAE encoder
    giving the mode, as the export's does) and its export, shared with the contract's (``export --tiny-random KIND``:
    the builder is seeded, so both have the same weights)."""
    from optimum_iobinding.export import export_pipeline
    from optimum_iobinding.export.tiny import TINY_RANDOM_KINDS

    torch_pipe = TINY_RANDOM_KINDS[kind]()
    torch_pipe.set_progress_bar_config(disable=True)
    folder = shared_export(
        f"tiny-random-{kind}", lambda target: export_pipeline(None, target, tiny_random=kind, progress=False)
    )
    return vae_encodes_its_mode(torch_pipe), folder


@pytest.fixture(scope="module")
def kontext(shared_export, vae_encodes_its_mode):
    """The tiny random FLUX.1 Kontext pipeline: diffusers' torch ``FluxKontextPipeline`` and its export."""
    return _flux_variant("flux-kontext", shared_export, vae_encodes_its_mode)


@pytest.fixture(scope="module")
def fill(shared_export, vae_encodes_its_mode):
    """The tiny random FLUX.1 Fill pipeline (a transformer of 384 values per token): diffusers' torch
    ``FluxFillPipeline`` and its export."""
    return _flux_variant("flux-fill", shared_export, vae_encodes_its_mode)


@pytest.fixture(scope="module")
def control(shared_export, vae_encodes_its_mode):
    """The tiny random FLUX.1 Control pipeline (a transformer of 128 values per token): diffusers' torch
    ``FluxControlPipeline`` and its export."""
    return _flux_variant("flux-control", shared_export, vae_encodes_its_mode)


@pytest.fixture(scope="session")
def live_sessions():
    """``live_sessions()``: how many onnxruntime sessions this process holds (after a garbage collection)."""

    def count() -> int:
        gc.collect()
        # type(), not isinstance: isinstance reads __class__, which some deprecated module proxies answer with a warning
        return sum(issubclass(type(obj), ort.InferenceSession) for obj in gc.get_objects())

    return count


@pytest.fixture(scope="session")
def refused_runs_nothing():
    """``refused_runs_nothing(pipe, error, message, action)``: runs ``action``, expects it refused (``error`` matching
    ``message``), and answers whether no component of ``pipe`` ran meanwhile."""

    def refused(pipe, error, message, action) -> bool:
        with contextlib.ExitStack() as stack:
            runs = [stack.enter_context(model.watch_runs()) for model in pipe.onnx_models.values()]
            with pytest.raises(error, match=message):
                action()
        return not any(runs)

    return refused


@pytest.fixture(scope="session")
def with_vae_config():
    """``with_vae_config(folder, target, **changes)``: a copy of ``folder`` at ``target`` whose vae_decoder
    config.json has ``changes`` (a value of ``...``: the key left out)."""

    def copy(folder, target, **changes):
        shutil.copytree(folder, target)
        path = target / "vae_decoder" / "config.json"
        config = json.loads(path.read_text())
        for key, value in changes.items():
            if value is ...:
                config.pop(key, None)
            else:
                config[key] = value
        path.write_text(json.dumps(config))
        return target

    return copy

"""ORT's refusal of one graph session for a model file, remembered across loads (runtime/graph_refusals.py): the graph
pool asks ORT once per file, onnxruntime version, provider and provider options (not the per-process stream), asks
again when the file changes or the user gives sess_options, remembers only placement refusals, and works on where
the cache folder cannot be written. The pool's session maker is a stand-in
that refuses as ORT's CUDA provider does (no GPU here): what is under test is the pool's decision."""

from __future__ import annotations

import json
import os

import onnxruntime as ort
import pytest

from optimum_iobinding.runtime.cuda_policy import PLACEMENT_REFUSAL
from optimum_iobinding.runtime.graph_pool import GraphPool
from optimum_iobinding.runtime.graph_refusals import refusals_path, remember_refusal, remembered_refusal

CUDA = "CUDAExecutionProvider"
REFUSAL = (
    "onnxruntime could not load 'model.onnx': This session cannot use the CUDA Graph feature as requested by the user "
    f"as {PLACEMENT_REFUSAL} to the CUDA execution provider."
)


class Weights:
    def release_parse(self):
        pass


class RefusingRecipe:
    """A session recipe whose one graph session ORT refuses with ``error`` (counting the attempts)."""

    def __init__(self, source, error, sess_options=None, stream="1", **options):
        self.source, self.error = str(source), error
        self.providers = [CUDA, "CPUExecutionProvider"]
        self.provider_options = [{"user_compute_stream": stream, "has_user_compute_stream": "1", **options}, {}]
        self.sess_options = sess_options
        self.weights = Weights()
        self.attempts = 0

    def create(self, free_dims=None, provider_updates=None, quiet=False):
        self.attempts += 1
        raise self.error


def pool_of(recipe):
    return GraphPool(recipe, "auto", None, {}, ort.RunOptions())


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "optimum-iobinding"


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"a model")
    return path


def test_a_placement_refusal_is_asked_once_and_remembered_for_the_next_load(cache, model):
    first = RefusingRecipe(model, ValueError(REFUSAL))
    assert pool_of(first).shared_session() is None and first.attempts == 1
    assert json.loads((cache / "one-session-refusals.json").read_text())  # written under XDG_CACHE_HOME
    again = RefusingRecipe(model, ValueError(REFUSAL), stream="2")  # another process's stream
    pool = pool_of(again)
    assert pool.shared_session() is None and again.attempts == 0  # not asked again
    assert pool.shared_refused == REFUSAL and pool.shared_tried


def test_a_changed_file_another_provider_or_other_options_are_asked_again(cache, model):
    pool_of(RefusingRecipe(model, ValueError(REFUSAL))).shared_session()
    assert remembered_refusal(str(model), CUDA) == REFUSAL
    assert remembered_refusal(str(model), "TensorrtExecutionProvider") is None
    other_options = RefusingRecipe(model, ValueError(REFUSAL), prefer_nhwc="1")
    pool_of(other_options).shared_session()
    assert other_options.attempts == 1
    with_sess_options = RefusingRecipe(model, ValueError(REFUSAL), sess_options=ort.SessionOptions())
    pool_of(with_sess_options).shared_session()
    assert with_sess_options.attempts == 1  # the user's sess_options may place nodes otherwise: asked
    model.write_bytes(b"another model")  # another size
    os.utime(model, ns=(1, 1))
    again = RefusingRecipe(model, ValueError(REFUSAL))
    pool_of(again).shared_session()
    assert again.attempts == 1


def test_a_passing_failure_is_not_remembered(cache, model):
    out_of_memory = RefusingRecipe(model, RuntimeError("CUDA failure 2: out of memory"))
    pool_of(out_of_memory).shared_session()
    again = RefusingRecipe(model, RuntimeError("CUDA failure 2: out of memory"))
    pool_of(again).shared_session()
    assert again.attempts == 1 and remembered_refusal(str(model), CUDA) is None


def test_an_unwritable_or_broken_cache_only_costs_the_question(tmp_path, monkeypatch, model):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    remember_refusal(str(model), CUDA, REFUSAL)  # no error
    assert remembered_refusal(str(model), CUDA) is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    os.makedirs(os.path.dirname(refusals_path()))
    with open(refusals_path(), "w") as handle:
        handle.write("{not json")
    recipe = RefusingRecipe(model, ValueError(REFUSAL))
    pool_of(recipe).shared_session()
    assert recipe.attempts == 1 and remembered_refusal(str(model), CUDA) == REFUSAL  # the broken file replaced

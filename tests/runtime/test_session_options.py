"""A user's onnxruntime.SessionOptions reaches every session whole (its properties, its session config entries), is
never changed, and a setting of it that the project must override is refused by name."""

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from optimum_iobinding import IOBindingORTModel
from optimum_iobinding.errors import ArgumentError
from optimum_iobinding.runtime.session_options import (
    SESSION_CONFIG_KEYS,
    config_entry,
    copy_session_options,
    session_config_entries,
    session_option_properties,
)

# {}: the session is made from the user's own object; share_weights=True (owned weights on the CPU): from a copy
PATHS = pytest.mark.parametrize("settings", [{}, dict(share_weights=True)], ids=["as-given", "owned-weights"])


def weighted(make_model, tensor, scale: float):
    """y = x @ w with w a 32×32 float initializer (large enough to become an owned weight) of ``scale``."""
    weight = numpy_helper.from_array(np.full((32, 32), scale, dtype=np.float32), "w")
    return make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [tensor("x", TensorProto.FLOAT, ["n", 32])],
        [tensor("y", TensorProto.FLOAT, ["n", 32])],
        [weight],
    )


@pytest.fixture
def model_path(tmp_path, make_model, tensor):
    path = tmp_path / "model.onnx"
    path.write_bytes(weighted(make_model, tensor, 1.0).SerializeToString())
    return path


def state(options: ort.SessionOptions):
    """Everything a SessionOptions tells about itself."""
    return ({name: getattr(options, name) for name in session_option_properties()}, session_config_entries(options))


def test_the_copy_holds_every_property_ort_s_session_options_has():
    base = ort.SessionOptions()
    fresh = ort.SessionOptions()
    for name in session_option_properties():
        value = getattr(fresh, name)
        if isinstance(value, bool):
            changed = not value
        elif isinstance(value, int) and not hasattr(type(value), "__members__"):
            changed = 3 if name.startswith("log_") else value + 2
        elif isinstance(value, str):
            changed = f"/tmp/{name}"
        else:  # an enum of ORT's
            changed = next(member for member in type(value).__members__.values() if member != value)
        setattr(base, name, changed)
    copy = copy_session_options(base)
    for name in session_option_properties():
        assert getattr(copy, name) == getattr(base, name) != getattr(fresh, name), name
    assert {"enable_profiling", "profile_file_prefix", "optimized_model_filepath"} <= set(session_option_properties())


def test_the_copy_holds_every_session_config_entry_ort_documents():
    base = ort.SessionOptions()
    for index, key in enumerate(SESSION_CONFIG_KEYS):
        base.add_session_config_entry(key, str(index))
    copy = copy_session_options(base)
    assert session_config_entries(copy) == {key: str(index) for index, key in enumerate(SESSION_CONFIG_KEYS)}
    assert config_entry(copy, "session.use_env_allocators") == base.get_session_config_entry(
        "session.use_env_allocators"
    )
    assert config_entry(ort.SessionOptions(), "session.use_env_allocators") is None


@PATHS
def test_a_session_config_entry_of_the_user_reaches_the_session(model_path, settings):
    options = ort.SessionOptions()
    options.add_session_config_entry("session.use_env_allocators", "1")
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.intra_op_num_threads = 1
    model = IOBindingORTModel(model_path, sess_options=options, **settings)
    used = model.session.get_session_options()
    assert used.get_session_config_entry("session.use_env_allocators") == "1"
    assert used.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert used.intra_op_num_threads == 1
    if settings:  # what the project adds for owned weights on the CPU is there too
        assert used.get_session_config_entry("session.disable_prepacking") == "1"
    x = torch.ones(2, 32)
    assert torch.equal(model(x=x)[0], torch.full((2, 32), 32.0))


def test_a_config_entry_ort_does_not_document_reaches_a_session_made_from_the_users_object(model_path):
    options = ort.SessionOptions()
    options.add_session_config_entry("custom_op.my_setting", "7")
    model = IOBindingORTModel(model_path, sess_options=options)
    assert model.session.get_session_options().get_session_config_entry("custom_op.my_setting") == "7"


@PATHS
def test_profiling_of_the_user_reaches_the_session(model_path, tmp_path, settings):
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    model = IOBindingORTModel(model_path, sess_options=options, **settings)
    model(x=torch.ones(1, 32))
    written = model.session.end_profiling()
    assert written.startswith(str(tmp_path / "profile"))
    assert (tmp_path / written).is_file() and (tmp_path / written).stat().st_size > 0


@PATHS
def test_the_optimized_model_filepath_of_the_user_is_written(model_path, tmp_path, settings):
    options = ort.SessionOptions()
    target = tmp_path / "optimized.onnx"
    options.optimized_model_filepath = str(target)
    IOBindingORTModel(model_path, sess_options=options, **settings)
    assert target.is_file() and target.stat().st_size > 0


@PATHS
def test_the_users_object_is_unchanged_after_loading_and_running(model_path, tmp_path, settings):
    options = ort.SessionOptions()
    options.add_session_config_entry("session.use_env_allocators", "1")
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    before = state(options)
    model = IOBindingORTModel(model_path, sess_options=options, **settings)
    model(x=torch.ones(3, 32))
    model.session.end_profiling()
    assert state(options) == before
    assert config_entry(options, "session.disable_prepacking") is None
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL


def test_two_models_with_owned_weights_sharing_one_sess_options_each_read_their_own(tmp_path, make_model, tensor):
    # both name their weight "w": an initializer one model's session got through the user's object would reach the
    # other's (ORT refuses a second one of the same name, or reads the first model's)
    options = ort.SessionOptions()
    models = []
    for scale in (1.0, 2.0):
        path = tmp_path / f"model_{int(scale)}.onnx"
        path.write_bytes(weighted(make_model, tensor, scale).SerializeToString())
        models.append(IOBindingORTModel(path, sess_options=options, share_weights=True, reuse_outputs=False))
    x = torch.ones(2, 32)
    assert torch.equal(models[0](x=x)[0], torch.full((2, 32), 32.0))
    assert torch.equal(models[1](x=x)[0], torch.full((2, 32), 64.0))
    assert config_entry(options, "session.disable_prepacking") is None


def test_prepacking_the_user_asked_for_is_refused_with_owned_weights_on_the_cpu(model_path):
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_prepacking", "0")
    with pytest.raises(ArgumentError) as caught:
        IOBindingORTModel(model_path, sess_options=options, share_weights=True)
    assert caught.value.argument == "sess_options"
    assert "'session.disable_prepacking' is '0'" in caught.value.reason
    assert "owned weights on the CPU" in caught.value.reason and "needs '1'" in caught.value.reason
    IOBindingORTModel(model_path, sess_options=options)  # without owned weights nothing needs it: taken as it is


def test_a_layout_optimization_level_the_user_chose_is_refused_with_owned_weights_on_the_cpu(model_path):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_LAYOUT
    with pytest.raises(
        ArgumentError,
        match=r"sess_options: its graph_optimization_level is ORT_ENABLE_LAYOUT, but "
        r"owned weights on the CPU .* needs ORT_ENABLE_EXTENDED or lower",
    ):
        IOBindingORTModel(model_path, sess_options=options, share_weights=True)
    IOBindingORTModel(model_path, sess_options=options)
    # ORT's default level, which no object tells apart from a choice, is lowered for the session alone
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    model = IOBindingORTModel(model_path, sess_options=options, share_weights=True)
    used = model.session.get_session_options()
    assert used.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL

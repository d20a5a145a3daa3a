"""Which sessions share a device's ONNX Runtime arena: the rules, without a GPU (the arena's registration recorded)."""

import gc

import pytest

from optimum_iobinding.runtime.shared_arena import SharedArenas

OPTIONS = {"enable_cuda_graph": "1", "user_compute_stream": "111", "arena_extend_strategy": "kSameAsRequested"}
CUDA = "CUDAExecutionProvider"


class Session:
    """Stands for an ORT session: something the arena's members can be garbage-collected as."""


@pytest.fixture
def arenas():
    registered, synchronized = [], []
    arenas = SharedArenas(register=registered.append, synchronize=synchronized.append)
    arenas.registered, arenas.synchronized = registered, synchronized
    return arenas


def join(arenas, device=0, graph=True, **options):
    """A session made with ``options`` over :data:`OPTIONS`, if it may join: returned, so that it stays a member."""
    provider_options = {**OPTIONS, **options}
    if not arenas.may_join(device, CUDA, provider_options, graph=graph, user_sess_options=False):
        return None
    session = Session()
    arenas.joined(device, session)
    return session


def test_graph_sessions_of_one_stream_join_and_others_keep_their_own_arena(arenas):
    kept = [join(arenas)]
    assert arenas.synchronized == []  # nothing ran on the arena yet
    kept.append(join(arenas))
    assert all(kept) and arenas.members(0) == 2 and arenas.registered == [0]  # registered once, on the first
    assert arenas.synchronized == [0]  # the first member's kernels done before the second's weights come
    assert join(arenas, user_compute_stream="222") is None  # another stream: its runs are not ordered with these
    assert join(arenas, graph=False) is None  # a session the project's graph runners do not capture
    assert join(arenas, gpu_mem_limit="1000") is None  # the user's own arena settings
    assert join(arenas, arena_extend_strategy="kNextPowerOfTwo") is None
    assert join(arenas, gpu_external_alloc="1234") is None
    assert not arenas.may_join(0, CUDA, OPTIONS, graph=True, user_sess_options=True)  # the user's session options
    assert not arenas.may_join(0, "TensorrtExecutionProvider", OPTIONS, graph=True, user_sess_options=False)
    assert arenas.members(0) == 2 and arenas.joined_count(0) == 2
    other_device = join(arenas, device=1, user_compute_stream="333")  # a device of its own, with its own stream
    assert other_device is not None and arenas.registered == [0, 1] and arenas.members(1) == 1


def test_no_session_joins_after_a_capture_until_every_member_is_gone(arenas):
    kept = [join(arenas), join(arenas)]
    arenas.close(0)  # a graph captured: memory it replays into may be handed to a new session's prepacked weights
    assert join(arenas) is None and arenas.members(0) == 2
    kept.pop()
    gc.collect()
    assert arenas.members(0) == 1 and join(arenas) is None  # one member, and its graphs, left
    kept.clear()
    gc.collect()
    assert arenas.members(0) == 0
    synchronized = len(arenas.synchronized)
    later = join(arenas, user_compute_stream="444")  # nothing can replay into the arena: open again, to any stream
    assert later is not None and arenas.members(0) == 1 and arenas.joined_count(0) == 3
    assert len(arenas.synchronized) == synchronized + 1  # after the old stream's last kernels


def test_a_capture_before_any_member_closes_nothing_and_a_refused_session_leaves(arenas):
    arenas.close(0)  # a graph of a session outside the arena: its memory is its own arena's
    assert arenas.may_join(0, CUDA, OPTIONS, graph=True, user_sess_options=False)
    arenas.not_made(0)  # ORT refused the session
    assert arenas.members(0) == 0 and arenas.joined_count(0) == 0
    assert join(arenas, user_compute_stream="555") is not None  # the refused one held no stream


def test_a_device_whose_arena_ort_refuses_keeps_each_sessions_own_arena():
    tries = []

    def refuse(device):
        tries.append(device)
        raise RuntimeError("no CUDA provider in this onnxruntime")

    arenas = SharedArenas(register=refuse, synchronize=lambda device: None)
    assert join(arenas) is None and join(arenas) is None
    assert tries == [0] and arenas.members(0) == 0  # asked once


def test_an_onnx_runtime_session_leaves_the_arena_when_it_is_collected(arenas):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    assert arenas.may_join(0, CUDA, OPTIONS, graph=True, user_sess_options=False)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    arenas.joined(0, session)
    assert arenas.members(0) == 1
    del session
    gc.collect()
    assert arenas.members(0) == 0

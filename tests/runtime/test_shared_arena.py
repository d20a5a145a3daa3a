"""Which sessions share a device's ONNX Runtime arena: the rules, without a GPU (the arena's registration recorded)."""

import gc

import pytest

from optimum_iobinding.runtime.shared_arena import SharedArenas

GRAPH = {"enable_cuda_graph": "1", "user_compute_stream": "111", "arena_extend_strategy": "kSameAsRequested"}
CUDA = "CUDAExecutionProvider"


class Session:
    """Stands for an ORT session: something the arena's members can be garbage-collected as."""


@pytest.fixture
def arenas():
    registered = []
    arenas = SharedArenas(register=registered.append)
    arenas.registered = registered
    return arenas


def join(arenas, device=0, **options):
    """A session made with ``options`` over :data:`GRAPH`, if it may join: returned, so that it stays a member."""
    provider_options = {**GRAPH, **options}
    if not arenas.may_join(device, CUDA, provider_options, user_sess_options=False):
        return None
    session = Session()
    arenas.joined(device, session)
    return session


def test_graph_sessions_of_one_stream_join_and_others_keep_their_own_arena(arenas):
    kept = [join(arenas), join(arenas)]
    assert all(kept) and arenas.members(0) == 2 and arenas.registered == [0]  # registered once, on the first
    assert join(arenas, user_compute_stream="222") is None  # another stream: its runs are not ordered with these
    assert join(arenas, enable_cuda_graph="0") is None  # not a graph session of the project's
    assert join(arenas, gpu_mem_limit="1000") is None  # the user's own arena settings
    assert join(arenas, arena_extend_strategy="kNextPowerOfTwo") is None
    assert not arenas.may_join(0, CUDA, GRAPH, user_sess_options=True)  # the user's session options
    assert not arenas.may_join(0, "TensorrtExecutionProvider", GRAPH, user_sess_options=False)
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
    later = join(arenas, user_compute_stream="444")  # nothing can replay into the arena: open again, to any stream
    assert later is not None and arenas.members(0) == 1 and arenas.joined_count(0) == 3


def test_a_capture_before_any_member_closes_nothing_and_a_refused_session_leaves(arenas):
    arenas.close(0)  # a graph of a session outside the arena: its memory is its own arena's
    assert arenas.may_join(0, CUDA, GRAPH, user_sess_options=False)
    arenas.not_made(0)  # ORT refused the session
    assert arenas.members(0) == 0 and arenas.joined_count(0) == 0
    assert join(arenas, user_compute_stream="555") is not None  # the refused one held no stream


def test_a_device_whose_arena_ort_refuses_keeps_each_sessions_own_arena():
    tries = []

    def refuse(device):
        tries.append(device)
        raise RuntimeError("no CUDA provider in this onnxruntime")

    arenas = SharedArenas(register=refuse)
    assert join(arenas) is None and join(arenas) is None
    assert tries == [0] and arenas.members(0) == 0  # asked once

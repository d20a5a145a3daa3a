"""The fixtures every test file shares, all built offline (nothing is downloaded): tiny ONNX models made in memory
with onnx.helper, the tiny random-weights Stable Diffusion export, random LoRAs, and helpers the pipelines' tests
share."""

from __future__ import annotations

import contextlib
import json
import shutil
from typing import Iterable, Sequence

import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

OPSET = 17
IR_VERSION = 9  # the newest onnx writes IR versions this onnxruntime cannot read

requires_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()),
    reason="needs a CUDA GPU, a CUDA build of torch and onnxruntime-gpu",
)


def tensor(name: str, elem_type: int, dims: Sequence | None):
    return helper.make_tensor_value_info(name, elem_type, dims)


def make_model(
    nodes: Iterable[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "test", list(inputs), list(outputs), initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    return model


def make_session(model: onnx.ModelProto, provider: str = "CPUExecutionProvider") -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=[provider])


@pytest.fixture
def concat_model() -> onnx.ModelProto:
    """y = concat(x, x) on axis 0, declared with an expression dim: x [batch, h] → y [2*batch, h]."""
    return make_model(
        [helper.make_node("Concat", ["x", "x"], ["y"], axis=0)],
        [tensor("x", TensorProto.FLOAT, ["batch", "h"])],
        [tensor("y", TensorProto.FLOAT, ["2*batch", "h"])],
    )


@pytest.fixture
def three_output_model() -> onnx.ModelProto:
    """sum = a + b (float), rounded = int64(a), greater = a > b (bool)."""
    return make_model(
        [
            helper.make_node("Add", ["a", "b"], ["sum"]),
            helper.make_node("Cast", ["a"], ["rounded"], to=TensorProto.INT64),
            helper.make_node("Greater", ["a", "b"], ["greater"]),
        ],
        [tensor("a", TensorProto.FLOAT, ["batch", 3]), tensor("b", TensorProto.FLOAT, ["batch", 3])],
        [
            tensor("sum", TensorProto.FLOAT, ["batch", 3]),
            tensor("rounded", TensorProto.INT64, ["batch", 3]),
            tensor("greater", TensorProto.BOOL, ["batch", 3]),
        ],
    )


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """The tiny random-weights Stable Diffusion pipeline exported to the ONNX layout (fp32, unfused), once per test
    process; tests only read it."""
    from optimum_iobinding.export import export_pipeline

    return export_pipeline(None, tmp_path_factory.mktemp("tiny") / "sd", tiny_random=True, progress=False)


def make_lora(pipe, folder, seed, unet_targets, text_targets=(), rank=4, text_rank=2, text_encoder="text_encoder"):
    """A LoRA file of random (non-zero) updates for the diffusers pipeline ``pipe`` in diffusers' format: the UNet's
    ``unet_targets`` and, with ``text_targets``, those of ``text_encoder`` (no peft needed: the GPU machine has none)."""
    from optimum_iobinding.export.tiny import random_lora_layers, save_lora

    layers = {"unet": random_lora_layers(pipe.unet, unet_targets, rank, seed)}
    if text_targets:
        layers[text_encoder] = random_lora_layers(getattr(pipe, text_encoder), text_targets, text_rank, seed + 1000)
    return save_lora(folder, **layers)


class _ModeOnly:
    """A latent distribution whose sample is its mode (what the export's VAE encoder gives)."""

    def __init__(self, distribution):
        self.distribution = distribution

    def sample(self, generator=None):
        return self.distribution.mode()

    def mode(self):
        return self.distribution.mode()


def vae_encodes_its_mode(pipe):
    """A diffusers torch pipeline whose VAE encoder gives the latent distribution's mode instead of a sample, as the
    ONNX export's encoder does (and diffusers' ONNX img2img): so img2img and inpainting images can be compared."""
    encode = pipe.vae.encode
    pipe.vae.encode = lambda sample, **kwargs: type("Encoded", (), {
        "latent_dist": _ModeOnly(encode(sample, **kwargs).latent_dist)})()
    return pipe


def with_vae_config(folder, target, **changes):
    """A copy of ``folder`` whose vae_decoder config.json has ``changes`` (a value of ``...``: the key left out)."""
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


def refused_runs_nothing(pipe, error, message, action):
    """Runs ``action``, expects it refused, and whether no component of ``pipe`` ran meanwhile."""
    with contextlib.ExitStack() as stack:
        runs = [stack.enter_context(model.watch_runs()) for model in pipe.onnx_models.values()]
        with pytest.raises(error, match=message):
            action()
    return not any(runs)


def flood_statuses(folder, url: str, name: str, requests: int, steps: int, size: int, post) -> list:
    """The HTTP statuses of ``requests`` requests sent at once to a CPU deployment ``name`` of ``folder`` on the
    running Serve at ``url``, which holds one request in its replica and queues one more (``max_ongoing_requests`` =
    ``max_queued_requests`` = 1); ``post(url, body)`` answers a tuple whose first item is the status. The deployment is
    deleted afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    from ray import serve

    from optimum_iobinding.serve import ServeConfig, build_app

    config = ServeConfig(model=str(folder), device="cpu", max_batch_size=1, steps=steps, warmup_batch_sizes=[],
                         max_ongoing_requests=1, max_queued_requests=1)
    serve.run(build_app(config), name=name, route_prefix=f"/{name}", blocking=False)
    try:
        bodies = [dict(prompt="busy", seed=i, size=size) for i in range(requests)]
        with ThreadPoolExecutor(len(bodies)) as pool:
            return [answer[0] for answer in pool.map(lambda body: post(f"{url}/{name}", body), bodies)]
    finally:
        serve.delete(name)

"""The fixtures every test folder shares, all built offline (nothing is downloaded): tiny ONNX models made in memory
with onnx.helper, the tiny random-weights exports that tests in more than one folder run on, random LoRAs, and the
``gpu`` marker's skip where there is no CUDA."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Sequence

import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

OPSET = 17
IR_VERSION = 9  # the newest onnx writes IR versions this onnxruntime cannot read

HAS_CUDA = torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()


def _one_thread(options: ort.SessionOptions) -> ort.SessionOptions:
    """``options`` with one intra-op and one inter-op thread that do not spin while idle, and without ORT's memory
    reuse and memory pattern: planning them is about two thirds of a tiny UNet's session creation on the CPU (the
    allocation planner, ~0.3 s of ~0.45 s), and the tests create a thousand sessions; at these sizes they save
    nothing. Outputs are unchanged: the plans only place intermediate tensors."""
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    options.enable_mem_reuse = False
    options.enable_mem_pattern = False
    return options


def _keep_to_one_thread() -> None:
    """pytest-xdist runs a test process per core (scripts/test.sh: -n auto): each keeps to one thread, torch's and
    ORT's, so that the processes do not take each other's cores (ORT's idle threads spin by default). A session made
    without options (the project's own when no ``sess_options`` is given, or a test's) gets these options
    (:func:`_one_thread`); one made with a caller's options keeps them as they are."""
    import optimum_iobinding.runtime.session as session_module

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    copy_session_options = session_module.copy_session_options
    session_module.copy_session_options = lambda base: (
        _one_thread(copy_session_options(None)) if base is None else copy_session_options(base)
    )
    init = ort.InferenceSession.__init__

    def one_thread_init(self, path_or_bytes, sess_options=None, *args, **kwargs):
        init(
            self,
            path_or_bytes,
            _one_thread(ort.SessionOptions()) if sess_options is None else sess_options,
            *args,
            **kwargs,
        )

    ort.InferenceSession.__init__ = one_thread_init


if os.environ.get("PYTEST_XDIST_WORKER"):
    _keep_to_one_thread()


def pytest_configure(config):
    """Under ``--dist loadgroup`` the tests marked ``xdist_group`` (those starting Ray) run in one process.
    pytest-xdist 3.8 names a test's group in its id by an attribute pytest 9.2 no longer reads, so with that pytest
    a group would be spread over the processes, silently (each starting its own Ray clusters)."""
    if getattr(config.option, "dist", None) != "loadgroup":
        return
    from importlib.metadata import version

    from packaging.version import Version

    if Version(pytest.__version__) >= Version("9.2") and Version(version("pytest-xdist")) <= Version("3.8.0"):
        raise pytest.UsageError(
            f"--dist loadgroup cannot group tests with pytest {pytest.__version__} and "
            f"pytest-xdist {version('pytest-xdist')}: install the pytest of constraints.txt"
        )


def pytest_addoption(parser):
    parser.addoption(
        "--first-case-only",
        action="store_true",
        help="run each parametrized test with its first parameter set only (the optimum environment's run: what "
        "other library versions can change is seen in one case of each test)",
    )


def pytest_collection_modifyitems(config, items):
    """With ``--first-case-only`` each test function keeps its first case. Tests marked ``gpu`` (setup.cfg declares
    the marker) skip where CUDA is missing."""
    if config.getoption("--first-case-only"):
        kept, dropped, functions = [], [], set()
        for item in items:
            function = item.nodeid.split("[")[0]
            (dropped if function in functions else kept).append(item)
            functions.add(function)
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU, a CUDA build of torch and onnxruntime-gpu")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# ------------------------------------------------------------------------------------------ tiny models in memory
def _tensor(name: str, elem_type: int, dims: Sequence | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, dims)


def _make_model(
    nodes: Iterable[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "test", list(inputs), list(outputs), initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    return model


def _make_session(model: onnx.ModelProto, provider: str = "CPUExecutionProvider") -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=[provider])


@pytest.fixture(scope="session")
def tensor():
    """``tensor(name, elem_type, dims)``: an input or output declaration (dims: sizes, names, expressions or None)."""
    return _tensor


@pytest.fixture(scope="session")
def make_model():
    """``make_model(nodes, inputs, outputs, initializers=())``: a checked ONNX model at an opset and IR version this
    onnxruntime reads."""
    return _make_model


@pytest.fixture(scope="session")
def make_session():
    """``make_session(model, provider="CPUExecutionProvider")``: an InferenceSession of an in-memory model."""
    return _make_session


@pytest.fixture
def concat_model() -> onnx.ModelProto:
    """y = concat(x, x) on axis 0, declared with an expression dim: x [batch, h] → y [2*batch, h]."""
    return _make_model(
        [helper.make_node("Concat", ["x", "x"], ["y"], axis=0)],
        [_tensor("x", TensorProto.FLOAT, ["batch", "h"])],
        [_tensor("y", TensorProto.FLOAT, ["2*batch", "h"])],
    )


@pytest.fixture
def three_output_model() -> onnx.ModelProto:
    """sum = a + b (float), rounded = int64(a), greater = a > b (bool)."""
    return _make_model(
        [
            helper.make_node("Add", ["a", "b"], ["sum"]),
            helper.make_node("Cast", ["a"], ["rounded"], to=TensorProto.INT64),
            helper.make_node("Greater", ["a", "b"], ["greater"]),
        ],
        [_tensor("a", TensorProto.FLOAT, ["batch", 3]), _tensor("b", TensorProto.FLOAT, ["batch", 3])],
        [
            _tensor("sum", TensorProto.FLOAT, ["batch", 3]),
            _tensor("rounded", TensorProto.INT64, ["batch", 3]),
            _tensor("greater", TensorProto.BOOL, ["batch", 3]),
        ],
    )


# ------------------------------------------------------------------------------------------------------ folders
def _hashes(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="session")
def snapshot():
    """``snapshot(folder)``: every file under ``folder`` with the hash of its bytes."""
    return _hashes


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if a command gets as far as loading a pipeline (Stable Diffusion's, the stream's, FLUX.1's),
    exporting one, building the tiny model or starting a server: what a refused command must not reach."""
    import importlib.util

    import optimum_iobinding.export as export
    import optimum_iobinding.pipelines as pipelines
    from optimum_iobinding import cli

    def reached(*args, **kwargs):
        raise AssertionError("the command started working before it checked its arguments")

    for name in ("OnnxStableDiffusionPipeline", "OnnxStreamDiffusionPipeline", "OnnxFluxPipeline"):
        monkeypatch.setattr(getattr(pipelines, name), "from_pretrained", reached)
    monkeypatch.setattr(export, "export_pipeline", reached)
    monkeypatch.setattr(cli, "tiny_model_folder", reached)
    if importlib.util.find_spec("ray") is not None:
        import optimum_iobinding.serve as serve

        monkeypatch.setattr(serve, "run", reached)


@pytest.fixture(scope="session")
def shared_export(tmp_path_factory):
    """``shared_export(name, write)``: the folder ``write(folder)`` makes, made once per test run — by the first test
    process (pytest-xdist worker) and module that asks for ``name``, under a file lock — and read by all the others:
    the tiny exports are deterministic (seeded), so one is as good as another, and exporting is most of what a tiny
    model costs. Tests only read these folders; each is checked unchanged when the process ends."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-exports"
    root.mkdir(exist_ok=True)
    made = {}

    def export(name: str, write) -> Path:
        target = root / name
        with FileLock(str(root / f"{name}.lock")):
            if not target.is_dir():
                partial = root / f"{name}.partial"
                shutil.rmtree(partial, ignore_errors=True)
                write(partial)
                partial.rename(target)
        made.setdefault(name, _hashes(target))
        return target

    yield export
    changed = [name for name, hashes in made.items() if _hashes(root / name) != hashes]
    assert not changed, f"tests changed the shared exports {changed}: copy a shared folder before changing it"


def _exported(**kwargs):
    """``write(folder)`` for :func:`shared_export`: ``export_pipeline(None, folder, **kwargs)``."""

    def write(folder: Path) -> None:
        from optimum_iobinding.export import export_pipeline

        export_pipeline(None, folder, progress=False, **kwargs)

    return write


@pytest.fixture(scope="session")
def tiny_folder(shared_export):
    """The tiny random-weights Stable Diffusion pipeline exported to the ONNX layout (fp32, unfused), once per test
    run; tests only read it."""
    return shared_export("tiny-sd", _exported(tiny_random=True))


@pytest.fixture(scope="session")
def tiny_fused_folder(shared_export):
    """The same pipeline exported fused for the CPU (ORT's optimizer, ``optimize="cpu"``), once per test run; tests
    only read it."""
    return shared_export("tiny-sd-fused", _exported(tiny_random=True, optimize="cpu"))


@pytest.fixture
def tiny_unet_external(tiny_folder, tmp_path):
    """The tiny UNet's model.onnx (its weights inside it) saved again with every weight in an external data file
    beside it (``model.weights``), in ``tmp_path``: what an export of a large model reads its weights from."""
    import onnx

    path = tmp_path / "model.onnx"
    onnx.save_model(
        onnx.load(str(tiny_folder / "unet" / "model.onnx")),
        str(path),
        save_as_external_data=True,
        location="model.weights",
        size_threshold=0,
    )
    return path


@pytest.fixture
def copy_of(tiny_folder, tmp_path):
    """``copy_of(**config_changes)``: a copy of tiny_folder whose components' config.json files have the changes
    (a component's keyword names its folder, ``__`` for ``/``)."""

    def copy(**config_changes):
        folder = tmp_path / "copy"
        shutil.copytree(tiny_folder, folder)
        for relative, changes in config_changes.items():
            path = folder / relative.replace("__", "/") / "config.json"
            config = json.loads(path.read_text())
            config.update(changes)
            path.write_text(json.dumps(config))
        return folder

    return copy


# --------------------------------------------------------------------------- tiny random exports of every family
# Each torch pipeline is made once per test module that uses it (the module's to change); the exports are shared.
class _ModeOnly:
    """A latent distribution whose sample is its mode (what the export's VAE encoder gives)."""

    def __init__(self, distribution):
        self.distribution = distribution

    def sample(self, generator=None):
        return self.distribution.mode()

    def mode(self):
        return self.distribution.mode()


def _vae_encodes_its_mode(pipe):
    encode = pipe.vae.encode
    pipe.vae.encode = lambda sample, **kwargs: type(
        "Encoded", (), {"latent_dist": _ModeOnly(encode(sample, **kwargs).latent_dist)}
    )()
    return pipe


@pytest.fixture(scope="session")
def vae_encodes_its_mode():
    """``vae_encodes_its_mode(pipe)``: the diffusers torch pipeline ``pipe`` with a VAE encoder that gives the latent
    distribution's mode instead of a sample, as the ONNX export's encoder does (and diffusers' ONNX img2img): so
    img2img and inpainting images can be compared."""
    return _vae_encodes_its_mode


def _torch_and_export(torch_pipe, shared_export, name):
    """Diffusers' torch pipeline ``torch_pipe`` (the module's own, to change) and its export, shared as ``name`` (the
    builders are seeded: every module's pipeline has the same weights)."""
    torch_pipe.set_progress_bar_config(disable=True)
    return torch_pipe, shared_export(name, _exported(torch_pipeline=torch_pipe))


@pytest.fixture(scope="session")
def xl_folder(shared_export):
    """The tiny random SDXL pipeline's export."""
    from optimum_iobinding.export import export_pipeline

    return shared_export("xl", lambda target: export_pipeline(None, target, tiny_random="xl", progress=False))


@pytest.fixture(scope="module")
def lcm(shared_export):
    """The tiny random Latent Consistency Model: diffusers' torch pipeline (its VAE encoder giving the mode, as the
    export's does) and its export."""
    from optimum_iobinding.export.tiny import build_tiny_random_lcm_pipeline

    torch_pipe, folder = _torch_and_export(build_tiny_random_lcm_pipeline(), shared_export, "lcm")
    return _vae_encodes_its_mode(torch_pipe), folder


@pytest.fixture(scope="module")
def sd3(shared_export):
    """The tiny random Stable Diffusion 3 pipeline: diffusers' torch pipeline and its export."""
    from optimum_iobinding.export.tiny import build_tiny_random_sd3_pipeline

    return _torch_and_export(build_tiny_random_sd3_pipeline(), shared_export, "sd3")


@pytest.fixture(scope="module")
def sd3_without_t5(shared_export):
    """The tiny random Stable Diffusion 3 pipeline without its T5 encoder: diffusers' torch pipeline and its export."""
    from optimum_iobinding.export.tiny import build_tiny_random_sd3_pipeline

    return _torch_and_export(build_tiny_random_sd3_pipeline(with_t5=False), shared_export, "sd3-without-t5")


@pytest.fixture(scope="module")
def schnell(shared_export):
    """The tiny random FLUX.1 schnell pipeline (no guidance embedding): diffusers' torch pipeline and its export."""
    from optimum_iobinding.export.tiny import build_tiny_random_flux_pipeline

    return _torch_and_export(build_tiny_random_flux_pipeline(0, guidance_embeds=False), shared_export, "schnell")


@pytest.fixture(scope="module")
def dev(shared_export):
    """The tiny random FLUX.1 dev pipeline (a guidance embedding): diffusers' torch pipeline and its export."""
    from optimum_iobinding.export.tiny import build_tiny_random_flux_pipeline

    return _torch_and_export(build_tiny_random_flux_pipeline(0, guidance_embeds=True), shared_export, "dev")


@pytest.fixture(params=["schnell", "dev"])
def flux(request):
    """Each tiny random FLUX.1 pipeline in turn (schnell, dev): diffusers' torch pipeline and its export."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def vae_folder(shared_export):
    """A folder of the tiny random tiny VAE (diffusers' AutoencoderTiny) alone: vae_encoder/ and vae_decoder/."""
    return shared_export("taesd", _exported(tiny_vae=True))


@pytest.fixture(scope="session")
def controlnet_folders(shared_export):
    """The tiny random ControlNet pipeline's exports: with one ControlNet ("one") and with two ("two")."""
    from optimum_iobinding.export.tiny import build_tiny_random_controlnet_pipeline

    def two(folder):
        _exported(torch_pipeline=build_tiny_random_controlnet_pipeline(controlnets=2))(folder)

    return {
        "one": shared_export("controlnet-one", _exported(tiny_random="controlnet")),
        "two": shared_export("controlnet-two", two),
    }


@pytest.fixture(scope="session")
def make_lora():
    """``make_lora(pipe, folder, seed, unet_targets, text_targets=(), rank=4, text_rank=2,
    text_encoder="text_encoder")``: a LoRA file of random (non-zero) updates for the diffusers pipeline ``pipe`` in
    diffusers' format: the UNet's ``unet_targets`` and, with ``text_targets``, those of ``text_encoder`` (no peft
    needed: the GPU machine has none)."""

    def make(pipe, folder, seed, unet_targets, text_targets=(), rank=4, text_rank=2, text_encoder="text_encoder"):
        from optimum_iobinding.export.tiny import random_lora_layers, save_lora

        layers = {"unet": random_lora_layers(pipe.unet, unet_targets, rank, seed)}
        if text_targets:
            layers[text_encoder] = random_lora_layers(getattr(pipe, text_encoder), text_targets, text_rank, seed + 1000)
        return save_lora(folder, **layers)

    return make

"""ONNX Runtime's transformer optimizer (attention and other fusions) and float16 conversion, applied to one exported
component with its weights kept on disk; and writing a model with external data where it is large."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Optional

import onnx
import torch

logger = logging.getLogger(__name__)

EXTERNAL_DATA_FILE = "weights.pb"
# Protobuf cannot serialize a message over 2 GiB; keep well below it in one file.
MAX_SINGLE_FILE_BYTES = 1 << 30


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the initializers (what decides whether a model fits one protobuf; ByteSize() itself fails > 2 GiB)."""
    return sum(len(t.raw_data) or 4 * (len(t.float_data) + len(t.int32_data)) + 8 * len(t.int64_data)
               for t in model.graph.initializer)


def save_onnx(model: onnx.ModelProto, path: Path, threshold: int = MAX_SINGLE_FILE_BYTES,
              external_data_file: str = EXTERNAL_DATA_FILE) -> bool:
    """Writes ``model`` to ``path``: one file, or with its weights in one ``external_data_file`` beside it where they
    are over ``threshold`` bytes. Returns whether it wrote external data."""
    path.parent.mkdir(parents=True, exist_ok=True)
    external = weight_bytes(model) > threshold
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=external_data_file, size_threshold=1024)
    else:
        onnx.save_model(model, str(path))
    return external


def convert_to_float16(model: onnx.ModelProto, shapes_known: bool = False) -> onnx.ModelProto:
    """fp32 → fp16 with ORT's converter: inputs and outputs become fp16 too (``keep_io_types=False``), the ops in
    its default block list (those that need fp32) stay fp32 behind casts. The converter needs every intermediate's
    type; ``shapes_known`` says the model already carries them (its own inference cannot serialize > 2 GiB)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    return convert_float_to_float16(model, keep_io_types=False, disable_shape_infer=shapes_known)


# ORT's optimizer model type of each kind of component.
OPTIMIZER_MODEL_TYPES = {"text_encoder": "clip", "text_encoder_2": "clip", "unet": "unet", "vae_encoder": "vae",
                         "vae_decoder": "vae", "controlnet": "unet"}


def _kind(name: str) -> str:
    """A component's kind: ``controlnet_1``, ``controlnet_2`` … are ControlNets like ``controlnet``."""
    return "controlnet" if name.startswith("controlnet") else name


def optimizer_model_type(name: str) -> str:
    """The ``model_type`` ORT's transformer optimizer takes for the component ``name`` (``"unet"``, ``"vae"`` or
    ``"clip"``)."""
    return OPTIMIZER_MODEL_TYPES[_kind(name)]


# The hidden sizes ORT's BiasSplitGelu kernel takes (other widths must skip that fusion).
BIAS_SPLIT_GELU_HIDDEN_SIZES = (2560, 5120, 6144, 10240, 12288)


# fusions whose fused operators have CUDA kernels only
CUDA_ONLY_FUSIONS = ("enable_nhwc_conv", "enable_group_norm", "enable_skip_group_norm", "enable_bias_splitgelu",
                     "enable_bias_add", "enable_packed_qkv", "enable_packed_kv")


def fusion_options_for(model_type: str, target: str) -> Any:
    """ORT's fusions for ``model_type`` on ``target`` (``"cpu"``: only fusions whose fused operators have CPU
    kernels, see :data:`CUDA_ONLY_FUSIONS`)."""
    from onnxruntime.transformers.fusion_options import FusionOptions

    options = FusionOptions(model_type)
    if target == "cpu":
        for flag in CUDA_ONLY_FUSIONS:
            if hasattr(options, flag):
                setattr(options, flag, False)
    return options


def fusion_options(name: str, config: Any, target: str):
    """ORT transformer-optimizer fusions for one component.

    ``target="cuda"``: every fusion ORT has for the model type, except BiasSplitGelu where the UNet's GEGLU widths
    are not among :data:`BIAS_SPLIT_GELU_HIDDEN_SIZES`, and GroupNorm for blocks narrower than ORT's kernel takes.
    ``target="cpu"``: only fusions whose fused ops have CPU kernels (attention, layer norm, GELU) — NhwcConv,
    GroupNorm, SkipGroupNorm, BiasSplitGelu and BiasAdd run on CUDA only.
    """
    name = _kind(name)
    options = fusion_options_for(optimizer_model_type(name), target)
    if target != "cpu":
        channels = list(config.get("block_out_channels", [])) if isinstance(config, dict) else \
            list(getattr(config, "block_out_channels", []))
        if name in ("unet", "controlnet") and not all(8 * c in BIAS_SPLIT_GELU_HIDDEN_SIZES for c in channels):
            options.enable_bias_splitgelu = False
        # ORT's CUDA GroupNorm takes only some channel counts (it refuses 32 channels in 32 groups, for one): the
        # SD-size widths it was written for, UNet blocks of ≥ 320 and VAE blocks of ≥ 128 channels
        smallest = {"unet": 320, "controlnet": 320, "vae_encoder": 128, "vae_decoder": 128}.get(name)
        if smallest is not None and channels and min(channels) < smallest:
            for flag in ("enable_group_norm", "enable_skip_group_norm"):
                if hasattr(options, flag):
                    setattr(options, flag, False)
    return options


def use_classic_attention(module: torch.nn.Module) -> None:
    """ORT's UNet attention fusion fails on graphs exported from SDPA attention (a TypeError in get_num_heads) and
    fuses the classic processor's MatMul/Softmax pattern into MultiHeadAttention: export with the classic one."""
    from diffusers.models.attention_processor import AttnProcessor

    for child in module.modules():
        if hasattr(child, "set_attn_processor") and hasattr(child, "attn_processors"):
            child.set_attn_processor(AttnProcessor())
            return


@contextlib.contextmanager
def in_folder(folder: Path):
    """ORT's fusion and shape-inference code reads initializers with ``numpy_helper.to_array(tensor)``, which resolves
    external data relative to the working directory: run it from the model's folder. (The working directory is the
    process's: exporting is not something to run on two threads at once.)"""
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


def load_light(path: Path) -> onnx.ModelProto:
    """The model at ``path`` with every initializer over 1 KiB left on disk beside it (read on demand).

    ORT's symbolic shape inference copies the whole ModelProto, weights included, in the passes that use it: on the
    SD1.5 UNet (3.4 GB fp32) its ``remove_useless_reshape_nodes`` pass alone went past 24 GB and was killed, and on
    the SDXL UNet each such pass took minutes. Without the weights in the proto the same fusions need about the
    memory of the weights alone. The exporter already writes large models this way; a small one is rewritten so."""
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(path), load_external_data=False)
    if not any(uses_external_data(tensor) for tensor in model.graph.initializer):
        model = unload(model, path)
    return model


def unload(model: onnx.ModelProto, path: Path) -> onnx.ModelProto:
    """Writes ``model`` to ``path`` with its weights beside it and returns it loaded light (see :func:`load_light`)."""
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.stem + ".weights", size_threshold=1024)
    return onnx.load(str(path), load_external_data=False)


def optimize_component(name: str, path: Path, options: Any, target: str, model_type: Optional[str] = None):
    """ORT's transformer optimizer on the model at ``path``, its weights left on disk while the graph is rewritten
    (:func:`load_light`; fusions that need a weight read it from there); where its attention fusion breaks on a
    graph (the VAE's attention exported by the classic processor trips ``get_num_heads_and_hidden_size``: the export
    writes the VAE's attention fused itself, see :mod:`.attention`), the component is optimized again without it.
    ``model_type``: ORT's model type (default: the one of the UNet family's component ``name``, see
    :func:`optimizer_model_type`). Returns ORT's ``OnnxModel``; initializers it did not touch are still on disk in
    ``path``'s folder: load them (``onnx.load_external_data_for_model``) before that folder goes."""
    from onnxruntime.transformers.optimizer import optimize_model

    model_type = optimizer_model_type(name) if model_type is None else model_type

    def run(fusions):
        with in_folder(path.parent):
            return optimize_model(load_light(path), model_type=model_type, opt_level=0,
                                  optimization_options=fusions, use_gpu=target == "cuda")

    try:
        return run(options)
    except Exception as error:  # the fusion scripts raise whatever the numpy code under them raises
        if not options.enable_attention:
            raise
        logger.warning("%s: ORT's attention fusion failed (%s: %s); optimizing without it", name,
                       type(error).__name__, error)
        options.enable_attention = False
        return run(options)


def optimized_to_float16(optimized: Any, folder: Path) -> onnx.ModelProto:
    """What ORT's ``OnnxModel.convert_float_to_float16(keep_io_types=False)`` does — symbolic type inference (onnx's
    own cannot type the fused com.microsoft ops), its float16 converter, then removing cascaded and useless Casts —
    with the weights on disk in ``folder`` for the two inference passes and in memory only for the conversion."""
    from onnx import ValueInfoProto
    from onnxruntime.transformers.float16 import convert_float_to_float16
    from onnxruntime.transformers.onnx_model import OnnxModel
    from onnxruntime.transformers.shape_infer_helper import SymbolicShapeInferenceHelper

    model = optimized.model
    try:
        with in_folder(folder):
            typed = SymbolicShapeInferenceHelper(model).infer_shapes(model, auto_merge=True, guess_output_rank=False)
    except Exception as error:  # ORT goes on without the types, warning; so do we, saying why
        logger.warning("ORT's symbolic shape inference failed before the float16 conversion (%s: %s); converting "
                       "without its types", type(error).__name__, error)
        typed = None
    # element types only, as ORT merges them (auto_merge may widen shapes: microsoft/onnxruntime#15521)
    known = {info.name for info in model.graph.value_info}
    for info in (typed.graph.value_info if typed is not None else ()):
        if info.name and info.name not in known and info.type.tensor_type.elem_type != onnx.TensorProto.UNDEFINED:
            typed_only = ValueInfoProto()
            typed_only.CopyFrom(info)
            typed_only.type.tensor_type.ClearField("shape")
            model.graph.value_info.append(typed_only)
            known.add(info.name)
    onnx.load_external_data_for_model(model, str(folder))
    converted = OnnxModel(convert_float_to_float16(model, keep_io_types=False, disable_shape_infer=True))
    converted.remove_cascaded_cast_nodes()
    converted = OnnxModel(unload(converted.model, folder / "fp16.onnx"))
    with in_folder(folder):
        converted.remove_useless_cast_nodes()
    onnx.load_external_data_for_model(converted.model, str(folder))
    return converted.model

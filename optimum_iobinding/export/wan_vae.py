"""Export of Wan 2.1/2.2's causal 3-D VAE (diffusers' ``AutoencoderKLWan``): one export for every frame count,
height and width.

diffusers runs the VAE chunk by chunk: the decoder one latent frame per call, the encoder the first video frame and
then four at a time; each causal convolution prepends the last two input frames of the chunk before (its feature
cache, ``CACHE_T = 2``; a temporal downsampling keeps one). Here every chunk is a graph call with that cache as
explicit inputs and outputs, so that a runner hands one call's cache outputs to the next call's inputs on the device
(:class:`~optimum_iobinding.pipelines.wan_codec.WanVideoCodec`). Two graphs per component, because diffusers' first
chunk is another computation, not the same one with an empty cache: its temporal upsamplings (decoder) and
downsamplings (encoder) skip their time convolution, so a first latent frame makes one video frame, not four.

- ``model.onnx``, the first chunk: the VAE's input alone in; its output, then the cache out.
- ``chunk.onnx`` (:data:`~optimum_iobinding.layout.WAN_VAE_CHUNK_PART`), every later chunk: the input and the cache
  in; the output and the next cache out, of the same shapes as the cache in.

The cache has the same shapes after every chunk (for a given batch and size): what diffusers holds after a first
chunk of one frame (one cached frame, or the marker "Rep" where a time convolution has not run yet) is written with
zero frames in front, which is exactly what the causal convolutions' zero padding would read. So every later call has
one input signature, which a CUDA graph can capture.

Graphs (``B`` batch; ``z`` latent channels; ``F`` the spatial factor, 8, or 16 with Wan 2.2's patching; sizes in
``vae_decoder`` as expressions of ``latent_height``/``latent_width``, in ``vae_encoder`` of ``height``/``width``)::

    vae_decoder/model.onnx   latent_sample [B, z, 1, h, w] → sample [B, 3, 1, h·F, w·F],
                             present_features.i [B, C_i, T_i, h·s_i, w·s_i]
    vae_decoder/chunk.onnx   latent_sample [B, z, 1, h, w], past_features.i → sample [B, 3, 4, h·F, w·F],
                             present_features.i
    vae_encoder/model.onnx   sample [B, 3, 1, H, W] → latent_sample [B, z, 1, H/F, W/F], present_features.i
    vae_encoder/chunk.onnx   sample [B, 3, 4, H, W], past_features.i → latent_sample [B, z, 1, H/F, W/F],
                             present_features.i

The decoder's ``sample`` is the decoder's output before ``vae.decode``'s clamp to [-1, 1], which the codec applies to the
whole video (after blending tiles, where it decodes tile by tile, as diffusers' tiling does); the encoder's
``latent_sample`` is the
latent distribution's mode (its mean), what Wan's image-to-video pipeline takes (``sample_mode="argmax"``). Both graphs
of a component name their weights alike and read them from one ``model.onnx_data``: on disk once, and once on the
device where the runtime shares a part's weights (:meth:`~optimum_iobinding.runtime.model.IOBindingORTModel.part`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import onnx
import torch
from onnx import numpy_helper

from ..errors import ArgumentError, ArgumentTypeError
from ..layout import (
    WAN_VAE_CHUNK_PART,
    WAN_VAE_DECODER_INPUT,
    WAN_VAE_DECODER_OUTPUT,
    WAN_VAE_ENCODER_INPUT,
    WAN_VAE_ENCODER_OUTPUT,
    WAN_VAE_WEIGHTS_FILE,
    wan_vae_cache_names,
)
from .components import to_precision, torchscript_export
from .optimize import fold_pads_into_convs

logger = logging.getLogger(__name__)

__all__ = [
    "WAN_VAE_COMPONENTS",
    "WAN_VAE_DTYPES",
    "check_wan_vae",
    "wan_vae_chunk_specs",
    "export_wan_vae",
    "rms_norm_as_one_node",
    "scatter_nodes",
    "write_chunk_graphs",
]

WAN_VAE_COMPONENTS = ("vae_encoder", "vae_decoder")
# the precisions of an export: float32 (as diffusers' Wan pipelines run the VAE, which its model cards load in
# float32) and ORT's float16 conversion; bfloat16 is not offered: ORT's CUDA Conv takes it from opset 22 only
WAN_VAE_DTYPES = ("fp32", "fp16")
# video frames per encoder call after the first, as diffusers' AutoencoderKLWan._encode cuts them
ENCODER_CHUNK_FRAMES = 4
# initializers of at least this many bytes go to the weights file (the threshold of the project's other exports)
_EXTERNAL_MIN_BYTES = 1024
# large tensors start at a multiple of this offset in the weights file, so that ONNX Runtime can map them
_ALIGNMENT = 64 * 1024


def check_wan_vae(vae: Any) -> None:
    """Refuses, by name, anything but a diffusers ``AutoencoderKLWan`` (Wan 2.1's, or Wan 2.2's with
    ``is_residual`` and ``patch_size``).

    Raises:
        ArgumentTypeError: ``vae`` is another class.
        ArgumentError: its patch size does not divide its channels.
    """
    from diffusers import AutoencoderKLWan

    if not isinstance(vae, AutoencoderKLWan):
        raise ArgumentTypeError("vae", f"expected a diffusers AutoencoderKLWan, got {type(vae).__name__}")
    patch = vae.config.patch_size or 1
    for key in ("in_channels", "out_channels"):
        if vae.config[key] % (patch * patch):
            raise ArgumentError(
                "vae",
                f"expected {key} divisible by patch_size² ({patch * patch}), got {key}={vae.config[key]}",
            )


def spatial_factor(vae: Any) -> int:
    """Pixels per latent pixel: 2 per spatial downsampling (every block but the last), times the patch size."""
    return 2 ** (len(vae.config.dim_mult) - 1) * (vae.config.patch_size or 1)


# ------------------------------------------------------------------------------------------------ chunk modules
def _causal_conv_forward(conv: Any, x: torch.Tensor, cache_x: Optional[torch.Tensor] = None) -> torch.Tensor:
    """diffusers' ``WanCausalConv3d.forward`` with its padding where the exported graph computes nothing for it: the
    height and width padding (symmetric) as the convolution's own, the causal frames in front (the cached ones, then
    zeros for those missing) counted in Python. Exported as diffusers writes it, the padding is a ``Pad`` over each
    causal convolution's whole input, its pads computed in the graph from the cache's traced shape."""
    frames = conv._padding[4]
    if cache_x is not None and frames > 0:
        x = torch.cat([cache_x.to(x.device), x], dim=2)
        frames -= int(cache_x.shape[2])  # a number: a chunk graph's frame counts are fixed
    if frames > 0:
        x = torch.cat([torch.zeros_like(x[:, :, :1])] * frames + [x], dim=2)
    width, _, height = conv._padding[:3]
    return torch.nn.functional.conv3d(
        x, conv.weight, conv.bias, conv.stride, (0, height, width), conv.dilation, conv.groups
    )


def _attention_forward(block: Any, x: torch.Tensor) -> torch.Tensor:
    """diffusers' ``WanAttentionBlock.forward`` (one head over each frame's pixels) with the attention's head dim
    taken by index instead of ``squeeze(1)``, which the TorchScript exporter writes as an ``If`` on the traced size
    (control flow that keeps the graph from being folded and captured), and the attention's scale a number (the
    channels are the weights'): computed from the traced size, it is a ``Shape`` … ``Sqrt`` chain that ORT runs on the
    host and copies to the device on every run, a synchronous copy that fails a CUDA graph's capture."""
    identity = x
    batch, channels, time, height, width = x.size()
    x = x.permute(0, 2, 1, 3, 4).reshape(batch * time, channels, height, width)
    x = block.norm(x)
    qkv = block.to_qkv(x).reshape(batch * time, 1, channels * 3, -1).permute(0, 1, 3, 2).contiguous()
    q, k, v = qkv.chunk(3, dim=-1)
    scale = float(block.to_qkv.out_channels // 3) ** -0.5  # one head over all the channels
    x = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    x = x[:, 0].permute(0, 2, 1).reshape(batch * time, channels, height, width)
    x = block.proj(x)
    x = x.view(batch, time, channels, height, width).permute(0, 2, 1, 3, 4)
    return x + identity


class _ChannelRMSNorm(torch.autograd.Function):
    """``x / ‖x‖ · √C · γ`` over the channels (axis 1, or the last axis): diffusers' ``WanRMS_norm`` without its bias,
    computed in float32 as diffusers computes a half-precision input, while the exporter traces; written as one
    ``SimplifiedLayerNormalization`` node (ONNX Runtime's RMS norm, which accumulates in float32 whatever the
    tensor's precision) over the last axis, between two ``Transpose`` nodes where the channels are axis 1."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gamma: torch.Tensor, channel_axis: int, epsilon: float) -> torch.Tensor:
        normalized = torch.nn.functional.normalize(x.float(), dim=channel_axis).to(x.dtype)
        shape = [1] * x.dim()
        shape[channel_axis] = -1
        return normalized * (gamma.numel() ** 0.5) * gamma.reshape(shape)

    @staticmethod
    def symbolic(g: Any, x: Any, gamma: Any, channel_axis: int, epsilon: float) -> Any:
        rank = x.type().dim()
        normalized = g.op("Transpose", x, perm_i=[0, *range(2, rank), 1]) if channel_axis == 1 else x
        # √C · x / ‖x‖ = x / √(mean(x²)), what the node computes (epsilon aside)
        y = g.op("SimplifiedLayerNormalization", normalized, gamma, axis_i=-1, epsilon_f=epsilon, stash_type_i=1)
        if channel_axis == 1:  # the channels back in their place
            y = g.op("Transpose", y, perm_i=[0, rank - 1, *range(1, rank - 1)])
        y.setType(x.type())
        return y


def rms_norm_as_one_node(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """diffusers' ``WanRMS_norm.forward`` exported as one ONNX Runtime RMS norm (:class:`_ChannelRMSNorm`), plus its
    bias where it has one. A float16 graph of the plain formula overflows: ``‖x‖²`` of the decoder's activations
    passes 65504 (diffusers normalizes half-precision inputs in float32 for that reason); the node's float32
    accumulation does not, and it reads and writes each activation once, where a float16-safe formula pre-scales it
    and runs two reductions and two divisions over it. Its epsilon is diffusers' floor of ``‖x‖`` (1e-12) squared and
    divided by the channels: about the same floor."""
    channel_axis = 1 if norm.channel_first else -1
    channels = round(norm.scale**2)  # a number, where the tracer would record the weight's size as a computation
    y = _ChannelRMSNorm.apply(x, norm.gamma.reshape(-1), channel_axis, 1e-24 / channels)
    if isinstance(norm.bias, torch.Tensor) or norm.bias != 0:
        y = y + norm.bias
    return y


@contextlib.contextmanager
def exportable_forwards(vae: Any, float16: bool = False) -> Iterator[None]:
    """Every ``WanCausalConv3d`` of ``vae`` runs :func:`_causal_conv_forward`, every ``WanAttentionBlock``
    :func:`_attention_forward` and, for a float16 export, every ``WanRMS_norm`` :func:`rms_norm_as_one_node`, while
    the exporter runs (attributes of each instance, removed after: the classes are left alone)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock, WanCausalConv3d, WanRMS_norm

    replaced: Dict[type, Any] = {WanCausalConv3d: _causal_conv_forward, WanAttentionBlock: _attention_forward}
    if float16:
        replaced[WanRMS_norm] = rms_norm_as_one_node
    modules = [(module, replaced[type(module)]) for module in vae.modules() if type(module) in replaced]
    try:
        for module, forward in modules:
            module.forward = functools.partial(forward, module)
        yield
    finally:
        for module, _ in modules:
            module.__dict__.pop("forward", None)


@contextlib.contextmanager
def nearest_upsampling(vae: Any) -> Iterator[None]:
    """The VAE's 2× ``nearest-exact`` upsamplings as ``nearest`` while the exporter runs (its TorchScript exporter
    has no ``nearest-exact``): at a whole scale factor both read source pixel ``floor(i / scale)``, the same values;
    the modes are put back after."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanUpsample

    changed = []
    for module in vae.modules():
        if isinstance(module, WanUpsample) and module.mode == "nearest-exact":
            factors = module.scale_factor if isinstance(module.scale_factor, tuple) else (module.scale_factor,)
            if all(float(factor).is_integer() for factor in factors):
                changed.append(module)
    try:
        for module in changed:
            module.mode = "nearest"
        yield
    finally:
        for module in changed:
            module.mode = "nearest-exact"


class _CausalChunk(torch.nn.Module):
    """One chunk of diffusers' own loop over an ``AutoencoderKLWan`` (``vae._decode`` or ``vae._encode``), its
    feature cache explicit: ``forward(input, *past)`` returns the output, then the cache after the chunk.

    Args:
        vae: the ``AutoencoderKLWan``.
        decoder: the decoder's chunk (else the encoder's).
        first: the first chunk: no cache in, and diffusers' first-chunk path (``first_chunk=True``, the time
            convolutions of temporal up- and downsamplings skipped).
        frames: the cached frames of each layer after a later chunk; the first chunk's cache is written with zero
            frames in front to as many, which the next chunk's causal convolutions read as their zero padding.
    """

    def __init__(self, vae: Any, decoder: bool, first: bool, frames: Sequence[int]):
        super().__init__()
        self.vae = vae
        self.decoder = decoder
        self.first = first
        self.frames = tuple(frames)
        self.patch = vae.config.patch_size
        self.z_dim = vae.config.z_dim

    def forward(self, sample: torch.Tensor, *past: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        from diffusers.models.autoencoders.autoencoder_kl_wan import WanResample

        cache: List[Any] = list(past) if not self.first else [None] * len(self.frames)
        # diffusers marks a temporal upsampling's cache "Rep" after the first chunk (its time convolution then pads
        # with zeros): zeros of its input's shape stand for it
        inputs_of: Dict[int, torch.Tensor] = {}

        def remember(module, args, kwargs):
            inputs_of[kwargs["feat_idx"][0]] = args[0]

        upsamplings = [m for m in self.vae.modules() if isinstance(m, WanResample) and m.mode == "upsample3d"]
        handles = [m.register_forward_pre_hook(remember, with_kwargs=True) for m in upsamplings] if self.first else []
        try:
            output = self._run(sample, cache)
        finally:
            for handle in handles:
                handle.remove()
        present = []
        for index, (value, frames) in enumerate(zip(cache, self.frames, strict=True)):
            if isinstance(value, str):
                value = torch.zeros_like(inputs_of[index][:, :, :1])
            if value.shape[2] < frames:
                zeros = torch.zeros_like(value[:, :, :1])
                value = torch.cat([zeros] * (frames - value.shape[2]) + [value], dim=2)
            present.append(value)
        return (output, *present)

    def _run(self, sample: torch.Tensor, cache: List[Any]) -> torch.Tensor:
        from diffusers.models.autoencoders.autoencoder_kl_wan import patchify, unpatchify

        vae = self.vae
        if self.decoder:
            x = vae.decoder(vae.post_quant_conv(sample), feat_cache=cache, feat_idx=[0], first_chunk=self.first)
            # not clamped here: the codec clamps the whole video, after tiles are blended (as diffusers' tiling)
            return unpatchify(x, patch_size=self.patch) if self.patch is not None else x
        x = patchify(sample, patch_size=self.patch) if self.patch is not None else sample
        x = vae.quant_conv(vae.encoder(x, feat_cache=cache, feat_idx=[0]))
        return x[:, : self.z_dim]  # the mean of DiagonalGaussianDistribution(x): its mode


def _diffusers_chunks(vae: Any, decoder: bool, chunks: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """diffusers' own loop over ``chunks`` (as ``vae._decode``/``vae._encode`` run them, without touching the
    VAE's cache): the feature cache after the last one, one tensor per cached layer."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

    cache: List[Any] = [None] * sum(1 for _ in vae.modules())  # more than there are layers
    index = [0]
    with torch.no_grad():
        for number, chunk in enumerate(chunks):
            index = [0]
            if decoder:
                vae.decoder(vae.post_quant_conv(chunk), feat_cache=cache, feat_idx=index, first_chunk=number == 0)
            else:
                patched = patchify(chunk, patch_size=vae.config.patch_size) if vae.config.patch_size else chunk
                vae.encoder(patched, feat_cache=cache, feat_idx=index)
    return cache[: index[0]]


def _dim(name: str, scale: Fraction) -> str:
    """A dim as an expression of an input dim ``name`` (see :func:`~optimum_iobinding.runtime.shapes.
    evaluate_dim_expression`): ``name``, ``name * 2``, ``name / 8``."""
    if scale == 1:
        return name
    if scale.denominator == 1:
        return f"{name} * {scale.numerator}"
    if scale.numerator == 1:
        return f"{name} / {scale.denominator}"
    return f"{name} * {scale.numerator} / {scale.denominator}"


def wan_vae_chunk_specs(vae: Any, decoder: bool, latent_size: Tuple[int, int] = (3, 5)) -> Dict[str, Dict[str, Any]]:
    """The export specs of a component's two graphs (``"first"``: model.onnx, ``"chunk"``: chunk.onnx), with
    examples of batch 2 at ``latent_size`` latent pixels; the cache's shapes are those diffusers' own loop holds after
    two chunks.

    Args:
        vae: diffusers' ``AutoencoderKLWan``.
        decoder: the decoder's graphs (else the encoder's).
        latent_size: the examples' latent height and width (distinct, above 2: a traced size never equals another).

    Returns:
        ``{"first": spec, "chunk": spec}``, each with ``module``, ``args``, ``input_names``, ``output_names``,
        ``dynamic_axes`` and ``shapes`` (every output's dims: ints and dim expressions).
    """
    check_wan_vae(vae)
    factor = spatial_factor(vae)
    generator = torch.Generator().manual_seed(0)
    latent_height, latent_width = latent_size
    if decoder:
        size = ("latent_height", "latent_width")
        example = torch.randn(1, vae.config.z_dim, 1, latent_height, latent_width, generator=generator)
        first_args, chunk_args = (example,), (example,)
        names = (WAN_VAE_DECODER_INPUT, WAN_VAE_DECODER_OUTPUT)
        input_sizes = (latent_height, latent_width)
    else:
        size = ("height", "width")
        channels = vae.config.in_channels // (vae.config.patch_size or 1) ** 2
        pixels = (latent_height * factor, latent_width * factor)
        first_args = (torch.randn(1, channels, 1, *pixels, generator=generator),)
        chunk_args = (torch.randn(1, channels, ENCODER_CHUNK_FRAMES, *pixels, generator=generator),)
        names = (WAN_VAE_ENCODER_INPUT, WAN_VAE_ENCODER_OUTPUT)
        input_sizes = pixels
    cache = _diffusers_chunks(vae, decoder, [first_args[0], chunk_args[0]])
    past_names, present_names = wan_vae_cache_names(len(cache))
    cache_dims = []
    for index, tensor in enumerate(cache):
        scales = [Fraction(tensor.shape[3 + axis], input_sizes[axis]) for axis in range(2)]
        if scales[0] != scales[1]:
            raise ArgumentError(
                "vae", f"expected its cached layer {index} scaled alike in height and width, got {scales}"
            )
        cache_dims.append(
            ["batch", tensor.shape[1], tensor.shape[2], _dim(size[0], scales[0]), _dim(size[1], scales[1])]
        )
    with torch.no_grad():
        first_module = _CausalChunk(vae, decoder, True, [dims[2] for dims in cache_dims]).eval()
        chunk_module = _CausalChunk(vae, decoder, False, [dims[2] for dims in cache_dims]).eval()
        first_output = first_module(*first_args)[0]
        chunk_output = chunk_module(*chunk_args, *cache)[0]
    input_dims = {0: "batch", 3: size[0], 4: size[1]}
    specs = {}
    for key, module, args, output in (
        ("first", first_module, first_args, first_output),
        ("chunk", chunk_module, (*chunk_args, *cache), chunk_output),
    ):
        scale = Fraction(output.shape[3], input_sizes[0])
        output_dims = ["batch", output.shape[1], output.shape[2], _dim(size[0], scale), _dim(size[1], scale)]
        cache_in = list(past_names) if key == "chunk" else []
        shapes = {names[1]: output_dims, **dict(zip(present_names, cache_dims, strict=True))}
        specs[key] = dict(
            module=module,
            args=args,
            input_names=[names[0], *cache_in],
            output_names=[names[1], *present_names],
            dynamic_axes={
                names[0]: input_dims,
                **{name: _named_axes(dims) for name, dims in zip(cache_in, cache_dims, strict=False)},
                **{name: _named_axes(dims) for name, dims in shapes.items()},
            },
            shapes=shapes,
        )
    return specs


def _named_axes(dims: Sequence[Any]) -> Dict[int, str]:
    return {axis: dim for axis, dim in enumerate(dims) if isinstance(dim, str)}


# -------------------------------------------------------------------------------------------------- graph checks
def scatter_nodes(model: onnx.ModelProto) -> List[str]:
    """The ``ScatterND`` nodes of ``model`` (ONNX Runtime's CUDA kernel for it is catastrophically slow): names."""
    return [node.name or node.output[0] for node in model.graph.node if node.op_type == "ScatterND"]


def _set_shapes(model: onnx.ModelProto, shapes: Dict[str, Sequence[Any]]) -> None:
    """Declares every output's dims (ints, or dim expressions of the input dims): the runtime sizes each output
    before the run from them, whatever the exporter named the dims it could not follow."""
    for value in model.graph.output:
        shape = value.type.tensor_type.shape
        del shape.dim[:]
        for size in shapes[value.name]:
            dim = shape.dim.add()
            if isinstance(size, str):
                dim.dim_param = size
            else:
                dim.dim_value = int(size)


# ------------------------------------------------------------------------------------------------------ writing
def _tensor_key(tensor: onnx.TensorProto) -> Tuple[int, Tuple[int, ...], str]:
    return tensor.data_type, tuple(tensor.dims), hashlib.sha256(tensor.raw_data).hexdigest()


def _with_raw_data(model: onnx.ModelProto) -> None:
    """Every initializer's values as ``raw_data`` (an exporter may write small ones as typed lists)."""
    for index, tensor in enumerate(model.graph.initializer):
        if not tensor.HasField("raw_data"):
            model.graph.initializer[index].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))


def _rename_inputs(model: onnx.ModelProto, renamed: Dict[str, str]) -> None:
    for node in model.graph.node:
        for index, name in enumerate(node.input):
            if name in renamed:
                node.input[index] = renamed[name]


def write_chunk_graphs(first: onnx.ModelProto, chunk: onnx.ModelProto, folder: Path) -> None:
    """Writes ``first`` as ``folder/model.onnx`` and ``chunk`` as ``folder/chunk.onnx``, every initializer of at
    least 1 KiB in one ``model.onnx_data`` beside them, once: the first graph's initializers equal to one of the
    chunk graph's take its name, and a name both graphs use holds the same values in both (the runtime hands a
    part the main graph's weights by name).

    Args:
        first: the first chunk's graph (its weights in memory); changed in place.
        chunk: the later chunks' graph (its weights in memory); changed in place.
        folder: the component's folder (made if absent).
    """
    for model in (first, chunk):
        _with_raw_data(model)
    chunk_names = {_tensor_key(tensor): tensor.name for tensor in chunk.graph.initializer}
    taken = {tensor.name for tensor in chunk.graph.initializer}
    values = {name for node in first.graph.node for name in node.output} | {v.name for v in first.graph.input}
    renamed: Dict[str, str] = {}
    kept: List[onnx.TensorProto] = []
    seen = set()
    for tensor in first.graph.initializer:
        name = chunk_names.get(_tensor_key(tensor))
        if name is None or name in values:
            name = tensor.name
            while name in taken or name in values:  # a name the chunk graph gives other values
                name = f"first_chunk.{name}"
        if name != tensor.name:
            renamed[tensor.name] = name
            tensor.name = name
        if name not in seen:
            seen.add(name)
            kept.append(tensor)
    del first.graph.initializer[:]
    first.graph.initializer.extend(kept)
    _rename_inputs(first, renamed)

    folder.mkdir(parents=True, exist_ok=True)
    places: Dict[Tuple[int, Tuple[int, ...], str], Tuple[int, int]] = {}
    with open(folder / WAN_VAE_WEIGHTS_FILE, "wb") as data:
        for model in (chunk, first):
            for tensor in model.graph.initializer:
                size = len(tensor.raw_data)
                if size < _EXTERNAL_MIN_BYTES:
                    continue
                key = _tensor_key(tensor)
                if key not in places:
                    offset = data.tell()
                    padding = -offset % _ALIGNMENT if size >= _ALIGNMENT else 0
                    data.write(b"\0" * padding)
                    places[key] = (offset + padding, size)
                    data.write(tensor.raw_data)
                offset, length = places[key]
                tensor.ClearField("raw_data")
                tensor.data_location = onnx.TensorProto.EXTERNAL
                del tensor.external_data[:]
                for entry_key, entry_value in (
                    ("location", WAN_VAE_WEIGHTS_FILE),
                    ("offset", str(offset)),
                    ("length", str(length)),
                ):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = entry_key, entry_value
    onnx.save_model(first, str(folder / "model.onnx"))
    onnx.save_model(chunk, str(folder / WAN_VAE_CHUNK_PART))


def export_wan_vae(
    vae: Any,
    target: Path,
    components: Sequence[str] = WAN_VAE_COMPONENTS,
    opset: int = 17,
    dtype: str = "fp32",
    latent_size: Tuple[int, int] = (3, 5),
) -> None:
    """Exports Wan's VAE into ``target/vae_decoder`` and ``target/vae_encoder`` (the chunk graphs the module
    docstring lists, their weights in ``model.onnx_data``, and ``config.json``: the VAE's config with its
    ``_class_name``), through the TorchScript exporter as the project's other components.

    Args:
        vae: diffusers' ``AutoencoderKLWan`` (Wan 2.1's, or Wan 2.2's patched residual one), on the CPU.
        target: the pipeline folder.
        components: which of :data:`WAN_VAE_COMPONENTS` to write.
        opset: ONNX opset.
        dtype: ``"fp32"`` or ``"fp16"`` (ORT's float16 conversion, inputs and outputs float16 too).
        latent_size: the examples' latent height and width (any size runs; the examples are only traced).

    Raises:
        ArgumentTypeError: ``vae`` is not an ``AutoencoderKLWan``.
        ArgumentError: an unknown component or dtype.
    """
    check_wan_vae(vae)
    unknown = [name for name in components if name not in WAN_VAE_COMPONENTS]
    if unknown or not components:
        raise ArgumentError("components", f"expected some of {list(WAN_VAE_COMPONENTS)}, got {list(components)}")
    if dtype not in WAN_VAE_DTYPES:
        raise ArgumentError("dtype", f"expected one of {', '.join(map(repr, WAN_VAE_DTYPES))}, got {dtype!r}")
    vae = vae.eval()
    for name in components:
        specs = wan_vae_chunk_specs(vae, decoder=name == "vae_decoder", latent_size=latent_size)
        models = {}
        with tempfile.TemporaryDirectory() as scratch:
            for key, spec in specs.items():
                path = Path(scratch) / key / "model.onnx"
                path.parent.mkdir()
                with nearest_upsampling(vae), exportable_forwards(vae, float16=dtype == "fp16"):
                    torchscript_export(spec, path, opset)
                exported = onnx.load(str(path), load_external_data=False)  # weights past 2 GiB stay in their files
                if fold_pads_into_convs(exported):  # the causal and spatial zero padding: the convolutions' own pads
                    onnx.save_model(exported, str(path))
                del exported
                model = to_precision(path, None, dtype)
                onnx.load_external_data_for_model(model, str(path.parent))
                _set_shapes(model, spec["shapes"])
                scattered = scatter_nodes(model)
                if scattered:  # nothing in diffusers' Wan VAE writes in place today; a later version might
                    logger.warning(
                        "%s %s: %d ScatterND node(s), slow on ORT's CUDA provider", name, key, len(scattered)
                    )
                models[key] = model
        write_chunk_graphs(models["first"], models["chunk"], Path(target) / name)
        config = dict(vae.config)
        config["_class_name"] = type(vae).__name__
        (Path(target) / name / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))

"""IP-Adapter on a UNet exported for it: diffusers' ``load_ip_adapter``, ``set_ip_adapter_scale`` and
``unload_ip_adapter``, and the call's ``ip_adapter_image`` / ``ip_adapter_image_embeds``.

The exported UNet takes each cross-attention layer's image-prompt keys and values as inputs
(:data:`~optimum_iobinding.layout.IP_ADAPTER_KEY_INPUT` ``i`` and :data:`~optimum_iobinding.layout.IP_ADAPTER_VALUE_INPUT`
``i``; see the export's :mod:`optimum_iobinding.export.ip_adapter`). A call makes them once, on the device, as
diffusers' IP-Adapter makes them inside each layer: the image encoder's embeddings (``image_embeds`` for a plain
adapter, the penultimate layer's states for a plus one) through the adapter's image projection (diffusers' module,
built by diffusers' conversion of the adapter's ``image_proj`` weights) give the image-prompt tokens, and each
layer's ``to_k_ip`` and ``to_v_ip`` weights their keys and values, the layer's scale folded into the values (the
attention is linear in them). Loading, switching or scaling an adapter therefore changes no session and no captured
graph. Without an adapter, each layer gets one key and value of zeros: an image-prompt attention of exactly zero.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np
import torch

from ..errors import ArgumentError, ArgumentTypeError
from ..layout import IMAGE_ENCODER, IMAGE_PROMPT_LAYERS_KEY, IP_ADAPTER_KEY_INPUT, IP_ADAPTER_VALUE_INPUT

__all__ = ["IPAdapterMixin", "image_prompt_input_names"]


def image_prompt_input_names(input_names: Sequence[str]) -> List[tuple]:
    """The (key, value) input pairs of a UNet exported for IP-Adapter, by layer; empty for another UNet."""
    keys = sorted(
        (int(name[len(IP_ADAPTER_KEY_INPUT) :]) for name in input_names if name.startswith(IP_ADAPTER_KEY_INPUT)),
    )
    return [(f"{IP_ADAPTER_KEY_INPUT}{i}", f"{IP_ADAPTER_VALUE_INPUT}{i}") for i in keys]


def _read_state_dict(source: Any, subfolder: Optional[str], weight_name: Optional[str], **hub_kwargs) -> Dict:
    """An IP-Adapter's state dict as diffusers reads it: ``{"image_proj": {...}, "ip_adapter": {...}}`` from a dict,
    or from a ``.safetensors`` (keys ``image_proj.…``, ``ip_adapter.…``) or ``.bin`` file in a folder or hub repo."""
    if isinstance(source, dict):
        state = source
    elif isinstance(source, (str, os.PathLike)):
        if not weight_name:
            raise ArgumentError("weight_name", "expected the adapter's file name in the folder or repo, got none")
        local = Path(os.fspath(source), subfolder or "", weight_name)
        if local.is_file():
            path = local
        elif Path(os.fspath(source)).exists():
            raise ArgumentError("weight_name", f"expected a file {str(local)!r}, got no such file")
        else:
            from huggingface_hub import hf_hub_download

            try:
                path = Path(hf_hub_download(os.fspath(source), weight_name, subfolder=subfolder or None, **hub_kwargs))
            except Exception as error:  # not a hub id, no such file, no network
                raise ArgumentError(
                    "pretrained_model_name_or_path_or_dict",
                    f"expected a local folder or a hub repo holding {weight_name!r}, got {os.fspath(source)!r}: "
                    f"{type(error).__name__}: {str(error)[:200]}",
                ) from error
        try:
            if path.suffix == ".safetensors":
                from safetensors.torch import load_file

                flat = load_file(str(path))
                state = {"image_proj": {}, "ip_adapter": {}}
                for key, value in flat.items():
                    part, _, rest = key.partition(".")
                    if part in state:
                        state[part][rest] = value
            else:
                state = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as error:  # not a weights file, or a broken one
            raise ArgumentError(
                "weight_name",
                f"expected an IP-Adapter weights file (.safetensors or .bin), got {str(path)!r}, which does not load: "
                f"{type(error).__name__}: {str(error)[:200]}",
            ) from error
    else:
        raise ArgumentTypeError(
            "pretrained_model_name_or_path_or_dict",
            f"expected a folder, a hub id or a state dict, got {type(source).__name__}",
        )
    if not isinstance(state, dict) or not {"image_proj", "ip_adapter"} <= set(state):
        raise ArgumentError(
            "pretrained_model_name_or_path_or_dict",
            f"expected an IP-Adapter state dict with 'image_proj' and 'ip_adapter' keys, got keys "
            f"{sorted(state)[:6] if isinstance(state, dict) else type(state).__name__}",
        )
    return state


def _checked_scale(scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise ArgumentTypeError("scale", f"expected a number or diffusers' per-block dict, got {scale!r}")
    if not np.isfinite(float(scale)):
        raise ArgumentError("scale", f"expected a finite number, got {scale!r}")
    return float(scale)


class _LoadedAdapter:
    """One loaded IP-Adapter: its image projection (a diffusers module), each layer's ``to_k_ip`` and ``to_v_ip``
    weights (float32, on the device), whether it takes the image encoder's penultimate states, and its scales."""

    def __init__(self, projection, keys: List[torch.Tensor], values: List[torch.Tensor], hidden_states: bool):
        self.projection = projection
        self.keys = keys
        self.values = values
        self.hidden_states = hidden_states
        self.scales = [1.0] * len(keys)


class IPAdapterMixin:
    """diffusers' IP-Adapter methods for a pipeline whose UNet was exported for IP-Adapter
    (``optimum-iobinding export … --ip-adapter``)."""

    _ip_adapter: Optional[_LoadedAdapter] = None

    @property
    def image_prompt_layers(self) -> List[tuple]:
        """The UNet's (key, value) image-prompt input pairs, by cross-attention layer (empty: not exported for it)."""
        return image_prompt_input_names(self.unet.input_names)

    def _check_takes_image_prompts(self, argument: str) -> None:
        if not self.image_prompt_layers:
            raise ArgumentError(
                argument,
                "expected a UNet exported for IP-Adapter (optimum-iobinding export MODEL -o OUT --ip-adapter, or "
                "export_pipeline(..., ip_adapter=True)); this folder's UNet takes no image-prompt inputs",
            )

    def load_ip_adapter(
        self,
        pretrained_model_name_or_path_or_dict: Union[str, os.PathLike, Dict],
        subfolder: Optional[str] = None,
        weight_name: Optional[str] = None,
        image_encoder_folder: Optional[str] = "image_encoder",
        **kwargs: Any,
    ) -> None:
        """Loads an IP-Adapter (diffusers' arguments: a folder, hub id or state dict, the ``subfolder`` and
        ``weight_name`` of its file) for the next calls, replacing the one loaded before; its scale is 1.0. The
        image encoder is the folder's ``image_encoder`` (exported with the pipeline); ``image_encoder_folder`` takes
        diffusers' default or ``None`` only.

        Raises:
            ArgumentError: the UNet was not exported for IP-Adapter, several adapters at once, an adapter whose
                layers or widths are not this UNet's, or one with LoRA weights (FaceID).
        """
        self._check_takes_image_prompts("pretrained_model_name_or_path_or_dict")
        for name, value in (("subfolder", subfolder), ("weight_name", weight_name)):
            if isinstance(value, (list, tuple)):
                if len(value) != 1:
                    raise ArgumentError(name, f"expected one IP-Adapter at a time, got {len(value)}")
        if isinstance(pretrained_model_name_or_path_or_dict, (list, tuple)):
            if len(pretrained_model_name_or_path_or_dict) != 1:
                raise ArgumentError(
                    "pretrained_model_name_or_path_or_dict",
                    f"expected one IP-Adapter at a time, got {len(pretrained_model_name_or_path_or_dict)}",
                )
            pretrained_model_name_or_path_or_dict = pretrained_model_name_or_path_or_dict[0]
        subfolder = subfolder[0] if isinstance(subfolder, (list, tuple)) else subfolder
        weight_name = weight_name[0] if isinstance(weight_name, (list, tuple)) else weight_name
        if image_encoder_folder not in (None, "image_encoder"):
            raise ArgumentError(
                "image_encoder_folder",
                f"expected the default 'image_encoder' (the image encoder is the ONNX folder's own export), got "
                f"{image_encoder_folder!r}",
            )
        keys = ("cache_dir", "token", "revision", "local_files_only", "force_download", "proxies")
        hub = {k: kwargs[k] for k in keys if k in kwargs}
        state = _read_state_dict(pretrained_model_name_or_path_or_dict, subfolder, weight_name, **hub)
        self._ip_adapter = self._adapter_from(state)

    def _adapter_from(self, state: Dict) -> _LoadedAdapter:
        from diffusers.loaders.unet import UNet2DConditionLoadersMixin
        from diffusers.models.embeddings import ImageProjection

        weights = state["ip_adapter"]
        if any("lora" in key for key in weights):
            raise ArgumentError(
                "pretrained_model_name_or_path_or_dict",
                "expected an IP-Adapter without LoRA weights (a FaceID adapter changes the UNet's own layers)",
            )
        layers = self.image_prompt_layers
        found = sorted(int(key.split(".")[0]) for key in weights if key.endswith(".to_k_ip.weight"))
        expected = [2 * i + 1 for i in range(len(layers))]
        if found != expected:
            raise ArgumentError(
                "pretrained_model_name_or_path_or_dict",
                f"expected an IP-Adapter for this UNet's {len(layers)} cross-attention layers (weights "
                f"1.to_k_ip … {expected[-1]}.to_k_ip), got {len(found)} layers",
            )
        device = self.device
        keys, values = [], []
        cross = (self.unet.input_dims.get("encoder_hidden_states") or [None])[-1]  # the image tokens' width too
        for index, (key_input, _) in enumerate(layers):
            width = self.unet.input_dims[key_input][2]
            for kind, bucket in (("to_k_ip", keys), ("to_v_ip", values)):
                weight = weights.get(f"{2 * index + 1}.{kind}.weight")
                expected_shape = (width, cross)
                if (
                    weight is None
                    or weight.ndim != 2
                    or any(isinstance(e, int) and e != g for e, g in zip(expected_shape, weight.shape))
                ):
                    raise ArgumentError(
                        "pretrained_model_name_or_path_or_dict",
                        f"expected layer {2 * index + 1}'s {kind} of shape {expected_shape} (this UNet's widths), got "
                        f"{tuple(weight.shape) if weight is not None else 'none'}: an IP-Adapter for another model",
                    )
                bucket.append(weight.to(device=device, dtype=torch.float32))
        # diffusers' own conversion of the image projection's weights (its ImageProjection, IPAdapterPlus…)
        try:
            projection = UNet2DConditionLoadersMixin._convert_ip_adapter_image_proj_to_diffusers(
                None, state["image_proj"], low_cpu_mem_usage=False
            )
        except Exception as error:  # a format diffusers' conversion does not know
            raise ArgumentError(
                "pretrained_model_name_or_path_or_dict",
                f"expected an image projection diffusers converts (IP-Adapter, plus, full), got keys "
                f"{sorted(state['image_proj'])[:4]}: {type(error).__name__}: {error}",
            ) from error
        projection = projection.to(device=device, dtype=torch.float32).eval()
        hidden_states = not isinstance(projection, ImageProjection)
        self._check_encoder_width(projection, hidden_states)
        return _LoadedAdapter(projection, keys, values, hidden_states=hidden_states)

    def _check_encoder_width(self, projection: torch.nn.Module, hidden_states: bool) -> None:
        """The adapter's image projection must take what the folder's image encoder gives (its ``image_embeds`` for
        a plain adapter, its penultimate states for the others): an adapter made for another encoder is refused."""
        encoder = getattr(self, IMAGE_ENCODER, None)
        first = next((m for m in projection.modules() if isinstance(m, torch.nn.Linear)), None)
        if encoder is None or first is None:
            return
        output = "penultimate_hidden_states" if hidden_states else "image_embeds"
        width = (encoder.output_dims.get(output) or [None])[-1]
        if isinstance(width, int) and width != first.in_features:
            raise ArgumentError(
                "pretrained_model_name_or_path_or_dict",
                f"expected an adapter taking this folder's image encoder's {output} of width {width}, got one taking "
                f"{first.in_features}: an adapter made for another image encoder",
            )

    def set_ip_adapter_scale(self, scale: Union[float, Dict, Sequence[Union[float, Dict]]]) -> None:
        """The loaded adapter's scale from the next call on, as diffusers takes it: a number for every layer, or a
        dict per block (InstantStyle: ``{"up": {"block_0": [0.0, 1.0, 0.0]}}``, expanded by diffusers' own rules;
        the layers it does not name get 0), or a list of one of them (diffusers' one per adapter)."""
        if self._ip_adapter is None:
            raise ArgumentError("scale", "expected a loaded IP-Adapter (load_ip_adapter first), got none loaded")
        if isinstance(scale, (list, tuple)):
            if len(scale) != 1:
                raise ArgumentError("scale", f"expected one scale (one IP-Adapter loaded), got a list of {len(scale)}")
            scale = scale[0]
        if isinstance(scale, dict):
            self._ip_adapter.scales = self._scales_by_block(scale)
            return
        self._ip_adapter.scales = [_checked_scale(scale)] * len(self._ip_adapter.keys)

    def _scales_by_block(self, scale: Dict) -> List[float]:
        """Each image-prompt layer's scale from a per-block dict, by diffusers' expansion
        (``_maybe_expand_lora_scales_for_one_adapter``, default 0) over the layers' module names the export wrote
        in the UNet's config; a layer takes the value of the last expanded name it starts with, as diffusers'
        ``set_ip_adapter_scale`` assigns them."""
        from diffusers.loaders.unet_loader_utils import _maybe_expand_lora_scales_for_one_adapter

        config = self.unet.config
        names = config.get(IMAGE_PROMPT_LAYERS_KEY)
        if not names or len(names) != len(self._ip_adapter.keys):
            raise ArgumentError(
                "scale",
                "expected a number: per-block scales need the UNet's layer names, which this export's config.json "
                "lacks (export the folder again)",
            )
        layers = config.get("layers_per_block")
        if not isinstance(layers, int):
            raise ArgumentError("scale", f"expected a number for a UNet of layers_per_block {layers!r}, got a dict")
        blocks = {
            side: [i for i, kind in enumerate(config.get(f"{side}_block_types", ())) if "CrossAttn" in kind]
            for side in ("down", "up")
        }

        class _Names:  # what diffusers' expansion checks the block names against
            @staticmethod
            def state_dict() -> Dict[str, None]:
                return {f"{name}.processor": None for name in names}

        try:
            expanded = _maybe_expand_lora_scales_for_one_adapter(
                scale, blocks, {"down": layers, "up": layers + 1}, model=_Names(), default_scale=0.0
            )
        except (ValueError, KeyError, TypeError) as error:
            raise ArgumentError("scale", f"expected per-block scales of this UNet's blocks, got {scale!r}: {error}")
        scales = []
        for name in names:
            value = 0.0
            for prefix, given in expanded.items():
                if f"{name}.processor".startswith(prefix):
                    value = given
            scales.append(_checked_scale(value))
        return scales

    def unload_ip_adapter(self) -> None:
        """Drops the loaded IP-Adapter: the next calls run as without one."""
        self._ip_adapter = None

    def check_image_prompt(self, ip_adapter_image: Any, ip_adapter_image_embeds: Any) -> None:
        """Refuses, before any work, image-prompt arguments this pipeline cannot take (named)."""
        if ip_adapter_image is None and ip_adapter_image_embeds is None:
            return
        if ip_adapter_image is not None and ip_adapter_image_embeds is not None:
            raise ArgumentError("ip_adapter_image", "expected ip_adapter_image or ip_adapter_image_embeds, got both")
        argument = "ip_adapter_image" if ip_adapter_image is not None else "ip_adapter_image_embeds"
        self._check_takes_image_prompts(argument)
        if self._ip_adapter is None:
            raise ArgumentError(argument, "expected a loaded IP-Adapter (load_ip_adapter first), got none loaded")
        if ip_adapter_image is not None and getattr(self, IMAGE_ENCODER, None) is None:
            raise ArgumentError(
                "ip_adapter_image",
                "expected a folder with an image_encoder (export the pipeline with its image encoder, or pass "
                "ip_adapter_image_embeds), got none",
            )

    def image_prompt_inputs(
        self, ip_adapter_image: Any, ip_adapter_image_embeds: Any, rows: int, guided: bool
    ) -> Dict[str, torch.Tensor]:
        """The UNet's image-prompt inputs for a call of ``rows`` images per guidance half (``[negative; positive]``
        rows where ``guided``, as the text embeddings); ``{}`` for a UNet without them. Without an adapter or an
        image prompt, each layer gets one key and value of zeros."""
        layers = self.image_prompt_layers
        if not layers:
            return {}
        dtypes = self.unet.input_dtypes
        total = rows * (2 if guided else 1)
        adapter = self._ip_adapter
        if adapter is None or (ip_adapter_image is None and ip_adapter_image_embeds is None):
            inputs = {}
            for key, value in layers:
                width = self.unet.input_dims[key][2]
                inputs[key] = torch.zeros(total, 1, width, dtype=dtypes[key], device=self.device)
                inputs[value] = torch.zeros(total, 1, width, dtype=dtypes[value], device=self.device)
            return inputs
        embeds = self._image_embeds(ip_adapter_image, ip_adapter_image_embeds, rows, guided, adapter)
        with torch.no_grad():  # as diffusers' MultiIPAdapterImageProjection: each image projected apart
            batch, images = embeds.shape[:2]
            tokens = adapter.projection(embeds.reshape(batch * images, *embeds.shape[2:]))
            tokens = tokens.reshape(batch, images * tokens.shape[1], tokens.shape[2])
        inputs = {}
        for (key, value), key_weight, value_weight, scale in zip(layers, adapter.keys, adapter.values, adapter.scales):
            inputs[key] = (tokens @ key_weight.T).to(dtypes[key]).contiguous()
            inputs[value] = (scale * (tokens @ value_weight.T)).to(dtypes[value]).contiguous()
        return inputs

    def _image_embeds(self, image: Any, embeds: Any, rows: int, guided: bool, adapter: _LoadedAdapter) -> torch.Tensor:
        """The image embeddings of every row, ``(rows, images, …)`` (float32, on the device; ``[negative;
        positive]`` where ``guided``), as diffusers' ``prepare_ip_adapter_image_embeds`` makes them: from ``embeds``
        (``ip_adapter_image_embeds``: a list of one tensor, its negative half first where guided) or from ``image``
        (one image or a list of images, as a list of one per adapter or not) through the image encoder — the
        negative is zeros for a plain adapter and the encoder's states of zero images for a plus one."""
        if embeds is not None:
            if isinstance(embeds, (list, tuple)):
                if len(embeds) != 1:
                    raise ArgumentError(
                        "ip_adapter_image_embeds", f"expected a list of one tensor (one IP-Adapter), got {len(embeds)}"
                    )
                embeds = embeds[0]
            if not isinstance(embeds, torch.Tensor) or embeds.ndim < 3:
                raise ArgumentTypeError(
                    "ip_adapter_image_embeds",
                    f"expected a list of one tensor of shape (batch, images, …), got {type(embeds).__name__}"
                    + (f" of shape {tuple(embeds.shape)}" if isinstance(embeds, torch.Tensor) else ""),
                )
            embeds = embeds.to(device=self.device, dtype=torch.float32)
            self._check_embeds(embeds, rows, guided, adapter)
            negative, positive = embeds.chunk(2) if guided else (None, embeds)
            if positive.shape[0] == rows and rows > 1:  # one row of embeddings per image already
                return torch.cat([negative, positive]) if guided else positive
        else:
            if isinstance(image, (list, tuple)) and len(image) == 1:
                image = image[0]  # diffusers' list of one entry per adapter
            pixels = self._image_prompt_pixels(image)
            output = 1 if adapter.hidden_states else 0
            # copies: the encoder's output tensor is reused by its next call (the negative's below)
            positive = self.image_encoder(pixel_values=pixels)[output].to(torch.float32, copy=True)[None]
            negative = None
            if guided:
                negative = (
                    self.image_encoder(pixel_values=torch.zeros_like(pixels))[output].to(torch.float32, copy=True)[None]
                    if adapter.hidden_states
                    else torch.zeros_like(positive)
                )
        positive = torch.cat([positive] * rows)
        return torch.cat([torch.cat([negative] * rows), positive]) if guided else positive

    def _check_embeds(self, embeds: torch.Tensor, rows: int, guided: bool, adapter: _LoadedAdapter) -> None:
        """``ip_adapter_image_embeds``: ``(batch, images, width)`` for a plain adapter, ``(batch, images, tokens,
        width)`` for the others, the width the adapter's projection takes; ``batch`` 1 (every image of the call
        shares it) or one per image, twice that (negative half first) where guided."""
        first = next((m for m in adapter.projection.modules() if isinstance(m, torch.nn.Linear)), None)
        rank = 4 if adapter.hidden_states else 3
        width = first.in_features if first is not None else embeds.shape[-1]
        halves = 2 if guided else 1
        batch = embeds.shape[0]
        if embeds.ndim != rank or embeds.shape[-1] != width or batch % halves or batch // halves not in (1, rows):
            shape = "(batch, images, width)" if rank == 3 else "(batch, images, tokens, width)"
            counts = f"{halves} or {halves * rows}" if rows > 1 else f"{halves}"
            raise ArgumentError(
                "ip_adapter_image_embeds",
                f"expected a tensor of shape {shape} with width {width} and batch {counts}"
                + (" (the negative half first: the call is guided)" if guided else "")
                + f", got shape {tuple(embeds.shape)}",
            )

    def _image_prompt_pixels(self, image: Any) -> torch.Tensor:
        """``image`` (one or a list) as the image encoder's ``pixel_values``, as diffusers prepares it where the
        pipeline has no feature extractor of its own: a ``CLIPImageProcessor`` at the encoder's image size."""
        from transformers import CLIPImageProcessor

        size = self.image_encoder.input_dims["pixel_values"][2]
        if not isinstance(size, int):
            raise ArgumentError("image_encoder", "expected an image encoder of a fixed image size, got a free one")
        dtype = self.image_encoder.input_dtypes["pixel_values"]
        if isinstance(image, torch.Tensor):  # as diffusers' encode_image: a tensor is the encoder's pixel_values
            if image.ndim == 3:
                image = image[None]
            if image.ndim != 4 or tuple(image.shape[1:]) != (3, size, size) or not image.is_floating_point():
                raise ArgumentError(
                    "ip_adapter_image",
                    f"expected a tensor of the image encoder's pixel_values, (images, 3, {size}, {size}) preprocessed "
                    f"(or a PIL image or numpy array), got {image.dtype} of shape {tuple(image.shape)}",
                )
            return image.to(device=self.device, dtype=dtype)
        if isinstance(image, (list, tuple)):
            image = [i.detach().cpu() if isinstance(i, torch.Tensor) else i for i in image]
        try:
            pixels = CLIPImageProcessor(size=size, crop_size=size)(image, return_tensors="pt").pixel_values
        except Exception as error:
            raise ArgumentTypeError(
                "ip_adapter_image", f"expected a PIL image, numpy array or tensor, got {type(image).__name__}: {error}"
            ) from error
        return pixels.to(device=self.device, dtype=dtype)

"""Runtime LoRA for the pipelines, with diffusers' names: a LoRA changes the owned weights of the ONNX models in place.

The export's ``lora_map.json`` (:func:`~optimum_iobinding.layout.read_weight_map`) says where each layer's weight
went; :func:`torch_layout_view` gives a view of the owned initializer in torch layout, which takes the updated weight.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import onnx
import torch

from ..errors import ArgumentError, ArgumentPathError, ModelFileError
from ..layout import WeightPlace, folded_biases, missing_weights_file, read_weight_map


def torch_layout_view(tensor: torch.Tensor, place: WeightPlace, shape: Sequence[int]) -> torch.Tensor:
    """A view of ``tensor`` (the initializer) in the torch layout ``shape`` of the weight at ``place``: writing into
    it (``copy_``) writes the initializer in place. A packed weight interleaved per head is not one strided view in
    torch layout; for it the view has the layout ``(in, heads, out / heads)`` and :func:`to_view_layout` says how
    to write into it."""
    if place.layout == "same":
        return tensor
    if place.layout == "transposed":
        return tensor.t()
    if place.layout == "nhwc":
        return tensor.permute(0, 3, 1, 2)
    if place.layout == "packed":
        out_features, in_features = shape
        blocks = tensor.view(in_features, place.heads, place.parts, out_features // place.heads)
        if place.heads == 1:
            return blocks[:, 0, place.index, :].t()
        return blocks[:, :, place.index, :]
    raise ArgumentError("place", f"unknown layout {place.layout!r}")


def to_view_layout(weight: torch.Tensor, place: WeightPlace) -> torch.Tensor:
    """``weight`` (torch layout) in the layout of :func:`torch_layout_view`'s view of ``place``."""
    if place.layout == "packed" and place.heads > 1:
        out_features, in_features = weight.shape
        return weight.t().reshape(in_features, place.heads, out_features // place.heads)
    return weight


def torch_shape(tensor: torch.Tensor, place: WeightPlace) -> Tuple[int, ...]:
    """The torch-layout shape of the weight at ``place`` in ``tensor`` (the initializer)."""
    if place.layout == "same":
        return tuple(tensor.shape)
    if place.layout == "transposed":
        return (tensor.shape[1], tensor.shape[0])
    if place.layout == "nhwc":
        out_channels, kh, kw, in_channels = tensor.shape
        return (out_channels, in_channels, kh, kw)
    return (tensor.shape[1] // place.parts, tensor.shape[0])


# ------------------------------------------------------------------------------------------------ runtime LoRA
# how a layer's two matrices are named: PEFT's names (what _to_peft_names converts to), and diffusers' older ones
# for keys its converters leave as they are
_MATRIX_SUFFIXES = (
    (".lora_A.weight", "down"),
    (".lora_B.weight", "up"),
    (".lora.down.weight", "down"),
    (".lora.up.weight", "up"),
    (".lora_linear_layer.down.weight", "down"),
    (".lora_linear_layer.up.weight", "up"),
)


@dataclass
class _LayerUpdate:
    """One adapter's update of one layer: ``scale · up @ down``."""

    down: torch.Tensor  # (rank, in[, kh, kw])
    up: torch.Tensor  # (out, rank[, 1, 1])
    scale: float

    def delta(self, shape: Sequence[int]) -> torch.Tensor:
        product = self.up.flatten(1).float() @ self.down.flatten(1).float()
        return (self.scale * product).reshape(tuple(shape))


class _Layer:
    """A layer's weight in the owned initializers: the views that write it and its weight before any LoRA, and the
    biases folded from it (:data:`~optimum_iobinding.layout.FOLDED_BIASES_KEY`), which change with it."""

    def __init__(
        self,
        weights: Dict[str, torch.Tensor],
        places: Sequence[WeightPlace],
        component: str,
        name: str,
        folds: Sequence[Dict[str, Any]] = (),
    ):
        mine = [fold for fold in folds if fold["weight"] in {place.initializer for place in places}]
        missing = [place.initializer for place in places if place.initializer not in weights]
        missing += [fold["bias"] for fold in mine if fold["bias"] not in weights]
        if missing:
            raise ModelFileError(
                component,
                f"layer {name}: its weight or a bias folded from it ({missing[0]}) is not among the weights the "
                "model keeps as tensors (too small to be one), so no LoRA can change it",
            )
        self.places = list(places)
        self.shape = torch_shape(weights[places[0].initializer], places[0])
        self.views = [torch_layout_view(weights[place.initializer], place, self.shape) for place in places]
        self.base = self._read().clone()
        self.dtype = weights[places[0].initializer].dtype
        # each folded bias: (its tensor, its value before any LoRA, the value bias, the weight's input columns read)
        self.folds = [
            (
                weights[fold["bias"]],
                weights[fold["bias"]].clone(),
                torch.tensor(fold["value_bias"], dtype=torch.float32, device=weights[fold["bias"]].device),
                slice(fold["offset"], fold["offset"] + len(fold["value_bias"])),
            )
            for fold in mine
        ]

    def _read(self) -> torch.Tensor:
        view, place = self.views[0], self.places[0]
        if place.layout == "packed" and place.heads > 1:
            return view.reshape(self.shape[1], self.shape[0]).t()
        return view

    def write(self, delta: Optional[torch.Tensor]) -> None:
        weight = self.base if delta is None else (self.base.float() + delta.to(self.base.device)).to(self.dtype)
        with torch.no_grad():
            for view, place in zip(self.views, self.places):
                view.copy_(to_view_layout(weight, place))
            for bias, base, value_bias, columns in self.folds:  # c' = c + b_v · (W + ΔW)ᵀ[rows]: the ΔW part
                change = 0.0 if delta is None else delta.to(bias.device)[:, columns].float() @ value_bias
                bias.copy_((base.float() + change).to(bias.dtype))


def _layer_of(key: str) -> Optional[Tuple[str, str, str]]:
    """``(component, layer, "down" | "up")`` of a LoRA state-dict key, or ``None`` for a key of no matrix."""
    for suffix, matrix in _MATRIX_SUFFIXES:
        if key.endswith(suffix):
            component, _, layer = key[: -len(suffix)].partition(".")
            return component, layer, matrix
    return None


# the libraries whose errors mean the Hub did not give a file (a connection, an unknown repository or file)
HUB_ERROR_MODULES = ("huggingface_hub", "httpx", "httpcore", "requests", "urllib3")


class LoraLoaderMixin:
    """Runtime LoRA for the pipelines, with diffusers' names. A LoRA changes the weights the models keep as owned
    tensors in place (``W = W₀ + Σ weight · scale · B @ A`` over the active adapters), where the export's
    ``lora_map.json`` says each layer's weight went. A model touched for the first time makes its weights owned
    (:meth:`IOBindingORTModel.own_weights`: one session made again, where a session had loaded them itself); after
    that no session is created again, and captured CUDA graphs replay the new weights (their addresses do not move). LoRA files are read by diffusers' own ``lora_state_dict``
    (diffusers/PEFT keys, the kohya format, hub ids)."""

    def _lora(self) -> Dict[str, Any]:
        """The LoRA state, one dict shared with the pipelines :meth:`from_pipe` made on the same components (as
        diffusers' adapters live in the shared modules): emptied in place, never replaced."""
        if getattr(self, "_lora_state", None) is None:
            self._lora_state = _empty_lora_state()
        return self._lora_state

    def share_lora_state(self, source: Any) -> None:
        """Called by ``from_pipe`` on the new pipeline: where it has ``source``'s LoRA components (the same models),
        the two share one LoRA state, so that an adapter loaded, set, fused or unloaded through either is one the
        other sees. A pipeline with another model in place of one of them starts with none; that is refused while
        ``source`` has adapters, whose changes its other, shared models hold."""
        if not isinstance(source, LoraLoaderMixin):
            return
        if all(getattr(self, name, None) is getattr(source, name, None) for name in self.lora_components):
            self._lora_state = source._lora()
            return
        state = getattr(source, "_lora_state", None)
        if state is not None and (state["adapters"] or state["fused"]):
            raise ArgumentError(
                "from_pipe",
                f"expected the LoRA components of the pipeline ({', '.join(self.lora_components)}) shared, or its "
                f"adapters unloaded first, got another model for one of them while {sorted(state['adapters'])} are "
                "loaded in the models it shares",
            )

    def _lora_state_dict(
        self, source: Any, **kwargs: Any
    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, float], Optional[Dict[str, Any]]]:
        """The LoRA read by the family's diffusers loader (:attr:`~optimum_iobinding.families.Family.lora`): its state
        dict in diffusers' or PEFT's names, the alphas by key, the metadata."""
        import diffusers.loaders

        argument = "pretrained_model_name_or_path_or_dict"
        if missing_weights_file(source):
            raise ArgumentPathError(
                argument,
                f"expected an existing LoRA file or folder, or a hub id, got {os.fspath(source)!r}: no such file",
            )
        reader = getattr(diffusers.loaders, self.family.lora)
        extra = (
            {"return_alphas": True} if "return_alphas" in inspect.signature(reader.lora_state_dict).parameters else {}
        )
        try:
            found = reader.lora_state_dict(source, return_lora_metadata=True, **extra, **kwargs)
        except Exception as error:  # a hub id the Hub cannot provide (offline, unknown, no such weight_name)
            fetching = isinstance(error, OSError) or type(error).__module__.split(".")[0] in HUB_ERROR_MODULES
            if not fetching or not isinstance(source, (str, os.PathLike)) or Path(source).expanduser().exists():
                raise  # a local file, or a LoRA the Hub gave that does not read: the reader's own error
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ArgumentPathError(
                argument,
                f"{os.fspath(source)!r} is not a local file or folder (no such path here), and the Hugging Face Hub "
                f"could not provide it: {type(error).__name__}: {reason[:200]}",
            ) from error
        found = found if isinstance(found, tuple) else (found,)
        if reader.__name__ == "SD3LoraLoaderMixin":  # the state dict (and the metadata), any alphas among the keys
            state_dict, metadata = found[0], (found[1] if len(found) > 1 else None)
            alphas = {key: state_dict.pop(key) for key in [key for key in state_dict if key.endswith(".alpha")]}
        else:  # the state dict, the alphas (and the metadata, where this diffusers gives it)
            state_dict, alphas, metadata = found[0], found[1], (found[2] if len(found) > 2 else None)
        return state_dict, {key: float(value) for key, value in dict(alphas or {}).items()}, metadata

    @property
    def lora_components(self) -> Tuple[str, ...]:
        """The components a LoRA may change: the denoiser and the CLIP text encoders (not a T5)."""
        t5 = self.family.options.get("t5_encoder")
        return (self.family.interface.component, *(name for name in ("text_encoder", "text_encoder_2") if name != t5))

    def _lora_layer(self, component: str, layer: str) -> Tuple[str, "_Layer"]:
        """The layer (its name as the export's map has it) of a component, made ready for in-place updates."""
        state = self._lora()
        model = getattr(self, component, None)
        if model is None:
            raise ArgumentError(component, "the LoRA changes this component, which the pipeline does not have")
        maps = state.setdefault("maps", {})
        if component not in maps:
            if model.model_path is None:
                raise ArgumentError(component, "the model was not loaded from a file, so it has no lora_map.json")
            maps[component], not_found = read_weight_map(Path(model.model_path).parent)
            state.setdefault("not_found", {})[component] = set(not_found)
            folds: List[Dict[str, Any]] = []
            if component == "transformer":  # the biases a transformer rewrite folded from the layers' weights
                folds = folded_biases(onnx.load(str(model.model_path), load_external_data=False))
                placed = {place.initializer for found in maps[component].values() for place in found}
                lost = [fold["weight"] for fold in folds if fold["weight"] not in placed]
                if lost:  # its bias would keep a stale value under a LoRA
                    raise ModelFileError(
                        component,
                        f"a bias is folded from the weight {lost[0]!r}, which lora_map.json places for no layer: "
                        "export the model again",
                    )
            state.setdefault("folds", {})[component] = folds
        places_by_layer = maps[component]
        for candidate in (
            layer,
            f"text_model.{layer}",
            layer[len("text_model.") :] if layer.startswith("text_model.") else None,
        ):
            if candidate is not None and candidate in places_by_layer:
                break
        else:
            if {layer, f"text_model.{layer}"} & state["not_found"][component]:
                raise ArgumentError(
                    component,
                    f"the LoRA changes layer {layer!r}, whose weight the export folded into another computation "
                    "(lora_map.json lists it as not found), so no LoRA can change it",
                )
            raise ArgumentError(
                component,
                f"the LoRA changes layer {layer!r}, which this model does not have (a LoRA for another architecture?)",
            )
        key = (component, candidate)
        if key not in state["layers"]:
            state["layers"][key] = _Layer(
                model.own_weights(), places_by_layer[candidate], component, candidate, state["folds"][component]
            )
        return candidate, state["layers"][key]

    def load_lora_weights(
        self, pretrained_model_name_or_path_or_dict: Any, adapter_name: Optional[str] = None, **kwargs: Any
    ) -> None:
        """Loads a LoRA (a folder, a ``.safetensors`` file, a hub id with ``weight_name=``, or a state dict) as the
        adapter ``adapter_name`` (default ``default_N``). As in diffusers it becomes the one active adapter of the
        components it changes (the others keep theirs) until :meth:`set_adapters` says otherwise.

        Raises:
            ValueError: the name is taken, or the LoRA does not fit the models (the message names the layer).
        """
        state = self._lora()
        denoiser_model = getattr(self, self.family.interface.component, None)
        owned_before = denoiser_model is not None and bool(denoiser_model.owned_weights)
        if adapter_name is None:
            adapter_name = f"default_{len(state['adapters'])}"
        if adapter_name in state["adapters"]:
            raise ArgumentError(
                "adapter_name", f"{adapter_name!r} is already loaded; unload_lora_weights() or pick another name"
            )
        state_dict, network_alphas, metadata = self._lora_state_dict(pretrained_model_name_or_path_or_dict, **kwargs)
        state_dict, alphas = _to_peft_names(state_dict, network_alphas)
        matrices: Dict[Tuple[str, str], Dict[str, torch.Tensor]] = {}
        for key, value in state_dict.items():
            found = _layer_of(key)
            if found is None:
                if key.partition(".")[0] == "transformer" and not key.endswith(".alpha"):
                    # e.g. a FLUX.1 Control LoRA's norm weights: replaced, not updated, which this cannot carry
                    raise ArgumentError(
                        "pretrained_model_name_or_path_or_dict",
                        f"the LoRA has {key!r}, which is no LoRA matrix (a low-rank pair's A or B): runtime LoRA "
                        "changes layers by low-rank updates only",
                    )
                continue
            component, layer, matrix = found
            if component not in self.lora_components:
                raise ArgumentError(
                    key, f"expected a LoRA key of {list(self.lora_components)}, got component {component!r}"
                )
            matrices.setdefault((component, layer), {})[matrix] = value
        if not matrices:
            raise ArgumentError(
                "pretrained_model_name_or_path_or_dict",
                f"no LoRA matrices found in {pretrained_model_name_or_path_or_dict!r}",
            )
        updates: Dict[Tuple[str, str], _LayerUpdate] = {}
        ranks: Dict[str, List[int]] = {}
        for (component, layer), pair in matrices.items():
            if set(pair) != {"down", "up"}:
                raise ArgumentError(
                    "pretrained_model_name_or_path_or_dict",
                    f"{component} layer {layer}: the LoRA has only its {sorted(pair)[0]} matrix",
                )
            ranks.setdefault(component, []).append(pair["down"].shape[0])
        for (component, layer), pair in matrices.items():
            name, target = self._lora_layer(component, layer)
            down, up = pair["down"], pair["up"]
            rank = down.shape[0]
            expected_out, expected_in = target.shape[0], target.shape[1]
            if (
                up.shape[0] != expected_out
                or down.shape[1] != expected_in
                or up.shape[1] != rank
                or (len(target.shape) == 4 and tuple(down.shape[2:]) != tuple(target.shape[2:]))
            ):
                raise ArgumentError(
                    "pretrained_model_name_or_path_or_dict",
                    f"{component} layer {name}: the LoRA's update is {tuple(up.shape)} @ "
                    f"{tuple(down.shape)}, the layer's weight is {tuple(target.shape)} (a LoRA for "
                    "another architecture?)",
                )
            alpha = alphas.get((component, layer))
            if alpha is None and metadata:
                alpha = (metadata.get(component) or metadata).get("lora_alpha")
            if alpha is None:  # as diffusers: the most common rank, which makes a uniform-rank LoRA's scale 1
                alpha = max(set(ranks[component]), key=ranks[component].count)
            device = target.base.device
            updates[(component, name)] = _LayerUpdate(
                down.to(device, torch.float32), up.to(device, torch.float32), float(alpha) / rank
            )
        state["adapters"][adapter_name] = updates
        for component in {component for component, _ in updates}:  # as diffusers: the new one, in what it changes
            state["active"][component] = {adapter_name: 1.0}
        self._apply_lora()
        if not owned_before:  # this LoRA made the denoiser's weights owned: a step cache's parts must read them
            self._refresh_step_cache()

    def _refresh_step_cache(self) -> None:
        """A step cache enabled before a LoRA made the denoiser's weights owned may run parts that loaded the
        weights from the file (the CPU): made again, its parts read the owned weights the LoRA changes. Later LoRAs
        change the same owned tensors, and the parts need nothing."""
        denoiser = getattr(self, "denoiser", None)
        cache = getattr(denoiser, "cache", None)
        if cache is not None:
            denoiser.enable_cache(cache.config)

    def set_adapters(
        self,
        adapter_names: Union[str, Sequence[str]],
        adapter_weights: Union[float, Dict[str, float], Sequence[Any], None] = None,
    ) -> None:
        """Makes ``adapter_names`` the active adapters, with ``adapter_weights`` (one number for all, one per
        adapter, or per adapter a dict of component → number)."""
        state = self._lora()
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        _check_adapter_names(state, names)
        if adapter_weights is None or isinstance(adapter_weights, (int, float, dict)):
            weights = [1.0 if adapter_weights is None else adapter_weights] * len(names)
        else:
            weights = list(adapter_weights)
            if len(weights) != len(names):
                raise ArgumentError(
                    "adapter_weights", f"expected {len(names)} weights (one per adapter), got {len(weights)}"
                )
        for weight in weights:
            if isinstance(weight, dict):
                self._check_lora_components(list(weight), "adapter_weights")
        state["active"] = {
            component: {
                name: _weight_for(weight, component)
                for name, weight in zip(names, weights)
                if any(key[0] == component for key in state["adapters"][name])
            }
            for component in self.lora_components
        }
        self._apply_lora()

    def get_active_adapters(self) -> List[str]:
        """The active adapters of the first component that has any (the UNet's, usually)."""
        for component in self.lora_components:
            if self._lora()["active"].get(component):
                return list(self._lora()["active"][component])
        return []

    def get_list_adapters(self) -> Dict[str, List[str]]:
        listed: Dict[str, List[str]] = {}
        for name, updates in self._lora()["adapters"].items():
            for component in sorted({component for component, _ in updates}):
                listed.setdefault(component, []).append(name)
        return listed

    def disable_lora(self) -> None:
        """Runs the models without any adapter (fused ones included) until :meth:`enable_lora`."""
        self._lora()["enabled"] = False
        self._apply_lora()

    def enable_lora(self) -> None:
        self._lora()["enabled"] = True
        self._apply_lora()

    def unload_lora_weights(self) -> None:
        """Removes every adapter. As in diffusers, what :meth:`fuse_lora` fused stays in the weights (call
        :meth:`unfuse_lora` first to remove it): without fused adapters the models get their weights as exported,
        with them the exported weights plus the fused updates, which later LoRAs change from."""
        state = self._lora()
        fused = self._lora_deltas(fused_only=True)
        for key, layer in state["layers"].items():
            layer.write(fused.get(key))
        state.clear()
        state.update(_empty_lora_state())

    def delete_adapters(self, adapter_names: Union[str, Sequence[str]]) -> None:
        """diffusers' ``delete_adapters``: removes the named adapters, the others stay. What an adapter fused stays
        in the weights (its update becomes part of the layers' base, as :meth:`unload_lora_weights` keeps it). As
        PEFT does, a component whose active adapters were all deleted gets the first adapter left that changes it
        (by name) as its active one."""
        state = self._lora()
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        _check_adapter_names(state, names)
        fused = self._lora_deltas(fused_only=True, adapters=names)
        for key, delta in fused.items():  # baked into the base: no adapter carries it any more
            layer = state["layers"][key]
            layer.base = (layer.base.float() + delta.to(layer.base.device)).to(layer.base.dtype)
        state["fused"] = {key: value for key, value in state["fused"].items() if key[0] not in names}
        for name in names:
            del state["adapters"][name]
            for component, active in state["active"].items():
                if active.pop(name, None) is not None and not active:
                    left = sorted(
                        other for other, updates in state["adapters"].items() if any(c == component for c, _ in updates)
                    )
                    if left:
                        active[left[0]] = 1.0
        self._apply_lora()

    def _diffusers_default_components(self, method: str) -> Tuple[str, ...]:
        """The components diffusers' ``fuse_lora`` / ``unfuse_lora`` of the family's loader take by default."""
        import diffusers.loaders

        reader = getattr(diffusers.loaders, self.family.lora)
        return tuple(inspect.signature(getattr(reader, method)).parameters["components"].default)

    def fuse_lora(
        self,
        components: Optional[Sequence[str]] = None,
        lora_scale: float = 1.0,
        safe_fusing: bool = False,
        adapter_names: Optional[Sequence[str]] = None,
        **kwargs: Any,
    ) -> None:
        """Fuses the active adapters (or ``adapter_names``), times ``lora_scale``, into the weights of
        ``components`` (default: diffusers' for the family, e.g. the UNet and the first text encoder, FLUX.1's
        transformer): they stay applied, whatever :meth:`set_adapters` says, until :meth:`unfuse_lora`."""
        components = (
            self._diffusers_default_components("fuse_lora")
            if components is None
            else self._check_lora_components(components, "components")
        )
        lora_scale = _finite_number(lora_scale, "lora_scale")
        state = self._lora()
        _check_adapter_names(state, adapter_names or ())
        for component in components:
            active = state["active"].setdefault(component, {})
            for name in adapter_names if adapter_names is not None else list(active):
                if (name, component) in state["fused"]:  # as diffusers: an adapter fused already is not fused again
                    continue
                state["fused"][(name, component)] = lora_scale * active.get(name, 1.0)
                if name in active:  # as diffusers: the adapter keeps the scaled weight once unfused
                    active[name] *= lora_scale
        self._apply_lora()
        if safe_fusing:
            bad = [
                f"{component} layer {layer}"
                for (component, layer), target in state["layers"].items()
                if not torch.isfinite(target.views[0]).all()
            ]
            if bad:
                self.unfuse_lora(components)
                raise ArgumentError("fuse_lora", f"the fused weights are not finite in {bad[:3]}; unfused again")

    def unfuse_lora(self, components: Optional[Sequence[str]] = None, **kwargs: Any) -> None:
        components = (
            self._diffusers_default_components("unfuse_lora")
            if components is None
            else self._check_lora_components(components, "components")
        )
        state = self._lora()
        state["fused"] = {key: value for key, value in state["fused"].items() if key[1] not in components}
        self._apply_lora()

    def _check_lora_components(self, components: Any, argument: str) -> Tuple[str, ...]:
        """``components`` (names of the pipeline's LoRA components), refused by name otherwise, as diffusers refuses
        a component its loader does not load LoRAs into."""
        names = (components,) if isinstance(components, str) else tuple(components)
        here = [name for name in self.lora_components if getattr(self, name, None) is not None]
        unknown = [name for name in names if name not in here]
        if unknown:
            raise ArgumentError(argument, f"expected components a LoRA changes here ({', '.join(here)}), got {unknown}")
        return names

    def _lora_deltas(
        self, fused_only: bool = False, adapters: Optional[Sequence[str]] = None
    ) -> Dict[Tuple[str, str], torch.Tensor]:
        """Each touched layer's update: the fused adapters' and (unless ``fused_only``) the active, unfused ones',
        while LoRA is enabled; of ``adapters`` only where given."""
        state = self._lora()
        deltas: Dict[Tuple[str, str], torch.Tensor] = {}
        if state["enabled"] or fused_only:
            for name, updates in state["adapters"].items():
                if adapters is not None and name not in adapters:
                    continue
                for (component, layer), update in updates.items():
                    factor = state["fused"].get((name, component))
                    if factor is None and not fused_only:
                        factor = state["active"].get(component, {}).get(name)
                    if not factor:
                        continue
                    target = state["layers"][(component, layer)]
                    delta = factor * update.delta(target.shape)
                    key = (component, layer)
                    deltas[key] = deltas[key] + delta if key in deltas else delta
        return deltas

    def _apply_lora(self) -> None:
        """Writes every touched layer: base + fused updates + the active, unfused adapters' updates."""
        deltas = self._lora_deltas()
        for key, target in self._lora()["layers"].items():
            target.write(deltas.get(key))


def _to_peft_names(
    state_dict: Dict[str, torch.Tensor], network_alphas: Dict[str, float]
) -> Tuple[Dict[str, torch.Tensor], Dict[Tuple[str, str], float]]:
    """The state dict in the PEFT names (``<component>.<layer>.lora_A.weight``), as diffusers converts it before
    loading (the kohya format comes out of ``lora_state_dict`` in diffusers' older names), and the alphas by
    ``(component, layer)``."""
    from diffusers.utils import (
        convert_state_dict_to_diffusers,
        convert_state_dict_to_peft,
        convert_unet_state_dict_to_peft,
    )

    def convert(component: str, part: Dict[str, Any]) -> Dict[str, Any]:
        try:  # diffusers' converters refuse names they recognise no format in: those are kept as they are
            if component == "unet":
                return convert_unet_state_dict_to_peft(part)
            try:
                part = convert_state_dict_to_diffusers(part)
            except ValueError:
                pass
            return convert_state_dict_to_peft(part)
        except ValueError:
            return part

    by_component: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        by_component.setdefault(key.partition(".")[0], {})[key] = value
    converted: Dict[str, torch.Tensor] = {}
    for component, part in by_component.items():
        converted.update(convert(component, part))
    alphas: Dict[Tuple[str, str], float] = {}
    for key, alpha in network_alphas.items():
        base = key[: -len(".alpha")] if key.endswith(".alpha") else key
        component = base.partition(".")[0]
        (name,) = convert(component, {base: torch.zeros(())}) or (base,)
        found = _layer_of(name)
        alphas[(component, found[1] if found else base.partition(".")[2])] = float(alpha)
    return converted, alphas


def _check_adapter_names(state: Dict[str, Any], names: Sequence[str]) -> None:
    unknown = [name for name in names if name not in state["adapters"]]
    if unknown:
        raise ArgumentError(
            "adapter_names", f"expected names of loaded adapters {sorted(state['adapters'])}, got {unknown}"
        )


def _weight_for(weight: Any, component: str) -> float:
    if isinstance(weight, dict):
        return _finite_number(weight.get(component, 1.0), "adapter_weights")
    return _finite_number(weight, "adapter_weights")


def _finite_number(value: Any, argument: str) -> float:
    """``value`` as a float, refused by name where it is no finite real number (a NaN weight makes every image
    NaN)."""
    import math
    import numbers

    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise ArgumentError(argument, f"expected a finite number (or per component a dict of them), got {value!r}")
    return float(value)


def _empty_lora_state() -> Dict[str, Any]:
    # adapters: name → (component, layer) → update; active: component → adapter → weight (as diffusers, each
    # component has its own); fused: (adapter, component) → the factor it was fused with
    return {"adapters": {}, "active": {}, "fused": {}, "enabled": True, "layers": {}}

"""``optimum_iobinding.accelerate(pipe)``: switch an optimum-onnx ``ORTDiffusionPipeline`` to this project's fast path in place.

optimum's parts bind torch tensors but allocate their outputs and synchronize the device around every call. Here each
part (UNet, text encoders, VAE encoder/decoder) is replaced by a subclass of optimum's own part class whose
``forward`` runs an :class:`IOBindingORTModel` on the same ONNX file: reused output buffers, one CUDA stream shared
by every part (ordered after the caller's stream with events, so the host never waits), and the UNet replayed as a
CUDA graph. Everything else — the pipeline class, its ``__call__`` (diffusers' loop), scheduler, tokenizers — stays
optimum's. Needs the optimum-onnx environment (``pip install 'optimum-iobinding[optimum]'``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ..errors import ArgumentError, ArgumentTypeError
from ..runtime.model import IOBindingORTModel
from ..runtime.options import CUDA_LIKE_PROVIDERS, CudaGraphSetting, ModelOptions, check_cuda_graph_setting

__all__ = ["accelerate"]

_PART_NAMES = ("unet", "text_encoder", "text_encoder_2", "text_encoder_3", "vae_encoder", "vae_decoder")


def accelerate(
    pipe: Any,
    *,
    cuda_graph: CudaGraphSetting = ModelOptions.default("cuda_graph"),
    provider_options: Optional[Dict[str, Any]] = None,
) -> Any:
    """Switches ``pipe``'s ONNX parts to reused buffers, one shared stream and (``cuda_graph``) a CUDA-graph UNet.

    Args:
        pipe: an optimum-onnx ``ORTDiffusionPipeline`` (``ORTStableDiffusionPipeline``, its XL, LCM, img2img and
            inpainting variants), on the CUDA or CPU execution provider.
        cuda_graph: the UNet's CUDA graphs, as the project's models take them (default: theirs, ``"auto"``):
            ``"auto"`` captures each signature where it can and runs without a graph where it cannot; ``True`` the
            same, a fallback warning; ``False`` never. CUDA only: ignored on the CPU; the other parts run without.
        provider_options: options for the new sessions, on top of this project's diffusion defaults and the parts'
            ``device_id`` (the other options optimum's sessions were made with are not carried over).

    Returns:
        ``pipe`` itself, its parts replaced. The sessions are re-created from the parts' files (the stream is a
        session option) before any part is replaced — a failure leaves ``pipe`` as it was — so while this runs the
        weights are on the device twice; optimum's sessions are released once the parts are swapped.
    """
    try:
        from optimum.onnxruntime.modeling_diffusion import ORTDiffusionPipeline, ORTVae
    except ImportError as error:
        raise ImportError("accelerate: needs optimum-onnx (pip install 'optimum-iobinding[optimum]')") from error
    check_cuda_graph_setting(cuda_graph)
    if not isinstance(pipe, ORTDiffusionPipeline):
        raise ArgumentTypeError(
            "pipe", f"expected an optimum.onnxruntime ORTDiffusionPipeline, got {type(pipe).__name__}"
        )
    if getattr(pipe, "transformer", None) is not None:
        raise ArgumentError(
            "pipe",
            "transformer-based pipelines (SD3, Flux) are not supported; this switches UNet "
            "pipelines (SD 1.x/2.x, SDXL, LCM)",
        )
    parts = {name: getattr(pipe, name) for name in _PART_NAMES if getattr(pipe, name, None) is not None}
    first = next(iter(parts.values()))
    provider = first.provider
    device_id = int(first.provider_option.get("device_id", 0)) if provider in CUDA_LIKE_PROVIDERS else None
    for name, part in parts.items():
        if part.provider != provider:
            raise ArgumentError(
                f"pipe.{name}",
                f"runs on {part.provider}, the other parts on {provider}; move the pipeline to one device first "
                "(pipe.to(...))",
            )
    given = dict(provider_options or {})
    if device_id is not None:
        given.setdefault("device_id", device_id)
    # each part keeps its own SessionOptions; the first part's options make the one stream every part runs on
    models, stream = {}, None
    for name, part in parts.items():
        options = ModelOptions.resolve(provider, given, part.session.get_session_options(), stream=stream)
        stream = options.stream
        graphs = cuda_graph if name == "unet" and stream is not None else False
        models[name] = IOBindingORTModel(
            str(part.path), config=dict(part.config), options=options.replace(cuda_graph=graphs)
        )
    replaced = {name: _ACCELERATED[_part_kind(parts[name])](model, pipe) for name, model in models.items()}
    for name, part in replaced.items():
        setattr(pipe, name, part)
    pipe.initialize_ort_attributes(parts=list(replaced.values()))
    if getattr(pipe, "vae", None) is not None:
        pipe.vae = ORTVae(replaced.get("vae_encoder"), replaced.get("vae_decoder"))
    return pipe


def _part_kind(part: Any) -> str:
    from optimum.onnxruntime.modeling_diffusion import ORTTextEncoder, ORTUnet, ORTVaeDecoder, ORTVaeEncoder

    for kind, part_class in (
        ("unet", ORTUnet),
        ("text_encoder", ORTTextEncoder),
        ("vae_encoder", ORTVaeEncoder),
        ("vae_decoder", ORTVaeDecoder),
    ):
        if isinstance(part, part_class):
            return kind
    raise ArgumentTypeError("pipe", f"cannot switch a part of type {type(part).__name__}")


def _accelerated_classes() -> Dict[str, type]:
    """optimum's part classes with ``forward`` running an :class:`IOBindingORTModel` (built lazily: optimum is an
    optional dependency)."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
    from optimum.onnxruntime.modeling_diffusion import ORTTextEncoder, ORTUnet, ORTVaeDecoder, ORTVaeEncoder
    from transformers.modeling_outputs import ModelOutput

    class _Accelerated:
        """Shared by the four part kinds: the session is the model's (its graph session once the plain one is
        released), and outputs are copies (the model's buffers are overwritten by the next call; diffusers' loops
        keep some outputs across steps)."""

        def __init__(self, model: IOBindingORTModel, parent: Any):
            self.fast_model = model
            super().__init__(model.session, parent, use_io_binding=True)
            self._io_binding = None  # optimum's binding would keep the plain session alive beside a graph session

        @property
        def session(self):
            return self.fast_model.session

        @session.setter
        def session(self, value):  # optimum's initializer assigns the session it was given: the model's already
            pass

        def run(self, **inputs: Any) -> Dict[str, torch.Tensor]:
            declared = set(self.fast_model.input_dtypes)
            outputs = self.fast_model(
                **{key: value for key, value in inputs.items() if key in declared and value is not None}
            )
            return {name: tensor.clone() for name, tensor in zip(self.fast_model.output_names, outputs)}

        @staticmethod
        def pack(outputs: Dict[str, torch.Tensor], return_dict: bool):
            return ModelOutput(**outputs) if return_dict else tuple(outputs.values())

    class AcceleratedORTUnet(_Accelerated, ORTUnet):
        def forward(
            self,
            sample,
            timestep,
            encoder_hidden_states,
            timestep_cond=None,
            cross_attention_kwargs=None,
            added_cond_kwargs=None,
            return_dict: bool = True,
        ):
            timestep = torch.as_tensor(timestep)
            if len(self.input_shapes["timestep"]) > 0 and timestep.dim() == 0:
                timestep = timestep.reshape(1)
            outputs = self.run(
                sample=sample,
                timestep=timestep,
                encoder_hidden_states=encoder_hidden_states,
                timestep_cond=timestep_cond,
                **(cross_attention_kwargs or {}),
                **(added_cond_kwargs or {}),
            )
            return self.pack({"sample": outputs.pop("out_sample"), **outputs}, return_dict)

    class AcceleratedORTTextEncoder(_Accelerated, ORTTextEncoder):
        def forward(self, input_ids, attention_mask=None, output_hidden_states=None, return_dict: bool = True):
            outputs = self.run(input_ids=input_ids, attention_mask=attention_mask)
            layers = int(
                self.config.num_hidden_layers
                if hasattr(self.config, "num_hidden_layers")
                else self.config.num_decoder_layers
            )
            hidden = [outputs.pop(f"hidden_states.{i}") for i in range(layers) if f"hidden_states.{i}" in outputs]
            if output_hidden_states:
                outputs["hidden_states"] = hidden + [outputs.get("last_hidden_state")]
            return self.pack(outputs, return_dict)

    class AcceleratedORTVaeEncoder(_Accelerated, ORTVaeEncoder):
        def forward(self, sample, generator=None, return_dict: bool = True):
            outputs = self.run(sample=sample)
            if "latent_sample" in outputs:
                outputs["latents"] = outputs.pop("latent_sample")
            if "latent_parameters" in outputs:
                outputs["latent_dist"] = DiagonalGaussianDistribution(parameters=outputs.pop("latent_parameters"))
            return self.pack(outputs, return_dict)

    class AcceleratedORTVaeDecoder(_Accelerated, ORTVaeDecoder):
        def forward(self, latent_sample, generator=None, return_dict: bool = True):
            return self.pack(self.run(latent_sample=latent_sample), return_dict)

    return {
        "unet": AcceleratedORTUnet,
        "text_encoder": AcceleratedORTTextEncoder,
        "vae_encoder": AcceleratedORTVaeEncoder,
        "vae_decoder": AcceleratedORTVaeDecoder,
    }


class _LazyClasses(dict):
    def __missing__(self, key: str) -> type:
        self.update(_accelerated_classes())
        return dict.__getitem__(self, key)


_ACCELERATED = _LazyClasses()

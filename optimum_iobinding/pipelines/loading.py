"""Loading and saving a pipeline (:class:`Loading`, a part of :class:`~.core.OnnxDiffusionPipeline`): its folder
(local, or downloaded with what the family reads), each component loaded with the options resolved once, replacements
checked, and the folder written back in its family's layout, safely."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type, TypeVar, Union


from ..errors import ArgumentTypeError
from ..layout import (
    building_beside,
    check_output_folder,
    resolve_pipeline_folder,
    save_tokenizer,
    step_cache_part_files,
    write_model_index,
)
from ..runtime.hub import check_hub_kwargs, copy_graphs, keywords_of
from ..runtime.options import CudaGraphSetting, PipelineOptions, ProviderSpec
from .components import check_replacement, load_components, names_of

PipelineT = TypeVar("PipelineT", bound="Loading")


class Loading:
    """``from_pretrained`` and ``save_pretrained`` of every family, from its declared components."""

    @classmethod
    def from_pretrained(
        cls: Type[PipelineT],
        pretrained_model_name_or_path: Union[str, os.PathLike],
        provider: ProviderSpec = None,
        provider_options: Optional[Dict[str, Any]] = None,
        sess_options: Any = None,
        io_binding: bool = True,
        cuda_graph: CudaGraphSetting = "auto",
        component_options: Optional[Dict[str, Dict[str, Any]]] = None,
        prepare_in_background: bool = True,
        **kwargs: Any,
    ) -> PipelineT:
        """Loads a diffusers-converted ONNX folder, an ``optimum-cli export onnx`` folder or ours, or a hub id.

        Args:
            pretrained_model_name_or_path: local folder or hub repository id.
            provider, provider_options, sess_options: for every ONNX component (see :class:`IOBindingORTModel`).
            io_binding: bind torch tensors on the session's device (default), or run diffusers' numpy baseline.
            cuda_graph: ``"auto"`` (default): on CUDA every component captures each input signature as a CUDA graph
                where it can (one INFO log line where it cannot); ``True``: the same, but the denoiser (the UNet or
                the transformer) must be captured; ``False``: no graphs (see :class:`IOBindingORTModel`). On CUDA
                the components a call of the family runs (not the VAE encoder of a family that encodes no image)
                start building their one session in background threads as they load, and the first call waits for
                them; every input signature is captured in it, reading one copy of the weights. :meth:`warmup`
                captures signatures ahead of the first request.
            component_options: per component (``"unet"``, ``"transformer"``, ``"text_encoder"``, ``"vae_decoder"``,
                …) settings of its :class:`IOBindingORTModel` that override the ones above: ``cuda_graph``,
                ``reuse_outputs``, ``max_output_signatures``, ``max_graph_signatures``, ``share_weights``.
            prepare_in_background: on CUDA, ``True`` (default): the sessions start building in background threads as
                the components load, the denoiser's first run goes beside the text encoder's where the family knows
                its shapes before encoding the prompt, and the VAE decoder's first run beside the denoising loop (a
                faster first image); ``False``: each session is made, and first run, when a call needs it, one after
                another. Either way each session is made and run on one thread of its own
                (:class:`~optimum_iobinding.runtime.session_thread.SessionThread`): ONNX Runtime's CUDA provider keeps
                a context (cuBLAS and cuDNN handles, tens to hundreds of MiB of device memory) for each thread that
                makes or runs a session, so one per session.
            **kwargs: components in place of the folder's (``scheduler=``, ``tokenizer=``, ``tokenizer_2=`` …); the
                family's loading arguments (the stream's ``tiny_vae``); and for ``huggingface_hub.snapshot_download``
                (revision, token, cache_dir, local_files_only).
        """
        replaceable = {"scheduler", *names_of(cls.declared_components, "tokenizer")}
        replacements = {name: kwargs.pop(name) for name in list(kwargs) if name in replaceable}
        replacements = {name: value for name, value in replacements.items() if value is not None}
        loading = {name: kwargs.pop(name) for name in list(kwargs) if name in cls.loading_arguments}
        check_hub_kwargs(
            f"{cls.__name__}.from_pretrained",
            kwargs,
            [*keywords_of(cls.from_pretrained), *sorted(replaceable), *cls.loading_arguments],
        )
        if not isinstance(prepare_in_background, bool):
            raise ArgumentTypeError("prepare_in_background", f"expected True or False, got {prepare_in_background!r}")
        options = PipelineOptions.resolve(
            names_of(cls.declared_components, "onnx"),
            provider,
            provider_options,
            sess_options,
            io_binding,
            cuda_graph,
            component_options,
            numbered=cls.numbered_components,
        )  # checked before any download
        for name, value in replacements.items():
            check_replacement(name, value)
        folder, model_folders = cls.model_folders(pretrained_model_name_or_path, kwargs, **loading)
        components = load_components(
            folder,
            model_folders,
            cls.declared_components,
            options,
            cls.denoiser_component(),
            replacements,
            tuple(cls.settings),
            cls.missing_denoiser_hint(folder),
            prepare=[
                name
                for name in model_folders
                if prepare_in_background and (name != "vae_encoder" or cls.encodes_images)
            ],
        )
        try:
            pipe = cls(**components)
        except BaseException:
            components.clear()  # release sessions now, not when the traceback goes
            raise
        pipe.prepare_in_background = prepare_in_background
        pipe.prepare_sessions()  # what the load did not start (a codec's own models), started now too
        return pipe

    @classmethod
    def model_folders(
        cls, pretrained_model_name_or_path: Union[str, os.PathLike], hub_kwargs: Dict[str, Any], **loading: Any
    ) -> Tuple[Path, Dict[str, Path]]:
        """The pipeline folder (downloaded with what the family reads, for a hub id) and each ONNX component's
        folder in it (a family with its own loading arguments finds some elsewhere)."""
        folder = resolve_pipeline_folder(
            pretrained_model_name_or_path,
            cls.download_names(),
            names_of(cls.declared_components, "tokenizer"),
            **hub_kwargs,
        )
        return folder, {name: folder / name for name in cls.onnx_names_in(folder)}

    @classmethod
    def weights_owned_from_load(
        cls, folder: Union[str, os.PathLike], component_options: Optional[Dict[str, Dict[str, Any]]] = None
    ) -> Dict[str, Dict[str, Any]]:
        """``component_options`` for a load that a LoRA follows: the components a LoRA changes (the denoiser and the
        text encoders of the folder) own their float weights from the load on (``share_weights=True``), under the
        given options (a component's own ``share_weights`` stays). On CUDA the load starts each session; one that
        loads its weights from the file would be made again around them when the LoRA comes."""
        options = {name: dict(settings) for name, settings in (component_options or {}).items()}
        for name in cls.onnx_names_in(Path(folder)):
            if name == cls.denoiser_component() or name.startswith("text_encoder"):
                options.setdefault(name, {}).setdefault("share_weights", True)
        return options

    @classmethod
    def download_names(cls) -> Sequence[str]:
        """The component folders to fetch from the Hub (glob patterns)."""
        return names_of(cls.declared_components, "onnx")

    @classmethod
    def onnx_names_in(cls, folder: Path) -> Tuple[str, ...]:
        """The ONNX components to load from ``folder`` (a family with a variable number of them finds them)."""
        return names_of(cls.declared_components, "onnx")

    @classmethod
    def missing_denoiser_hint(cls, folder: Path) -> str:
        """What a folder without this family's denoiser is instead (for the error)."""
        others = {
            "unet": "a UNet: a Stable Diffusion folder",
            "transformer": "a diffusion transformer: an SD3 or FLUX.1 folder",
        }
        for name, what in others.items():
            if name != cls.denoiser_component() and (folder / name / "model.onnx").is_file():
                return (
                    f"{cls.folder_description}; {str(folder)!r} holds {what}, which another class loads "
                    "(pipeline_class_for(folder) gives it)"
                )
        return cls.folder_description

    def save_pretrained(self, save_directory: Union[str, os.PathLike], overwrite: bool = False) -> None:
        """Writes the folder's layout (diffusers' ONNX layout for the UNet families, optimum's for the transformers),
        which this class loads again.

        The folder is built beside ``save_directory`` and moved into place when whole, so a failed save leaves
        what was there. ``save_directory`` must be new or empty unless ``overwrite=True``, which replaces it whole
        (the folder the pipeline was loaded from included: its files are copied out first).
        """
        target = check_output_folder(save_directory, None, overwrite, argument="save_directory")
        with building_beside(target, argument="save_directory") as scratch:
            written = []
            for name in self.onnx_names():
                model = getattr(self, name, None)
                if model is not None:
                    model.save_pretrained(scratch / name)
                    written.append(name)
                    if model.model_path is not None:  # a step cache's parts beside it (read when a cache is enabled)
                        copy_graphs(step_cache_part_files(Path(model.model_path).parent), scratch / name)
            self.save_parts(scratch)
            for name in self.tokenizer_names():
                if getattr(self, name, None) is not None:
                    save_tokenizer(getattr(self, name), scratch / name)
            for name in names_of(self.declared_components, "processor"):
                if getattr(self, name, None) is not None:
                    getattr(self, name).save_pretrained(str(scratch / name))
            self.scheduler.save_pretrained(str(scratch / "scheduler"))
            self.write_model_index(scratch, written)

    def save_parts(self, target: Path) -> None:
        """Writes into ``target`` the graphs beside the components' ``model.onnx`` that the family runs (Wan's VAE
        chunk graphs); none by default."""

    def write_model_index(self, target: Path, written: List[str]) -> None:
        """Writes the family's model_index.json into ``target`` (``written``: the ONNX components saved): diffusers'
        ONNX layout under the family's :attr:`~optimum_iobinding.families.Family.index_class_name` (the CLIP + UNet
        families and the stream; SDXL and the diffusion transformers write optimum's)."""
        write_model_index(
            target, type(self.scheduler).__name__, type(self.tokenizer).__name__, written, self.family.index_class_name
        )

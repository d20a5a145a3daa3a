"""The prompt encoders: text to the embeddings a denoiser takes, as a part its family declares.

- :class:`CLIPPrompt`: one CLIP (SD 1.x/2.x, LCM, ControlNet, the stream): its last hidden states;
- :class:`CLIPPairPrompt`: SDXL's two CLIPs: both penultimate hidden states side by side, the second's pooled
  projection (the refiner has only the second);
- :class:`SD3Prompt`: two CLIPs and T5: both CLIPs' penultimate states padded to T5's width, then T5's states along the
  sequence (zeros without a T5); both CLIPs' pooled projections side by side;
- :class:`FluxPrompt`: CLIP's pooled output and T5's token states, and the text's rotary position ids;
- :class:`WanPrompt`: UMT5's token states of the cleaned prompt, the padding masked out and zeroed.

Every encoder's output buffer is reused by its next call, so what is kept is copied out. A part reads the pipeline's
public surface only (its text encoders, tokenizers, ``device``, ``denoiser``)."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from .part import PipelinePart
from ..errors import ArgumentError, ModelFileError
from ..families import FLUX_TEXT_IDS, WAN_TEXT_INPUTS, family
from ..runtime.inputs import as_checked_tensor
from ..runtime.model import IOBindingORTModel
from .arguments import is_integer
from .transfer import tensor_of, upload

logger = logging.getLogger(__name__)

Prompt = Union[str, List[str], None]
# what a tokenizer's truncation warning says of each kind of encoder
CLIP_LIMIT, T5_LIMIT = "CLIP can only handle sequences up to", "`max_sequence_length` is set to"


def warn_truncated(tokenizer: Any, texts: Union[str, List[str]], max_length: int, why: str) -> None:
    """Logs, as diffusers does, the part of ``texts`` that ``max_length`` tokens cut off (``why``: the reason's start,
    e.g. :data:`CLIP_LIMIT`)."""
    untruncated = tokenizer(texts, padding="longest", return_tensors="np").input_ids
    if untruncated.shape[-1] > max_length:
        removed = tokenizer.batch_decode(untruncated[:, max_length - 1 : -1])
        logger.warning(f"The following part of your input was truncated because {why} {max_length} tokens: {removed}")


def as_list(texts: Prompt, count: int) -> List[str]:
    """A prompt argument as one text per row: a str serves all ``count`` rows."""
    return [texts] * count if isinstance(texts, str) else list(texts)


def clip_skip_layer(outputs: Dict[str, torch.Tensor], clip_skip: Optional[int]) -> torch.Tensor:
    """A CLIP export's penultimate hidden states (``hidden_states.N-1``), or ``clip_skip`` layers earlier, as
    diffusers takes ``hidden_states[-(clip_skip + 2)]``; refused by name when the export has no hidden states."""
    layers = sorted(
        (name for name in outputs if name.startswith("hidden_states.")), key=lambda name: int(name.split(".")[1])
    )
    if len(layers) < 2:
        raise ModelFileError(
            "text encoder outputs",
            f"expected hidden_states.0 … hidden_states.N (an export with output_hidden_states), got {list(outputs)}",
        )
    if clip_skip is not None and (not is_integer(clip_skip) or not 0 <= clip_skip <= len(layers) - 2):
        raise ArgumentError("clip_skip", f"expected None or an integer in [0, {len(layers) - 2}], got {clip_skip!r}")
    return outputs[layers[len(layers) - 2 - (clip_skip or 0)]]


class PromptEncoder(PipelinePart):
    """What every prompt part shares: the pipeline, tokenization onto the device."""

    def __init__(self, pipe: Any):
        super().__init__(pipe)

    @property
    def device(self) -> torch.device:
        return self.pipe.device

    def token_ids(self, encoder: IOBindingORTModel, ids: np.ndarray) -> torch.Tensor:
        """A tokenizer's ids on the device in the dtype ``encoder`` declares, converted and range-checked on the host:
        converted on the device, the check would read the values back and make the host wait."""
        dtype = encoder.input_dtypes["input_ids"]
        return upload(as_checked_tensor("input_ids", torch.from_numpy(ids), dtype).to(dtype), self.device)

    def run(
        self,
        tokenizer: Any,
        encoder: IOBindingORTModel,
        texts: List[str],
        max_length: int,
        why: str,
        **tokenizer_kwargs: Any,
    ) -> Dict[str, torch.Tensor]:
        """``texts`` through ``tokenizer`` (padded to ``max_length``, truncated with diffusers' warning) and
        ``encoder``: its outputs by name (reused buffers: copy what is kept)."""
        ids = tokenizer(
            texts, padding="max_length", max_length=max_length, truncation=True, return_tensors="np", **tokenizer_kwargs
        ).input_ids
        warn_truncated(tokenizer, texts, max_length, why)
        return dict(zip(encoder.output_names, encoder(input_ids=self.token_ids(encoder, ids))))

    def repeated(self, tensor: Any, num_images_per_prompt: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Given or encoded embeddings on the device (in ``dtype`` where given), each row ``num_images_per_prompt``
        times."""
        tensor = tensor_of(tensor).to(device=self.device, dtype=dtype)
        return tensor.repeat_interleave(num_images_per_prompt, dim=0)


class CLIPPrompt(PromptEncoder):
    """One CLIP text encoder (``text_encoder``, ``tokenizer``): its last hidden states."""

    def encode(
        self,
        prompt: Prompt,
        num_images_per_prompt: int,
        do_classifier_free_guidance: bool,
        negative_prompt: Prompt = None,
        prompt_embeds: Optional[torch.Tensor] = None,
        negative_prompt_embeds: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Text embeddings on the device: ``[negative; positive]`` when guiding, else positive only."""
        if prompt_embeds is None:
            prompt_embeds = self.encode_text(prompt)
        batch_size = prompt_embeds.shape[0]
        prompt_embeds = self.repeated(prompt_embeds, num_images_per_prompt)
        if not do_classifier_free_guidance:
            return prompt_embeds
        if negative_prompt_embeds is None:
            negative_prompt = [""] * batch_size if negative_prompt is None else as_list(negative_prompt, batch_size)
            negative_prompt_embeds = self.encode_text(negative_prompt, max_length=prompt_embeds.shape[1])
        return torch.cat([self.repeated(negative_prompt_embeds, num_images_per_prompt), prompt_embeds])

    def encode_text(self, text: Union[str, List[str]], max_length: Optional[int] = None) -> torch.Tensor:
        """The CLIP's last hidden states of ``text`` (a copy: the encoder's next call reuses its buffer)."""
        tokenizer, encoder = self.pipe.tokenizer, self.pipe.text_encoder
        texts = [text] if isinstance(text, str) else text
        outputs = self.run(tokenizer, encoder, texts, max_length or tokenizer.model_max_length, CLIP_LIMIT)
        return outputs[encoder.output_names[0]].clone()


class CLIPPairPrompt(PromptEncoder):
    """SDXL's two CLIPs (``text_encoder`` optional, ``text_encoder_2`` with its projection)."""

    def check_encoders(self) -> None:
        """SDXL reads the text encoders' hidden states (``hidden_states.0`` …, an export with
        ``output_hidden_states``) and the second one's pooled projection ``text_embeds``: a folder whose encoders
        give less is refused when loading, naming the component."""
        for name in ("text_encoder", "text_encoder_2"):
            encoder = getattr(self.pipe, name, None)
            if encoder is None:
                continue
            outputs = encoder.output_names
            layers = [output for output in outputs if output.startswith("hidden_states.")]
            if len(layers) < 2 or (name == "text_encoder_2" and "text_embeds" not in outputs):
                needs = "hidden_states.0 … hidden_states.N" + (
                    " and text_embeds (CLIPTextModelWithProjection)" if name == "text_encoder_2" else ""
                )
                raise ArgumentError(
                    name,
                    f"expected an SDXL text encoder with outputs {needs} (exported with "
                    f"output_hidden_states), got outputs {outputs} in {encoder.model_path!r}",
                )

    def encode(
        self,
        prompt: Prompt,
        prompt_2: Prompt,
        num_images_per_prompt: int,
        do_classifier_free_guidance: bool,
        negative_prompt: Prompt = None,
        negative_prompt_2: Prompt = None,
        prompt_embeds: Optional[torch.Tensor] = None,
        negative_prompt_embeds: Optional[torch.Tensor] = None,
        pooled_prompt_embeds: Optional[torch.Tensor] = None,
        negative_pooled_prompt_embeds: Optional[torch.Tensor] = None,
        clip_skip: Optional[int] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(prompt_embeds, pooled)`` on the device, ``[negative; positive]`` when guiding. As diffusers: an absent
        negative prompt gives zeros when the model asks for them (the pipeline's ``force_zeros_for_empty_prompt``)."""
        if prompt_embeds is None:
            prompt = [prompt] if isinstance(prompt, str) else prompt
            prompt_2 = prompt if prompt_2 is None else as_list(prompt_2, len(prompt))
            prompt_embeds, pooled_prompt_embeds = self.encode_text(prompt, prompt_2, clip_skip)
        elif pooled_prompt_embeds is None:
            raise ArgumentError(
                "pooled_prompt_embeds", "expected them with prompt_embeds (SDXL's UNet takes both), got None"
            )
        prompt_embeds = tensor_of(prompt_embeds, "prompt_embeds").to(self.device)
        pooled_prompt_embeds = tensor_of(pooled_prompt_embeds, "pooled_prompt_embeds").to(self.device)
        batch_size = prompt_embeds.shape[0]
        if do_classifier_free_guidance and negative_prompt_embeds is None:
            if negative_prompt is None and negative_prompt_2 is None and self.pipe.config.force_zeros_for_empty_prompt:
                negative_prompt_embeds = torch.zeros_like(prompt_embeds)
                negative_pooled_prompt_embeds = torch.zeros_like(pooled_prompt_embeds)
            else:
                negative_prompt = negative_prompt or ""
                negative_prompt_2 = negative_prompt_2 or negative_prompt
                negative_prompt_embeds, negative_pooled_prompt_embeds = self.encode_text(
                    as_list(negative_prompt, batch_size), as_list(negative_prompt_2, batch_size), clip_skip=None
                )
        elif do_classifier_free_guidance and negative_pooled_prompt_embeds is None:
            raise ArgumentError("negative_pooled_prompt_embeds", "expected them with negative_prompt_embeds, got None")

        prompt_embeds = self.repeated(prompt_embeds, num_images_per_prompt)
        pooled_prompt_embeds = self.repeated(pooled_prompt_embeds, num_images_per_prompt)
        if not do_classifier_free_guidance:
            return prompt_embeds, pooled_prompt_embeds
        return (
            torch.cat([self.repeated(negative_prompt_embeds, num_images_per_prompt), prompt_embeds]),
            torch.cat([self.repeated(negative_pooled_prompt_embeds, num_images_per_prompt), pooled_prompt_embeds]),
        )

    def encode_text(
        self, prompt: List[str], prompt_2: List[str], clip_skip: Optional[int]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        if len(prompt) != len(prompt_2):
            raise ArgumentError("prompt_2", f"expected {len(prompt)} prompts like prompt, got {len(prompt_2)}")
        pipe = self.pipe
        pairs = [(prompt, pipe.tokenizer, pipe.text_encoder), (prompt_2, pipe.tokenizer_2, pipe.text_encoder_2)]
        hidden_states, pooled = [], None
        for text, tokenizer, encoder in pairs:
            if encoder is None:
                continue
            ids = tokenizer(
                text, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="np"
            ).input_ids
            outputs = dict(zip(encoder.output_names, encoder(input_ids=self.token_ids(encoder, ids))))
            hidden_states.append(clip_skip_layer(outputs, clip_skip).clone())
            if pooled is None and "text_embeds" in outputs:
                pooled = outputs["text_embeds"].clone()
        if pooled is None:
            raise ArgumentError(
                "text_encoder_2", "expected a text_embeds output (CLIPTextModelWithProjection), got none"
            )
        return torch.cat(hidden_states, dim=-1), pooled


class T5Prompt(PromptEncoder):
    """What the transformers' prompts share: T5's token states of ``max_sequence_length`` tokens."""

    #: the T5 encoder and tokenizer of the family
    t5_encoder, t5_tokenizer = "", ""

    def t5_states(self, texts: List[str], max_sequence_length: int) -> torch.Tensor:
        encoder = getattr(self.pipe, self.t5_encoder)
        outputs = self.run(
            getattr(self.pipe, self.t5_tokenizer),
            encoder,
            texts,
            max_sequence_length,
            T5_LIMIT,
            add_special_tokens=True,
        )
        return outputs["last_hidden_state"].clone()


class SD3Prompt(T5Prompt):
    """SD3's two CLIPs with projections and hidden states, and an optional T5 (``text_encoder_3``)."""

    t5_encoder, t5_tokenizer = family("sd3").options["t5_encoder"], family("sd3").options["t5_tokenizer"]

    def check_encoders(self) -> None:
        """Both CLIP encoders must give ``text_embeds`` (the projection) and their hidden states (an export with
        ``output_hidden_states``: SD3 reads the penultimate); the T5 encoder ``last_hidden_state``."""
        for name in ("text_encoder", "text_encoder_2"):
            encoder = getattr(self.pipe, name)
            outputs = encoder.output_names
            layers = [output for output in outputs if output.startswith("hidden_states.")]
            if encoder.input_names != ["input_ids"] or "text_embeds" not in outputs or len(layers) < 2:
                raise ArgumentError(
                    name,
                    f"expected a CLIPTextModelWithProjection export taking input_ids, with "
                    f"outputs text_embeds and hidden_states.0 … hidden_states.N, got inputs "
                    f"{encoder.input_names} and outputs {outputs} in {encoder.model_path!r}",
                )
        encoder = self.pipe.text_encoder_3
        if encoder is not None:
            if encoder.input_names != ["input_ids"] or "last_hidden_state" not in encoder.output_names:
                raise ArgumentError(
                    "text_encoder_3",
                    f"expected a T5 encoder export (input_ids → last_hidden_state), got "
                    f"inputs {encoder.input_names} and outputs {encoder.output_names} in "
                    f"{encoder.model_path!r}",
                )
            if self.pipe.tokenizer_3 is None:
                raise ArgumentError(
                    "tokenizer_3",
                    "expected the T5 tokenizer with text_encoder_3, got None (the folder has no tokenizer_3/)",
                )

    def encode(
        self,
        prompt: Prompt,
        prompt_2: Prompt = None,
        prompt_3: Prompt = None,
        num_images_per_prompt: int = 1,
        do_classifier_free_guidance: bool = True,
        negative_prompt: Prompt = None,
        negative_prompt_2: Prompt = None,
        negative_prompt_3: Prompt = None,
        prompt_embeds: Optional[torch.Tensor] = None,
        negative_prompt_embeds: Optional[torch.Tensor] = None,
        pooled_prompt_embeds: Optional[torch.Tensor] = None,
        negative_pooled_prompt_embeds: Optional[torch.Tensor] = None,
        clip_skip: Optional[int] = None,
        max_sequence_length: int = 256,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(prompt_embeds, pooled_prompt_embeds)`` on the device in the transformer's dtype, ``[negative;
        positive]`` when guiding, each prompt's rows repeated ``num_images_per_prompt`` times; an absent negative
        prompt is ``""``."""
        if prompt_embeds is None:
            prompt = [prompt] if isinstance(prompt, str) else prompt
            prompt_embeds, pooled_prompt_embeds = self.encode_text(
                prompt, prompt_2 or prompt, prompt_3 or prompt, clip_skip, max_sequence_length
            )
        batch_size = prompt_embeds.shape[0]
        if do_classifier_free_guidance and negative_prompt_embeds is None:
            negative_prompt = negative_prompt or ""
            negatives = [negative_prompt, negative_prompt_2 or negative_prompt, negative_prompt_3 or negative_prompt]
            negatives = [batch_size * [text] if isinstance(text, str) else text for text in negatives]
            if len(negatives[0]) != batch_size:
                raise ArgumentError(
                    "negative_prompt", f"expected {batch_size} prompts (as many as prompt), got {len(negatives[0])}"
                )
            negative_prompt_embeds, negative_pooled_prompt_embeds = self.encode_text(
                *negatives, clip_skip=None, max_sequence_length=max_sequence_length
            )
        dtypes = self.pipe.denoiser.model.input_dtypes
        dtype, pooled_dtype = dtypes["encoder_hidden_states"], dtypes["pooled_projections"]
        prompt_embeds = self.repeated(prompt_embeds, num_images_per_prompt, dtype)
        pooled = self.repeated(pooled_prompt_embeds, num_images_per_prompt, pooled_dtype)
        if not do_classifier_free_guidance:
            return prompt_embeds, pooled
        return (
            torch.cat([self.repeated(negative_prompt_embeds, num_images_per_prompt, dtype), prompt_embeds]),
            torch.cat([self.repeated(negative_pooled_prompt_embeds, num_images_per_prompt, pooled_dtype), pooled]),
        )

    def encode_text(
        self, prompt: List[str], prompt_2: Prompt, prompt_3: Prompt, clip_skip: Optional[int], max_sequence_length: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        prompt_2, prompt_3 = as_list(prompt_2, len(prompt)), as_list(prompt_3, len(prompt))
        for name, texts in (("prompt_2", prompt_2), ("prompt_3", prompt_3)):
            if len(texts) != len(prompt):
                raise ArgumentError(name, f"expected {len(prompt)} prompts like prompt, got {len(texts)}")
        pipe = self.pipe
        hidden_1, pooled_1 = self.clip_embeds(prompt, pipe.tokenizer, pipe.text_encoder, clip_skip)
        hidden_2, pooled_2 = self.clip_embeds(prompt_2, pipe.tokenizer_2, pipe.text_encoder_2, clip_skip)
        t5 = self.t5_embeds(prompt_3, max_sequence_length)
        clip = torch.cat([hidden_1, hidden_2.to(hidden_1.dtype)], dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))  # to T5's width
        return torch.cat([clip.to(t5.dtype), t5], dim=-2), torch.cat([pooled_1, pooled_2.to(pooled_1.dtype)], dim=-1)

    def clip_embeds(
        self, texts: List[str], tokenizer: Any, encoder: IOBindingORTModel, clip_skip: Optional[int]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """One CLIP's penultimate (``clip_skip``: earlier) hidden states and pooled projection, copied out of the
        encoder's reused output buffers."""
        outputs = self.run(tokenizer, encoder, texts, tokenizer.model_max_length, CLIP_LIMIT)
        return clip_skip_layer(outputs, clip_skip).clone(), outputs["text_embeds"].clone()

    def t5_embeds(self, texts: List[str], max_sequence_length: int) -> torch.Tensor:
        """T5's last hidden states (``max_sequence_length`` tokens), or zeros of the transformer's width without a
        T5 (diffusers' ``text_encoder_3=None``)."""
        if self.pipe.text_encoder_3 is None:
            denoiser = self.pipe.denoiser
            return torch.zeros(
                len(texts),
                max_sequence_length,
                denoiser.joint_attention_dim,
                device=self.device,
                dtype=denoiser.model.input_dtypes["encoder_hidden_states"],
            )
        return self.t5_states(texts, max_sequence_length)


class FluxPrompt(T5Prompt):
    """FLUX.1's CLIP (its pooled output) and T5 (``text_encoder_2``: the token states)."""

    t5_encoder, t5_tokenizer = family("flux").options["t5_encoder"], family("flux").options["t5_tokenizer"]

    def check_encoders(self) -> None:
        for name, output in (("text_encoder", "pooler_output"), ("text_encoder_2", "last_hidden_state")):
            encoder = getattr(self.pipe, name)
            if output not in encoder.output_names:
                what = "a CLIP text encoder with its pooled output" if name == "text_encoder" else "a T5 encoder"
                raise ArgumentError(
                    name,
                    f"expected {what} (output {output!r}), got outputs {encoder.output_names} in "
                    f"{encoder.model_path!r}",
                )

    def encode(
        self,
        prompt: Prompt,
        prompt_2: Prompt = None,
        num_images_per_prompt: int = 1,
        prompt_embeds: Optional[torch.Tensor] = None,
        pooled_prompt_embeds: Optional[torch.Tensor] = None,
        max_sequence_length: int = 512,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(prompt_embeds, pooled_prompt_embeds, text_ids)`` on the device as diffusers' ``FluxPipeline`` makes
        them: T5's token embeddings of ``prompt_2`` (``prompt`` where absent), CLIP's pooled embedding of ``prompt``,
        each repeated ``num_images_per_prompt`` times, and the text's rotary position ids (zeros)."""
        if prompt_embeds is None:
            prompt = [prompt] if isinstance(prompt, str) else prompt
            prompt_2 = prompt if prompt_2 is None else as_list(prompt_2, len(prompt))
            pipe = self.pipe
            pooled_prompt_embeds = self.run(
                pipe.tokenizer, pipe.text_encoder, prompt, pipe.tokenizer.model_max_length, CLIP_LIMIT
            )["pooler_output"].clone()
            prompt_embeds = self.t5_states(prompt_2, max_sequence_length)
        dtypes = self.pipe.denoiser.model.input_dtypes
        prompt_embeds = self.repeated(prompt_embeds, num_images_per_prompt, dtypes["encoder_hidden_states"])
        pooled_prompt_embeds = self.repeated(pooled_prompt_embeds, num_images_per_prompt, dtypes["pooled_projections"])
        text_ids = torch.zeros(prompt_embeds.shape[1], 3, dtype=dtypes[FLUX_TEXT_IDS])
        return prompt_embeds, pooled_prompt_embeds, upload(text_ids, self.device)


class WanPrompt(T5Prompt):
    """Wan's UMT5 encoder (``text_encoder``, ``tokenizer``), as diffusers' ``WanPipeline`` runs it: each prompt cleaned
    (diffusers' own ``prompt_clean``: HTML entities, runs of whitespace), tokenized to ``max_sequence_length`` with its
    attention mask, encoded with the padding masked out, and the states past each prompt's tokens zeroed."""

    t5_encoder, t5_tokenizer = family("wan").options["t5_encoder"], family("wan").options["t5_tokenizer"]

    def check_encoders(self) -> None:
        encoder = self.pipe.text_encoder
        if sorted(encoder.input_names) != sorted(WAN_TEXT_INPUTS) or "last_hidden_state" not in encoder.output_names:
            raise ArgumentError(
                "text_encoder",
                f"expected a UMT5 encoder export ({' and '.join(WAN_TEXT_INPUTS)} → last_hidden_state), got inputs "
                f"{encoder.input_names} and outputs {encoder.output_names} in {encoder.model_path!r}",
            )

    def states(self, texts: List[str], max_sequence_length: int) -> torch.Tensor:
        """UMT5's states of ``texts`` (cleaned as diffusers cleans them), zero past each text's tokens (a copy: the
        encoder's next call reuses its buffer)."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        tokenizer, encoder = self.pipe.tokenizer, self.pipe.text_encoder
        tokens = tokenizer(
            [prompt_clean(text) for text in texts],
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="np",
        )
        ids, mask = tokens.input_ids, tokens.attention_mask
        mask_dtype = encoder.input_dtypes[WAN_TEXT_INPUTS[1]]
        on_device = upload(torch.from_numpy(mask).to(mask_dtype), self.device)
        (states,) = encoder(**{WAN_TEXT_INPUTS[0]: self.token_ids(encoder, ids), WAN_TEXT_INPUTS[1]: on_device})
        return states.masked_fill(on_device[..., None] == 0, 0.0)

    def encode(
        self,
        prompt: Prompt,
        negative_prompt: Prompt = None,
        do_classifier_free_guidance: bool = True,
        num_videos_per_prompt: int = 1,
        prompt_embeds: Optional[torch.Tensor] = None,
        negative_prompt_embeds: Optional[torch.Tensor] = None,
        max_sequence_length: int = 226,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(prompt_embeds, negative_prompt_embeds)`` on the device in the transformer's dtype, each prompt's rows
        repeated ``num_videos_per_prompt`` times, as diffusers' ``WanPipeline.encode_prompt`` gives them; the negative
        ones (an absent negative prompt is ``""``) only with classifier-free guidance, else ``None``."""
        if prompt_embeds is None:
            prompt_embeds = self.states([prompt] if isinstance(prompt, str) else prompt, max_sequence_length)
        batch_size = prompt_embeds.shape[0]
        if do_classifier_free_guidance and negative_prompt_embeds is None:
            negative = as_list(negative_prompt or "", batch_size)
            if len(negative) != batch_size:
                raise ArgumentError(
                    "negative_prompt", f"expected {batch_size} prompts (as many as prompt), got {len(negative)}"
                )
            negative_prompt_embeds = self.states(negative, max_sequence_length)
        dtype = self.pipe.denoiser.model.input_dtypes["encoder_hidden_states"]
        prompt_embeds = self.repeated(prompt_embeds, num_videos_per_prompt, dtype)
        if not do_classifier_free_guidance:
            return prompt_embeds, None
        return prompt_embeds, self.repeated(negative_prompt_embeds, num_videos_per_prompt, dtype)

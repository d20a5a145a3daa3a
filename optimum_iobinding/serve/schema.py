"""What goes into and comes out of a request: the body of ``POST /v1/images`` (:class:`ImageRequest`), its size, start
image and inpainting mask read into what the pipelines take (within the replica's limits), and the images written as
PNG bytes; and OpenAI's images API: the bodies of ``POST /v1/images/generations`` (JSON) and ``POST /v1/images/edits``
(a multipart form, :func:`parse_form`) read into the same requests, and its error shape (:class:`OpenAIError`)."""

# no `from __future__ import annotations`: FastAPI reads ImageRequest's annotations as objects
import base64
import binascii
import io
import json
import re
import struct
import sys
import warnings
import zlib
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple, Union

try:
    from pydantic import BaseModel, ConfigDict, Field, ValidationError
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("optimum_iobinding.serve needs Ray Serve: pip install 'optimum-iobinding[serve]'") from error

from ..errors import ArgumentError, did_you_mean

MAX_SEED = 2**63 - 1


class ImageRequest(BaseModel):
    """The body of ``POST /v1/images``."""

    model_config = ConfigDict(extra="forbid")

    prompt: str
    negative_prompt: Optional[str] = None
    seed: Optional[int] = Field(default=None, ge=0, le=MAX_SEED)
    steps: Optional[int] = None
    guidance: Optional[float] = None
    size: Union[int, str, None] = Field(default=None, description="pixels: 512 (square) or '768x512' (width x height)")
    n: int = Field(default=1, ge=1)
    response_format: Literal["png", "b64_json"] = "png"
    image: Optional[str] = Field(
        default=None,
        description="the image to start from (image to image) or to edit (FLUX.1 Kontext, Fill, inpainting), base64 "
        "PNG or JPEG",
    )
    mask: Optional[str] = Field(
        default=None, description="with image: where to repaint, a base64 PNG of its size (white, or transparent)"
    )
    control_image: Optional[str] = Field(
        default=None, description="the control image (ControlNet, FLUX.1 Control), base64 PNG or JPEG"
    )
    strength: Optional[float] = Field(default=None, description="with image: how much of the schedule runs")
    control_mode: Optional[int] = Field(
        default=None, ge=0, description="with control_image: a union ControlNet's mode (FLUX.1 ControlNet union models)"
    )
    loras: Optional[Dict[str, float]] = Field(
        default=None,
        description="the LoRAs the service loaded (GET /v1/models lists them) and their weights, e.g. {'pixel-art': "
        "0.8}; {} for none; default: each at the weight the service gives it",
    )


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages that name what a client sent (which may be
    huge: Python refuses to print an int of more than 4300 digits)."""
    try:
        text = repr(value)
    except ValueError:
        return f"an integer of more than {sys.get_int_max_str_digits()} digits"
    return text if len(text) <= limit else f"{text[: limit - 3]}... ({len(text)} characters)"


def parse_size(size: Union[int, str, None], default: int) -> Tuple[int, int]:
    """``(width, height)`` of a request's ``size``: an int (a square), ``"WxH"``, or ``None`` (the default)."""
    if size is None:
        return default, default
    sides = None
    if isinstance(size, int) and not isinstance(size, bool):
        sides = size, size
    elif isinstance(size, str):
        parts = size.lower().split("x")
        if len(parts) == 2 and all(part.strip().isascii() and part.strip().isdigit() for part in parts):
            try:
                sides = int(parts[0]), int(parts[1])
            except ValueError:  # more digits than Python reads
                pass
    if sides is None or min(sides) < 1:
        raise ArgumentError("size", f"expected positive pixels as 512 or '768x512' (width x height), got {shown(size)}")
    return sides


def plain_reason(error: BaseException) -> str:
    """An error's message for a client: Pillow names the file it read by its object (``<_io.BytesIO object at
    0x7f…>``), which means nothing to the sender of a JSON field; such a name becomes ``the image``."""
    text = re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the image", str(error)).strip()
    return (text.splitlines() or [type(error).__name__])[0][:200]


def decode_image(data: Union[str, bytes], max_pixels: Optional[int] = None, name: str = "image") -> Any:
    """A PNG or JPEG → float32 HxWx3 in [0, 1] (what the image-to-image pipelines take): base64 text, as a JSON
    field carries it, or the file's bytes, as a multipart form's part does. An image of more than ``max_pixels`` is
    refused from its header, before its pixels are decoded. A refusal names the field (``name``: ``image``,
    ``control_image``), what it takes and what came: text that is no base64, bytes of no image Pillow reads (their
    first bytes shown), an image that cannot be decoded."""
    import numpy as np

    raw, expected = _image_bytes(data, name)
    pixels = _read_image(raw, name, expected, max_pixels, lambda image: np.asarray(image.convert("RGB")))
    return pixels.astype(np.float32) / 255.0


def decode_mask(data: Union[str, bytes], size: Tuple[int, int], max_pixels: Optional[int] = None) -> Any:
    """An inpainting mask (a PNG, base64 or its bytes, as :func:`decode_image` takes them) → float32 HxW, 1 where
    the image is repainted: where the mask has an alpha channel, its fully transparent pixels (as OpenAI's images API
    reads a mask), otherwise its light pixels (grey ≥ 128: diffusers' white). ``size``: the image's ``(width,
    height)``, which the mask must have. A refusal names the field (``mask``)."""
    import numpy as np

    def repainted(image: Any) -> Any:
        if "A" in image.getbands() or "transparency" in image.info:
            return np.asarray(image.convert("RGBA"))[..., 3] == 0
        if image.mode.startswith("I"):  # 16-bit grey (a PNG's): light against its own range, not clamped to 8 bits
            return np.asarray(image, dtype=np.int64) >= 32768
        if image.mode == "F":
            return np.asarray(image, dtype=np.float64) >= 0.5
        return np.asarray(image.convert("L")) >= 128

    raw, expected = _image_bytes(data, "mask", "a PNG")
    mask = _read_image(raw, "mask", expected, max_pixels, repainted)
    height, width = mask.shape
    if (width, height) != tuple(size):
        raise ArgumentError("mask", f"expected the image's size, {size[0]}x{size[1]}, got {width}x{height}")
    return mask.astype(np.float32)


# the formats a request's image may come in: Pillow would open many more, some through outside programs (EPS through
# Ghostscript)
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


def _image_bytes(data: Union[str, bytes], name: str, kind: str = "a PNG or JPEG") -> Tuple[bytes, str]:
    """The file's bytes of an image field (base64 text is decoded) and what the field takes, in words."""
    if isinstance(data, (bytes, bytearray)):
        return bytes(data), f"{kind} file"
    try:
        return base64.b64decode(data, validate=True), f"a base64 {kind[2:]}"
    except (binascii.Error, ValueError) as error:
        raise ArgumentError(
            name, f"expected a base64 {kind[2:]}, got text that is no base64 ({plain_reason(error)})"
        ) from None


def _read_image(raw: bytes, name: str, expected: str, max_pixels: Optional[int], convert: Callable[[Any], Any]) -> Any:
    """``convert(image)`` of the image in ``raw``, refused naming the field ``name`` where Pillow cannot read it or
    it has more than ``max_pixels`` pixels (known from its header, before its pixels are decoded)."""
    from PIL import Image

    def undecodable(kind: str, error: Exception) -> ArgumentError:
        return ArgumentError(name, f"expected {expected}, got {kind} that could not be decoded: {plain_reason(error)}")

    # Pillow raises many kinds of errors on a damaged file (OSError, SyntaxError, struct.error ...), and warns of a
    # decompression bomb: each is the client's image failing, never the service's
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
            limit = f"at most {max_pixels} pixels (max_pixels_per_image)" if max_pixels else "an image Pillow decodes"
            raise ArgumentError(name, f"expected {limit}, got more: {plain_reason(error)}") from None
        except Image.UnidentifiedImageError:
            raise ArgumentError(
                name,
                f"expected {expected}, got {len(raw)} bytes of no image Pillow reads (they start with {raw[:8]!r})",
            ) from None
        except Exception as error:  # noqa: BLE001
            raise undecodable(f"{len(raw)} bytes", error) from None
        with image:
            width, height = image.size
            if max_pixels is not None and width * height > max_pixels:
                raise ArgumentError(
                    name, f"expected at most {max_pixels} pixels (max_pixels_per_image), got {width}×{height}"
                )
            try:
                return convert(image)
            except Exception as error:  # noqa: BLE001
                raise undecodable(f"a {image.format or 'file'} of {width}×{height} pixels", error) from None


def _png_chunk(kind: bytes, data: Any) -> List[Any]:
    """A PNG chunk as its pieces (length, type, data, CRC of type and data), to be joined once."""
    return [struct.pack(">I", len(data)), kind, data, struct.pack(">I", zlib.crc32(data, zlib.crc32(kind)))]


def stored_png(pixels: Any) -> bytes:
    """An uncompressed PNG of a uint8 HxWx3 array: rows unfiltered, zlib's stored blocks (PNG spec, level 0). Three
    passes over the pixels: the rows with their filter bytes, zlib's stored stream, the PNG's bytes."""
    import numpy as np

    height, width, channels = pixels.shape
    if pixels.dtype != np.uint8 or channels != 3:
        raise ValueError(f"pixels: expected uint8 HxWx3, got {pixels.dtype} {pixels.shape}")
    rows = np.zeros((height, 1 + width * 3), np.uint8)  # each row: filter type 0 (none), then its bytes
    rows[:, 1:] = pixels.reshape(height, width * 3)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, truecolour, no interlace
    return b"".join(
        [
            b"\x89PNG\r\n\x1a\n",
            *_png_chunk(b"IHDR", header),
            *_png_chunk(b"IDAT", zlib.compress(rows, 0)),
            *_png_chunk(b"IEND", b""),
        ]
    )


def encode_pngs(images: Sequence[Any], compression: int = 0) -> List[bytes]:
    """PNG bytes of uint8 HxWx3 arrays. ``compression`` 0: stored (:func:`stored_png`, the pixels' bytes as they are);
    1–9: zlib's levels through Pillow, whose adaptive row filters make about half the bytes of a smooth image."""
    if compression == 0:
        return [stored_png(pixels) for pixels in images]
    from PIL import Image

    encoded = []
    for pixels in images:
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG", compress_level=compression)
        encoded.append(buffer.getvalue())
    return encoded


# ------------------------------------------------------------------------------------------ OpenAI's images API
class OpenAIError(Exception):
    """A refusal in OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``, :meth:`body`): the
    HTTP ``status``, the one-line ``message``, the request field it names (``param``, ``None`` for the request as a
    whole) and a ``code`` (by default the status's: :data:`OPENAI_ERROR_CODES`)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or OPENAI_ERROR_CODES.get(status)

    def body(self) -> Dict[str, Any]:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# the code of an error of each status where no more precise one is given
OPENAI_ERROR_CODES = {
    400: "invalid_value",
    404: "model_not_found",
    413: "request_too_large",
    503: "service_unavailable",
    504: "timeout",
}


class OpenAIImageRequest(BaseModel):
    """The body of ``POST /v1/images/generations``: OpenAI's fields that this server honours (``prompt``,
    ``model``, ``n``, ``size``, ``response_format``, ``output_format``, ``user``) and, as extensions, those of
    ``POST /v1/images`` that OpenAI's API lacks (``negative_prompt``, ``seed``, ``steps``, ``guidance``)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str
    model: Optional[str] = Field(default=None, description="the served model's id (GET /v1/models); default it")
    n: Optional[int] = Field(default=None, ge=1, description="images (default 1)")
    size: Optional[str] = Field(default=None, description="'WIDTHxHEIGHT', or 'auto' (the model's default size)")
    response_format: Optional[str] = Field(default=None, description="'b64_json' (the default, and the only one)")
    output_format: Optional[str] = Field(default=None, description="'png' (the default, and the only one)")
    user: Optional[str] = Field(default=None, description="accepted and not used")
    negative_prompt: Optional[str] = Field(default=None, description="extension: what the images should not show")
    seed: Optional[int] = Field(default=None, ge=0, le=MAX_SEED, description="extension: image k has seed + k")
    steps: Optional[int] = Field(default=None, description="extension: denoising steps (default the server's)")
    guidance: Optional[float] = Field(default=None, description="extension: guidance scale (default the server's)")


class OpenAIImageEditRequest(OpenAIImageRequest):
    """The text fields of ``POST /v1/images/edits`` (a multipart form, whose ``image`` and ``mask`` parts are files):
    those of :class:`OpenAIImageRequest` and, as an extension, ``strength``."""

    strength: Optional[float] = Field(
        default=None, description="extension: how much of the schedule runs (default 0.8 without a mask, 1 with one)"
    )


# OpenAI's fields of its images API that this server does not take: named as such when a request gives one
OPENAI_FIELDS_NOT_TAKEN = (
    "background",
    "moderation",
    "output_compression",
    "partial_images",
    "quality",
    "stream",
    "style",
    "input_fidelity",
    "markup",
    "safety_identifier",
)


def openai_validation_error(error: ValidationError) -> OpenAIError:
    """A field refused by the request's model, as OpenAI's API answers it: 400 naming the field (``param``), in the
    project's words (``n: expected …, got …``); an unknown field with the fields there are (or the one it may
    misspell), one of OpenAI's that this server does not take as such."""
    detail = error.errors(include_url=False, include_context=False)[0]
    param = ".".join(str(part) for part in detail["loc"]) or None
    kind = detail["type"]
    if kind == "missing":
        return OpenAIError(400, f"{param}: expected a value, got none", param, "missing_required_parameter")
    if kind == "extra_forbidden":
        if param in OPENAI_FIELDS_NOT_TAKEN:
            reason = "OpenAI's images API has it; this server does not take it"
        else:
            fields = list(OpenAIImageEditRequest.model_fields) + ["image", "mask"]
            reason = "unknown field; " + (did_you_mean(str(param), fields) or f"the fields are {', '.join(fields)}")
        return OpenAIError(400, f"{param}: {reason}", param, "unknown_parameter")
    expected = re.sub(r", got .*$", "", re.sub(r"^Input should be ", "", detail["msg"]))  # what came is said after
    code = "invalid_type" if kind.endswith(("_type", "_parsing", "_from_float")) else "invalid_value"
    return OpenAIError(400, f"{param}: expected {expected}, got {shown(detail.get('input'))}", param, code)


def openai_request(fields: Dict[str, Any], model_id: str, edit: bool = False) -> Dict[str, Any]:
    """The request :meth:`~optimum_iobinding.serve.batching.ImageGenerator.generate` takes, from the fields of an
    OpenAI images request (the JSON body of a generation, the text fields of an edit's form).

    Raises:
        OpenAIError: 400 for a field the request's model refuses, a ``response_format`` other than ``b64_json``
            (``url`` too: the server keeps no images, so it has no address to give) or an ``output_format`` other
            than ``png``; 404 for a ``model`` this server does not serve.
    """
    schema = OpenAIImageEditRequest if edit else OpenAIImageRequest
    try:
        parsed = schema.model_validate(fields)
    except ValidationError as error:
        raise openai_validation_error(error) from None
    if parsed.model is not None and parsed.model != model_id:
        raise OpenAIError(
            404,
            f"model: expected {model_id!r} (the model served here: GET /v1/models), got {shown(parsed.model)}",
            "model",
        )
    if parsed.response_format not in (None, "b64_json"):
        why = ": the server keeps no images, so it has no URL to give" if parsed.response_format == "url" else ""
        raise OpenAIError(
            400,
            f"response_format: expected 'b64_json', got {shown(parsed.response_format)}{why}",
            "response_format",
            "unsupported_value",
        )
    if parsed.output_format not in (None, "png"):
        raise OpenAIError(
            400,
            f"output_format: expected 'png', got {shown(parsed.output_format)}",
            "output_format",
            "unsupported_value",
        )
    request = {
        "prompt": parsed.prompt,
        "negative_prompt": parsed.negative_prompt,
        "seed": parsed.seed,
        "steps": parsed.steps,
        "guidance": parsed.guidance,
        "size": None if parsed.size in (None, "auto") else parsed.size,
        "n": 1 if parsed.n is None else parsed.n,
    }
    if edit:
        request["strength"] = parsed.strength
    return request


def openai_generation_request(body: bytes, model_id: str) -> Dict[str, Any]:
    """The request of a ``POST /v1/images/generations`` body (a JSON object), as :func:`openai_request` makes it."""
    try:
        fields = json.loads(body)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError; nesting too deep recurses
        raise OpenAIError(
            400, f"body: expected a JSON object, got no JSON ({plain_reason(error)})", None, "invalid_json"
        )
    if not isinstance(fields, dict):
        raise OpenAIError(400, f"body: expected a JSON object, got {type(fields).__name__}", None, "invalid_json")
    return openai_request(fields, model_id)


def openai_edit_request(body: bytes, content_type: str, model_id: str) -> Dict[str, Any]:
    """The request of a ``POST /v1/images/edits`` body, a multipart form as OpenAI's API takes it: one ``image`` file
    (also as ``image[]``, the name OpenAI's clients give a list of images), an optional ``mask`` file, and text fields
    (:class:`OpenAIImageEditRequest`; an empty one is left out). The files' bytes go into the request as ``image`` and
    ``mask``."""
    parts = parse_form(body, content_type)
    images = parts.pop("image", []) + parts.pop("image[]", [])
    masks = parts.pop("mask", [])
    if not images:
        raise OpenAIError(400, "image: expected an image file, got none", "image", "missing_required_parameter")
    for name, files in (("image", images), ("mask", masks)):
        if len(files) > 1:
            raise OpenAIError(400, f"{name}: expected one file, got {len(files)}", name)
    fields = {}
    for name, values in parts.items():
        if len(values) > 1:
            raise OpenAIError(400, f"{name}: expected one value, got {len(values)}", name)
        try:
            text = values[0].decode("utf-8")
        except UnicodeDecodeError:
            raise OpenAIError(400, f"{name}: expected UTF-8 text, got {len(values[0])} bytes of none", name) from None
        if text:  # an empty field is no value (OpenAI's clients send a None as one)
            fields[name] = text
    request = openai_request(fields, model_id, edit=True)
    request.update(image=images[0], mask=masks[0] if masks else None)
    return request


def parse_form(body: bytes, content_type: str) -> Dict[str, List[bytes]]:
    """The parts of a ``multipart/form-data`` body (RFC 7578) by field name, each a list of the parts' bytes in the
    order they came (a file's bytes or a text field's UTF-8).

    Raises:
        OpenAIError: 400 where the body is no such form (another content type, no boundary, a part without a name or
            headers, no closing delimiter).
    """
    from email.message import Message

    header = Message()
    header["content-type"] = content_type
    boundary = header.get_param("boundary") if header.get_content_type() == "multipart/form-data" else None
    if not isinstance(boundary, str) or not boundary:
        raise OpenAIError(
            400, f"body: expected multipart/form-data with a boundary, got {shown(content_type or 'no content type')}"
        )
    sections = (b"\r\n" + body).split(b"\r\n--" + boundary.encode("latin-1"))
    parts: Dict[str, List[bytes]] = {}
    for section in sections[1:]:
        if section.startswith(b"--"):  # the closing delimiter
            return parts
        head, found, content = section.partition(b"\r\n\r\n")
        disposition = Message()
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-disposition":
                disposition["content-disposition"] = value.strip()
        name = disposition.get_param("name", header="content-disposition")
        if not found or not isinstance(name, str):
            raise OpenAIError(
                400, "body: expected form parts with a content-disposition naming their field, got one without"
            )
        parts.setdefault(name, []).append(content)
    raise OpenAIError(400, "body: expected a multipart form ending in its closing delimiter, got none")

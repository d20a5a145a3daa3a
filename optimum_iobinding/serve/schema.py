"""What goes into and comes out of a request: the body of ``POST /v1/images`` (:class:`ImageRequest`), its size and
start image read into what the pipelines take (within the replica's limits), and the images written as PNG bytes."""

# no `from __future__ import annotations`: FastAPI reads ImageRequest's annotations as objects
import base64
import binascii
import io
import re
import struct
import sys
import warnings
import zlib
from typing import Any, List, Literal, Optional, Sequence, Tuple, Union

try:
    from pydantic import BaseModel, ConfigDict, Field
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("optimum_iobinding.serve needs Ray Serve: pip install 'optimum-iobinding[serve]'") from error

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
    image: Optional[str] = Field(default=None, description="image-to-image: the start image, base64 PNG or JPEG")
    strength: Optional[float] = Field(default=None, description="image-to-image: how much of the schedule runs")


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
        raise ValueError(f"size: expected positive pixels as 512 or '768x512' (width x height), got {shown(size)}")
    return sides


IMAGE_EXPECTED = "a base64 PNG or JPEG"


def plain_reason(error: BaseException) -> str:
    """An error's message for a client: Pillow names the file it read by its object (``<_io.BytesIO object at
    0x7f…>``), which means nothing to the sender of a JSON field; such a name becomes ``the image``."""
    text = re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the image", str(error)).strip()
    return (text.splitlines() or [type(error).__name__])[0][:200]


def decode_image(data: str, max_pixels: Optional[int] = None) -> Any:
    """A base64 PNG or JPEG → float32 HxWx3 in [0, 1] (what the image-to-image pipelines take). An image of more than
    ``max_pixels`` is refused from its header, before its pixels are decoded. A refusal names the JSON field
    (``image``), what it takes and what came: text that is no base64, bytes of no image Pillow reads (their first
    bytes shown), an image that cannot be decoded."""
    import numpy as np
    from PIL import Image

    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ValueError(
            f"image: expected {IMAGE_EXPECTED}, got text that is no base64 ({plain_reason(error)})"
        ) from None

    def undecodable(kind: str, error: Exception) -> ValueError:
        return ValueError(
            f"image: expected {IMAGE_EXPECTED}, got {kind} that could not be decoded: {plain_reason(error)}"
        )

    # Pillow raises many kinds of errors on a damaged file (OSError, SyntaxError, struct.error ...), and warns of a
    # decompression bomb: each is the client's image failing, never the service's
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(raw))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
            limit = f"at most {max_pixels} pixels (max_pixels_per_image)" if max_pixels else "an image Pillow decodes"
            raise ValueError(f"image: expected {limit}, got more: {plain_reason(error)}") from None
        except Image.UnidentifiedImageError:
            raise ValueError(
                f"image: expected {IMAGE_EXPECTED}, got {len(raw)} bytes of no image Pillow reads "
                f"(they start with {raw[:8]!r})"
            ) from None
        except Exception as error:  # noqa: BLE001
            raise undecodable(f"{len(raw)} bytes", error) from None
        with image:
            width, height = image.size
            if max_pixels is not None and width * height > max_pixels:
                raise ValueError(
                    f"image: expected at most {max_pixels} pixels (max_pixels_per_image), got {width}×{height}"
                )
            try:
                pixels = np.asarray(image.convert("RGB"))
            except Exception as error:  # noqa: BLE001
                raise undecodable(f"a {image.format or 'file'} of {width}×{height} pixels", error) from None
    return pixels.astype(np.float32) / 255.0


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

"""Image bytes into a picture, with the limits that keep one request from holding the worker: PNG, JPEG, WebP
and GIF (its first frame) only, a cap on the encoded size and on the pixel count (checked from the header before
the pixels are decoded)."""
from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
DETAILS = ("auto", "low", "high")
LOW_DETAIL_SIDE = 512  # `detail: low`: the longer side at most this many pixels, as OpenAI's 512x512 low-res view
_MEDIA_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"}


class ImageError(ValueError):
    """An image the worker cannot take (corrupt, too large, an unsupported type, a refused or failed fetch); the
    message says why, the caller names the part."""


@dataclass(frozen=True)
class MediaLimits:
    max_images: int | None = None  # per request (LIMIT_MM_PER_PROMPT); None: no cap
    max_image_bytes: int = 20 * 2**20  # encoded size, for data: URLs and fetches alike
    max_image_pixels: int = 40_000_000  # width x height
    fetch_timeout: float = 10.0  # seconds for the whole fetch, redirects included
    max_redirects: int = 3
    allow_private: bool = False  # fetch from private, loopback and link-local addresses too
    allowed_domains: tuple[str, ...] | None = None  # None: any host; else only these hosts (and their subdomains)


def decode_data_url(url: str, limits: MediaLimits):
    """A `data:image/...;base64,...` URL's picture."""
    header, comma, payload = url.partition(",")
    if not comma or not header.startswith("data:"):
        raise ImageError("a data URL must look like data:image/png;base64,<data>")
    media = header[5:].split(";")
    if "base64" not in media[1:]:
        raise ImageError("only base64 data URLs are accepted (data:image/png;base64,<data>)")
    media_type = media[0].strip().lower()
    if media_type and media_type not in _MEDIA_TYPES:
        raise ImageError(f"unsupported image type {media_type}: PNG, JPEG, WebP and GIF are accepted")
    # base64 is 4 characters per 3 bytes: refuse an oversized payload before decoding it.
    if len(payload) * 3 // 4 > limits.max_image_bytes + 3:
        raise ImageError(f"the image is larger than the limit of {limits.max_image_bytes} bytes")
    try:
        data = base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data URL's base64 is corrupt") from None
    return decode_image(data, limits)


def decode_image(data: bytes, limits: MediaLimits):
    """Encoded image bytes as an RGB picture (a GIF's first frame)."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_image_bytes:
        raise ImageError(f"the image is larger than the limit of {limits.max_image_bytes} bytes")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise ImageError("the data is not an image in a supported format (PNG, JPEG, WebP, GIF)") from None
    except Exception as exc:  # noqa: BLE001 - any decoder failure is the image's fault
        raise ImageError(f"the image cannot be read: {exc}") from None
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise ImageError(f"the image has {width}x{height} pixels, more than the limit of {limits.max_image_pixels}")
    try:
        image.seek(0)  # a GIF's (or animated WebP's) first frame
        return image.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt pixel data
        raise ImageError(f"the image cannot be decoded: {exc}") from None


def at_detail(image, detail: str | None):
    """The picture the processor sees at an OpenAI `detail` level: `low` shrinks it (aspect kept, bicubic, each
    side rounded to the nearest pixel) so its longer side is at most LOW_DETAIL_SIDE; `auto`, `high` and none
    leave it as it is, for the processor's own resolution."""
    if detail not in (None, *DETAILS):
        raise ImageError("detail must be auto, low or high")
    width, height = image.size
    if detail != "low" or max(width, height) <= LOW_DETAIL_SIDE:
        return image
    from PIL import Image

    scale = LOW_DETAIL_SIDE / max(width, height)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    return image.resize(size, Image.Resampling.BICUBIC)

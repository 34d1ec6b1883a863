"""Reading an image reference: the dispatch on its scheme, data: URLs and local paths under
BATCHLLM_IMAGE_ROOT here (s3:// in s3.py, http(s) in web.py), and the decoding with Pillow
under the size limits."""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from batchllm.input.images.problem import ImageProblem, shown
from batchllm.input.images.s3 import s3_bytes
from batchllm.input.images.web import http_bytes
from batchllm.settings import Settings


def image_parts(messages: list[dict[str, Any]]) -> Iterator[tuple[int, int, str]]:
    """(message index, part index, url) of every image part of stored chat messages."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.get("type") == "image_url":
                    yield i, j, part["image_url"]["url"]


def read_image_bytes(url: str, settings: Settings, *, deadline: float | None = None) -> bytes:
    """The encoded bytes an image reference names; ImageProblem when it names none this
    process may read. `deadline` (time.monotonic()): when an http(s) fetch must have ended,
    besides its own timeout."""
    scheme = urlsplit(url).scheme.lower() if "://" in url or url.startswith("data:") else ""
    if scheme == "data":
        data = _data_url_bytes(url)
    elif scheme in ("http", "https"):
        data = http_bytes(url, settings, deadline)
    elif scheme == "s3":
        data = s3_bytes(url, settings)
    elif scheme in ("", "file"):
        data = _local_bytes(unquote(urlsplit(url).path) if scheme else url, settings)
    else:
        raise ImageProblem(
            f"unsupported image URL scheme {scheme!r}: expected data:, s3://, a local path "
            "under BATCHLLM_IMAGE_ROOT, or http(s):// with BATCHLLM_ALLOW_HTTP_IMAGES"
        )
    if len(data) > settings.max_image_bytes:
        raise _too_big(len(data), settings)
    return data


def _too_big(size: int, settings: Settings) -> ImageProblem:
    return ImageProblem(
        f"image is {size:,} bytes or more, over the limit of {settings.max_image_bytes:,} "
        "(BATCHLLM_MAX_IMAGE_BYTES)"
    )


def open_image(
    url: str,
    settings: Settings,
    *,
    decode: bool = True,
    deadline: float | None = None,
) -> Any:
    """The image a reference names, as a PIL RGB image (`decode=False`: opened from its header
    only, its size known and its pixels decoded by `decoded` later); ImageProblem when it
    cannot be read, is not an image, or is over the size limits."""
    image = _opened(read_image_bytes(url, settings, deadline=deadline), settings)
    return decoded(image) if decode else image


def decoded(image: Any) -> Any:
    """An opened image's pixels, decoded in full (a truncated file fails here) as RGB."""
    from PIL import Image

    try:
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ImageProblem(f"not a decodable image ({_reason(exc)})") from None


def _opened(data: bytes, settings: Settings) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageProblem("not a decodable image (unknown image format)") from None
    except (OSError, ValueError) as exc:
        raise ImageProblem(f"not a decodable image ({_reason(exc)})") from None
    width, height = image.size
    if width * height > settings.max_image_pixels:
        # Checked from the header, before the pixels are decoded.
        raise ImageProblem(
            f"image is {width}x{height} pixels, over the limit of "
            f"{settings.max_image_pixels:,} (BATCHLLM_MAX_IMAGE_PIXELS)"
        )
    if width < 1 or height < 1:
        raise ImageProblem(f"image is {width}x{height} pixels")
    return image


def _reason(exc: Exception) -> str:
    return str(exc).split("\n")[0] or type(exc).__name__


def _data_url_bytes(url: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise ImageProblem("data URL has no ',' before its data")
    if not header.lower().endswith(";base64"):
        raise ImageProblem("data URL is not base64 (expected data:image/...;base64,...)")
    if not header.lower().startswith("data:image/"):
        raise ImageProblem(f"data URL is {shown(header)!r}, not an image (data:image/...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageProblem(f"data URL is not valid base64 ({exc})") from None


def _local_bytes(path: str, settings: Settings) -> bytes:
    if settings.image_root is None:
        raise ImageProblem(
            f"local image path {shown(path)!r}: local images are off (set BATCHLLM_IMAGE_ROOT "
            "to the directory they may be read from)"
        )
    root = settings.image_root.expanduser().resolve()
    candidate = Path(path).expanduser()
    resolved = (candidate if candidate.is_absolute() else root / candidate).resolve()
    if not resolved.is_relative_to(root):
        raise ImageProblem(
            f"local image path {shown(path)!r} is outside BATCHLLM_IMAGE_ROOT ({root})"
        )
    try:
        size = resolved.stat().st_size
        if size > settings.max_image_bytes:
            raise _too_big(size, settings)
        return resolved.read_bytes()
    except FileNotFoundError:
        raise ImageProblem(f"no such image file: {shown(path)}") from None
    except OSError as exc:
        raise ImageProblem(f"cannot read image file {shown(path)}: {exc.strerror}") from None

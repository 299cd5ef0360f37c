"""Images named by URL in a request (vLLM's MediaConnector): `data:image/...;base64,`, `http(s)://` and
`file://` (only under --allowed-local-media-path), each decoded with PIL into a loaded RGB image. Videos come
by the same URLs (media_bytes; `data:video/...`), decoded in video.py.

Every refusal is a RequestError at the request field that named the URL (HTTP 400), never a bare PIL or
socket exception: the bytes come from the user, so anything wrong with them is the user's to fix.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import errno
import io
import os
import re
import stat
import urllib.parse
from concurrent.futures import Executor
from typing import Optional

from PIL import Image, UnidentifiedImageError

from pagedserve.common import envs
from pagedserve.common.errors import RequestError
from pagedserve.frontend.multimodal.fetch import fetch_url, shown_url

SUPPORTED_SCHEMES = ("data", "http", "https", "file")
# What a vision model's processor is given in practice; the rest of PIL's readers (TIFF, ICO, PSD, EPS, ...)
# are more parser for an attacker to reach and nothing a client needs.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


def _default_fetch_timeout() -> float:
    return envs.VLLM_IMAGE_FETCH_TIMEOUT


@dataclasses.dataclass(frozen=True)
class MediaLimits:
    """What a request's media may be. `max_image_pixels` None leaves PIL's own decompression-bomb limit
    (`Image.MAX_IMAGE_PIXELS`); PIL refuses images over twice that whatever this says."""
    allowed_local_media_path: Optional[str] = None
    max_image_bytes: Optional[int] = None
    max_image_pixels: Optional[int] = None      # of an image, and of each frame of a video
    max_video_bytes: Optional[int] = None
    fetch_timeout_s: float = dataclasses.field(default_factory=_default_fetch_timeout)

    def __post_init__(self) -> None:
        # These come from flags and the environment, not from a request: a bad one is the operator's error.
        for name in ("max_image_bytes", "max_image_pixels", "max_video_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 (or None: no limit), got {value}")
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"fetch_timeout_s must be positive, got {self.fetch_timeout_s}")


def load_image(url: str, limits: MediaLimits, field: str) -> Image.Image:
    """The image `url` names, fully decoded, in RGB. Blocks on I/O and decoding (the event loop should call
    load_image_async); a RequestError at `field` for anything it cannot or may not load."""
    data, source = media_bytes(url, limits, field, "image")
    return _decode(data, limits, field, source)


def media_bytes(url: str, limits: MediaLimits, field: str, kind: str) -> tuple[bytes, str]:
    """The bytes of the `kind` ("image" or "video") `url` names, within that kind's byte limit, and how to
    name where they came from in an error. Blocks on I/O."""
    max_bytes = limits.max_image_bytes if kind == "image" else limits.max_video_bytes
    match = _SCHEME.match(url)
    scheme = match.group(1).lower() if match else ""
    if scheme == "data":
        data, source = _data_url_bytes(url, field, kind), "the data URL"
    elif scheme in ("http", "https"):
        data, source = fetch_url(url, limits.fetch_timeout_s, max_bytes, field), shown_url(url)
    elif scheme == "file":
        data, source = _file_bytes(url, limits.allowed_local_media_path, max_bytes, field)
    else:
        named = f"URL scheme {scheme!r}" if scheme else "a URL without a scheme"
        raise RequestError.at(field, f"unsupported {kind} URL: {named} (supported: "
                                     f"{', '.join(s + ':' for s in SUPPORTED_SCHEMES)})")
    if max_bytes is not None and len(data) > max_bytes:
        raise RequestError.at(field, f"{source} is over the limit of {max_bytes} bytes")
    return data, source


async def load_image_async(url: str, limits: MediaLimits, field: str,
                           executor: Optional[Executor] = None) -> Image.Image:
    """load_image on a thread (`executor`'s, else asyncio's default pool): the loop keeps serving meanwhile."""
    if executor is None:
        return await asyncio.to_thread(load_image, url, limits, field)
    return await asyncio.get_running_loop().run_in_executor(executor, load_image, url, limits, field)


def _data_url_bytes(url: str, field: str, kind: str) -> bytes:
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise RequestError.at(field, "the data URL has no ',' before its data")
    mime, *params = (part.strip().lower() for part in header.split(";"))
    if not mime.startswith(f"{kind}/"):
        raise RequestError.at(field, f"the data URL's media type is {mime or 'missing'!r}, not {kind}/...")
    if "base64" not in params:
        raise RequestError.at(field, f"only base64 data URLs are supported (data:{kind}/...;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError.at(field, f"the data URL is not valid base64: {exc}") from None


def _file_bytes(url: str, allowed: Optional[str], max_bytes: Optional[int], field: str) -> tuple[bytes, str]:
    parts = urllib.parse.urlsplit(url)
    path = urllib.parse.unquote(parts.path)
    if parts.netloc not in ("", "localhost"):
        raise RequestError.at(field, f"file URL {shown_url(url)} names host {parts.netloc!r}: only local files")
    if allowed is None:
        raise RequestError.at(field, f"file URLs are refused ({path}): this server was started without "
                                     f"--allowed-local-media-path")
    real = _inside(path, allowed)
    if real is None:
        raise RequestError.at(field, f"{path} is outside --allowed-local-media-path {allowed}")
    try:
        return _read_regular_file(real, max_bytes), path
    except OSError as exc:
        raise RequestError.at(field, f"cannot read {path}: {exc.strerror or exc}") from None


def _read_regular_file(path: str, max_bytes: Optional[int]) -> bytes:
    # Non-blocking open, then the type: a FIFO or a device under the folder would otherwise block or never end.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        # One byte past the limit is enough to know it is over, whatever the file's size.
        return f.read(-1 if max_bytes is None else max_bytes + 1)


def _inside(path: str, root: str) -> Optional[str]:
    """`path` with symlinks and '..' resolved, if that lies under `root` (resolved too); else None."""
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    try:
        inside = os.path.commonpath([real, real_root]) == real_root
    except ValueError:
        inside = False      # a relative path, or another drive
    return real if inside and os.path.isabs(path) else None


def _decode(data: bytes, limits: MediaLimits, field: str, source: str) -> Image.Image:
    image = _open(data, field, source)
    try:
        if image.format not in IMAGE_FORMATS:
            raise RequestError.at(field, f"{source} is an unsupported image format {image.format} "
                                         f"(supported: {', '.join(IMAGE_FORMATS)})")
        _check_pixels(image, limits, field, source)
        try:
            image.load()
            return image.convert("RGB")
        except Image.DecompressionBombError as exc:
            raise RequestError.at(field, f"{source} is too large: {exc}") from None
        except Exception as exc:    # Pillow's decoders raise many types for broken data (see _open)
            raise RequestError.at(field, f"{source} is not an image PIL can read: {exc}") from None
    finally:
        image.close()


def _open(data: bytes, field: str, source: str) -> Image.Image:
    """The image's header: Image.open reads the format and size and decodes nothing yet."""
    try:
        return Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise RequestError.at(field, f"{source} is too large: {exc}") from None
    except UnidentifiedImageError:      # its own text names the BytesIO object, nothing the user sent
        raise RequestError.at(field, f"{source} is not an image PIL can read: no image format PIL knows "
                                     f"starts this way") from None
    # Not only UnidentifiedImageError: a plugin given a broken header may raise SyntaxError, struct.error,
    # IndexError, ... and every one of them means the same to the user.
    except Exception as exc:
        raise RequestError.at(field, f"{source} is not an image PIL can read: {exc}") from None


def _check_pixels(image: Image.Image, limits: MediaLimits, field: str, source: str) -> None:
    # PIL only warns between its limit and twice it; None here keeps its limit, as a refusal.
    limit = limits.max_image_pixels if limits.max_image_pixels is not None else Image.MAX_IMAGE_PIXELS
    width, height = image.size
    if limit is not None and width * height > limit:
        raise RequestError.at(field, f"{source} is {width}x{height} = {width * height} pixels, over the limit "
                                     f"of {limit}")

"""Images named in chat messages: content parts read into PIL images, under the server's media policy.

A message's content may be a list of parts; ``split_image_parts`` takes the image parts out (in
order) and leaves ``{"type": "image"}`` in their place, which a vision model's chat template writes
as its image placeholder. An image part is OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}``
or, offline, vLLM's ``{"type": "image_pil", "image_pil": <PIL image>}``.

Rules kept here (``MediaPolicy``):
- ``data:`` URLs (base64) are always read; ``http(s)`` URLs only from a host in ``allowed_domains``,
  within ``timeout_s`` and ``max_bytes``; ``file://`` URLs only under ``allowed_local_path`` (after
  resolving links). Anything else is refused.
- An image is decoded whole before it is used: a file that is no image, is truncated, or has more
  than ``max_pixels`` pixels (checked from its header before decoding, so a decompression bomb
  never expands) is refused. Every refusal is a ``MediaError`` (a ValueError) naming the part.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import warnings
from dataclasses import dataclass
from typing import Any, Optional


class MediaError(ValueError):
    """A bad image part; ``param`` names it (``messages[0].content[1]``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class MediaPolicy:
    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: Optional[str] = None
    timeout_s: float = 5.0
    max_bytes: int = 20 << 20
    max_pixels: int = 4096 * 4096
    max_images: int = 8
    reads_images: bool = True  # False: the model reads text only, every image part is refused

    @classmethod
    def from_server(cls, server: Any, reads_images: bool = True) -> "MediaPolicy":
        return cls(tuple(server.allowed_media_domains), server.allowed_local_media_path, server.media_fetch_timeout_s,
                   server.max_media_bytes, server.max_image_pixels, server.limit_mm_per_prompt, reads_images)


OFFLINE = MediaPolicy(max_images=1 << 30)  # LLM.chat: data URLs and PIL images, any number


def split_image_parts(conversation: list[dict], policy: MediaPolicy) -> tuple[list[dict], list[Any]]:
    """(conversation with each image part as ``{"type": "image"}``, the images in order)."""
    images: list[Any] = []
    out = []
    for i, message in enumerate(conversation):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("image_url", "image_pil", "image"):
                parts.append(part)
                continue
            where = f"messages[{i}].content[{j}]"
            if not policy.reads_images:
                raise MediaError(where, "this model reads text only; send text parts, or serve a vision-language model")
            if len(images) == policy.max_images:
                raise MediaError(where, f"more than {policy.max_images} images in one request "
                                        "(server.limit_mm_per_prompt); send fewer images")
            images.append(_part_image(part, kind, where, policy))
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images


def _part_image(part: dict, kind: str, where: str, policy: MediaPolicy) -> Any:
    from PIL import Image

    if kind == "image_url":
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not isinstance(url, str):
            raise MediaError(where, "an image_url part has image_url.url, a string")
        return load_image(url, policy, where)
    img = part.get(kind)
    if not isinstance(img, Image.Image):
        raise MediaError(where, f"an {kind} part holds a PIL image, got {type(img).__name__}")
    _check_pixels(img.size, policy, where)
    return img


def load_image(url: str, policy: MediaPolicy, where: str) -> Any:
    """The image a URL names, decoded (``MediaError`` naming ``where`` when refused)."""
    if url.startswith("data:"):
        return decode_image(_data_url_bytes(url, policy, where), policy, where)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        return decode_image(_fetch(url, policy, where), policy, where)
    if scheme == "file":
        return decode_image(_read_local(url, policy, where), policy, where)
    raise MediaError(where, f"image URLs are data:, http(s): or file: URLs, got {ascii(url[:40])}")


def decode_image(data: bytes, policy: MediaPolicy, where: str) -> Any:
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            _check_pixels(img.size, policy, where)  # from the header, before anything is decoded
            img.load()
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise MediaError(where, f"the image is too large to decode ({e})") from e
    except Image.UnidentifiedImageError as e:
        raise MediaError(where, "the data is not an image PIL can read (PNG, JPEG, GIF, WebP, ...)") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # truncated or corrupt data
        raise MediaError(where, f"the image could not be decoded, is it truncated? ({e})") from e
    return img


def _check_pixels(size: tuple[int, int], policy: MediaPolicy, where: str) -> None:
    width, height = size
    if width * height > policy.max_pixels:
        raise MediaError(where, f"the image has {width}x{height} pixels, more than {policy.max_pixels} "
                                "(server.max_image_pixels); send a smaller image")


def _data_url_bytes(url: str, policy: MediaPolicy, where: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise MediaError(where, "a data URL image is data:<type>;base64,<data>")
    if len(payload) > policy.max_bytes * 4 // 3 + 4:
        raise MediaError(where, f"the image is larger than {policy.max_bytes} bytes (server.max_media_bytes)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(where, f"the data URL is not valid base64 ({e})") from e


def _fetch(url: str, policy: MediaPolicy, where: str) -> bytes:
    import httpx

    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in {d.lower() for d in policy.allowed_domains}:
        raise MediaError(where, f"the host {ascii(host)} is not in server.allowed_media_domains; send the image "
                                "as a data URL")
    try:
        with httpx.stream("GET", url, timeout=policy.timeout_s, follow_redirects=False) as response:
            if response.status_code != 200:
                raise MediaError(where, f"fetching the image answered HTTP {response.status_code}")
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > policy.max_bytes:
                    raise MediaError(where, f"the image is larger than {policy.max_bytes} bytes "
                                            "(server.max_media_bytes)")
            return bytes(data)
    except httpx.HTTPError as e:
        raise MediaError(where, f"the image could not be fetched ({type(e).__name__})") from e


def _read_local(url: str, policy: MediaPolicy, where: str) -> bytes:
    root = policy.allowed_local_path
    if root is None:
        raise MediaError(where, "file:// image URLs need server.allowed_local_media_path")
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
    root = os.path.realpath(root)
    if os.path.commonpath([path, root]) != root:
        raise MediaError(where, "the file is not under server.allowed_local_media_path")
    try:
        if os.path.getsize(path) > policy.max_bytes:
            raise MediaError(where, f"the image is larger than {policy.max_bytes} bytes (server.max_media_bytes)")
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise MediaError(where, f"the file could not be read ({type(e).__name__})") from e

"""Images in chat requests: extraction, safe decoding, and cache-key identity markers.

    images = extract_images(messages, limits)                 # [ImageInput(message_index, digest, image)]
    key = inject_image_markers(key_tokens, image_pad_id, [im.digest for im in images])

Accepted parts (kept bound to their message, in order):
- OpenAI ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` (or a bare
  string for ``image_url``);
- Responses-style ``{"type": "input_image", "image_url": "data:..."}``.

Only ``data:`` URLs are decoded here. ``http(s)`` URLs are refused unless
``ALLOW_REMOTE_IMAGE_URLS=true``, and then the HTTP layer (server/common/image_fetch.py) fetches them on
the request's own thread and passes the bytes on as ``data:`` URLs, so this module does no
network I/O and a slow image host never blocks the inference worker. ``file://`` URLs and bare
paths are always refused: an API request must never read the server's disk.

Formats are an allow-list (PNG, JPEG, WebP, GIF first frame), recognised from the magic bytes
before PIL sees the data: EPS, PSD and the rest are refused unopened (PIL's EPS reader runs
Ghostscript where it is installed). Sizes are checked on the headers before any pixel is
decoded: MAX_IMAGE_PIXELS per image and MAX_IMAGE_PIXELS_PER_REQUEST over all of a request's
images (a 5 KB PNG can declare a 120 MB canvas, and one body can hold thousands of them).

Every failure is an ``ImageError`` (a ValueError; the HTTP layer answers 400) that says what to fix.
No MLX and no network here; PIL only.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

from PIL import Image

IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
DEFAULT_MAX_REQUEST_PIXELS = 64_000_000
ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_FORMATS_TEXT = "PNG, JPEG, WebP or GIF (first frame)"

# Marker ids live in [-2**31, -1]: real token ids are >= 0, and block hashing encodes ids as
# signed 8-byte integers, so a negative id is representable and can never equal a real one.
_MARKER_SPAN = 2**31


class ImageError(ValueError):
    """An image in the request could not be used (client error: 400)."""


@dataclass(frozen=True, slots=True)
class ImageInput:
    message_index: int      # which message the image belongs to
    digest: bytes           # SHA-256 of the decoded image bytes (the image's identity)
    image: Any              # PIL.Image.Image, RGB, fully loaded


@dataclass(frozen=True, slots=True)
class ImageLimits:
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    allow_remote: bool = False
    remote_timeout: float = 10.0
    max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS

    @classmethod
    def from_settings(cls, settings: Any) -> "ImageLimits":
        return cls(
            max_bytes=int(getattr(settings, "max_image_bytes", DEFAULT_MAX_IMAGE_BYTES)),
            max_pixels=int(getattr(settings, "max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS)),
            max_request_pixels=int(getattr(settings, "max_image_pixels_per_request", DEFAULT_MAX_REQUEST_PIXELS)),
            allow_remote=bool(getattr(settings, "allow_remote_image_urls", False)),
            remote_timeout=float(getattr(settings, "remote_image_timeout_seconds", 10.0)),
        )


# ---------------------------------------------------------------------------- parts
def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and (part.get("type") in IMAGE_PART_TYPES
                                       or ("type" not in part and "image_url" in part))


def has_images(messages: Sequence[Any]) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(is_image_part(p) for p in m["content"]) for m in messages)


def image_part_url(part: dict) -> str:
    """The URL string of an image part (``image_url`` as a string or ``{"url": ...}``)."""
    ref = part.get("image_url", part.get("image"))
    if isinstance(ref, dict):
        ref = ref.get("url")
    if not isinstance(ref, str) or not ref.strip():
        raise ImageError(f"image part of type {part.get('type')!r} needs 'image_url' as a data: URL string "
                         "or {\"url\": \"data:image/png;base64,...\"}")
    return ref.strip()


def image_parts(messages: Sequence[Any]) -> list[tuple[int, int, dict]]:
    """(message index, part index, part) for every image part, in message order."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            out += [(i, j, p) for j, p in enumerate(content) if is_image_part(p)]
    return out


# ---------------------------------------------------------------------------- decoding
def decode_data_url(url: str, max_bytes: int) -> bytes:
    """Bytes of a base64 ``data:`` URL, refusing payloads over ``max_bytes`` before decoding."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise ImageError("malformed data: URL (no ',' between header and payload); "
                         "expected data:image/png;base64,<base64 bytes>")
    if ";base64" not in header.lower():
        raise ImageError("image data: URLs must be base64-encoded (data:image/...;base64,...)")
    payload = "".join(payload.split())  # line-wrapped base64 is common
    if len(payload) > 4 * ((max_bytes + 2) // 3) + 4:
        raise ImageError(f"image payload exceeds MAX_IMAGE_BYTES={max_bytes}")
    try:
        if "-" in payload or "_" in payload:
            data = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
        else:
            data = base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("image data: URL is not valid base64") from None
    if not data:
        raise ImageError("image data: URL has an empty payload")
    if len(data) > max_bytes:
        raise ImageError(f"image of {len(data)} bytes exceeds MAX_IMAGE_BYTES={max_bytes}")
    return data


def sniff_format(data: bytes) -> str | None:
    """The accepted format the magic bytes announce (``ACCEPTED_FORMATS``), or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    return None


def data_url_for(data: bytes) -> str:
    """A base64 ``data:`` URL carrying ``data`` (how fetched remote images travel to the worker)."""
    fmt = sniff_format(data)
    mime = f"image/{fmt.lower()}" if fmt else "application/octet-stream"
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


def open_image(data: bytes, max_pixels: int) -> Any:
    """A lazily opened PIL image (header read, no pixels) of an accepted format within ``max_pixels``."""
    fmt = sniff_format(data)
    if fmt is None:
        raise ImageError(f"image format not accepted: send {_FORMATS_TEXT} bytes")
    try:
        with warnings.catch_warnings():
            # Our own caps govern; PIL's warning threshold may be under MAX_IMAGE_PIXELS.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=[fmt])  # lazy: reads the header only
    except Image.DecompressionBombError:
        raise ImageError(f"image exceeds the decompression-bomb limit (MAX_IMAGE_PIXELS={max_pixels})") from None
    except Exception as exc:  # noqa: BLE001 - PIL raises many kinds for corrupt data
        raise ImageError(f"image could not be decoded ({type(exc).__name__}); send {_FORMATS_TEXT} bytes") from None
    width, height = img.size
    if width <= 0 or height <= 0 or width * height > max_pixels:
        raise ImageError(f"image of {width}x{height} pixels exceeds MAX_IMAGE_PIXELS={max_pixels}")
    return img


def load_rgb(img: Any, max_pixels: int) -> Any:
    """Decode an opened image's pixels (a GIF's first frame) as RGB."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img.seek(0)
            img.load()
            return img.convert("RGB")
    except Image.DecompressionBombError:
        raise ImageError(f"image exceeds the decompression-bomb limit (MAX_IMAGE_PIXELS={max_pixels})") from None
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt pixel data
        raise ImageError(f"image could not be decoded ({type(exc).__name__}); send {_FORMATS_TEXT} bytes") from None


def decode_image(data: bytes, max_pixels: int) -> Any:
    """A fully loaded RGB PIL image, refusing more than ``max_pixels`` before pixel data is read."""
    return load_rgb(open_image(data, max_pixels), max_pixels)


def is_remote_url(url: str) -> bool:
    return url[:16].lower().startswith(("http://", "https://"))


def load_image_bytes(url: str, limits: ImageLimits) -> bytes:
    """Bytes of a ``data:`` URL; every other kind of URL is refused with the reason."""
    lower = url[:16].lower()
    if lower.startswith("data:"):
        return decode_data_url(url, limits.max_bytes)
    if is_remote_url(url):
        if not limits.allow_remote:
            raise ImageError("remote image URLs are disabled on this server; send the image inline as a "
                             "data:image/...;base64,... URL (or set ALLOW_REMOTE_IMAGE_URLS=true)")
        raise ImageError("remote image was not fetched before the request was queued; send it inline as a "
                         "data:image/...;base64,... URL")
    if lower.startswith("file:"):
        raise ImageError("file:// image URLs are refused (a request may not read the server's disk); "
                         "send the image inline as a data:image/...;base64,... URL")
    raise ImageError(f"unsupported image URL {url[:40]!r}: send a data:image/...;base64,... URL"
                     + (" or an http(s) URL" if limits.allow_remote else ""))


def _open_all(messages: Sequence[Any], limits: ImageLimits) -> list[tuple[int, str, bytes, Any]]:
    """(message index, where, bytes, lazily opened image) for every image part, sizes checked
    per image and over the whole request before any pixel is decoded."""
    opened = []
    total = 0
    for i, j, part in image_parts(messages):
        where = f"messages[{i}].content[{j}]"
        try:
            data = load_image_bytes(image_part_url(part), limits)
            img = open_image(data, limits.max_pixels)
        except ImageError as exc:
            raise ImageError(f"{where}: {exc}") from None
        total += img.size[0] * img.size[1]
        if total > limits.max_request_pixels:
            raise ImageError(f"{where}: the request's images hold more than MAX_IMAGE_PIXELS_PER_REQUEST="
                             f"{limits.max_request_pixels} pixels in all; send fewer or smaller images")
        opened.append((i, where, data, img))
    return opened


def check_images(messages: Sequence[Any], limits: ImageLimits = ImageLimits()) -> int:
    """Header-only checks of every image (format, per-image and per-request pixels); returns the
    request's total pixel count. Cheap: no pixel is decoded."""
    return sum(img.size[0] * img.size[1] for _, _, _, img in _open_all(messages, limits))


def extract_images(messages: Sequence[Any], limits: ImageLimits = ImageLimits()) -> list[ImageInput]:
    """Decode every image part, in message order, each bound to its message index."""
    out = []
    for i, where, data, img in _open_all(messages, limits):
        try:
            image = load_rgb(img, limits.max_pixels)
        except ImageError as exc:
            raise ImageError(f"{where}: {exc}") from None
        out.append(ImageInput(i, hashlib.sha256(data).digest(), image))
    return out


# ---------------------------------------------------------------------------- cache-key identity
def image_marker_tokens(digest: bytes, vocab_size: int = 0) -> tuple[int, int]:
    """Two ids derived from an image's SHA-256, both negative (never a real token id).

    62 bits of the digest: two images collide with probability ~2**-62. ``vocab_size`` is only
    checked for sanity (real ids are in ``[0, vocab_size)``).

    Args:
        digest: SHA-256 (>= 8 bytes) of the image bytes.
        vocab_size: the model's vocabulary size (0 = unknown).
    Returns:
        (hi, lo), each in ``[-2**31, -1]``.
    """
    if len(digest) < 8:
        raise ValueError(f"image digest must be at least 8 bytes, got {len(digest)}")
    if vocab_size < 0:
        raise ValueError(f"{vocab_size=} must be >= 0")
    hi = int.from_bytes(digest[0:4], "little") % _MARKER_SPAN
    lo = int.from_bytes(digest[4:8], "little") % _MARKER_SPAN
    return -(hi + 1), -(lo + 1)


def image_pad_runs(tokens: Sequence[int], image_pad_id: int) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of ``image_pad_id`` in ``tokens``, in order."""
    runs = []
    start = -1
    for i, t in enumerate(tokens):
        if t == image_pad_id:
            if start < 0:
                start = i
        elif start >= 0:
            runs.append((start, i))
            start = -1
    if start >= 0:
        runs.append((start, len(tokens)))
    return runs


def inject_image_markers(key_tokens: Sequence[int], image_pad_id: int, digests: Sequence[bytes],
                         vocab_size: int = 0) -> list[int]:
    """Insert image k's 2-token marker right after the k-th run of image-pad tokens.

    Same message structure with a different image then yields a different key from that image on.
    Raises ValueError (a bug) when the run count differs from the number of digests.
    """
    runs = image_pad_runs(key_tokens, image_pad_id)
    if len(runs) != len(digests):
        raise ValueError(f"{len(runs)} image-pad runs in the key but {len(digests)} images")
    out: list[int] = []
    prev = 0
    for (_, end), digest in zip(runs, digests):
        out.extend(key_tokens[prev:end])
        out.extend(image_marker_tokens(digest, vocab_size))
        prev = end
    out.extend(key_tokens[prev:])
    return out


def markers_in(key_tokens: Sequence[int]) -> list[tuple[int, int]]:
    """The (hi, lo) markers found in a key, in order (consecutive pairs of negative ids)."""
    out = []
    i = 0
    n = len(key_tokens)
    while i < n:
        if key_tokens[i] < 0 and i + 1 < n and key_tokens[i + 1] < 0:
            out.append((int(key_tokens[i]), int(key_tokens[i + 1])))
            i += 2
        else:
            i += 1
    return out


def expand_image_pads(tokens: Sequence[int], image_pad_id: int, counts: Sequence[int]) -> list[int]:
    """Replace the k-th run of ``image_pad_id`` with ``counts[k]`` pads (a text-only render has one
    pad per image; the processor expands it to the image's patch count).

    Runs beyond ``len(counts)`` are a ValueError (the text and the images disagree).
    """
    runs = image_pad_runs(tokens, image_pad_id)
    if len(runs) > len(counts):
        raise ValueError(f"{len(runs)} image placeholders in the text but {len(counts)} images")
    out: list[int] = []
    prev = 0
    for (start, end), n in zip(runs, counts):
        out.extend(tokens[prev:start])
        out.extend([image_pad_id] * n)
        prev = end
    out.extend(tokens[prev:])
    return out

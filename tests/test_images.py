"""pipeline/images.py: extraction, safe decoding, identity markers (pure: PIL only, no MLX)."""
from __future__ import annotations

import base64
import hashlib
import io
import os

import numpy as np
import pytest
from PIL import Image

from mlxstack.pipeline.images import (
    ImageError,
    ImageLimits,
    decode_data_url,
    expand_image_pads,
    extract_images,
    image_marker_tokens,
    image_pad_runs,
    inject_image_markers,
    markers_in,
)

PAD = 7


def png_bytes(seed: int = 0, size: tuple[int, int] = (20, 10)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def user(*parts) -> dict:
    return {"role": "user", "content": list(parts)}


def openai_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


# ---------------------------------------------------------------------------- extraction
def test_extracts_both_part_styles_in_message_order():
    a, b, c = png_bytes(0), png_bytes(1), png_bytes(2)
    messages = [
        {"role": "system", "content": "sys"},
        user(openai_part(data_url(a)), {"type": "text", "text": "x"}, {"type": "input_image", "image_url": data_url(b)}),
        {"role": "assistant", "content": "ok"},
        user({"type": "image_url", "image_url": data_url(c)}),   # bare string form
    ]
    images = extract_images(messages)
    assert [im.message_index for im in images] == [1, 1, 3]
    assert [im.digest for im in images] == [hashlib.sha256(x).digest() for x in (a, b, c)]
    assert images[0].image.size == (20, 10) and images[0].image.mode == "RGB"


def test_bad_base64_is_a_clear_image_error():
    with pytest.raises(ImageError, match=r"messages\[0\].content\[0\].*not valid base64"):
        extract_images([user(openai_part("data:image/png;base64,@@@not-base64@@@"))])


def test_undecodable_bytes_are_an_image_error():
    with pytest.raises(ImageError, match="could not be decoded"):
        extract_images([user(openai_part(data_url(b"definitely not an image")))])


def test_non_base64_data_url_refused():
    with pytest.raises(ImageError, match="base64"):
        extract_images([user(openai_part("data:image/png,rawbytes"))])


@pytest.mark.parametrize("url", ["file:///etc/passwd", "FILE:///etc/hosts", "/etc/passwd", "C:\\img.png",
                                 "relative/picture.png", "ftp://host/x.png"])
def test_local_paths_and_other_schemes_always_refused(url):
    # Even with remote URLs allowed, nothing may read the server's disk.
    fetched = []
    with pytest.raises(ImageError):
        extract_images([user(openai_part(url))], ImageLimits(allow_remote=True),
                       fetch=lambda *a: fetched.append(a) or b"")
    assert fetched == []


def test_file_url_message_says_why():
    with pytest.raises(ImageError, match="server's disk"):
        extract_images([user(openai_part("file:///etc/passwd"))])


def test_remote_urls_refused_unless_enabled():
    raw = png_bytes(3)
    calls = []

    def fetch(url, max_bytes, timeout):
        calls.append((url, max_bytes, timeout))
        return raw

    part = openai_part("https://example.com/cat.png")
    with pytest.raises(ImageError, match="ALLOW_REMOTE_IMAGE_URLS"):
        extract_images([user(part)], ImageLimits(), fetch=fetch)
    assert calls == []
    images = extract_images([user(part)], ImageLimits(allow_remote=True, remote_timeout=2.5, max_bytes=999_999),
                            fetch=fetch)
    assert calls == [("https://example.com/cat.png", 999_999, 2.5)]
    assert images[0].digest == hashlib.sha256(raw).digest()


def test_byte_cap_checked_before_and_after_decoding():
    raw = png_bytes(4, (64, 64))
    with pytest.raises(ImageError, match="MAX_IMAGE_BYTES"):
        extract_images([user(openai_part(data_url(raw)))], ImageLimits(max_bytes=len(raw) - 1))
    with pytest.raises(ImageError, match="MAX_IMAGE_BYTES"):  # far too long: refused before b64decode
        decode_data_url("data:image/png;base64," + "A" * 10_000, max_bytes=100)
    assert len(extract_images([user(openai_part(data_url(raw)))], ImageLimits(max_bytes=len(raw)))) == 1


def test_pixel_cap_refuses_before_loading_pixels():
    # A tiny file that claims a huge canvas: the cap is checked from the header.
    buf = io.BytesIO()
    Image.new("L", (4000, 4000)).save(buf, "PNG")  # compresses to a few KB
    raw = buf.getvalue()
    assert len(raw) < 100_000
    with pytest.raises(ImageError, match="MAX_IMAGE_PIXELS"):
        extract_images([user(openai_part(data_url(raw)))], ImageLimits(max_pixels=1_000_000))
    assert extract_images([user(openai_part(data_url(raw)))], ImageLimits(max_pixels=16_000_000))[0].image.size == (4000, 4000)


def test_missing_url_is_an_image_error():
    with pytest.raises(ImageError, match="image_url"):
        extract_images([user({"type": "image_url", "image_url": {}})])


# ---------------------------------------------------------------------------- markers
def test_markers_never_equal_real_token_ids():
    vocab = 151_936
    for i in range(2000):
        digest = hashlib.sha256(os.urandom(16) + bytes([i % 256])).digest()
        hi, lo = image_marker_tokens(digest, vocab)
        assert -(2**31) <= hi < 0 and -(2**31) <= lo < 0
    # Extreme digests stay in range too.
    assert image_marker_tokens(b"\xff" * 32) == (-(2**31), -(2**31))
    assert image_marker_tokens(b"\x00" * 32) == (-1, -1)


def test_different_images_get_different_markers_same_image_same_marker():
    da, db = hashlib.sha256(png_bytes(0)).digest(), hashlib.sha256(png_bytes(1)).digest()
    assert image_marker_tokens(da) != image_marker_tokens(db)
    assert image_marker_tokens(da) == image_marker_tokens(hashlib.sha256(png_bytes(0)).digest())
    markers = {image_marker_tokens(hashlib.sha256(i.to_bytes(4, "little")).digest()) for i in range(5000)}
    assert len(markers) == 5000


def test_marker_rejects_short_digest():
    with pytest.raises(ValueError):
        image_marker_tokens(b"abc")


def test_inject_after_each_pad_run():
    d1, d2 = hashlib.sha256(b"one").digest(), hashlib.sha256(b"two").digest()
    m1, m2 = image_marker_tokens(d1), image_marker_tokens(d2)
    key = [1, 2, 5, PAD, PAD, PAD, 6, 3, 5, PAD, PAD, 6, 4]
    out = inject_image_markers(key, PAD, [d1, d2])
    assert out == [1, 2, 5, PAD, PAD, PAD, *m1, 6, 3, 5, PAD, PAD, *m2, 6, 4]
    assert markers_in(out) == [m1, m2]
    # A run at the very end still gets its marker.
    assert inject_image_markers([1, PAD, PAD], PAD, [d1]) == [1, PAD, PAD, *m1]
    assert inject_image_markers([1, 2], PAD, []) == [1, 2]


def test_inject_count_mismatch_is_a_bug():
    with pytest.raises(ValueError, match="2 image-pad runs"):
        inject_image_markers([PAD, 1, PAD], PAD, [b"x" * 32])


def test_swapped_image_changes_key_only_from_that_image_on():
    key = [1, 2, 5, PAD, PAD, 6, 9, 9]
    a = inject_image_markers(key, PAD, [hashlib.sha256(b"a").digest()])
    b = inject_image_markers(key, PAD, [hashlib.sha256(b"b").digest()])
    first_diff = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert first_diff == 5  # right after the pad run: everything before it still shares


def test_pad_runs_and_expansion():
    assert image_pad_runs([PAD, 1, PAD, PAD, 2, PAD], PAD) == [(0, 1), (2, 4), (5, 6)]
    assert expand_image_pads([1, PAD, 2, PAD, 3], PAD, [3, 2]) == [1, PAD, PAD, PAD, 2, PAD, PAD, 3]
    # Fewer runs than counts (e.g. a prefix of the conversation): only those are expanded.
    assert expand_image_pads([1, PAD, 2], PAD, [4, 9]) == [1, PAD, PAD, PAD, PAD, 2]
    with pytest.raises(ValueError):
        expand_image_pads([PAD, 1, PAD], PAD, [2])

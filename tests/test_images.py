"""prompt/images.py: extraction, safe decoding, identity markers (pure: PIL only, no MLX)."""
from __future__ import annotations

import base64
import hashlib
import io
import os

import numpy as np
import pytest
from PIL import Image

from mlxstack.prompt.images import (
    ImageError,
    ImageLimits,
    check_images,
    data_url_for,
    decode_data_url,
    expand_image_pads,
    extract_images,
    image_marker_tokens,
    image_pad_runs,
    inject_image_markers,
    markers_in,
    sniff_format,
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
    with pytest.raises(ImageError, match="format not accepted"):
        extract_images([user(openai_part(data_url(b"definitely not an image")))])
    truncated = png_bytes(5, (64, 64))[:120]  # a real PNG header, pixel data cut off
    with pytest.raises(ImageError, match=r"could not be decoded \(\w+\); send PNG, JPEG, WebP or GIF"):
        extract_images([user(openai_part(data_url(truncated)))])


def test_non_base64_data_url_refused():
    with pytest.raises(ImageError, match="base64"):
        extract_images([user(openai_part("data:image/png,rawbytes"))])


@pytest.mark.parametrize("url", ["file:///etc/passwd", "FILE:///etc/hosts", "/etc/passwd", "C:\\img.png",
                                 "relative/picture.png", "ftp://host/x.png"])
def test_local_paths_and_other_schemes_always_refused(url):
    # Even with remote URLs allowed, nothing may read the server's disk.
    with pytest.raises(ImageError, match=r"messages\[0\]\.content\[0\]: (file:// image URLs are refused|unsupported image URL)"):
        extract_images([user(openai_part(url))], ImageLimits(allow_remote=True))


def test_file_url_message_says_why():
    with pytest.raises(ImageError, match="server's disk"):
        extract_images([user(openai_part("file:///etc/passwd"))])


def test_remote_urls_refused_unless_enabled_and_never_fetched_here():
    # prompt/images.py does no network I/O: the HTTP layer replaces remote URLs with data: URLs.
    part = openai_part("https://example.com/cat.png")
    with pytest.raises(ImageError, match="ALLOW_REMOTE_IMAGE_URLS"):
        extract_images([user(part)], ImageLimits())
    with pytest.raises(ImageError, match="not fetched before the request was queued"):
        extract_images([user(part)], ImageLimits(allow_remote=True))
    import mlxstack.prompt.images as images_module
    source = open(images_module.__file__).read()
    assert "urllib" not in source and "socket" not in source and "http.client" not in source


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


def encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("fmt, expected", [("PNG", "PNG"), ("JPEG", "JPEG"), ("WEBP", "WEBP"), ("GIF", "GIF"),
                                           ("BMP", None), ("TIFF", None), ("ICO", None), ("PPM", None)])
def test_sniff_format_accepts_only_the_allow_list(fmt, expected):
    raw = encoded(Image.new("RGB", (8, 8), (10, 20, 30)), fmt)
    assert sniff_format(raw) == expected
    if expected:
        assert extract_images([user(openai_part(data_url(raw)))])[0].image.size == (8, 8)
    else:  # formats PIL could decode are refused too: only the allow-list is ever opened
        with pytest.raises(ImageError, match=r"format not accepted: send PNG, JPEG, WebP or GIF"):
            extract_images([user(openai_part(data_url(raw)))])


@pytest.mark.parametrize("raw", [
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n",        # EPS: PIL would run Ghostscript
    b"\xc5\xd0\xd3\xc6" + b"\x00" * 40,                                     # DOS EPS binary header
    b"8BPS\x00\x01" + b"\x00" * 40,                                           # Photoshop PSD
    b"<svg xmlns='http://www.w3.org/2000/svg' width='9' height='9'/>",
])
def test_dangerous_formats_refused_before_pil_opens_them(raw, monkeypatch):
    opened = []
    monkeypatch.setattr(Image, "open", lambda *a, **k: opened.append(a))  # a spy: must stay unused
    with pytest.raises(ImageError, match="format not accepted"):
        extract_images([user(openai_part(data_url(raw)))])
    assert opened == []


def test_gif_first_frame_only():
    frames = [Image.new("RGB", (6, 4), c) for c in ((255, 0, 0), (0, 0, 255), (0, 255, 0))]
    raw = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    image = extract_images([user(openai_part(data_url(raw)))])[0].image
    assert image.mode == "RGB" and image.size == (6, 4)
    assert image.getpixel((0, 0)) == (255, 0, 0)


def test_request_pixel_budget_counts_every_image_before_decoding(monkeypatch):
    # Three 100x100 images: 30,000 pixels. A budget of 25,000 refuses the third, naming it,
    # and no image is decoded (load_rgb is never reached).
    raws = [encoded(Image.new("RGB", (100, 100), (i, i, i)), "PNG") for i in range(3)]
    msgs = [user(*[openai_part(data_url(r)) for r in raws[:2]]), {"role": "assistant", "content": "ok"},
            user(openai_part(data_url(raws[2])))]
    import mlxstack.prompt.images as images_module
    decoded = []
    real = images_module.load_rgb
    monkeypatch.setattr(images_module, "load_rgb", lambda img, cap: decoded.append(img) or real(img, cap))
    with pytest.raises(ImageError, match=r"messages\[2\]\.content\[0\]: .*MAX_IMAGE_PIXELS_PER_REQUEST=25000"):
        extract_images(msgs, ImageLimits(max_request_pixels=25_000))
    assert decoded == []
    assert check_images(msgs, ImageLimits(max_request_pixels=30_000)) == 30_000
    assert len(extract_images(msgs, ImageLimits(max_request_pixels=30_000))) == 3 and len(decoded) == 3


def test_bomb_png_refused_by_request_budget_not_decoded():
    # The case: a few KB of PNG declaring a huge canvas, repeated in one request.
    bomb = encoded(Image.new("L", (6000, 6000)), "PNG")
    assert len(bomb) < 200_000
    msgs = [user(*[openai_part(data_url(bomb))] * 3)]
    with pytest.raises(ImageError, match=r"content\[1\].*MAX_IMAGE_PIXELS_PER_REQUEST"):
        check_images(msgs, ImageLimits(max_pixels=40_000_000, max_request_pixels=64_000_000))


def test_data_url_for_round_trips():
    raw = png_bytes(9)
    url = data_url_for(raw)
    assert url.startswith("data:image/png;base64,")
    assert decode_data_url(url, len(raw)) == raw
    assert data_url_for(b"xyz").startswith("data:application/octet-stream;base64,")


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

"""decode_rgb / encode on real image files made with PIL: odd modes, EXIF rotation, draft, bad data."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from lightray.data.images import BadImage, decode, decode_rgb, encode, resize_short


def _bytes(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _halves(w: int, h: int) -> Image.Image:
    """Left half red, right half blue: shows which way an image was turned."""
    arr = np.zeros((h, w, 3), np.uint8)
    arr[:, : w // 2] = (255, 0, 0)
    arr[:, w // 2:] = (0, 0, 255)
    return Image.fromarray(arr)


def _close(px: tuple, want: tuple, tol: int = 40) -> bool:
    return all(abs(int(a) - int(b)) <= tol for a, b in zip(px, want))


def test_grayscale_jpeg_becomes_rgb_with_equal_channels():
    img = Image.fromarray(np.tile(np.arange(0, 240, 4, dtype=np.uint8), (30, 1)), "L")
    out = decode_rgb(_bytes(img, "JPEG", quality=95), None)
    assert out.mode == "RGB" and out.size == (60, 30)
    arr = np.asarray(out).astype(int)
    assert np.array_equal(arr[..., 0], arr[..., 1]) and np.array_equal(arr[..., 1], arr[..., 2])


def test_cmyk_jpeg_becomes_rgb_with_right_colour():
    out = decode_rgb(_bytes(Image.new("CMYK", (40, 20), (0, 255, 255, 0)), "JPEG"), None)
    assert out.mode == "RGB"
    assert _close(out.getpixel((20, 10)), (255, 0, 0))


def test_palette_png_with_transparency_is_composited_on_white():
    img = Image.new("P", (20, 10), 0)
    img.putpalette([0, 0, 0] + [0, 200, 0] * 255)
    img.paste(1, (10, 0, 20, 10))  # right half opaque green, left half index 0 = transparent
    out = decode_rgb(_bytes(img, "PNG", transparency=0), None)
    assert out.mode == "RGB"
    assert out.getpixel((2, 5)) == (255, 255, 255)
    assert out.getpixel((15, 5)) == (0, 200, 0)


def test_plain_palette_png_keeps_its_colours():
    img = Image.new("P", (8, 8), 3)
    img.putpalette([0, 0, 0] * 3 + [10, 20, 30] + [0, 0, 0] * 252)
    assert decode_rgb(_bytes(img, "PNG"), None).getpixel((4, 4)) == (10, 20, 30)


def test_16bit_grayscale_png_is_scaled_not_clipped_to_white():
    arr = np.full((10, 20), 32768, np.uint16)
    arr[:, 10:] = 65535
    data = _bytes(Image.fromarray(arr), "PNG")
    assert Image.open(io.BytesIO(data)).mode.startswith("I")  # really a 16-bit file
    out = decode_rgb(data, None)
    assert out.mode == "RGB"
    assert _close(out.getpixel((2, 2)), (127, 127, 127), tol=2)
    assert out.getpixel((15, 2)) == (255, 255, 255)


def test_rgba_png_alpha_is_composited_on_white():
    img = Image.new("RGBA", (20, 10), (0, 0, 255, 0))
    img.paste((255, 0, 0, 255), (10, 0, 20, 10))
    out = decode_rgb(_bytes(img, "PNG"), None)
    assert out.mode == "RGB"
    assert out.getpixel((2, 5)) == (255, 255, 255)  # fully transparent blue shows as background
    assert out.getpixel((15, 5)) == (255, 0, 0)


@pytest.mark.parametrize("orientation,top_colour", [(6, (255, 0, 0)), (8, (0, 0, 255))])
def test_exif_rotated_jpeg_comes_out_upright(orientation, top_colour):
    stored = _halves(60, 40)  # landscape as stored; the camera says "turn it"
    exif = Image.Exif()
    exif[0x0112] = orientation
    res = decode(_bytes(stored, "JPEG", quality=95, exif=exif.tobytes()), None)
    assert res.image.size == (40, 60)  # portrait once upright
    assert (res.orig_width, res.orig_height) == (40, 60)
    assert _close(res.image.getpixel((20, 5)), top_colour)
    assert _close(res.image.getpixel((20, 55)), (255, 0, 0) if top_colour != (255, 0, 0) else (0, 0, 255))


def test_mirrored_exif_orientation_is_undone():
    exif = Image.Exif()
    exif[0x0112] = 2  # mirrored left-right
    out = decode_rgb(_bytes(_halves(60, 40), "JPEG", quality=95, exif=exif.tobytes()), None)
    assert out.size == (60, 40)
    assert _close(out.getpixel((5, 20)), (0, 0, 255)) and _close(out.getpixel((55, 20)), (255, 0, 0))


def test_large_jpeg_is_decoded_to_exact_short_side_and_reports_original_size():
    big = _halves(1600, 1200)
    res = decode(_bytes(big, "JPEG", quality=90), 64)
    assert res.image.size == (85, 64)  # 1600 * 64 / 1200 = 85.3
    assert (res.orig_width, res.orig_height) == (1600, 1200)
    assert _close(res.image.getpixel((10, 32)), (255, 0, 0)) and _close(res.image.getpixel((75, 32)), (0, 0, 255))


def test_draft_decode_matches_full_decode_closely():
    rng = np.random.default_rng(0)
    smooth = Image.fromarray((rng.random((12, 16, 3)) * 255).astype(np.uint8)).resize((1600, 1200),
                                                                                         Image.Resampling.BICUBIC)
    data = _bytes(smooth, "JPEG", quality=95)
    fast = np.asarray(decode_rgb(data, 96)).astype(float)
    full = np.asarray(resize_short(Image.open(io.BytesIO(data)).convert("RGB"), 96)).astype(float)
    assert fast.shape == full.shape == (96, 128, 3)
    assert np.abs(fast - full).mean() < 3.0


def test_small_image_is_upscaled_to_the_tier():
    out = decode_rgb(_bytes(_halves(30, 20), "PNG"), 64)
    assert out.size == (96, 64)


@pytest.mark.parametrize("make,reason", [
    (lambda jpg: b"", "zero-byte"),
    (lambda jpg: b"hello, this is a text file\n" * 10, "not an image"),
    (lambda jpg: jpg[: len(jpg) // 2], "truncated"),
    (lambda jpg: jpg[:-2], "truncated"),  # only the end-of-image marker missing: still rejected, never padded
    (lambda jpg: jpg[:200], ""),
])
def test_bad_data_raises_badimage_with_reason(make, reason):
    rng = np.random.default_rng(1)
    jpg = _bytes(Image.fromarray((rng.random((64, 80, 3)) * 255).astype(np.uint8)), "JPEG", quality=90)
    with pytest.raises(BadImage) as err:
        decode_rgb(make(jpg), 32)
    assert reason in err.value.reason and err.value.reason


def test_encode_raw_is_hwc_uint8_and_jpeg_round_trips():
    img = _halves(10, 6)
    raw = encode(img, "raw", 90)
    assert len(raw) == 6 * 10 * 3
    assert np.array_equal(np.frombuffer(raw, np.uint8).reshape(6, 10, 3), np.asarray(img))
    jpg = encode(img, "jpeg", 90)
    assert jpg[:2] == b"\xff\xd8"
    assert Image.open(io.BytesIO(jpg)).size == (10, 6)
    with pytest.raises(ValueError, match="'png'"):
        encode(img, "png", 90)

"""Decode any source image to upright 8-bit RGB at (about) the size needed, and re-encode it.

Speed: ImageNet originals average ~400x350 but run to 4000+ px; the shard tiers are 64..288 px. For
JPEG, PIL's draft mode asks libjpeg to do the IDCT at 1/2, 1/4 or 1/8 scale, so a big original is
decoded straight to the smallest size still >= the target, several times faster than a full decode
followed by a resize. Only then is the short side resampled to exactly ``target_short``.

Strictness: a truncated JPEG is rejected (``ImageFile.LOAD_TRUNCATED_IMAGES`` stays False), since a
silently grey-padded image is a wrong training sample that nobody ever finds.
"""

from __future__ import annotations

import io
import struct
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image

RESAMPLE = Image.Resampling.BICUBIC  # antialiased when shrinking (PIL scales the kernel); part of the cache key
ALPHA_BACKGROUND = (255, 255, 255)  # transparent pixels shown on white, as a browser would show them
_ORIENT_TAG = 0x0112
# EXIF orientation -> the transpose that makes the image upright.
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
FORMATS = ("jpeg", "raw")


class BadImage(ValueError):
    """The bytes are not a usable image; ``reason`` says why (recorded in bad_files.json)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class Decoded:
    image: Image.Image  # RGB, upright
    orig_width: int  # of the upright original, before any draft or resize
    orig_height: int


def short_side_size(width: int, height: int, short: int) -> tuple[int, int]:
    """(w, h) with the short side == ``short`` and the aspect ratio kept (rounded, at least 1 px)."""
    if width <= height:
        return short, max(1, round(height * short / width))
    return max(1, round(width * short / height)), short


def resize_short(img: Image.Image, short: int) -> Image.Image:
    """Resample so the short side is exactly ``short`` (no-op when it already is)."""
    size = short_side_size(img.width, img.height, short)
    if size == img.size:
        return img
    return img.resize(size, RESAMPLE)


def _to_rgb(img: Image.Image) -> Image.Image:
    mode = img.mode
    if mode == "RGB":
        return img
    if mode.startswith("I;16") or mode in ("I", "F"):
        # 16-bit (PNG/TIFF) and 32-bit grayscale: PIL's convert("RGB") clips at 255, which turns almost
        # every pixel white; scale the 16-bit range down instead.
        arr = np.asarray(img)
        if mode == "F":
            scale = 255.0 if float(np.nanmax(arr, initial=0.0)) <= 1.0 else 1.0
            arr8 = np.clip(np.nan_to_num(arr) * scale, 0, 255).astype(np.uint8)
        else:
            arr8 = np.clip(arr.astype(np.int64) // 257, 0, 255).astype(np.uint8)
        return Image.fromarray(arr8, "L").convert("RGB")
    if mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
        mode = "RGBA"
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGB", rgba.size, ALPHA_BACKGROUND)
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    try:
        return img.convert("RGB")  # L, 1, P, CMYK (PIL undoes Adobe's inverted CMYK), YCbCr, ...
    except (ValueError, OSError) as exc:
        raise BadImage(f"unsupported image mode {mode} ({exc})") from None


def decode(data: bytes, target_short: int | None) -> Decoded:
    """Like :func:`decode_rgb`, also returning the upright original's size."""
    if not data:
        raise BadImage("zero-byte file")
    try:
        with warnings.catch_warnings():
            # A DecompressionBombWarning is only a warning; the hard limit (2x) still raises below.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            orientation = 1
            try:
                orientation = int(img.getexif().get(_ORIENT_TAG, 1) or 1)
            except (ValueError, TypeError, KeyError, OSError, SyntaxError, struct.error):
                # A broken EXIF block is not a broken image: keep the pixels, skip the tag.
                orientation = 1
            width, height = img.size
            if orientation in (5, 6, 7, 8):
                width, height = height, width
            if target_short and img.format == "JPEG":
                # Ask for the smallest DCT scale whose result still has short side >= target_short.
                want_w, want_h = short_side_size(img.width, img.height, target_short)
                img.draft(img.mode if img.mode in ("RGB", "L", "CMYK") else None, (want_w, want_h))
            img.load()
    except BadImage:
        raise
    except Image.DecompressionBombError as exc:
        raise BadImage(f"too large ({exc})") from None
    except Image.UnidentifiedImageError:
        raise BadImage("not an image (no known image format in the bytes)") from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, struct.error) as exc:
        text = str(exc) or type(exc).__name__
        kind = "truncated" if "truncated" in text.lower() else "corrupt"
        raise BadImage(f"{kind} image data ({text})") from None
    if img.width < 1 or img.height < 1:
        raise BadImage(f"empty image ({img.width}x{img.height})")
    img = _to_rgb(img)
    if orientation in _TRANSPOSE:
        img = img.transpose(_TRANSPOSE[orientation])
    if target_short:
        img = resize_short(img, target_short)
    return Decoded(img, width, height)


def decode_rgb(data: bytes, target_short: int | None) -> Image.Image:
    """Decode image bytes to upright RGB with short side ``target_short`` (None = full size).

    JPEGs are decoded in draft mode (reduced-size IDCT) when that still leaves the short side at or
    above the target. EXIF orientation is applied; grayscale, palette, CMYK, 16-bit and alpha images
    become RGB (alpha composited on white). Raises BadImage for zero-byte, non-image, corrupt or
    truncated data.
    """
    return decode(data, target_short).image


def encode(img: Image.Image, fmt: str, quality: int = 90) -> bytes:
    """``jpeg``: baseline JPEG at ``quality``; ``raw``: HWC uint8 bytes (height*width*3)."""
    if img.mode != "RGB":
        img = _to_rgb(img)
    if fmt == "raw":
        return img.tobytes()  # PIL's RGB buffer is already row-major HWC uint8
    if fmt == "jpeg":
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=int(quality))
        return buf.getvalue()
    raise ValueError(f"format: bad value {fmt!r}; expected one of {', '.join(FORMATS)}")


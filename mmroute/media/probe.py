"""An image's decoded size from its container headers, never its pixels.

The size must be the one the engine's processor sees. vLLM 0.33
(``multimodal/media/image.py``, ``ImageMediaIO.load_bytes``) opens the bytes with
Pillow and applies ``ImageOps.exif_transpose`` (vLLM PR #44974, errors suppressed), so
EXIF orientations 5-8 swap width and height. Pillow's ``getexif`` reads the EXIF
block of JPEG (APP1), PNG (eXIf, or a "Raw profile type exif" text chunk) and WebP
(EXIF chunk) and falls back to an XMP ``tiff:Orientation``; we read the same places.
Sizes follow Pillow's plugins: PNG IHDR; JPEG the last SOFn before SOS; GIF the
logical screen grown to the first frame's extent; WebP the canvas (VP8X) or bitstream
size; BMP the DIB header (negative height = top-down).

Structural completeness is checked where it is cheap, because Pillow fails on truncated
files when the engine decodes them: the PNG chunks up to the end of the image data
are whole, a JPEG scan ends in EOI, the first GIF frame's sub-blocks are whole, the
WebP RIFF is whole, an uncompressed BMP holds all its rows. (Pillow is a little laxer
in the last bytes -- it needs no PNG zlib checksum -- which we cannot see without
inflating the pixels, so such a file is refused here.)
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass

from mmroute.media.errors import MediaError

# PIL's DecompressionBombError threshold (2 x Image.MAX_IMAGE_PIXELS): Pillow, and so
# the engine, refuses images above it.
DEFAULT_MAX_PIXELS = 178_956_970
_MAX_TEXT = 1 << 20  # cap on a decompressed PNG text chunk (Pillow's MAX_TEXT_CHUNK)
_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')


@dataclass(frozen=True)
class ImageInfo:
    width: int  # as decoded by the engine (after EXIF orientation)
    height: int
    format: str  # Pillow's format name: PNG, JPEG, GIF, WEBP, BMP
    orientation: int = 1  # the EXIF orientation applied (1: none)

    @property
    def mime(self) -> str:
        return "image/" + self.format.lower()


class _Truncated(Exception):
    pass


def _u16be(b: bytes, i: int) -> int:
    if i + 2 > len(b):
        raise _Truncated
    return (b[i] << 8) | b[i + 1]


def _u16le(b: bytes, i: int) -> int:
    if i + 2 > len(b):
        raise _Truncated
    return b[i] | (b[i + 1] << 8)


def _u32be(b: bytes, i: int) -> int:
    if i + 4 > len(b):
        raise _Truncated
    return struct.unpack_from(">I", b, i)[0]


def _u32le(b: bytes, i: int) -> int:
    if i + 4 > len(b):
        raise _Truncated
    return struct.unpack_from("<I", b, i)[0]


# ---- EXIF / XMP orientation ------------------------------------------------------------


def exif_orientation(exif: bytes) -> int | None:
    """The IFD0 Orientation (tag 0x0112) of a TIFF-structured EXIF block, or None when
    absent or malformed (vLLM suppresses Pillow's errors there: no transpose)."""
    if exif.startswith(b"Exif\x00\x00"):
        exif = exif[6:]
    try:
        order = exif[:2]
        if order == b"II":
            fmt = "<"
        elif order == b"MM":
            fmt = ">"
        else:
            return None
        if len(exif) < 8 or struct.unpack_from(fmt + "H", exif, 2)[0] != 42:
            return None
        ifd = struct.unpack_from(fmt + "I", exif, 4)[0]
        count = struct.unpack_from(fmt + "H", exif, ifd)[0]
        for k in range(count):
            entry = ifd + 2 + 12 * k
            tag, typ, n = struct.unpack_from(fmt + "HHI", exif, entry)
            if tag != 0x0112:
                continue
            if n != 1:
                return None  # Pillow yields a tuple: no transpose
            code = {1: "B", 3: "H", 4: "I", 6: "b", 8: "h", 9: "i"}.get(typ)
            if code is None:
                return None
            return int(struct.unpack_from(fmt + code, exif, entry + 8)[0])
    except struct.error:
        return None
    return None


def xmp_orientation(xmp: bytes) -> int | None:
    m = _XMP_ORIENTATION.search(xmp)
    return int(m.group(2)) if m else None


def _orientation(exif: bytes | None, xmp: bytes | None) -> int:
    value = exif_orientation(exif) if exif is not None else None
    if value is None and xmp is not None:
        value = xmp_orientation(xmp)
    return value if value is not None else 1


# ---- formats ----------------------------------------------------------------------------


def _guard(width: int, height: int, max_pixels: int | None) -> None:
    """Refuse a decompression bomb as soon as its header claims the size."""
    if max_pixels is not None and width * height > max_pixels:
        raise MediaError(
            400,
            "image_too_large",
            f"image of {width}x{height} pixels exceeds the limit of {max_pixels} pixels",
        )


def _png(data: bytes, limit: int | None) -> tuple[int, int, bytes | None, bytes | None]:
    if _u32be(data, 8) != 13 or data[12:16] != b"IHDR":
        raise MediaError(400, "invalid_image", "invalid PNG: the first chunk is not IHDR")
    ihdr = data[12:29]
    if len(data) < 33:
        raise _Truncated
    if zlib.crc32(ihdr) != _u32be(data, 29):
        raise MediaError(400, "invalid_image", "invalid PNG: IHDR checksum mismatch")
    width, height = _u32be(data, 16), _u32be(data, 20)
    _guard(width, height, limit)
    exif: bytes | None = None
    raw_exif: bytes | None = None
    xmp: bytes | None = None
    pos, seen_idat = 33, False
    while True:
        # Pillow decodes once the image data is whole: it needs neither IEND nor the
        # last IDAT's CRC, and stops reading at a damaged chunk after the data.
        if pos + 8 > len(data):
            if seen_idat:
                break
            raise _Truncated
        length = _u32be(data, pos)
        ctype = data[pos + 4 : pos + 8]
        body_start, body_end = pos + 8, pos + 8 + length
        if body_end > len(data):
            if seen_idat and ctype != b"IDAT":
                break
            raise _Truncated
        if ctype == b"IDAT":
            seen_idat = True
        if body_end + 4 > len(data):
            if seen_idat:
                break
            raise _Truncated
        if ctype == b"IEND":
            break
        if ctype == b"eXIf":
            exif = data[body_start:body_end]
        elif ctype in (b"tEXt", b"zTXt", b"iTXt"):
            key, value = _png_text(ctype, data[body_start:body_end])
            if key == b"Raw profile type exif" and value is not None:
                raw_exif = value
            elif key == b"XML:com.adobe.xmp" and value is not None:
                xmp = value
        pos = body_end + 4
    if not seen_idat:
        raise MediaError(400, "invalid_image", "invalid PNG: no image data (IDAT)")
    if exif is None and raw_exif is not None:
        # Pillow: the hex dump after the third line of an ImageMagick raw profile.
        try:
            exif = bytes.fromhex("".join(raw_exif.decode("latin-1").split("\n")[3:]))
        except ValueError:
            exif = None
    return width, height, exif, xmp


def _inflate(blob: bytes) -> bytes | None:
    try:
        d = zlib.decompressobj()
        out = d.decompress(blob, _MAX_TEXT)
        return out if not d.unconsumed_tail else None
    except zlib.error:
        return None


def _png_text(ctype: bytes, body: bytes) -> tuple[bytes, bytes | None]:
    key, sep, rest = body.partition(b"\x00")
    if not sep:
        return key, None
    if ctype == b"tEXt":
        return key, rest
    if ctype == b"zTXt":
        return key, _inflate(rest[1:]) if rest[:1] == b"\x00" else None
    # iTXt: compression flag, method, language\0, translated keyword\0, text
    if len(rest) < 2:
        return key, None
    flag, tail = rest[0], rest[2:]
    parts = tail.split(b"\x00", 2)
    if len(parts) < 3:
        return key, None
    text = parts[2]
    return key, (_inflate(text) if flag else text)


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg(data: bytes, limit: int | None) -> tuple[int, int, bytes | None, bytes | None]:
    size: tuple[int, int] | None = None
    exif: bytes | None = None
    xmp: bytes | None = None
    i, n = 2, len(data)
    while True:
        if i >= n:
            raise _Truncated
        if data[i] != 0xFF:  # Pillow skips junk between segments
            i += 1
            continue
        if i + 1 >= n:
            raise _Truncated
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x00 or marker == 0x01 or 0xD0 <= marker <= 0xD9:
            if marker == 0xD9:
                raise MediaError(400, "invalid_image", "invalid JPEG: no image before the end marker")
            i += 2
            continue
        if marker == 0xDA:  # start of scan: headers are over
            break
        length = _u16be(data, i + 2)
        if length < 2 or i + 2 + length > n:
            raise _Truncated
        seg = data[i + 4 : i + 2 + length]
        if marker in _SOF:
            if len(seg) < 5:
                raise _Truncated
            size = (_u16be(seg, 3), _u16be(seg, 1))
            _guard(size[0], size[1], limit)
        elif marker == 0xE1:
            if seg.startswith(b"Exif\x00\x00"):
                exif = seg if exif is None else exif + seg[6:]
            elif seg.startswith(b"http://ns.adobe.com/xap/1.0/\x00"):
                xmp = seg.split(b"\x00", 1)[1]
        i += 2 + length
    if size is None:
        raise MediaError(400, "invalid_image", "invalid JPEG: no frame header (SOF) before the scan")
    if data.find(b"\xff\xd9", i) < 0:
        raise _Truncated
    return size[0], size[1], exif, xmp


def _gif_skip_blocks(data: bytes, i: int, eof_ends: bool = False) -> int:
    """Skip a chain of data sub-blocks; return the index after the terminator.
    ``eof_ends``: the data may stop where the next block size would be (Pillow decodes a
    frame whose terminator and trailer are missing)."""
    blocks = 0
    while True:
        if i >= len(data):
            if eof_ends and blocks:
                return i
            raise _Truncated
        size = data[i]
        i += 1
        if size == 0:
            return i
        if i + size > len(data):
            raise _Truncated
        i += size
        blocks += 1


def _gif(data: bytes, limit: int | None) -> tuple[int, int]:
    width, height = _u16le(data, 6), _u16le(data, 8)
    _guard(width, height, limit)
    if len(data) < 13:
        raise _Truncated
    flags = data[10]
    i = 13 + ((3 << ((flags & 7) + 1)) if flags & 0x80 else 0)
    while True:
        if i >= len(data):
            raise _Truncated
        block = data[i]
        if block == 0x3B:  # trailer before any image
            raise MediaError(400, "invalid_image", "invalid GIF: no image in the file")
        if block == 0x21:  # extension: label, then sub-blocks
            i = _gif_skip_blocks(data, i + 2)
            continue
        if block != 0x2C:  # Pillow ignores stray bytes here
            i += 1
            continue
        x, y, w, h = (_u16le(data, i + 1 + 2 * k) for k in range(4))
        if i + 10 > len(data):
            raise _Truncated
        lflags = data[i + 9]
        i += 10 + ((3 << ((lflags & 7) + 1)) if lflags & 0x80 else 0)
        if i >= len(data):
            raise _Truncated
        _gif_skip_blocks(data, i + 1, eof_ends=True)  # LZW minimum code size, then the frame data
        # Pillow grows the canvas to the first frame's extent.
        return max(width, x + w), max(height, y + h)


def _webp(data: bytes, limit: int | None) -> tuple[int, int, bytes | None, bytes | None]:
    riff_size = _u32le(data, 4)
    end = 8 + riff_size
    if riff_size < 4 or riff_size % 2:
        raise MediaError(400, "invalid_image", "invalid WebP: bad RIFF size")
    if len(data) < end:
        raise _Truncated
    first = data[12:16]
    payload = data[20:end]
    exif: bytes | None = None
    xmp: bytes | None = None
    if first == b"VP8 ":
        if len(payload) < 10:
            raise _Truncated
        if payload[3:6] != b"\x9d\x01\x2a":
            raise MediaError(400, "invalid_image", "invalid WebP: bad VP8 start code")
        width, height = _u16le(payload, 6) & 0x3FFF, _u16le(payload, 8) & 0x3FFF
    elif first == b"VP8L":
        if len(payload) < 5:
            raise _Truncated
        if payload[0] != 0x2F:
            raise MediaError(400, "invalid_image", "invalid WebP: bad VP8L signature")
        bits = _u32le(payload, 1)
        width, height = (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    else:  # VP8X: canvas size, then the chunks that hold the image and metadata
        if len(payload) < 10:
            raise _Truncated
        width = (payload[4] | payload[5] << 8 | payload[6] << 16) + 1
        height = (payload[7] | payload[8] << 8 | payload[9] << 16) + 1
    _guard(width, height, limit)
    pos, has_image = 12, first != b"VP8X"
    while pos < end:
        if pos + 8 > end:
            raise _Truncated
        fourcc = data[pos : pos + 4]
        size = _u32le(data, pos + 4)
        body_end = pos + 8 + size
        if body_end > end:
            raise _Truncated
        if fourcc in (b"VP8 ", b"VP8L", b"ANMF"):
            has_image = True
        elif fourcc == b"EXIF" and exif is None:
            exif = data[pos + 8 : body_end]
        elif fourcc == b"XMP " and xmp is None:
            xmp = data[pos + 8 : body_end]
        pos = body_end + (size & 1)
    if not has_image:
        raise MediaError(400, "invalid_image", "invalid WebP: no image data")
    return width, height, exif, xmp


def _bmp(data: bytes, limit: int | None) -> tuple[int, int]:
    offset = _u32le(data, 10)
    header = _u32le(data, 14)
    if header == 12:
        width, height = _u16le(data, 18), _u16le(data, 20)
        bits, compression = _u16le(data, 24), 0
    elif header in (40, 52, 56, 64, 108, 124):
        width = _u32le(data, 18)
        raw_h = _u32le(data, 22)
        height = 2**32 - raw_h if data[25] == 0xFF else raw_h  # top-down rows
        bits, compression = _u16le(data, 28), _u32le(data, 30)
    else:
        raise MediaError(400, "invalid_image", f"invalid BMP: unsupported header size {header}")
    _guard(width, height, limit)
    if compression in (0, 3) and width > 0 and bits > 0:  # uncompressed rows: check they are all there
        stride = ((width * bits + 31) >> 3) & ~3
        if offset + stride * height > len(data):
            raise _Truncated
    return width, height


def _sniff(data: bytes) -> str | None:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP" and data[12:16] in (b"VP8 ", b"VP8L", b"VP8X"):
        return "WEBP"
    if data.startswith(b"BM"):
        return "BMP"
    return None


def image_size(data: bytes, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> ImageInfo:
    """Width/height as the engine decodes them (EXIF orientation applied), from headers.
    Raises MediaError 400 for unknown formats, truncated or corrupt headers, and images
    whose width*height exceeds ``max_pixels`` (a decompression bomb)."""
    fmt = _sniff(data)
    if fmt is None:
        raise MediaError(
            400, "invalid_image", "unrecognised image data (supported: PNG, JPEG, GIF, WebP, BMP)"
        )
    exif = xmp = None
    try:
        if fmt == "PNG":
            width, height, exif, xmp = _png(data, max_pixels)
        elif fmt == "JPEG":
            width, height, exif, xmp = _jpeg(data, max_pixels)
        elif fmt == "GIF":
            width, height = _gif(data, max_pixels)
        elif fmt == "WEBP":
            width, height, exif, xmp = _webp(data, max_pixels)
        else:
            width, height = _bmp(data, max_pixels)
    except _Truncated:
        raise MediaError(400, "invalid_image", f"invalid {fmt} image: the data is truncated") from None
    if width <= 0 or height <= 0:
        raise MediaError(400, "invalid_image", f"invalid {fmt} image: size {width}x{height}")
    _guard(width, height, max_pixels)  # the GIF canvas may have grown
    orientation = _orientation(exif, xmp)
    if orientation in (5, 6, 7, 8):
        width, height = height, width
    return ImageInfo(width, height, fmt, orientation)

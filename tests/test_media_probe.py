"""Header-only image sizing against Pillow (the engine's decoder) on real encoded images."""

from __future__ import annotations

import io
import random
import struct
import zlib

import pytest
from PIL import Image, ImageOps, PngImagePlugin

from mmroute.errors import RouterError
from mmroute.media.errors import MediaError
from mmroute.media.probe import ImageInfo, exif_orientation, image_size


def encode(fmt: str, size: tuple[int, int], mode: str = "RGB", **kw) -> bytes:
    color = {"RGB": (200, 30, 60), "RGBA": (1, 2, 3, 100), "L": 90, "P": 3, "1": 1}[mode]
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, fmt, **kw)
    return buf.getvalue()


def pillow_size(data: bytes) -> tuple[int, int]:
    """What vLLM 0.33's ImageMediaIO.load_bytes ends up with: open + exif_transpose."""
    with Image.open(io.BytesIO(data)) as im:
        return ImageOps.exif_transpose(im).size


def png_chunk(ctype: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + ctype + body + struct.pack(">I", zlib.crc32(ctype + body))


def png_header_only(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(b"")) + png_chunk(b"IEND", b"")


SIZES = [(1, 1), (37, 23), (640, 480), (1, 3000), (3000, 1), (333, 777)]
VARIANTS = [
    ("PNG", "RGB", {}),
    ("PNG", "RGBA", {}),
    ("PNG", "P", {}),
    ("PNG", "1", {}),
    ("JPEG", "RGB", {}),
    ("JPEG", "L", {"progressive": True}),
    ("GIF", "P", {}),
    ("WEBP", "RGB", {"lossless": True}),
    ("WEBP", "RGBA", {"lossless": False}),
    ("WEBP", "RGB", {"quality": 50}),
    ("BMP", "RGB", {}),
    ("BMP", "1", {}),
    ("BMP", "P", {}),
]


@pytest.mark.parametrize("fmt,mode,kw", VARIANTS)
@pytest.mark.parametrize("size", SIZES)
def test_sizes_equal_pillow(fmt, mode, kw, size):
    data = encode(fmt, size, mode, **kw)
    info = image_size(data)
    with Image.open(io.BytesIO(data)) as im:
        assert (info.width, info.height) == im.size == size
        assert info.format == im.format == fmt
    assert info.orientation == 1 and info.mime == f"image/{fmt.lower()}"


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_like_exif_transpose(fmt, orientation):
    im = Image.new("RGB", (40, 20), (10, 20, 30))
    exif = im.getexif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    im.save(buf, fmt, exif=exif)
    data = buf.getvalue()
    info = image_size(data)
    assert info.orientation == orientation
    assert (info.width, info.height) == pillow_size(data)
    assert (info.width, info.height) == ((20, 40) if orientation >= 5 else (40, 20))


def test_big_endian_exif_and_other_tags():
    # Hand-built TIFF block: big-endian, two tags before Orientation, LONG-typed value.
    entries = [(0x010F, 2, 4, b"abc\x00"), (0x0110, 2, 4, b"xyz\x00"), (0x0112, 4, 1, struct.pack(">I", 6))]
    ifd = struct.pack(">H", len(entries)) + b"".join(struct.pack(">HHI", t, ty, n) + v for t, ty, n, v in entries)
    tiff = b"MM\x00\x2a" + struct.pack(">I", 8) + ifd + b"\x00\x00\x00\x00"
    assert exif_orientation(b"Exif\x00\x00" + tiff) == 6
    assert exif_orientation(tiff) == 6
    im = Image.new("RGB", (30, 10))
    buf = io.BytesIO()
    im.save(buf, "JPEG", exif=b"Exif\x00\x00" + tiff)
    data = buf.getvalue()
    assert (image_size(data).width, image_size(data).height) == pillow_size(data) == (10, 30)


@pytest.mark.parametrize("blob", [b"", b"Exif\x00\x00", b"II*\x00\xff\xff\xff\x7f", b"MM\x00*\x00\x00\x00\x08\x00\x05", b"junkjunk"])
def test_malformed_exif_means_no_transpose(blob):
    assert exif_orientation(blob) is None


def test_jpeg_xmp_orientation():
    xmp = b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:Description tiff:Orientation="8"/></x:xmpmeta>'
    buf = io.BytesIO()
    Image.new("RGB", (50, 20)).save(buf, "JPEG", xmp=xmp)
    data = buf.getvalue()
    info = image_size(data)
    assert info.orientation == 8 and (info.width, info.height) == pillow_size(data) == (20, 50)


def test_png_xmp_and_raw_profile_exif():
    xmp = '<x:xmpmeta><rdf:Description><tiff:Orientation>6</tiff:Orientation></rdf:Description></x:xmpmeta>'
    meta = PngImagePlugin.PngInfo()
    meta.add_itxt("XML:com.adobe.xmp", xmp, zip=True)
    buf = io.BytesIO()
    Image.new("RGB", (50, 20)).save(buf, "PNG", pnginfo=meta)
    data = buf.getvalue()
    assert (image_size(data).width, image_size(data).height) == pillow_size(data) == (20, 50)

    exif = Image.Exif()
    exif[0x0112] = 5
    raw = exif.tobytes()
    meta = PngImagePlugin.PngInfo()
    meta.add_text("Raw profile type exif", f"\nexif\n{len(raw):8}\n{raw.hex()}\n", zip=True)
    buf = io.BytesIO()
    Image.new("RGB", (50, 20)).save(buf, "PNG", pnginfo=meta)
    data = buf.getvalue()
    assert (image_size(data).width, image_size(data).height) == pillow_size(data) == (20, 50)


def test_png_exif_after_idat():
    data = encode("PNG", (30, 12))
    exif = Image.Exif()
    exif[0x0112] = 6
    iend = data.rindex(b"IEND") - 4
    data = data[:iend] + png_chunk(b"eXIf", exif.tobytes()) + data[iend:]
    assert (image_size(data).width, image_size(data).height) == pillow_size(data) == (12, 30)


def test_gif_first_frame_grows_canvas():
    # Logical screen 10x10, first frame at (5, 5) of 10x10: Pillow reports 15x15.
    gif = (
        b"GIF89a" + struct.pack("<HH", 10, 10) + b"\x80\x00\x00" + b"\x00\x00\x00\xff\xff\xff"
        + b"!\xf9\x04\x00\x00\x00\x00\x00"
        + b"," + struct.pack("<HHHH", 5, 5, 10, 10) + b"\x00"
        + b"\x02\x02\x44\x01\x00" + b";"
    )
    with Image.open(io.BytesIO(gif)) as im:
        assert im.size == (15, 15)
    assert (image_size(gif).width, image_size(gif).height) == (15, 15)


def test_animated_webp_and_gif():
    frames = [Image.new("RGB", (64, 48), c) for c in ((255, 0, 0), (0, 255, 0))]
    for fmt in ("WEBP", "GIF"):
        buf = io.BytesIO()
        frames[0].save(buf, fmt, save_all=True, append_images=frames[1:], duration=100)
        data = buf.getvalue()
        with Image.open(io.BytesIO(data)) as im:
            assert getattr(im, "n_frames", 1) == 2
            assert (image_size(data).width, image_size(data).height) == im.size == (64, 48)


def test_bmp_top_down_and_os2():
    data = bytearray(encode("BMP", (21, 13)))
    height = struct.unpack_from("<i", data, 22)[0]
    struct.pack_into("<i", data, 22, -height)  # top-down rows
    with Image.open(io.BytesIO(bytes(data))) as im:
        assert im.size == (21, 13)
    assert (image_size(bytes(data)).width, image_size(bytes(data)).height) == (21, 13)
    # OS/2 1.x core header (12 bytes): 24-bit, 3x2, rows padded to 4 bytes
    rows = (b"\x00" * 9 + b"\x00" * 3) * 2
    core = b"BM" + struct.pack("<IHHI", 14 + 12 + len(rows), 0, 0, 26) + struct.pack("<IHHHH", 12, 3, 2, 1, 24) + rows
    with Image.open(io.BytesIO(core)) as im:
        assert im.size == (3, 2)
    assert (image_size(core).width, image_size(core).height) == (3, 2)


def pillow_decodes(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
        return True
    except Exception:
        return False


@pytest.mark.parametrize("fmt,mode,kw", VARIANTS)
def test_truncated_images_are_400(fmt, mode, kw):
    """Every prefix of a real file: a prefix we accept, Pillow decodes (no truncated
    header or image slips through). Pillow is a little laxer near the very end (it needs
    neither a PNG's zlib checksum nor the last bytes of some BMP rows), so we may refuse
    a prefix it decodes only within the final bytes of the data."""
    data = encode(fmt, (64, 48), mode, **kw)
    cuts = sorted(set(range(0, min(len(data), 300))) | set(range(0, len(data), max(1, len(data) // 97))))
    refused = 0
    for cut in cuts:
        try:
            info = image_size(data[:cut])
        except MediaError as exc:
            assert exc.status == 400 and exc.code == "invalid_image", cut
            if pillow_decodes(data[:cut]):
                assert len(data) - cut <= 64, f"{fmt}: Pillow decodes a {cut}-byte prefix we refuse"
            refused += 1
        else:
            assert pillow_decodes(data[:cut]), f"{fmt}: a {cut}-byte prefix passes but Pillow fails"
            assert (info.width, info.height) == (64, 48)
    assert refused >= len(cuts) - 17  # a PNG decodes without its last CRC and IEND
    assert image_size(data).width == 64


def test_wrong_types_are_400():
    for blob in (b"", b"hello world, not an image", b"%PDF-1.7\n...", bytes(range(256)), b"<svg xmlns='x'/>"):
        with pytest.raises(MediaError) as ei:
            image_size(blob)
        assert ei.value.status == 400 and ei.value.code == "invalid_image"
        assert "unrecognised" in ei.value.message


def test_fuzzed_headers_never_crash():
    rng = random.Random(1234)
    magics = [b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a", b"RIFF\x00\x00\x00\x00WEBPVP8X", b"RIFF\x20\x00\x00\x00WEBPVP8 ", b"BM"]
    seeds = [encode(f, (17, 9), m, **k) for f, m, k in VARIANTS]
    for _ in range(3000):
        if rng.random() < 0.5:
            blob = rng.choice(magics) + rng.randbytes(rng.randint(0, 80))
        else:
            blob = bytearray(rng.choice(seeds))
            for _ in range(rng.randint(1, 6)):
                blob[rng.randrange(len(blob))] = rng.randrange(256)
            blob = bytes(blob)
        try:
            info = image_size(blob)
        except MediaError as exc:
            assert exc.status == 400
        else:
            assert isinstance(info, ImageInfo) and info.width > 0 and info.height > 0


def test_decompression_bomb_header():
    bomb = png_header_only(100_000, 100_000)
    assert len(bomb) < 80
    with pytest.raises(Image.DecompressionBombError):
        Image.open(io.BytesIO(bomb))  # the engine's decoder refuses it too
    with pytest.raises(MediaError) as ei:
        image_size(bomb)
    assert ei.value.status == 400 and ei.value.code == "image_too_large"
    assert "100000x100000" in ei.value.message
    assert isinstance(ei.value, RouterError) and ei.value.body()["error"]["code"] == "image_too_large"


def test_configured_pixel_limit():
    data = encode("PNG", (200, 100))
    with pytest.raises(MediaError) as ei:
        image_size(data, max_pixels=19_999)
    assert ei.value.code == "image_too_large"
    assert image_size(data, max_pixels=20_000).width == 200
    assert image_size(png_header_only(100_000, 100_000), max_pixels=None).width == 100_000


def test_corrupt_png_header():
    data = bytearray(png_header_only(10, 10))
    data[20] ^= 0xFF  # height byte, CRC no longer matches
    with pytest.raises(MediaError) as ei:
        image_size(bytes(data))
    assert ei.value.code == "invalid_image" and "checksum" in ei.value.message
    with pytest.raises(MediaError):
        image_size(png_header_only(0, 10))

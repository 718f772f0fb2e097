"""Header parsers: the size Pillow reports, for every allowed format, without decoding.

Each generated or hand-built file is checked against ``Image.open(...).size``
(exact equality); malformed headers raise ``HeaderError`` with a message that
says what is wrong; mutated files never raise anything else.
"""

from __future__ import annotations

import io
import struct
import warnings
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from images import make_image
from PIL import Image

from kimi_encoder import headers
from kimi_encoder.headers import FORMATS, HeaderError, detect_format, header_size

SIZES = [(1, 1), (37, 23), (2, 301), (517, 3)]
SAVABLE = {
    "PNG": ["1", "L", "LA", "P", "P-trns-index", "P-trns-bytes", "RGB", "RGB-trns", "RGBA", "I;16"],
    "JPEG": ["1", "L", "RGB", "CMYK"],
    "WEBP": ["L", "LA", "P", "RGB", "RGBA", "CMYK"],
    "GIF": ["1", "L", "LA", "P", "P-trns-index", "RGB", "RGBA", "I;16"],
    "BMP": ["1", "L", "P", "P-trns-bytes", "RGB", "RGBA"],
    "TIFF": ["1", "L", "LA", "P", "P-trns-bytes", "RGB", "RGBA", "CMYK", "I;16", "I", "F"],
}


def saved(img: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **options)
    return buf.getvalue()


def assert_matches_pillow(data: bytes) -> tuple[int, int]:
    """Our format and size equal Pillow's for ``data``; the size."""
    fmt = detect_format(data)
    assert fmt in FORMATS
    with Image.open(io.BytesIO(data)) as img:
        pillow = ("JPEG" if img.format == "MPO" else img.format), img.size
    assert (fmt, header_size(data, fmt)) == pillow
    return pillow[1]


# ---------------------------------------------------------------- files Pillow writes


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
@pytest.mark.parametrize(
    ("fmt", "mode"),
    [(f, m) for f, modes in SAVABLE.items() for m in modes],
    ids=[f"{f}-{m}" for f, modes in SAVABLE.items() for m in modes],
)
def test_every_mode_matches_pillow(fmt, mode, size):
    assert assert_matches_pillow(saved(make_image(mode, size), fmt)) == size


RGB = make_image("RGB", (301, 203))
ICC = bytes(range(256)) * 600  # 150 KB: split over several APP2 segments
EXIF = Image.Exif()
EXIF[0x010E] = "x" * 40_000  # ImageDescription: a 40 KB APP1 segment before the frame header
OPTIONS = [
    ("JPEG", {"progressive": True}),
    ("JPEG", {"progressive": True, "optimize": True, "quality": 5}),
    ("JPEG", {"subsampling": 0, "quality": 95}),
    ("JPEG", {"subsampling": 2, "restart_marker_blocks": 1}),
    ("JPEG", {"icc_profile": ICC, "exif": EXIF, "comment": b"hello", "dpi": (300, 300)}),
    ("MPO", {"save_all": True, "append_images": [make_image("RGB", (64, 32))]}),
    ("PNG", {"optimize": True}),
    ("PNG", {"icc_profile": ICC, "exif": EXIF}),
    ("WEBP", {"lossless": True}),
    ("WEBP", {"quality": 1, "method": 6}),
    ("WEBP", {"icc_profile": ICC, "exif": EXIF}),  # extended format: VP8X
    ("GIF", {"interlace": False, "comment": b"x" * 1000}),
    ("GIF", {"optimize": True}),
    ("TIFF", {"compression": "tiff_lzw"}),
    ("TIFF", {"compression": "tiff_adobe_deflate"}),
    ("TIFF", {"compression": "packbits"}),
    ("TIFF", {"compression": "jpeg"}),
    ("TIFF", {"big_tiff": True}),
    ("TIFF", {"tiffinfo": {274: 6}}),  # Orientation 6: Pillow reports the size transposed
    ("TIFF", {"tiffinfo": {274: 3}}),
    ("BMP", {}),
]


@pytest.mark.parametrize(
    ("fmt", "options"), OPTIONS, ids=[f"{f}-{'-'.join(o) or 'plain'}" for f, o in OPTIONS]
)
def test_encoder_options_match_pillow(fmt, options):
    assert_matches_pillow(saved(RGB, fmt, **options))


def test_tiff_orientation_swaps_the_size_as_pillow_does():
    assert assert_matches_pillow(saved(RGB, "TIFF", tiffinfo={274: 8})) == (203, 301)


def test_big_endian_tiff():
    data = saved(make_image("I;16", (40, 7)).convert("I;16B"), "TIFF")
    assert data.startswith(b"MM\x00*")
    assert assert_matches_pillow(data) == (40, 7)


def test_multi_page_files_report_the_first_page():
    for fmt in ("TIFF", "GIF", "WEBP", "PNG"):  # PNG: an APNG
        sizes = [(33, 21)] * 3 if fmt == "WEBP" else [(33, 21), (90, 80), (5, 4)]
        pages = [make_image("RGB", size, seed) for seed, size in enumerate(sizes)]
        data = saved(pages[0], fmt, save_all=True, append_images=pages[1:])
        with Image.open(io.BytesIO(data)) as img:
            assert getattr(img, "n_frames", 1) == 3, fmt
        assert_matches_pillow(data)


# ---------------------------------------------------------------- files built by hand


def jpeg_with_frame_marker(marker: int) -> bytes:
    data = saved(RGB, "JPEG")
    return data.replace(b"\xff\xc0", bytes([0xFF, marker]), 1)


@pytest.mark.parametrize(
    "marker", [0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF, 0xDE]
)
def test_every_jpeg_frame_marker(marker):
    assert assert_matches_pillow(jpeg_with_frame_marker(marker)) == (301, 203)


def test_jpeg_fill_bytes_stray_bytes_and_many_segments():
    data = saved(RGB, "JPEG")
    comments = b"".join(b"\xff\xfe\x00\x05abc" for _ in range(5000))
    odd = data[:2] + comments + b"junk\xff\x00\xff\xff\xff" + data[2:]
    assert assert_matches_pillow(odd) == (301, 203)


def test_jpeg_cut_after_the_frame_header_keeps_its_size():
    data = saved(RGB, "JPEG")
    assert assert_matches_pillow(data[: data.index(b"\xff\xda")]) == (301, 203)


def bmp(header: int, width: int, height: int, bits: int = 24) -> bytes:
    """A zero-pixel BMP with a ``header``-byte info header (12: OS/2 core); height < 0: top-down."""
    row = (width * bits + 31) // 32 * 4
    pixels = bytes(row * abs(height))
    if header == 12:
        info = struct.pack("<IHHHH", 12, width, height, 1, bits)
        palette = bytes(3 << bits) if bits <= 8 else b""
    else:
        info = struct.pack("<IiiHHII", header, width, height, 1, bits, 0, len(pixels))
        info = info.ljust(header, b"\0")
        palette = bytes(4 << bits) if bits <= 8 else b""
    offset = 14 + header + len(palette)
    head = b"BM" + struct.pack("<IHHI", offset + len(pixels), 0, 0, offset)
    return head + info + palette + pixels


BMP_CASES = [
    (header, height, bits)
    for header in (12, 40, 52, 56, 64, 108, 124)
    for height in ((13,) if header == 12 else (13, -13))  # the OS/2 core height is unsigned
    for bits in (8, 24, 32)
]


@pytest.mark.parametrize(
    ("header", "height", "bits"), BMP_CASES, ids=[f"{h}-bytes-{y}-{b}-bit" for h, y, b in BMP_CASES]
)
def test_every_bmp_header_version(header, height, bits):
    data = bmp(header, 7, height, bits)
    with Image.open(io.BytesIO(data)) as img:
        img.load()  # a complete, valid file, not just a header
    assert assert_matches_pillow(data) == (7, 13)


TIFF_TYPES = {"SHORT": (3, "H"), "LONG": (4, "I")}


def tiff(order: bytes, width: int, height: int, kind: str = "LONG", orientation: int = 0) -> bytes:
    """An uncompressed 8-bit grayscale TIFF with its size tags of type ``kind``."""
    e = "<" if order == b"II" else ">"
    code, fmt = TIFF_TYPES[kind]
    tags = [
        (256, code, fmt, width),
        (257, code, fmt, height),
        (258, 3, "H", 8),
        (259, 3, "H", 1),
        (262, 3, "H", 1),
        (273, 4, "I", 0),  # strip offset, set below
        (277, 3, "H", 1),
        (278, 4, "I", height),
        (279, 4, "I", width * height),
    ]
    if orientation:
        tags.append((274, 3, "H", orientation))
    tags.sort()
    pixels_at = 8 + 2 + 12 * len(tags) + 4
    ifd = struct.pack(e + "H", len(tags))
    for tag, code, fmt, value in tags:
        value = pixels_at if tag == 273 else value
        ifd += struct.pack(e + "HHI", tag, code, 1) + struct.pack(e + fmt, value).ljust(4, b"\0")
    head = order + struct.pack(e + "HI", 42, 8)
    return head + ifd + struct.pack(e + "I", 0) + bytes(width * height)


@pytest.mark.parametrize("order", [b"II", b"MM"], ids=["little", "big"])
@pytest.mark.parametrize("kind", ["SHORT", "LONG"])
@pytest.mark.parametrize("orientation", [0, 1, 5, 6, 7, 8])
def test_tiff_byte_orders_tag_types_and_orientations(order, kind, orientation):
    data = tiff(order, 9, 4, kind, orientation)
    with Image.open(io.BytesIO(data)) as img:
        img.load()
    expected = (4, 9) if orientation >= 5 else (9, 4)
    assert assert_matches_pillow(data) == expected


def gif_with_frame_at(screen: tuple[int, int], left: int, top: int) -> bytes:
    """A Pillow GIF whose logical screen is rewritten to ``screen`` and its frame moved."""
    data = bytearray(saved(make_image("P", (20, 10)), "GIF"))
    data[6:10] = struct.pack("<HH", *screen)
    at = data.index(b",\x00\x00\x00\x00\x14\x00\x0a\x00")
    data[at + 1 : at + 5] = struct.pack("<HH", left, top)
    return bytes(data)


@pytest.mark.parametrize(
    ("screen", "left", "top", "size"),
    [
        ((20, 10), 0, 0, (20, 10)),
        ((50, 40), 3, 4, (50, 40)),  # frame inside a larger screen
        ((8, 6), 0, 0, (20, 10)),  # frame larger than the screen: Pillow grows the size
        ((20, 10), 7, 30, (27, 40)),  # frame placed beyond the screen
    ],
    ids=["same", "inside", "larger", "beyond"],
)
def test_gif_size_grows_to_the_first_frame(screen, left, top, size):
    assert assert_matches_pillow(gif_with_frame_at(screen, left, top)) == size


def test_gif_extensions_and_stray_bytes_before_the_first_frame():
    data = saved(make_image("P", (20, 10)), "GIF")
    at = data.index(b",\x00\x00\x00\x00")
    extras = (
        b"!\xfe\x03abc\x02de\x00"  # comment, two sub-blocks
        + b"!\xff\x0bNETSCAPE2.0\x03\x01\x00\x00\x00"  # loop count
        + b"!\xf9\x04\x01\x0a\x00\x02\x00"  # graphic control
        + b"!\x01\x00\x00"  # empty unknown extension: Pillow reads one more terminator
        + b"stray"
    )
    assert assert_matches_pillow(data[:at] + extras + data[at:]) == (20, 10)


def webp_vp8x(width: int, height: int) -> bytes:
    """A WebP whose VP8X chunk declares a ``width x height`` canvas (header only)."""
    vp8x = b"VP8X" + struct.pack("<I", 10) + bytes(4)
    vp8x += (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    return b"RIFF" + struct.pack("<I", 4 + len(vp8x)) + b"WEBP" + vp8x


def test_webp_sizes_from_every_chunk_kind():
    lossy, lossless = saved(RGB, "WEBP"), saved(RGB, "WEBP", lossless=True)
    assert lossy[12:16] == b"VP8 "
    assert lossless[12:16] == b"VP8L"
    assert saved(make_image("RGBA", (9, 9)), "WEBP")[12:16] == b"VP8X"
    assert header_size(lossy, "WEBP") == header_size(lossless, "WEBP") == (301, 203)
    assert header_size(webp_vp8x(16383, 16383), "WEBP") == (16383, 16383)
    assert header_size(webp_vp8x(2**24, 1), "WEBP") == (2**24, 1)


# ---------------------------------------------------------------- detection


@pytest.mark.parametrize(
    ("data", "name"),
    [
        (b"\x00\x00\x01\x00\x01\x00", "ICO"),
        (b"%!PS-Adobe-3.0 EPSF-3.0\n", "PostScript/EPS"),
        (b"\xc5\xd0\xd3\xc6" + bytes(26), "EPS"),
        (b"%PDF-1.7\n", "PDF"),
        (b"8BPS\x00\x01", "PSD"),
        (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG 2000"),
        (b"\xff\x4f\xff\x51\x00", "JPEG 2000"),
        (b"\x00\x00\x00\x1cftypavif", "HEIF/AVIF (ISO media)"),
        (b"RIFF\x00\x00\x00\x00AVI LIST", "RIFF (not WebP)"),
        (b"  <?xml version='1.0'?><svg/>", "SVG/XML"),
        (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "SVG/XML"),
        (b"II\x00*\x08\x00\x00\x00", "TIFF with a malformed header"),
        (b"GIF88a", "unknown"),
        (b"\x89PNG\r\n", "unknown"),  # a cut signature is no signature
        (b"", "unknown"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_detect_names_what_it_sees(data, name):
    assert detect_format(data) == name


def other_pillow_files() -> dict[str, bytes]:
    """A small file in every other format this Pillow writes (in the first mode it takes)."""
    Image.init()
    files = {}
    for fmt in sorted(set(Image.SAVE) - set(FORMATS) - {"MPO"}):  # MPO files are JPEG files
        for mode in ("RGB", "P", "1"):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)  # IM
                    files[fmt] = saved(make_image(mode, (32, 32)), fmt)
                break
            except (OSError, ValueError, KeyError):
                continue  # a mode this format cannot store, or a reader-only stub
    return files


OTHER_FILES = other_pillow_files()


def test_other_formats_cover_the_known_risks():
    assert {"ICO", "EPS", "PDF", "JPEG2000", "TGA", "PCX", "PPM", "QOI"} <= set(OTHER_FILES)
    assert detect_format(OTHER_FILES["TGA"]) == "unknown"  # no signature: never named ICO or CUR


@pytest.mark.parametrize("fmt", sorted(OTHER_FILES))
def test_nothing_else_pillow_writes_is_detected_as_allowed(fmt):
    assert detect_format(OTHER_FILES[fmt]) not in FORMATS


# ---------------------------------------------------------------- malformed headers


def png_with(ihdr: bytes, kind: bytes = b"IHDR", crc: int | None = None) -> bytes:
    crc = zlib.crc32(kind + ihdr) if crc is None else crc
    chunk = struct.pack(">I", len(ihdr)) + kind + ihdr + struct.pack(">I", crc)
    return b"\x89PNG\r\n\x1a\n" + chunk


def ihdr(depth: int = 8, color: int = 2, filtering: int = 0) -> bytes:
    return struct.pack(">IIBBBBB", 5, 5, depth, color, 0, filtering, 0)


JPEG = saved(RGB, "JPEG")
SOF = JPEG.index(b"\xff\xc0")
WEBP = saved(RGB, "WEBP")
GIF = saved(make_image("P", (20, 10)), "GIF")
GIF_FRAME = GIF.index(b",\x00\x00\x00\x00")
TIFF = tiff(b"II", 9, 4)
BAD = [
    ("PNG", png_with(b"x" * 13, b"tEXt"), r"PNG's first chunk is b'tEXt'; .* IHDR first"),
    ("PNG", png_with(ihdr()[:12]), "PNG IHDR chunk has 12 bytes, not 13"),
    ("PNG", png_with(ihdr())[:20], r"PNG IHDR chunk needs 33 bytes but the file has 20 \(trunc"),
    ("PNG", png_with(ihdr(), crc=0), "PNG IHDR chunk fails its CRC check"),
    ("PNG", png_with(ihdr(depth=4)), "bit depth 4 with colour type 2, an invalid pair"),
    ("PNG", png_with(ihdr(filtering=1)), "compression 0, filter 1, interlace 0"),
    ("JPEG", b"\xff\xd8\xff\x01", r"JPEG has an invalid marker 0xFF01 at byte 2"),
    ("JPEG", b"\xff\xd8\xff\xe0\x00\x64abc", r"JPEG segment 0xFFE0 at byte 2 \(100 bytes\) needs"),
    ("JPEG", b"\xff\xd8\xff\xe0", r"JPEG segment 0xFFE0 at byte 2 needs 6 bytes"),
    ("JPEG", b"\xff\xd8\xff\xda\x00\x02", r"no frame header \(SOFn marker\) before its first scan"),
    ("JPEG", JPEG[:SOF] + b"\xff\xc0\x00\x07\x08\x00\x01\x00\x01", "frame header at .* has 5"),
    ("JPEG", JPEG[: SOF + 4] + b"\x0c" + JPEG[SOF + 5 :], "12-bit samples and 3 components"),
    ("JPEG", b"\xff\xd8" + b"\xff\xd0" * 20_000, "more than 16384 markers before its first"),
    ("WEBP", WEBP[:100], r"RIFF header declares \d+ bytes but the file has 100 \(truncated\)"),
    ("WEBP", WEBP[:20] + b"\x01" + WEBP[21:], "VP8 chunk does not start with a key frame"),
    ("WEBP", webp_vp8x(5, 5).replace(b"VP8X\x0a", b"VP8X\x09"), "VP8X chunk is shorter than 10"),
    ("WEBP", b"RIFF\x0c\x00\x00\x00WEBPALPH\x00\x00\x00\x00", r"first chunk is b'ALPH'"),
    ("WEBP", b"RIFF\x11\x00\x00\x00WEBPVP8L\x05\x00\x00\x00\x2e" + bytes(4), "VP8L .* signat"),
    ("GIF", GIF[:GIF_FRAME] + b";", "GIF has no image before its end"),
    ("GIF", GIF[: GIF_FRAME + 5], r"GIF image descriptor needs \d+ bytes but the file has"),
    ("GIF", GIF[:GIF_FRAME] + b"!\xf9\x02\x00\x00\x00" + GIF[GIF_FRAME:], "control extension"),
    ("GIF", GIF[:GIF_FRAME] + b"!\x01" + b"\x01x" * 17_000, "more than 16384 sub-blocks"),
    ("BMP", bmp(40, 3, 3)[:14] + struct.pack("<I", 20) + bytes(40), "info header has 20 bytes"),
    ("BMP", bmp(124, 3, 3)[:100], r"BMP 124-byte info header needs 138 bytes .* has 100"),
    ("BMP", bmp(40, 3, 3, bits=3), "BMP has 3 bits per pixel"),
    ("BMP", bmp(40, 3, 3)[:30] + struct.pack("<I", 4) + bmp(40, 3, 3)[34:], "compression 4 with"),
    ("BMP", bmp(40, 3, 3, 8)[:46] + struct.pack("<I", 70_000) + bmp(40, 3, 3, 8)[50:], "70000"),
    ("TIFF", b"II*\x00\x00\x00\x00\x00" + bytes(20), r"points to no image directory \(offset 0\)"),
    ("TIFF", b"II*\x00\xe7\x03\x00\x00" + bytes(20), r"TIFF directory at byte 999 needs 1001"),
    ("TIFF", b"II*\x00\x08\x00\x00\x00\xff\xff", "TIFF directory has 65535 entries, more than"),
    ("TIFF", TIFF.replace(b"\x00\x01\x04\x00", b"\x00\x01\x02\x00", 1), "tag 256 has type 2 and"),
    ("TIFF", TIFF.replace(b"\x01\x01\x04\x00", b"\xff\xff\x04\x00", 1), "no ImageLength tag"),
]


@pytest.mark.parametrize(
    ("fmt", "data", "match"), BAD, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(BAD)]
)
def test_malformed_headers_say_what_is_wrong(fmt, data, match):
    assert detect_format(data) == fmt
    with pytest.raises(HeaderError, match=match):
        header_size(data, fmt)


# ---------------------------------------------------------------- fuzzing

SAMPLES = [
    saved(make_image("RGBA", (37, 23)), "PNG"),
    saved(RGB, "JPEG", progressive=True, exif=EXIF),
    saved(make_image("RGBA", (37, 23)), "WEBP"),
    saved(RGB, "WEBP", lossless=True),
    saved(make_image("P", (37, 23)), "GIF", save_all=True, append_images=[make_image("P", (9, 9))]),
    bmp(108, 37, -23),
    saved(make_image("RGB", (37, 23)), "TIFF", compression="tiff_lzw"),
    tiff(b"MM", 37, 23, "SHORT", 6),
    saved(make_image("RGB", (37, 23)), "TIFF", big_tiff=True),
]
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def mutated(draw):
    data = bytearray(draw(st.sampled_from(SAMPLES)))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["cut", "set", "insert"]))
        if action == "cut":
            del data[at:]
        elif action == "set" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


@FUZZ
@given(mutated())
@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow's notes on the corrupt TIFFs
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_mutated_files_give_a_size_or_a_header_error(data):
    fmt = detect_format(data)
    if fmt not in FORMATS:
        return
    try:
        width, height = header_size(data, fmt)
    except HeaderError:
        return
    assert isinstance(width, int)
    assert isinstance(height, int)
    assert width >= 0
    assert height >= 0
    # Pillow refusing what we read is the rank's 400 (preprocess.decode), not a disagreement;
    # what Pillow raises on a broken file is no fixed set of types.
    try:
        with Image.open(io.BytesIO(data), formats=[fmt]) as img:
            pillow = img.size
    except Exception:  # noqa: BLE001 - every Pillow refusal counts, whatever its type
        return
    assert (width, height) == pillow


@FUZZ
@given(st.sampled_from(FORMATS), st.binary(max_size=64))
def test_random_bytes_behind_a_signature(fmt, tail):
    prefix = {"WEBP": b"RIFF\x40\x00\x00\x00WEBPVP8 "}.get(fmt)
    magic = prefix or next(m for m, name in headers._ALLOWED_SIGNATURES if name == fmt)
    data = magic + tail
    assert detect_format(data) == fmt
    try:
        width, height = header_size(data, fmt)
    except HeaderError:
        return
    assert width >= 0
    assert height >= 0

"""Image format and size from the file header alone, for the formats the server reads.

Admission must stay cheap whatever bytes arrive, so nothing here decodes a
pixel, inflates a stream or copies more than a few bytes: the format comes
from the file's signature (never a name or a media type), the size from a
small parser per format that walks a bounded number of header structures.
Every parser reports the size Pillow reports as ``Image.open(data).size`` for
the same bytes, because the owner rank decodes with Pillow and the grid planned
here must be the grid it finds. Where Pillow is lenient about malformed
headers the parsers follow it only as far as it changes the size; anything
they cannot read is a ``HeaderError``.

>>> png = bytes.fromhex("89504e470d0a1a0a0000000d49484452000000030000000208060000009d74661a")
>>> detect_format(png), header_size(png, "PNG")
('PNG', (3, 2))
"""

from __future__ import annotations

import re
import struct
import zlib

# The formats the server reads, by Pillow's name for them (``Image.open(formats=...)``).
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
FORMAT_LIST = "PNG, JPEG, WebP, GIF, BMP or TIFF"

# Header structures (JPEG segments, GIF sub-blocks, TIFF directory entries) walked
# before the size is known; real files need a few dozen, so this only stops abuse.
MAX_STRUCTURES = 16_384

_ALLOWED_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"II+\x00", "TIFF"),  # BigTIFF
    (b"MM\x00+", "TIFF"),
)

# Formats recognised only to name them in the refusal.
_OTHER_SIGNATURES = (
    (b"\x00\x00\x01\x00", "ICO"),
    (b"icns", "ICNS"),
    (b"%!PS", "PostScript/EPS"),
    (b"\xc5\xd0\xd3\xc6", "EPS"),
    (b"%PDF", "PDF"),
    (b"8BPS", "PSD"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG 2000"),
    (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"\x00\x00\x00\x0cJXL \r\n\x87\n", "JPEG XL"),
    (b"\xff\x0a", "JPEG XL"),
    (b"qoif", "QOI"),
    (b"DDS ", "DDS"),
    (b"II\x00*", "TIFF with a malformed header"),
    (b"MM*\x00", "TIFF with a malformed header"),
    (b"PK\x03\x04", "ZIP"),
    (b"\x1f\x8b", "gzip"),
)


class HeaderError(ValueError):
    """A header this module cannot read: malformed, truncated or outside what Pillow reads."""


def detect_format(data: bytes) -> str:
    """The format named by the file's signature: one of ``FORMATS``, another name, or 'unknown'.

    >>> detect_format(b"\\x00\\x00\\x01\\x00"), detect_format(b"GIF89a"), detect_format(b"hello")
    ('ICO', 'GIF', 'unknown')
    """
    for magic, name in _ALLOWED_SIGNATURES:
        if data.startswith(magic):
            return name
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return "WEBP"
    for magic, name in _OTHER_SIGNATURES:
        if data.startswith(magic):
            return name
    if data[4:8] == b"ftyp":
        return "HEIF/AVIF (ISO media)"
    if data.startswith(b"RIFF"):
        return "RIFF (not WebP)"
    if data[:256].lstrip().startswith((b"<?xml", b"<svg", b"<!DOCTYPE svg")):
        return "SVG/XML"
    return "unknown"


def header_size(data: bytes, fmt: str) -> tuple[int, int]:
    """(width, height) of ``data``, a file in ``fmt`` (one of ``FORMATS``), from its header.

    Raises ``HeaderError`` for a header it cannot read. Sizes may be 0 or huge:
    checking them is the caller's business.
    """
    return _PARSERS[fmt](data)


def _need(data: bytes, end: int, what: str, *args: object) -> None:
    """Refuse a file shorter than ``end`` bytes; ``what.format(*args)`` names the structure."""
    if len(data) < end:
        raise HeaderError(
            f"{what.format(*args)} needs {end} bytes but the file has {len(data)} (truncated)"
        )


def _png(data: bytes) -> tuple[int, int]:
    _need(data, 16, "PNG's first chunk header")
    length, kind = struct.unpack_from(">I4s", data, 8)
    if kind != b"IHDR":
        raise HeaderError(f"PNG's first chunk is {kind!r}; the PNG standard puts IHDR first")
    if length != 13:
        raise HeaderError(f"PNG IHDR chunk has {length} bytes, not 13")
    _need(data, 33, "PNG IHDR chunk")
    width, height, depth, color, compression, filtering, interlace = struct.unpack_from(
        ">IIBBBBB", data, 16
    )
    if zlib.crc32(data[12:29]) != struct.unpack_from(">I", data, 29)[0]:
        raise HeaderError("PNG IHDR chunk fails its CRC check (corrupt header)")
    if depth not in _PNG_DEPTHS.get(color, ()):
        raise HeaderError(
            f"PNG IHDR has bit depth {depth} with colour type {color}, an invalid pair"
        )
    if (compression, filtering) != (0, 0) or interlace > 1:
        raise HeaderError(
            f"PNG IHDR has compression {compression}, filter {filtering}, interlace {interlace}; "
            "only 0, 0 and 0 or 1 exist"
        )
    return width, height


# Colour type -> valid bit depths (PNG standard, table 11.1).
_PNG_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}

# Markers Pillow reads as a frame header: SOF0-3, 5-7, 9-11, 13-15, and DHP (0xDE).
_JPEG_FRAMES = frozenset(
    (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF, 0xDE)
)
# Markers without a length field: JPG, RST0-7, SOI, EOI, JPG0-13.
_JPEG_BARE = frozenset((0xC8, *range(0xD0, 0xDA), *range(0xF0, 0xFE)))
_JPEG_SOS = 0xDA
_FILL = re.compile(rb"\xff+")


def _jpeg(data: bytes) -> tuple[int, int]:
    """Walk the segments up to the first scan; the last frame header before it gives the size.

    Like Pillow: bytes between segments are skipped, a run of 0xFF is fill, 0xFF00 is
    skipped, and a file that ends before the scan still has the size of its frame header.
    """
    size = None
    pos, end = 2, len(data)  # the 0xFF after SOI starts the first marker
    for _ in range(MAX_STRUCTURES):
        pos = data.find(b"\xff", pos)
        if pos < 0:
            break
        pos = _FILL.match(data, pos).end()  # the last 0xFF of a run prefixes the marker
        if pos >= end:
            break
        marker, start = data[pos], pos - 1
        pos += 1
        if marker == 0x00 or marker in _JPEG_BARE:
            continue
        if marker < 0xC0:
            raise HeaderError(f"JPEG has an invalid marker 0xFF{marker:02X} at byte {start}")
        _need(data, pos + 2, "JPEG segment 0xFF{:02X} at byte {}", marker, start)
        length = struct.unpack_from(">H", data, pos)[0]
        body, pos = pos + 2, pos + max(length, 2)
        _need(data, pos, "JPEG segment 0xFF{:02X} at byte {} ({} bytes)", marker, start, length)
        if marker in _JPEG_FRAMES:
            size = _jpeg_frame(data, body, pos, start)
        if marker == _JPEG_SOS:
            break
    else:
        raise HeaderError(f"JPEG has more than {MAX_STRUCTURES} markers before its first scan")
    if size is None:
        raise HeaderError("JPEG has no frame header (SOFn marker) before its first scan")
    return size


def _jpeg_frame(data: bytes, body: int, end: int, start: int) -> tuple[int, int]:
    if end - body < 6 or (end - body - 6) % 3:
        raise HeaderError(
            f"JPEG frame header at byte {start} has {end - body} bytes; it needs 6 plus 3 per "
            "component"
        )
    bits, height, width, components = struct.unpack_from(">BHHB", data, body)
    if bits != 8 or components not in (1, 3, 4):
        raise HeaderError(
            f"JPEG frame header at byte {start} has {bits}-bit samples and {components} "
            "components; only 8-bit samples with 1, 3 or 4 components are read"
        )
    return width, height


def _webp(data: bytes) -> tuple[int, int]:
    """The canvas size: the VP8X chunk's, or the only frame's (VP8 or VP8L first chunk)."""
    _need(data, 20, "WebP's first chunk header")
    riff_end = struct.unpack_from("<I", data, 4)[0] + 8
    if riff_end > len(data):
        raise HeaderError(
            f"WebP RIFF header declares {riff_end} bytes but the file has {len(data)} (truncated)"
        )
    chunk = data[12:16]
    if chunk == b"VP8 ":
        _need(data, 30, "WebP VP8 frame header")
        if data[20] & 1 or data[23:26] != b"\x9d\x01\x2a":
            raise HeaderError("WebP VP8 chunk does not start with a key frame header")
        width, height = struct.unpack_from("<HH", data, 26)
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L":
        _need(data, 25, "WebP VP8L header")
        bits = struct.unpack_from("<I", data, 21)[0]
        if data[20] != 0x2F or bits >> 29:
            raise HeaderError("WebP VP8L chunk has a wrong signature or version")
        return (bits & 0x3FFF) + 1, (bits >> 14 & 0x3FFF) + 1
    if chunk == b"VP8X":
        _need(data, 30, "WebP VP8X chunk")
        if struct.unpack_from("<I", data, 16)[0] < 10:
            raise HeaderError("WebP VP8X chunk is shorter than 10 bytes")
        width = int.from_bytes(data[24:27], "little") + 1
        height = int.from_bytes(data[27:30], "little") + 1
        return width, height
    raise HeaderError(f"WebP's first chunk is {chunk!r}; it must be 'VP8 ', 'VP8L' or 'VP8X'")


def _gif(data: bytes) -> tuple[int, int]:
    """The logical screen, grown to the first frame's extent where that is larger (as Pillow)."""
    _need(data, 13, "GIF logical screen descriptor")
    width, height, flags = struct.unpack_from("<HHB", data, 6)
    pos = 13 + (3 << (flags & 7) + 1 if flags & 0x80 else 0)  # global colour table
    walker = _GifBlocks(data)
    while True:
        found = _GIF_BLOCK.search(data, pos)  # stray bytes between blocks are skipped
        if found is None or data[found.start()] == 0x3B:
            raise HeaderError("GIF has no image before its end")
        pos = found.start() + 1
        if data[pos - 1] == 0x2C:  # image descriptor
            _need(data, pos + 9, "GIF image descriptor")
            left, top, w, h, flags = struct.unpack_from("<HHHHB", data, pos)
            pos += 9 + (3 << (flags & 7) + 1 if flags & 0x80 else 0)  # local colour table
            _need(data, pos + 1, "GIF image data")
            return max(width, left + w), max(height, top + h)
        pos = walker.extension(pos)


_GIF_BLOCK = re.compile(rb"[!,;]")


class _GifBlocks:
    """Skips GIF extensions sub-block by sub-block, counting against ``MAX_STRUCTURES``."""

    def __init__(self, data: bytes):
        self.data, self.steps = data, 0

    def extension(self, pos: int) -> int:
        """Skip the extension whose label is at ``pos``; the position after it.

        As Pillow: after the first sub-block (and a NETSCAPE loop block) it
        skips sub-blocks up to a terminator, reading on past an immediate one,
        except in a comment.
        """
        _need(self.data, pos + 1, "GIF extension label")
        label = self.data[pos]
        pos, block = self.sub_block(pos + 1)
        if label == 0xFE:
            while block is not None:
                pos, block = self.sub_block(pos)
            return pos
        if label == 0xF9 and block is not None:
            flags = self.data[block[0]] if block[1] else 0
            if block[1] < (4 if flags & 1 else 3):
                raise HeaderError("GIF graphic control extension is shorter than 4 bytes")
        if (
            label == 0xFF
            and block is not None
            and self.data.startswith(b"NETSCAPE2.0", block[0], block[0] + block[1])
        ):
            pos, block = self.sub_block(pos)
        while True:
            pos, block = self.sub_block(pos)
            if block is None:
                return pos

    def sub_block(self, pos: int) -> tuple[int, tuple[int, int] | None]:
        """(position after it, (start, bytes present) or None at a terminator or the end)."""
        self.steps += 1
        if self.steps > MAX_STRUCTURES:
            raise HeaderError(
                f"GIF has more than {MAX_STRUCTURES} sub-blocks before its first image"
            )
        if pos >= len(self.data) or not self.data[pos]:
            return min(pos + 1, len(self.data)), None
        start = pos + 1
        end = min(start + self.data[pos], len(self.data))
        return end, (start, end - start)


def _bmp(data: bytes) -> tuple[int, int]:
    """Every info header version Pillow reads; a height whose top byte is 0xFF is top-down."""
    _need(data, 18, "BMP file header")
    header = struct.unpack_from("<I", data, 14)[0]
    if header not in (12, 40, 52, 56, 64, 108, 124):
        raise HeaderError(
            f"BMP info header has {header} bytes; readable versions have 12, 40, 52, 56, 64, "
            "108 or 124"
        )
    _need(data, 14 + header, f"BMP {header}-byte info header")
    if header == 12:
        width, height, _, bits = struct.unpack_from("<HHHH", data, 18)
        compression = colors = 0
    else:
        width, height, _, bits, compression = struct.unpack_from("<IIHHI", data, 18)
        colors = struct.unpack_from("<I", data, 46)[0]
        if data[25] == 0xFF:  # negative height: rows stored top-down
            height = 2**32 - height
    if bits not in (1, 4, 8, 16, 24, 32):
        raise HeaderError(f"BMP has {bits} bits per pixel; readable depths are 1, 4, 8, 16, 24, 32")
    if compression > 3 or (compression == 3 and bits < 16):
        raise HeaderError(
            f"BMP compression {compression} with {bits} bits per pixel is not read (readable: "
            "0 raw, 1 RLE8, 2 RLE4, 3 bit fields at 16, 24 or 32 bits)"
        )
    if bits <= 8 and not 0 < (colors or 1 << bits) <= 65536:
        raise HeaderError(f"BMP palette has {colors} colours; it must have 1 to 65536")
    return width, height


_TIFF_WIDTH, _TIFF_LENGTH, _TIFF_ORIENTATION = 256, 257, 274
# Integer types a size tag may have: SHORT, LONG, and LONG8 (BigTIFF).
_TIFF_TYPES = {3: "H", 4: "I", 16: "Q"}


def _tiff(data: bytes) -> tuple[int, int]:
    """ImageWidth and ImageLength of the first directory, both byte orders, TIFF and BigTIFF.

    Swapped for Orientation 5-8 (transposed), as Pillow reports it. The first
    occurrence of a tag wins; a directory cut short keeps the entries before the cut.
    """
    order = "<" if data[:2] == b"II" else ">"
    big = struct.unpack_from(order + "H", data, 2)[0] == 43
    _need(data, 16 if big else 8, "TIFF header")
    offset = struct.unpack_from(order + ("Q" if big else "I"), data, 8 if big else 4)[0]
    if not offset:
        raise HeaderError("TIFF header points to no image directory (offset 0)")
    count_format, entry_size = ("Q", 20) if big else ("H", 12)
    _need(data, offset + struct.calcsize(count_format), f"TIFF directory at byte {offset}")
    count = struct.unpack_from(order + count_format, data, offset)[0]
    if count > MAX_STRUCTURES:
        raise HeaderError(f"TIFF directory has {count} entries, more than {MAX_STRUCTURES}")
    first = offset + struct.calcsize(count_format)
    count = min(count, (len(data) - first) // entry_size)
    tags: dict[int, int] = {}
    for entry in range(first, first + count * entry_size, entry_size):
        tag, kind = struct.unpack_from(order + "HH", data, entry)
        if tag not in (_TIFF_WIDTH, _TIFF_LENGTH, _TIFF_ORIENTATION) or tag in tags:
            continue
        values = struct.unpack_from(order + ("Q" if big else "I"), data, entry + 4)[0]
        if kind not in _TIFF_TYPES or (kind == 16 and not big) or values != 1:
            raise HeaderError(
                f"TIFF tag {tag} has type {kind} and {values} values; size tags must be one "
                "SHORT or LONG"
            )
        tags[tag] = struct.unpack_from(order + _TIFF_TYPES[kind], data, entry + (12 if big else 8))[
            0
        ]
    if _TIFF_WIDTH not in tags or _TIFF_LENGTH not in tags:
        raise HeaderError("TIFF's first directory has no ImageWidth or no ImageLength tag")
    width, height = tags[_TIFF_WIDTH], tags[_TIFF_LENGTH]
    if tags.get(_TIFF_ORIENTATION) in (5, 6, 7, 8):
        return height, width
    return width, height


_PARSERS = {"PNG": _png, "JPEG": _jpeg, "WEBP": _webp, "GIF": _gif, "BMP": _bmp, "TIFF": _tiff}

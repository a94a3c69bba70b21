"""Read PNG files without an image library: the chunks (CRC-checked), the size, the text."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

SIGNATURE = b"\x89PNG\r\n\x1a\n"


def chunks(path: Path) -> list[tuple[bytes, bytes]]:
    """The (type, data) chunks of a PNG file, checking the signature and every chunk's CRC."""
    data = path.read_bytes()
    assert data[:8] == SIGNATURE, f"{path}: not a PNG (header {data[:8]!r})"
    out, at = [], 8
    while at < len(data):
        (size,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + size]
        (crc,) = struct.unpack(">I", data[at + 8 + size : at + 12 + size])
        assert zlib.crc32(kind + body) == crc, f"{path}: bad CRC in chunk {kind!r}"
        out.append((kind, body))
        at += 12 + size
    return out


def check(path: Path, min_size: tuple[int, int] = (400, 200)) -> dict[str, str]:
    """A complete PNG of at least ``min_size`` pixels; returns its text metadata (tEXt)."""
    found = chunks(path)
    kinds = [kind for kind, _ in found]
    assert kinds[0] == b"IHDR", kinds
    assert kinds[-1] == b"IEND", kinds
    assert b"IDAT" in kinds, kinds
    width, height = struct.unpack(">II", found[0][1][:8])
    assert width >= min_size[0], (width, height)
    assert height >= min_size[1], (width, height)
    text = (body.split(b"\0", 1) for kind, body in found if kind == b"tEXt")
    return {key.decode("latin-1"): value.decode("latin-1") for key, value in text}

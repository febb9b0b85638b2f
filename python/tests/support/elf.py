"""The section names of an ELF file, read with ``struct`` (no dependency):
the install check tells a stripped extension from one that ships debug info
by them (``.debug_info``, ``.symtab``)."""

from __future__ import annotations

import struct

ELF_MAGIC = b"\x7fELF"
ELFCLASS64 = 2
ELFDATA2LSB = 1


def section_names(data: bytes) -> set[str]:
    """Every section's name of a 64-bit little-endian ELF file (x86-64 and
    aarch64 Linux, what the wheels are built for)."""
    if data[:4] != ELF_MAGIC:
        raise ValueError("not an ELF file")
    if data[4] != ELFCLASS64 or data[5] != ELFDATA2LSB:
        raise ValueError("not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i: int) -> tuple[int, int, int]:
        """(name offset, file offset, size) of section ``i``."""
        base = shoff + i * shentsize
        (name,) = struct.unpack_from("<I", data, base)
        offset, size = struct.unpack_from("<QQ", data, base + 0x18)
        return name, offset, size

    _, strtab, strtab_size = header(shstrndx)
    names = data[strtab : strtab + strtab_size]
    out = set()
    for i in range(shnum):
        start = header(i)[0]
        out.add(names[start : names.index(b"\0", start)].decode())
    return out - {""}


__all__ = ["section_names"]

"""The ELF section reader the install check tells a stripped extension by,
against binutils on the real extension and a stripped copy of it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from support.elf import section_names

import ucm

#: The extension of the checkout or install under test.
(NATIVE,) = Path(ucm.__file__).parent.glob("_native*.so")


def readelf_sections(path: Path) -> set[str]:
    out = subprocess.run(
        ["readelf", "-S", "-W", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return set(re.findall(r"^\s*\[\s*\d+\]\s+(\S+)", out, re.M)) - {"NULL"}


@pytest.mark.skipif(not shutil.which("readelf"), reason="binutils (readelf, strip) not installed")
def test_section_names_match_readelf_before_and_after_strip(tmp_path: Path) -> None:
    assert section_names(NATIVE.read_bytes()) == readelf_sections(NATIVE)
    stripped = tmp_path / NATIVE.name
    subprocess.run(["strip", "-o", str(stripped), str(NATIVE)], check=True)
    names = section_names(stripped.read_bytes())
    assert names == readelf_sections(stripped)
    assert not names & {".debug_info", ".symtab"}


def test_not_an_elf_file() -> None:
    with pytest.raises(ValueError, match="not an ELF file"):
        section_names(b"#!/bin/sh\n")

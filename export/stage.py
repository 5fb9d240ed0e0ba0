"""The `export` stage's body: write the folder, load it back, compare, and put the model card in it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.torch import load_file, save_file

from moeflow.card.generate import generate
from moeflow.configs import ConfigError, ExportConfig
from moeflow.export import convert, parity
from moeflow.moe import device
from moeflow.moe.evaluate import HeldOut, load_model
from moeflow.tokenize import tokenizer

WEIGHTS = "model.safetensors"
# the model's files (its stats list them); the rest of the folder is the card's
MODEL_FILES = ("config.json", "generation_config.json", WEIGHTS, "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json")


def write(train_dir: Path, tokenizer_dir: Path, out: Path) -> dict:
    """The model files of the export in `out`, from a train artifact's weights and the tokenizer artifact."""
    meta = json.loads((Path(train_dir) / "model_config.json").read_text())
    why = convert.unmappable(convert.model_config(meta))
    if why:
        raise ConfigError(f"export: the model at {train_dir} cannot be written as {convert.ARCHITECTURE}: "
                          + "; ".join(why))
    sd = load_file(str(Path(train_dir) / WEIGHTS))
    tensors = convert.hf_state_dict(sd, meta)  # fails on a tensor it would drop or lacks, before any file
    tok = tokenizer.load(tokenizer_dir)
    eos = tok.token_to_id(tokenizer.EOS)
    config = convert.hf_config(meta, eos)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos, "do_sample": False}, indent=2))
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    convert.tokenizer_files(Path(tokenizer_dir) / tokenizer.TOKENIZER, out, tokenizer.EOS, meta["max_seq_len"])
    return {"architecture": convert.ARCHITECTURE, "tensors": len(tensors), "source_tensors": len(sd),
            "parameters": int(sum(t.numel() for t in tensors.values())), "files": list(MODEL_FILES),
            "document_mask": meta.get("document_eos") is not None}


def stage(cfg: ExportConfig, inputs: dict, out: Path) -> dict:
    """Export the `model` input, compare it on the `mix` input's held-out rows, write the card beside it
    (walked back from the same inputs as the `card` stage's, and this stage's figures)."""
    import transformers

    stats = write(inputs["model"].dir, inputs["tokenizer"].dir, out)
    theirs, warnings = parity.load_back(out)
    held = HeldOut(inputs["mix"].dir, cfg.max_sequences_per_domain)
    stats |= parity.compare(load_model(inputs["model"].dir), theirs, held, device.resolve(cfg.device or "auto"))
    rows = held.data[np.concatenate(list(held.picked.values()))]  # every row compared, decoded, encoded again
    stats |= parity.tokenizer_agrees(out, tokenizer.load(inputs["tokenizer"].dir), rows)
    stats |= {"tolerance": cfg.tolerance, "transformers": transformers.__version__, "load_warnings": warnings}
    if stats["max_abs_logprob_diff"] > cfg.tolerance:
        raise parity.ExportError(
            f"export: transformers' {convert.ARCHITECTURE} differs from moeflow's model by up to "
            f"{stats['max_abs_logprob_diff']} in log p over {stats['tokens_compared']} held-out tokens, above "
            f"export.tolerance {cfg.tolerance}: {json.dumps(stats['domains'])}")
    roots = [inputs[k].dir for k in ("evaluate", "model", "overlap", "sources") if k in inputs]
    generate(roots, out, export=stats)
    return stats

"""The export: moeflow's model as transformers' Qwen2MoeForCausalLM, loaded back by the real library and compared;
models it cannot write exactly are refused before any work, naming the option."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from helpers import write_config, write_training_mix
from moeflow import configs
from moeflow.configs import ConfigError, ModelConfig
from moeflow.export import convert, parity, preflight
from moeflow.export.stage import write
from moeflow.moe.evaluate import HeldOut, load_model
from moeflow.moe.model import Transformer
from moeflow.tokenize import mix, tokenizer

VARIANTS = {
    "tied": {},
    "untied-shared-dense": {"tie_embeddings": False, "shared_expert_hidden": 48, "dense_layers": 1, "n_layers": 3},
    "every-other-top1-unnormalised": {"n_layers": 3, "moe_every": 2, "top_k": 1, "normalize_expert_weights": False},
    "many-experts-capacity": {"num_experts": 16, "top_k": 4, "expert_hidden": 16, "capacity_factor": 1.0},
}


def _trained(root: Path, model: dict, document_eos: bool = False) -> tuple[Path, Transformer]:
    """A train artifact's two files for a model of `model`'s fields with random weights (seeded), beside
    a tokenizer and a held-out set of two domains."""
    root.mkdir(parents=True)
    write_training_mix(root)
    tok = tokenizer.load(root)
    eos = tok.token_to_id(tokenizer.EOS) if document_eos else None
    cfg = ModelConfig(**{"d_model": 32, "n_heads": 4, "num_experts": 4, "top_k": 2, "expert_hidden": 32, **model})
    torch.manual_seed(0)
    m = Transformer(cfg, tok.get_vocab_size(), 32, eos)
    for p in m.parameters():  # norms away from 1 and routers away from uniform: every tensor must map right
        p.data.add_(torch.randn_like(p) * 0.05)
    save_file(m.state_dict(), str(root / "model.safetensors"))
    meta = {**cfg.model_dump(mode="json"), "vocab_size": tok.get_vocab_size(), "max_seq_len": 32}
    (root / "model_config.json").write_text(json.dumps(meta if eos is None else {**meta, "document_eos": eos}))
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, tok.get_vocab_size(), 33) for _ in range(12)]
    if document_eos:  # documents restart inside the rows
        for r in rows:
            r[rng.integers(1, 32, 3)] = tok.token_to_id(tokenizer.EOS)
    mix.write_rows(root / "heldout.arrow", rows, [[{"doc_id": f"d{i}", "length": 33}] for i in range(12)],
                   tok.get_vocab_size(), domains=["a"] * 6 + ["b"] * 6)
    return root, m.eval()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_transformers_loads_the_export_and_gives_moeflows_log_probabilities(tmp_path, variant):
    root, _ = _trained(tmp_path / "run", VARIANTS[variant])
    out = tmp_path / "export"
    out.mkdir()
    stats = write(root, root, out)
    assert stats["source_tensors"] == len(load_model(root).state_dict())
    theirs, warnings = parity.load_back(out)  # fails on any missing, unexpected or mismatched tensor
    assert type(theirs).__name__ == "Qwen2MoeForCausalLM"
    got = parity.compare(load_model(root), theirs, HeldOut(root, 6), torch.device("cpu"))
    assert got["tokens_compared"] == 12 * 32
    assert got["max_abs_logprob_diff"] < 1e-5, got
    assert set(got["domains"]) == {"a", "b"}
    for d in got["domains"].values():
        assert d["abs_loss_diff"] < 1e-5


def test_a_document_masked_model_matches_with_its_restarted_positions(tmp_path):
    root, ours = _trained(tmp_path / "run", {}, document_eos=True)
    out = tmp_path / "export"
    out.mkdir()
    write(root, root, out)
    theirs, _ = parity.load_back(out)
    got = parity.compare(load_model(root), theirs, HeldOut(root, 6), torch.device("cpu"))
    assert got["max_abs_logprob_diff"] < 1e-5, got
    # without the positions transformers attends across documents: the check can tell the two apart
    rows = torch.from_numpy(mix_rows(root))
    with torch.no_grad():
        plain = theirs(input_ids=rows[:, :-1]).logits.log_softmax(-1)
        mine = ours(rows[:, :-1])[0].log_softmax(-1)
    assert (plain - mine).abs().max() > 1e-3


def mix_rows(root: Path) -> np.ndarray:
    from moeflow.moe.data import sequences

    return sequences(root / "heldout.arrow")


def _tampered(tmp_path, change) -> tuple[Path, Path]:
    """An export whose tensors `change(state dict)` then edited in place."""
    from safetensors.torch import load_file

    root, _ = _trained(tmp_path / "run", {})
    out = tmp_path / "export"
    out.mkdir()
    write(root, root, out)
    sd = load_file(str(out / "model.safetensors"))
    change(sd)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return root, out


def _swap(sd: dict) -> None:
    a, b = "model.layers.0.mlp.experts.0.up_proj.weight", "model.layers.0.mlp.experts.1.up_proj.weight"
    sd[a], sd[b] = sd[b].clone(), sd[a].clone()


def test_a_wrong_tensor_fails_the_comparison(tmp_path):
    """The check must be able to fail: one expert's weights swapped with another's after export."""
    root, out = _tampered(tmp_path, _swap)
    theirs, _ = parity.load_back(out)
    got = parity.compare(load_model(root), theirs, HeldOut(root, 6), torch.device("cpu"))
    assert got["max_abs_logprob_diff"] > 1e-3


def test_a_dropped_tensor_fails_the_load(tmp_path):
    _, out = _tampered(tmp_path, lambda sd: sd.pop("model.layers.1.mlp.experts.3.down_proj.weight"))
    with pytest.raises(parity.ExportError, match="experts.down_proj"):
        parity.load_back(out)


def test_autotokenizer_gives_moeflows_ids(tmp_path):
    root, _ = _trained(tmp_path / "run", {})
    out = tmp_path / "export"
    out.mkdir()
    write(root, root, out)
    got = parity.tokenizer_agrees(out, tokenizer.load(root), mix_rows(root))
    assert got["texts_compared"] == 12
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(out)
    assert auto.eos_token == tokenizer.EOS
    assert auto("abc def ghi", add_special_tokens=False)["input_ids"] == tokenizer.load(root).encode(
        "abc def ghi", add_special_tokens=False).ids


@pytest.mark.parametrize(("field", "value", "named"), [
    ("glu", False, "model.glu"),
    ("unigram_head_bias", True, "model.unigram_head_bias"),
    ("router_bias_rate", 1e-3, "model.router_bias_rate"),
])
def test_a_model_the_export_cannot_write_is_refused_before_any_work(tmp_path, field, value, named):
    path = write_config(tmp_path / "c.yaml", model={field: value})
    cfg = configs.load(path)
    with pytest.raises(ConfigError, match=named) as e:
        preflight(cfg)
    assert "export: null" in str(e.value)
    preflight(configs.load(path, export=None))  # without an export the run may train it
    root, _ = _trained(tmp_path / "run", {field: value})
    with pytest.raises(ConfigError, match=named):
        write(root, root, tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_a_class_head_is_refused():
    assert any("output_classes" in w for w in convert.unmappable(
        ModelConfig(output_classes=64, tie_embeddings=False)))
    assert convert.unmappable(ModelConfig()) == []


def test_the_mapping_refuses_a_checkpoint_with_a_tensor_it_would_drop_or_lacks(tmp_path):
    root, m = _trained(tmp_path / "run", {})
    meta = json.loads((root / "model_config.json").read_text())
    sd = dict(m.state_dict())
    assert len(convert.hf_state_dict(sd, meta)) > len(sd)  # the clean checkpoint maps
    with pytest.raises(parity.ExportError, match="would drop.*blocks.0.extra"):
        convert.hf_state_dict({**sd, "blocks.0.extra": sd["norm.weight"]}, meta)
    del sd["blocks.1.moe.router.layer.weight"]
    with pytest.raises(parity.ExportError, match="lacks the tensor 'blocks.1.moe.router.layer.weight'"):
        convert.hf_state_dict(sd, meta)

"""moeflow's model as a stock `transformers` Qwen2-MoE checkpoint: config, tensors, tokenizer files.

Legend: D model width, H heads, Dh head width, E experts, F expert hidden width, V vocabulary.

The reference model maps onto `Qwen2MoeForCausalLM` exactly (up to float32 rounding) with four rewrites:
- q and k rows are permuted within each head from interleaved rotary pairs (moeflow's `apply_rope`) to
  `rotate_half` order (pair i is rows i and i + Dh/2); scores q.k do not change under the same permutation;
- Qwen2-MoE's q, k, v biases are written as zeros (the architecture's default `qkv_bias`, which vLLM assumes);
- the shared expert goes through Qwen2-MoE's sigmoid gate with its weights at zero (a gate of exactly 0.5),
  its `down_proj` doubled; a model without one gets a shared expert of width 1 and zero weights (output 0);
- `rms_norm_eps` is float32's machine epsilon, what `nn.RMSNorm()` uses when none is given.

Experts are written per expert (`mlp.experts.{e}.gate_proj.weight`, ...), the layout Qwen2-MoE checkpoints
are published in and vLLM reads; `transformers` fuses them on load. What cannot map is refused before any
work (`unmappable`): a plain GELU MLP (`glu: false`), a class head (`output_classes`), the LM head's bias
(`unigram_head_bias`; the architecture's head has none, and adding it moves logits by about its size), the
router's expert bias (`router_bias_rate`; Qwen2-MoE's gate chooses by its probabilities alone).
A capacity-factor model exports: it drops tokens only while training, and both it and the export are dropless
in evaluation.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moeflow.configs import ModelConfig

# No torch import: the flow's preflight and the stage registry read `unmappable` in processes (a data stage's
# workers) that should not hold torch; the tensors below are torch's, used through their methods.
ARCHITECTURE = "Qwen2MoeForCausalLM"
MODEL_TYPE = "qwen2_moe"
EPS = float(np.finfo(np.float32).eps)  # nn.RMSNorm's eps when none is given (torch.finfo(torch.float32).eps)


class ExportError(RuntimeError):
    """The exported folder does not reproduce the trained model: what differs, and by how much."""


def model_config(meta: dict) -> ModelConfig:
    """The model's config from a train artifact's `model_config.json` (which also holds vocabulary, length and
    the document EOS)."""
    return ModelConfig(**{k: v for k, v in meta.items() if k in ModelConfig.model_fields})


def unmappable(model: ModelConfig) -> list[str]:
    """The options of a model config that Qwen2-MoE cannot express exactly, each with what to set instead;
    empty when it exports."""
    why = []
    if not model.glu:
        why.append("model.glu: false (Qwen2-MoE's experts and MLPs are SwiGLU): set glu: true")
    if model.output_classes is not None:
        why.append("model.output_classes (a class head, for mixture-search proxies): remove it")
    if model.unigram_head_bias:
        why.append("model.unigram_head_bias: true (Qwen2-MoE's LM head has no bias): set it to false")
    if model.router_bias_rate is not None:
        why.append("model.router_bias_rate (auxiliary-loss-free balancing: Qwen2-MoE's gate has no bias for the "
                   "choice of experts): remove it, and balance with train.load_balance_coef or "
                   "train.sequence_balance_coef")
    return why


def _dense_only(m: ModelConfig) -> list[int]:
    return [i for i in range(m.n_layers) if not m.is_moe(i)]


def hf_config(meta: dict, eos_id: int) -> dict:
    """`config.json` for `Qwen2MoeForCausalLM` from moeflow's `model_config.json`."""
    m = model_config(meta)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": meta["vocab_size"],
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_heads,
        "hidden_act": "silu",
        "intermediate_size": m.dense_hidden or m.top_k * m.expert_hidden,  # as moe/model.py's Block
        "moe_intermediate_size": m.expert_hidden,
        "shared_expert_intermediate_size": m.shared_expert_hidden or 1,
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "norm_topk_prob": m.normalize_expert_weights,
        "decoder_sparse_step": 1,
        "mlp_only_layers": _dense_only(m),
        "max_position_embeddings": meta["max_seq_len"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rms_norm_eps": EPS,
        "tie_word_embeddings": m.tie_embeddings,
        "qkv_bias": True,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
        "use_cache": True,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def _rotate_half_order(w_RD, n_heads: int):
    """q or k rows [H * Dh, D] from interleaved pairs (2i, 2i + 1) to halves (i, i + Dh / 2), within each head."""
    head = w_RD.shape[0] // n_heads
    order = list(range(0, head, 2)) + list(range(1, head, 2))
    return w_RD.view(n_heads, head, -1)[:, order].reshape_as(w_RD)


def _mlp(prefix: str, src: str, sd: dict, scale: float = 1.0) -> dict:
    """A SwiGLU MLP (`SharedExpert`'s gate_proj, up_proj, down_proj) under Qwen2-MoE's names."""
    return {f"{prefix}.gate_proj.weight": sd[f"{src}.gate_proj.weight"],
            f"{prefix}.up_proj.weight": sd[f"{src}.up_proj.weight"],
            f"{prefix}.down_proj.weight": sd[f"{src}.down_proj.weight"] * scale}


def _moe(prefix: str, src: str, sd: dict, m: ModelConfig) -> dict:
    """Router, experts one by one, and the gated shared expert of one MoE layer."""
    E, F_, D = m.num_experts, m.expert_hidden, m.d_model
    out = {f"{prefix}.gate.weight": sd[f"{src}.router.layer.weight"]}
    w1, v1, w2 = (sd[f"{src}.experts.mlp.{n}"].view(E, F_, D) for n in ("w1", "v1", "w2"))
    for e in range(E):
        out[f"{prefix}.experts.{e}.gate_proj.weight"] = w1[e]
        out[f"{prefix}.experts.{e}.up_proj.weight"] = v1[e]
        out[f"{prefix}.experts.{e}.down_proj.weight"] = w2[e].T  # moeflow computes h @ w2: [F, D] -> [D, F]
    if m.shared_expert_hidden:
        out |= _mlp(f"{prefix}.shared_expert", f"{src}.shared_expert", sd, scale=2.0)  # the gate halves it
    else:  # no shared expert: one of width 1 whose weights are zero adds exactly 0
        zero = sd[f"{src}.router.layer.weight"].new_zeros
        out |= {f"{prefix}.shared_expert.gate_proj.weight": zero(1, D),
                f"{prefix}.shared_expert.up_proj.weight": zero(1, D),
                f"{prefix}.shared_expert.down_proj.weight": zero(D, 1)}
    out[f"{prefix}.shared_expert_gate.weight"] = sd[f"{src}.router.layer.weight"].new_zeros(1, D)  # sigmoid 0.5
    return out


class _Reads(dict):
    """A state dict that remembers which tensors were read."""

    def __init__(self, sd: dict):
        super().__init__(sd)
        self.read: set[str] = set()

    def __getitem__(self, key: str):
        self.read.add(key)
        return super().__getitem__(key)


def hf_state_dict(sd: dict, meta: dict) -> dict:
    """moeflow's state dict (`model.safetensors` of `train`) under Qwen2-MoE's tensor names. Every source tensor
    must be read: one the mapping would leave out, or one it needs and the checkpoint lacks, is an ExportError."""
    m, src = model_config(meta), _Reads(sd)
    try:
        out = _mapped(src, m)
    except KeyError as e:
        raise ExportError(f"export: the checkpoint lacks the tensor {e} that {ARCHITECTURE} needs") from None
    if left := sorted(set(sd) - src.read):
        raise ExportError(f"export: tensors the mapping to {ARCHITECTURE} would drop: {left}")
    return {k: v.detach().float().contiguous() for k, v in out.items()}


def _mapped(sd: dict, m: ModelConfig) -> dict:
    D, H = m.d_model, m.n_heads
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    if not m.tie_embeddings:
        out["lm_head.weight"] = sd["head.weight"]
    dense_only = set(_dense_only(m))
    for i in range(m.n_layers):
        src, dst = f"blocks.{i}", f"model.layers.{i}"
        q, k, v = sd[f"{src}.attn.qkv.weight"].split(D)
        out |= {f"{dst}.self_attn.q_proj.weight": _rotate_half_order(q, H),
                f"{dst}.self_attn.k_proj.weight": _rotate_half_order(k, H),
                f"{dst}.self_attn.v_proj.weight": v,
                f"{dst}.self_attn.o_proj.weight": sd[f"{src}.attn.out.weight"],
                f"{dst}.input_layernorm.weight": sd[f"{src}.attn_norm.weight"],
                f"{dst}.post_attention_layernorm.weight": sd[f"{src}.ffn_norm.weight"]}
        for n in "qkv":
            out[f"{dst}.self_attn.{n}_proj.bias"] = q.new_zeros(D)
        if i in dense_only:
            out |= _mlp(f"{dst}.mlp", f"{src}.mlp", sd)
        else:
            out |= _moe(f"{dst}.mlp", f"{src}.moe", sd, m)
    return out


def tokenizer_files(tokenizer_json: Path, out: Path, eos: str, max_len: int) -> None:
    """`tokenizer.json` as moeflow trained or took it, and the two files `AutoTokenizer` reads beside it: the
    fast tokenizer as it is (no class that would rebuild it from vocab and merges), EOS as the separator."""
    (out / "tokenizer.json").write_bytes(Path(tokenizer_json).read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": eos, "unk_token": None,
        "pad_token": None, "add_bos_token": False, "add_eos_token": False, "model_max_length": max_len,
        "clean_up_tokenization_spaces": False}, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": eos, "bos_token": eos}, indent=2))

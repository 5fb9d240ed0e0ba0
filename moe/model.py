"""A decoder-only transformer with MoE feed-forwards (RMSNorm, RoPE, SDPA; optional dense first layers).

Legend: B batch, S sequence, D model width, H heads, Dh head width, V vocabulary.

Initialisation is GPT-2's (as nanoGPT and Megatron-LM's scaled init apply it), the same for dense and MoE
layers: every matrix (the embedding, an untied LM head, attention's qkv, the router, experts' and MLPs' input
projections) is drawn from normal(0, 0.02); the projections that write into the residual stream
(attention's `out`, experts' `w2`, dense and shared MLPs' `down_proj`) from normal(0, 0.02 / sqrt(2 *
n_layers)), so the 2 * n_layers updates a token's residual stream receives add up to a variance that does
not grow with depth; RMSNorm gains start at 1. `init_weights` applies it by parameter name, after the
modules are built, so the MegaBlocks backend (which shares the reference layer's tensors) gets it too.

Packed rows hold several documents, each followed by EOS. By default attention is causal over the whole row
(nanoGPT's and OLMo's default): a document sees the end of the one before it, and positions run on across
the boundary. With `document_eos` set (`train.document_mask: true`, as Llama 3 and Olmo 3 train) each EOS
opens a document: a token attends only to its own document (the EOS before it included) and its rotary
position counts from that EOS, so a document is computed as if it were alone in the row.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.configs import ModelConfig
from moeflow.moe.backend import build_moe
from moeflow.moe.experts import SharedExpert


def rope_tables(seq_len: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)  # (S, Dh/2)
    return angles.cos(), angles.sin()


def apply_rope(x_BHSDh: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BHSDh[..., 0::2], x_BHSDh[..., 1::2]
    rot = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rot.flatten(-2).type_as(x_BHSDh)


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask_B1SS: torch.Tensor | None = None) -> torch.Tensor:
        """cos, sin: [S, Dh/2], or [B, 1, S, Dh/2] with positions per document; mask: None for causal."""
        B, S, D = x_BSD.shape
        q, k, v = self.qkv(x_BSD).view(B, S, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1SS, is_causal=mask_B1SS is None)
        return self.out(y.transpose(1, 2).reshape(B, S, D))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: bool):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg.d_model, cfg.n_heads)
        self.ffn_norm = nn.RMSNorm(cfg.d_model)
        if moe:
            self.moe = build_moe(cfg)
        else:  # a dense MLP as wide as the experts a token visits: equal active parameters
            self.mlp = SharedExpert(cfg.d_model, cfg.dense_hidden or cfg.top_k * cfg.expert_hidden, cfg.glu)

    def forward(self, x, cos, sin, mask=None) -> tuple[torch.Tensor, dict | None]:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        if hasattr(self, "moe"):
            y, aux = self.moe(self.ffn_norm(x))
            return x + y, aux
        return x + self.mlp(self.ffn_norm(x)), None


INIT_STD = 0.02
RESIDUAL_OUTPUTS = ("attn.out.weight", "experts.mlp.w2", "down_proj.weight")  # write into the residual stream


def init_weights(model: nn.Module, n_layers: int) -> None:
    """GPT-2's initialisation (module docstring), in parameter order: the same draws from the same seed."""
    scaled = INIT_STD / math.sqrt(2 * n_layers)
    for name, p in model.named_parameters():
        if p.dim() >= 2:  # norm gains keep their 1
            nn.init.normal_(p, std=scaled if name.endswith(RESIDUAL_OUTPUTS) else INIT_STD)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, max_seq_len: int, document_eos: int | None = None):
        super().__init__()
        self.cfg, self.vocab_size, self.document_eos = cfg, vocab_size, document_eos
        self.embed = nn.Embedding(vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, cfg.is_moe(i)) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        # skip_init: no draws of its own, so every other parameter gets the draws it gets when tied
        rows = cfg.output_classes or vocab_size
        self.head = None if cfg.tie_embeddings else nn.utils.skip_init(nn.Linear, cfg.d_model, rows, bias=False)
        # `factored_head`: each token's vector for the choice among its class's tokens (registered last, drawn
        # last: every other parameter's draws are those of a model without it)
        self.within = (nn.Parameter(torch.empty(vocab_size, cfg.d_model))
                       if cfg.output_classes and cfg.factored_head else None)
        init_weights(self, cfg.n_layers)
        # `unigram_head_bias`: zeros until `init_head_bias` is given the training mix's counts
        self.head_bias = nn.Parameter(torch.zeros(rows)) if cfg.unigram_head_bias else None
        cos, sin = rope_tables(max_seq_len, cfg.d_model // cfg.n_heads)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens_BS: torch.Tensor, return_hidden: bool = False) -> tuple:
        """Logits [B, S, V] and, for each MoE layer in order, its aux losses and metrics; with `return_hidden`,
        the head's input [B, S, D] third (a factored head's loss needs it)."""
        hidden_BSD, auxes = self.features(tokens_BS)
        logits_BSV = self.logits(hidden_BSD)
        return (logits_BSV, auxes, hidden_BSD) if return_hidden else (logits_BSV, auxes)

    def features(self, tokens_BS: torch.Tensor) -> tuple[torch.Tensor, list[dict]]:
        """The LM head's input [B, S, D] and each MoE layer's aux losses and metrics: `forward` without the head."""
        x = self.embed(tokens_BS)
        attention = self.attention_inputs(tokens_BS)
        auxes = []
        for block in self.blocks:
            x, aux = block(x, *attention)
            if aux is not None:
                auxes.append(aux)
        return self.norm(x), auxes

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: the embedding matrix when tied, else its own; plus the unigram bias, if any."""
        out = hidden @ self.embed.weight.T if self.head is None else self.head(hidden)
        return out if self.head_bias is None else out + self.head_bias.to(out.dtype)  # bf16 stays bf16

    @torch.no_grad()
    def init_head_bias(self, counts: torch.Tensor) -> None:
        """Set the head's bias to the log frequency of each token in `counts` [V] (add-one smoothed; with
        `output_classes`, of each class): at step 0 the model predicts the unigram distribution."""
        rows = self.head_bias.numel()
        per_row = torch.zeros(rows, dtype=torch.float64).index_add_(
            0, torch.arange(len(counts)) % rows, counts.double()) + 1
        self.head_bias.copy_((per_row / per_row.sum()).log().float())

    def targets(self, next_BS: torch.Tensor) -> torch.Tensor:
        """What the head predicts of the next tokens: the tokens, or with `output_classes` their classes."""
        return next_BS if self.cfg.output_classes is None else next_BS % self.cfg.output_classes

    def within_nll(self, hidden_BSD: torch.Tensor, next_BS: torch.Tensor) -> torch.Tensor:
        """With `factored_head`: -log P(token | its class) of each next token [B, S], a softmax over the class's
        members (ids class, class + C, class + 2C, ... below the vocabulary's size), so that with the class's
        cross-entropy it is the token's own: a head over C classes and V / C members costs D (C + V / C) a
        position in place of D V."""
        C, V = self.cfg.output_classes, self.vocab_size
        K = -(-V // C)  # members of the fullest class
        ids_BSK = (next_BS % C).unsqueeze(-1) + C * torch.arange(K, device=next_BS.device)
        real_BSK = ids_BSK < V
        members_BSKD = self.within[ids_BSK.clamp(max=V - 1)]
        logits_BSK = torch.einsum("bsd,bskd->bsk", hidden_BSD.float(), members_BSKD.float())
        logits_BSK = logits_BSK.masked_fill(~real_BSK, float("-inf"))
        return -logits_BSK.log_softmax(-1).gather(-1, (next_BS // C).unsqueeze(-1)).squeeze(-1)

    def attention_inputs(self, tokens_BS: torch.Tensor) -> tuple:
        """(cos, sin, mask) for every block: the row's positions and causal attention, or, with
        `document_eos`, positions from each document's EOS and attention within the document."""
        B, S = tokens_BS.shape
        if self.document_eos is None:
            return self.rope_cos[:S], self.rope_sin[:S], None
        opens_BS = tokens_BS == self.document_eos
        doc_BS = opens_BS.cumsum(1)  # each EOS opens the next document
        at_BS = torch.arange(S, device=tokens_BS.device).expand(B, S)
        pos_BS = at_BS - torch.where(opens_BS, at_BS, 0).cummax(1).values
        causal_SS = torch.ones(S, S, dtype=torch.bool, device=tokens_BS.device).tril()
        mask_B1SS = ((doc_BS[:, :, None] == doc_BS[:, None, :]) & causal_SS).unsqueeze(1)
        return self.rope_cos[pos_BS].unsqueeze(1), self.rope_sin[pos_BS].unsqueeze(1), mask_B1SS

    def num_params(self) -> dict[str, int]:
        """Total and active parameters (active: each token uses top_k of num_experts experts)."""
        shards = getattr(self, "expert_shards", 1)  # experts split across ranks: count every rank's
        expert = shards * sum(p.numel() for n, p in self.named_parameters() if ".experts." in n)
        total = sum(p.numel() for n, p in self.named_parameters() if ".experts." not in n) + expert
        inactive = expert * (self.cfg.num_experts - self.cfg.top_k) // self.cfg.num_experts
        # lookup tables: the embedding, and a factored head's per-token vectors (a position reads a class's own)
        embedding = self.embed.weight.numel() + (self.within.numel() if self.within is not None else 0)
        bias = self.head_bias.numel() if self.head_bias is not None else 0  # an add, not a matmul: no FLOPs
        return {"total": total, "active": total - inactive, "expert": expert, "embedding": embedding,
                "active_non_embedding": total - inactive - embedding - bias}

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 x active non-embedding parameters + attention (PaLM appendix B),
        plus a tied LM head's matmul (6 x embedding); an untied head is a non-embedding matrix; a factored
        head's choice within a class reads that class's members' vectors (6 x D x V / C)."""
        p = self.num_params()
        attention = 12 * self.cfg.n_layers * self.cfg.d_model * seq_len
        head = p["embedding"] if self.head is None else 0
        if self.within is not None:
            head = self.cfg.d_model * -(-self.vocab_size // self.cfg.output_classes)
        return 6 * (p["active_non_embedding"] + head) + attention


def lm_loss(
    model: Transformer, batch_BS: torch.Tensor, logit_z: bool = False
) -> tuple[torch.Tensor, list[dict], torch.Tensor]:
    """(cross-entropy, per-MoE-layer aux, logits z-loss or 0) of next-token prediction on a batch."""
    logits_BSV, auxes, hidden_BSD = model(batch_BS[:, :-1], return_hidden=True)
    logits = logits_BSV.reshape(-1, logits_BSV.shape[-1]).float()
    ce = F.cross_entropy(logits, model.targets(batch_BS[:, 1:]).reshape(-1))
    if model.within is not None:  # factored head: the class's cross-entropy plus the token's within it
        ce = ce + model.within_nll(hidden_BSD, batch_BS[:, 1:]).mean()
    # only when asked: a logsumexp over every logit costs about a tenth of a tiny model's step
    z = torch.logsumexp(logits, dim=-1).square().mean() if logit_z else ce.new_zeros(())
    return ce, auxes, z

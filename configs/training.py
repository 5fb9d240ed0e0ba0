"""The model's and training's config: model shape and backend, training, alarms, ranks, ladder, evaluation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from moeflow.configs.base import Frozen, operational


class ModelConfig(Frozen):
    d_model: int = Field(default=128, gt=0)
    n_layers: int = Field(default=2, gt=0)
    n_heads: int = Field(default=4, gt=0)
    num_experts: int = Field(default=8, gt=0)
    top_k: int = Field(default=2, gt=0)
    expert_hidden: int = Field(default=256, gt=0)
    shared_expert_hidden: int = Field(default=0, ge=0)  # 0: no shared expert
    glu: bool = True  # SwiGLU experts (w1, v1, w2) or a plain GELU MLP (w1, w2)
    backend: Literal["torch", "megablocks"] = "torch"
    # None: dropless. A number: each expert takes at most ceil(cf * tokens * top_k / experts) assignments
    # (first come, first served) and the rest are dropped: the comparison variant, it reports its drop rate.
    capacity_factor: float | None = Field(default=None, gt=0)
    moe_every: int = Field(default=1, ge=1)  # an MoE FFN in every k-th layer (counted after the dense ones)
    dense_layers: int = Field(default=0, ge=0)  # the first N layers use a dense MLP
    dense_hidden: int | None = Field(
        default=None, gt=0
    )  # default: top_k * expert_hidden (equal active width)
    router_jitter: float = Field(default=0.0, ge=0, lt=1)  # multiplicative input noise while training
    # DeepSeek-V3's auxiliary-loss-free balancing (torchtitan's `load_balance_coeff`, OLMo-core's `bias_gamma`):
    # a per-expert bias added to the router's probabilities for the top-k choice only (the weights stay
    # unbiased), moved by this much after each optimizer step towards the step's mean load,
    # bias_e += rate * sign(mean load - load_e); none: no bias
    router_bias_rate: float | None = Field(default=None, gt=0)
    normalize_expert_weights: bool = True  # the top-k routing weights sum to 1
    # true: the LM head is the embedding matrix (GPT-2, nanoGPT); false: its own matrix (Llama, OLMo)
    tie_embeddings: bool = True
    # the LM head predicts each next token's class, its id modulo this, in place of the token: a head this
    # many rows wide, for a mixture search's cheap proxies (`mix.search.output_classes`); none: the token
    output_classes: int | None = Field(default=None, gt=1)
    # with output_classes: the head also picks the token among its class's members (a two-level softmax), so
    # the loss is each next token's own cross-entropy, log P(class) + log P(token | class), at about the
    # class head's cost
    factored_head: bool = False
    # the LM head adds a bias that starts at the log of each token's (or class's) frequency in the training mix,
    # so step 0 predicts the unigram distribution: a narrow tied head otherwise spends its first steps learning it
    # (width 16 sat at ln V for 10-15 steps), which is most of a short run and no measure of the model's capacity.
    # Off by default: no stock architecture that vLLM serves has a head bias, so a model with it cannot be
    # exported exactly (export/convert.py); what leaving it off costs is measured in benchmarks/README.md
    unigram_head_bias: bool = False

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.output_classes is not None and self.tie_embeddings:
            raise ValueError("output_classes needs tie_embeddings: false (the head is not the embedding)")
        if self.factored_head and self.output_classes is None:
            raise ValueError("factored_head needs output_classes (the classes it factors the vocabulary into)")
        if self.d_model % self.n_heads:
            raise ValueError("d_model must be divisible by n_heads")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("d_model / n_heads must be even (rotary embeddings rotate pairs)")
        if self.top_k > self.num_experts:
            raise ValueError("top_k must be <= num_experts")
        if self.dense_layers > self.n_layers:
            raise ValueError("dense_layers must be <= n_layers")
        if self.backend == "megablocks" and self.capacity_factor is not None:
            raise ValueError(
                "capacity_factor is the reference backend's comparison variant; megablocks dMoE is dropless"
            )
        if self.backend == "megablocks" and self.router_bias_rate is not None:
            raise ValueError(
                "router_bias_rate (auxiliary-loss-free balancing) biases moeflow's router, and backend megablocks "
                "routes with dMoE's own: use backend: torch, or remove router_bias_rate"
            )
        if self.backend == "megablocks" and self.expert_hidden * self.num_experts < 128:
            raise ValueError(
                "backend megablocks needs expert_hidden * num_experts >= 128 (dMoE's constructor takes "
                f"log2 of it / 128); expert_hidden={self.expert_hidden} * num_experts={self.num_experts} = "
                f"{self.expert_hidden * self.num_experts}"
            )
        return self

    def is_moe(self, layer: int) -> bool:
        return layer >= self.dense_layers and (layer - self.dense_layers) % self.moe_every == 0


Action = Literal["log", "stop"]


class AlarmActions(Frozen):
    """What each kind of alarm does: `log` it, or `stop` the run (failing the stage); unset: `alarms.stop`'s."""

    loss_spike: Action | None = None
    grad_norm: Action | None = None  # the jump against the window
    grad_norm_ceiling: Action | None = None
    grad_norm_trend: Action | None = None
    ladder_band: Action | None = None


class AlarmConfig(Frozen):
    window: int = Field(default=20, ge=2)  # steps of history the bands are computed from
    loss_spike: float = Field(default=0.5, gt=0)  # alarm when loss > (1 + this) x the window's median
    grad_norm_sigma: float = Field(
        default=6.0, gt=0
    )  # alarm when grad norm > mean + sigma x std of the window
    grad_norm_ratio: float = Field(default=1.5, ge=1)  # ... and > this x the window's mean (a quiet window's
    # std is tiny, and small wobbles would otherwise alarm)
    # alarm when the grad norm crosses this: a slow climb moves the jump rule's window along with it
    grad_norm_ceiling: float | None = Field(default=None, gt=0)
    # alarm when the mean grad norm of the last `trend_window` steps crosses this x the mean of the
    # `trend_window` steps before them
    grad_norm_trend: float | None = Field(default=None, gt=1)
    trend_window: int = Field(default=50, ge=2)
    # the band alarms once `band_patience` of the last `band_of` smoothed steps are outside it (default
    # `band_of`: `band_patience`, so that many in a row; 1: the first step outside)
    band_patience: int = Field(default=1, ge=1)
    band_of: int | None = Field(default=None, ge=1)
    stop: bool = False  # stop the run (failing the stage) on the first alarm whose kind `actions` leaves unset
    actions: AlarmActions = AlarmActions()

    @model_validator(mode="after")
    def _check(self) -> AlarmConfig:
        if self.band_of is not None and self.band_of < self.band_patience:
            raise ValueError(
                f"train.alarms.band_of={self.band_of} must be at least band_patience={self.band_patience} "
                "(the band alarms once band_patience of the last band_of smoothed steps are outside it)"
            )
        return self

    def action(self, rule: str) -> Action:
        """What an alarm of kind `rule` does."""
        return getattr(self.actions, rule) or ("stop" if self.stop else "log")


class DistributedConfig(Frozen):
    """Training across processes: the train stage launches torchrun when this asks for more than one."""

    nproc_per_node: int = Field(default=1, ge=1)  # ranks on this node (CPU: gloo; CUDA: NCCL, one GPU each)
    nnodes: int = Field(default=1, ge=1)  # >1: start the same command on every node (README, multi-node)
    node_rank: int = Field(default=0, ge=0)
    rdzv_endpoint: str = "127.0.0.1:0"  # host:port of the rendezvous; port 0: a free port (one node only)
    expert_parallel: bool = True  # experts split across ranks (ragged all-to-all); false: replicated

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @model_validator(mode="after")
    def _check(self) -> DistributedConfig:
        if self.node_rank >= self.nnodes:
            raise ValueError(
                f"train.distributed.node_rank={self.node_rank} must be below nnodes={self.nnodes}"
            )
        if self.nnodes > 1 and self.rdzv_endpoint.endswith(":0"):
            raise ValueError(
                "train.distributed.rdzv_endpoint needs a fixed host:port that every node can reach "
                "when nnodes > 1"
            )
        return self


class TrainConfig(Frozen):
    steps: int = Field(default=300, gt=0)
    batch_size: int = Field(default=16, gt=0)  # sequences per optimizer step
    grad_accum: int = Field(default=1, ge=1)  # micro-batches per step (batch_size must divide evenly)
    seq_len: int = Field(default=128, gt=1)
    lr: float = Field(default=3e-3, gt=0)
    schedule: Literal["cosine", "wsd"] = "cosine"  # warmup then cosine, or warmup-stable-decay
    decay_fraction: float = Field(default=0.2, gt=0, le=1)  # wsd: the share of steps spent decaying
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup_steps: int = Field(default=20, ge=0)
    weight_decay: float = Field(default=0.1, ge=0)  # on matrices (moe/optim.py)
    embedding_weight_decay: bool = False  # decay the tied embedding / LM head too (OLMo-core: off)
    # false: a packed row's documents attend across their EOS separators and positions run on (nanoGPT, OLMo);
    # true: attention within each document, positions from its start (Llama 3, Olmo 3); evaluation follows
    document_mask: bool = False
    grad_clip: float = Field(default=1.0, gt=0)
    # where it computes (auto: CUDA when present); like the number of ranks, not part of the key
    device: Literal["auto", "cpu", "cuda"] = operational("auto")
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: autocast where the device supports it
    # Both router losses are averaged over the MoE layers, where Switch, ST-MoE and Megatron add each layer's:
    # a Switch-style coefficient a per layer is a * (MoE layers) here (0.01 here is 0.01 / L there).
    load_balance_coef: float = Field(default=0.01, ge=0)
    router_z_coef: float = Field(default=0.001, ge=0)
    # DeepSeek-V3's sequence-wise balance loss: the load-balancing loss of each sequence on its own, averaged over
    # the sequences (and the MoE layers), so no single sequence crowds a few experts
    sequence_balance_coef: float = Field(default=0.0, ge=0)
    logit_z_coef: float = Field(default=0.0, ge=0)  # z-loss on the LM head's logits
    # exact resume makes the checkpoint cadence invisible in the weights
    checkpoint_every: int = operational(100, gt=0)
    keep_checkpoints: int = operational(2, ge=1)
    log_every: int = operational(10, gt=0)
    # Keyed although they only watch the run: they decide bytes of its artifact (the MFU field of
    # metrics.jsonl, alarms.jsonl) and, with a `stop` action, where it ends. The live view and TensorBoard show
    # them while it runs, so the artifact keeps them as they were; changing them trains again.
    peak_tflops: float | None = Field(default=None, gt=0)  # the device's peak, for MFU; unset: a known GPU's
    alarms: AlarmConfig = AlarmConfig()
    # one checkpoint serves any number of ranks
    distributed: DistributedConfig = operational(DistributedConfig())

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.batch_size % self.grad_accum:
            raise ValueError("batch_size must be divisible by grad_accum")
        world = self.distributed.world_size
        if (self.batch_size // self.grad_accum) % world:
            raise ValueError(
                f"train.batch_size / grad_accum = {self.batch_size // self.grad_accum} sequences "
                f"per micro-batch must split evenly over the {world} ranks of train.distributed"
            )
        return self


class TrainStageConfig(Frozen):
    """What the train stage and each ladder rung receive.

    The model, the run, the seed, the band's tolerance: keyed, for it decides the band fields of
    metrics.jsonl and the band alarms (a rung, which has no band, gets 0).
    """

    model: ModelConfig
    train: TrainConfig
    seed: int
    band_tolerance: float = Field(default=0.05, ge=0)  # the ladder band's extra width


class LadderConfig(Frozen):
    """Small runs of the target's recipe (same data, tokenizer, schedule shape, MoE ratios) that predict the
    target run's loss before it starts (`fit`: how, moe/ladder.py)."""

    # additive: held-out losses of the first width at the target's steps and at a few, and of the target's
    # own shape at those few: L(N, D) = g(N) + h(D) gives the target's (moe/ladder.py); compute: rungs of every
    # width, final training losses fitted against FLOPs (at least 3 widths; it missed tiny by 11-17%)
    fit: Literal["compute", "additive"] = "additive"
    widths: tuple[int, ...] = Field(default=(32,), min_length=1)  # d_model of each rung (x head width)
    layers: tuple[int, ...] | None = None  # n_layers of each rung; default: the target's
    budget_fraction: float = Field(default=0.3, gt=0, le=1)  # ladder FLOPs / target FLOPs
    min_steps: int = Field(default=20, ge=3)  # a rung trains at least this long, whatever the budget
    bootstrap: int = Field(default=200, ge=10)  # resamples of the rungs for the prediction's band
    # extra relative width of the target run's band: in the train stage's key, not the ladder's (its fit
    # does not use it)
    band_tolerance: float = operational(0.05, ge=0)

    @model_validator(mode="after")
    def _check(self) -> LadderConfig:
        if self.layers is not None and len(self.layers) != len(self.widths):
            raise ValueError("ladder.layers must give one layer count per width")
        if self.fit == "compute" and len(self.widths) < 3:
            raise ValueError("ladder.widths: the compute fit needs at least 3 widths (or fit: additive)")
        return self


class EvalConfig(Frozen):
    max_sequences_per_domain: int = Field(default=64, gt=0)
    # benchmark scores (`moe.scores`): at most this many items per task, a fixed subset drawn with
    # `benchmark_seed`; 0 scores none
    benchmark_items: int = Field(default=100, ge=0)
    benchmark_seed: int = 0
    # where evaluation computes; unset: `train.device` (the evaluate stage fills it in)
    device: Literal["auto", "cpu", "cuda"] | None = operational(None)


class ExportConfig(Frozen):
    """The `export` stage: the trained model as a stock `transformers` folder (`Qwen2MoeForCausalLM`), loaded
    back and compared with moeflow's own forward on the evaluation's held-out rows (export/)."""

    # the largest |log p(moeflow) - log p(transformers)| over every held-out token allowed, in float32: the stage
    # fails above it (rounding of the two implementations' sums is ~1e-6; a wrong tensor is ~1)
    tolerance: float = Field(default=1e-4, gt=0)
    # held-out rows per domain compared; unset: evaluate.max_sequences_per_domain (the rows the card's loss is on)
    max_sequences_per_domain: int | None = Field(default=None, gt=0)
    # where the comparison computes; unset: evaluate's device
    device: Literal["auto", "cpu", "cuda"] | None = operational(None)

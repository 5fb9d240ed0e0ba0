"""The stages this package declares: `proxy`, `mix_search`, `rung`, `ladder`, `train` and `evaluate`.

Their bodies are named, not imported (`Lazy`): they import torch, which a data stage's worker process should
not hold."""

from __future__ import annotations

from moeflow.configs import EvalConfig, RunConfig, TrainStageConfig
from moeflow.core.stage import Lazy, Stage

TRAIN_LIBS = ("torch", "numpy", "safetensors")


def _train_config(c: RunConfig) -> TrainStageConfig:
    return TrainStageConfig(
        model=c.model, train=c.train, seed=c.seed, band_tolerance=c.ladder.band_tolerance if c.ladder else 0.0
    )


def _rung_config(c: RunConfig) -> TrainStageConfig:
    """A rung trains before there is a band to watch: its key holds no tolerance."""
    return TrainStageConfig(model=c.model, train=c.train, seed=c.seed, band_tolerance=0.0)


def _train_libs(s: TrainStageConfig) -> tuple[str, ...]:
    """The MegaBlocks backend's own distributions count only when it is the backend that trains."""
    megablocks = ("megablocks", "stanford-stk", "grouped_gemm") if s.model.backend == "megablocks" else ()
    return TRAIN_LIBS + megablocks


def _ladder_config(c: RunConfig) -> dict:
    """The additive fit also scores its rungs on the target's held-out rows, as evaluation does."""
    s = {"ladder": c.ladder, "model": c.model, "train": c.train, "seed": c.seed, "phases": c.phases()}
    if c.ladder and c.ladder.fit == "additive":
        s |= {"eval_sequences": c.evaluate.max_sequences_per_domain, "device": c.evaluate.device or c.train.device}
    return s


def _search_config(c: RunConfig) -> dict:
    """What the search's fit and choice read: the declared mix and the target it chooses for."""
    weights = {d: w / sum(c.mix.weights.values()) for d, w in c.mix.weights.items()}
    return {"search": c.mix.search, "weights": weights, "max_epochs": c.mix.max_epochs,
            "heldout_fraction": c.mix.heldout.fraction, "phases": c.phases(), "batch_size": c.train.batch_size,
            "model": c.model, "train": c.train, "seed": c.seed,
            "eval_sequences": c.evaluate.max_sequences_per_domain, "device": c.evaluate.device or c.train.device}


# a mixture-search proxy: a rung's kind of run under its own name, so neither card nor ladder takes one for the other
PROXY = Stage("proxy", _rung_config, Lazy("moeflow.moe.launch:stage"), _train_libs, resumable=True)
MIX_SEARCH = Stage("mix_search", _search_config, Lazy("moeflow.moe.mix_search:stage"),
                   ("scipy", "pyarrow", "tokenizers", *TRAIN_LIBS))
RUNG = Stage("rung", _rung_config, Lazy("moeflow.moe.launch:stage"), _train_libs, resumable=True)
LADDER = Stage("ladder", _ladder_config, Lazy("moeflow.moe.ladder:stage"), ("scipy", *TRAIN_LIBS))
TRAIN = Stage("train", _train_config, Lazy("moeflow.moe.launch:stage"), _train_libs, resumable=True)
def _evaluate_config(c: RunConfig) -> EvalConfig:
    """Evaluation computes where training does unless `evaluate.device` says otherwise."""
    return c.evaluate.model_copy(update={"device": c.evaluate.device or c.train.device})


# the tokenizer encodes the benchmark requests; pyarrow reads the held-out rows and the benchmark index. It reads
# every held-out row of the mix (a domain's loss takes some of them), so the rows and documents count as the mix's
EVALUATE = Stage("evaluate", _evaluate_config, Lazy("moeflow.moe.evaluate:stage"),
                 (*TRAIN_LIBS, "tokenizers", "pyarrow"), reads="mix",
                 counts=(("heldout_sequences", "heldout_sequences", "held-out rows"),
                         ("heldout_documents", "heldout_documents", "held-out documents")), section="evaluate")

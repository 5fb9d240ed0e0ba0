"""Training-health plots for the model card: PNGs from the train artifact's metrics, byte-stable across runs.

loss.png (cross-entropy, the ladder's band when there is one, learning rate), grad_norm.png (total and
per parameter group), balance.png (load imbalance per MoE layer, token drop rate) and expert_load.png
(each MoE layer's share of tokens per expert over the steps). Curriculum phase boundaries, the end of
warmup and the start of the WSD decay are marked. PNG metadata carries no software version or date,
so equal metrics give equal bytes.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

PLOTS = ("loss.png", "grad_norm.png", "balance.png", "expert_load.png")


@functools.cache
def _pyplot():
    # matplotlib is imported when a plot is drawn: every data worker imports this package for the card stage's
    # declaration (card/stages.py), and matplotlib costs it ~40 MB and a second of start-up for nothing
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    plt = _pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def _marks(ax, train_cfg: dict, rs: list[dict] | None = None) -> None:
    for i in range(1, len(rs or [])):  # curriculum phase boundaries (the context length may change there)
        if rs[i].get("phase") != rs[i - 1].get("phase"):
            ax.axvline(
                rs[i]["step"] - 0.5,
                color="tab:purple",
                lw=1.0,
                ls="-.",
                label=f"phase {rs[i]['phase']} (context {rs[i].get('seq_len')})",
            )
    if train_cfg.get("warmup_steps"):
        ax.axvline(train_cfg["warmup_steps"], color="grey", lw=0.8, ls=":", label="end of warmup")
    if train_cfg.get("schedule") == "wsd":
        start = train_cfg["steps"] - max(1, round(train_cfg["decay_fraction"] * train_cfg["steps"]))
        ax.axvline(start, color="grey", lw=0.8, ls="--", label="decay starts")


def health(metrics: Path, train_cfg: dict, out: Path) -> list[str]:
    """Draw the plots into `out`; return their file names."""
    out.mkdir(parents=True, exist_ok=True)
    rs = [json.loads(line) for line in Path(metrics).read_text().splitlines()]
    step = np.array([r["step"] for r in rs])
    _loss(rs, step, train_cfg, out / "loss.png")
    _grad_norm(rs, step, train_cfg, out / "grad_norm.png")
    _balance(rs, step, train_cfg, out / "balance.png")
    _expert_load(rs, step, out / "expert_load.png")
    return list(PLOTS)


def _loss(rs: list[dict], step: np.ndarray, train_cfg: dict, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(step, [r["ce"] for r in rs], lw=0.9, label="cross-entropy")
    if "ladder_band" in rs[-1]:
        band = np.array([r.get("ladder_band", [np.nan, np.nan]) for r in rs], dtype=float)
        ax.fill_between(step, band[:, 0], band[:, 1], alpha=0.2, color="tab:orange", label="ladder band")
    _marks(ax, train_cfg, rs)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    lr = ax.twinx()
    lr.plot(step, [r["lr"] for r in rs], color="tab:green", lw=0.7)
    lr.set_ylabel("learning rate", color="tab:green")
    ax.legend(loc="upper right", fontsize=8)
    _save(fig, path)


def _grad_norm(rs: list[dict], step: np.ndarray, train_cfg: dict, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(step, [r["grad_norm"] for r in rs], lw=0.9, color="black", label="total")
    for group in sorted(rs[-1].get("grad_norm_groups", {})):
        ax.plot(step, [r["grad_norm_groups"].get(group, np.nan) for r in rs], lw=0.6, label=group)
    _marks(ax, train_cfg, rs)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("grad norm (before clipping)")
    ax.legend(fontsize=7, ncol=2)
    _save(fig, path)


def _balance(rs: list[dict], step: np.ndarray, train_cfg: dict, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    imbalance = np.array([r["load_imbalance"] for r in rs], dtype=float)
    for layer in range(imbalance.shape[1]):
        ax.plot(step, imbalance[:, layer], lw=0.8, label=f"MoE layer {layer}")
    ax.set_xlabel("step")
    ax.set_ylabel("load imbalance (max / mean)")
    _marks(ax, train_cfg, rs)
    drop = ax.twinx()
    drop.plot(step, [r["token_drop_rate"] for r in rs], color="tab:red", lw=0.8)
    drop.set_ylabel("token drop rate", color="tab:red")
    ax.legend(fontsize=8)
    _save(fig, path)


def _expert_load(rs: list[dict], step: np.ndarray, path: Path) -> None:
    plt = _pyplot()
    load = np.array([r["tokens_per_expert"] for r in rs], dtype=float)  # (steps, layers, experts)
    share = load / load.sum(axis=2, keepdims=True)
    fig, axes = plt.subplots(1, share.shape[1], figsize=(3.5 * share.shape[1], 3.2), squeeze=False)
    for layer, ax in enumerate(axes[0]):
        im = ax.imshow(
            share[:, layer, :].T,
            aspect="auto",
            origin="lower",
            cmap="viridis",
            extent=(step[0], step[-1], -0.5, share.shape[2] - 0.5),
            vmin=0,
            vmax=max(0.5, share.max()),
        )
        ax.set_title(f"MoE layer {layer}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("expert")
    fig.colorbar(im, ax=axes[0].tolist(), label="share of tokens")
    fig.savefig(path, dpi=90, metadata={"Software": None}, bbox_inches="tight")
    plt.close(fig)


WATERFALL = "filter_waterfall.png"


def _read(counts: dict) -> int:
    """Documents a stage read of a source, from its per-source counts (kept, dropped:<reason>)."""
    return counts.get("kept", 0) + sum(n for k, n in counts.items() if k.startswith("dropped:"))


def waterfall(stats: dict, steps: list[str], quality: dict | None = None) -> dict[str, list[tuple[str, int, int]]]:
    """Per source, from the filter stage's stats: (step, documents it removed, documents left after it) in
    the order the steps ran, after ("read", 0, documents in); drops no configured step names, as "other".
    Given the quality stage's stats (with its per-source counts), then "dedup" (what left between the filter
    and the quality stage) and "quality" (what the classifier's rule or the coherence rule dropped)."""
    out = {}
    later = (quality or {}).get("by_source")
    for src, counts in sorted(stats.get("by_source", {}).items()):
        left = _read(counts)
        rows = [("read", 0, left)]
        for step in steps:
            removed = sum(n for k, n in counts.items() if k.startswith(f"dropped:{step}."))
            left -= removed
            rows.append((step, removed, left))
        rows.append(("other", left - counts.get("kept", 0), counts.get("kept", 0)))
        if later is not None:
            scored = later.get(src, {})
            rows.append(("dedup", counts.get("kept", 0) - _read(scored), _read(scored)))
            rows.append(("quality", _read(scored) - scored.get("kept", 0), scored.get("kept", 0)))
        out[src] = rows
    if not any(rows[len(steps) + 1][1] for rows in out.values()):  # every source has the same columns
        for rows in out.values():
            del rows[len(steps) + 1]
    return out


def filter_waterfall(rows: dict[str, list[tuple[str, int, int]]], path: Path) -> None:
    """Documents left per source after each step (`waterfall`), as grouped bars, the removed count on each."""
    plt = _pyplot()
    steps = [s for s, _, _ in next(iter(rows.values()))] if rows else ["read"]
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(steps)), 3.6))
    width = 0.8 / max(1, len(rows))
    for i, (src, series) in enumerate(rows.items()):
        x = np.arange(len(series)) + i * width
        bars = ax.bar(x, [left for _, _, left in series], width, label=src)
        for bar, (_, removed, _) in zip(bars, series, strict=True):
            if removed:
                ax.annotate(f"-{removed}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(np.arange(len(steps)) + 0.4 - width / 2, steps, rotation=20, ha="right")
    ax.set_ylabel("documents left")
    ax.set_title("documents left after each step, per source (-n: removed by the step)")
    ax.legend(fontsize=7)
    _save(fig, path)


QUALITY = "quality_scores.png"


def quality_line(stats: dict, config: dict, domain: str) -> float | None:
    """Where a domain's keep rule cuts its scores: its threshold, or the score of the last document its
    top_fraction keeps (None when sources of the domain have rules of their own)."""
    rule = config.get("overrides", {}).get(domain) or config["keep"]
    if rule.get("threshold") is not None:
        return rule["threshold"]
    cuts = stats.get("cutoffs", {})
    cut = cuts.get(f"domain:{domain}") or (cuts.get("all") if domain not in config.get("overrides", {}) else None)
    return cut[0] if cut else None


def quality_histograms(stats: dict, config: dict, path: Path) -> None:
    """Per domain, the quality scores in 20 bins of 0.05 with the keep rule's line drawn (documents left of it
    are dropped)."""
    plt = _pyplot()
    domains = sorted(stats.get("by_domain", {}))
    fig, axes = plt.subplots(len(domains) or 1, 1, figsize=(6.4, 1.9 * max(1, len(domains))), squeeze=False)
    for ax, domain in zip(axes[:, 0], domains, strict=False):
        d = stats["by_domain"][domain]
        bins = len(d["histogram"])
        ax.bar(np.arange(bins) / bins, d["histogram"], width=1 / bins, align="edge", color="tab:blue")
        line = quality_line(stats, config, domain)
        if line is not None:
            ax.axvline(line, color="tab:red", linestyle="--", label=f"keep from {line:g}")
            ax.legend(fontsize=7)
        ax.set_xlim(0, 1)
        ax.set_ylabel("documents")
        ax.set_title(f"{domain}: {d['kept']} of {d['documents']} kept", fontsize=9)
    axes[-1, 0].set_xlabel("quality score")
    _save(fig, path)

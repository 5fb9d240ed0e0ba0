"""The model card's training figures beyond the plan: hardware, health, the mixture search, the scaling ladder,
per-rank load."""

from __future__ import annotations

from moeflow.card.sections import table
from moeflow.configs import MixSearchConfig


def hardware(train: dict) -> str:
    """The device training computed on (recorded by the run), then the host it ran on."""
    host = f"{train['host']['platform']}, {train['host']['cpus']} CPUs"
    dev = train["stats"].get("device")
    if dev is None:  # recorded before runs named their device
        return host + (f", {train['host']['cuda']}" if train["host"].get("cuda") else "")
    what = f"{dev['count']} x {dev['name']}" if dev["type"] == "cuda" else f"CPU ({dev['name'] or 'unknown'})"
    return f"trained on {what}; host {host}"


def _alarms(alarms: list[dict], show: int = 5) -> str:
    """Each rule's count (and action, where recorded), then the first alarms."""
    if not alarms:
        return "none"
    kinds: dict[str, int] = {}
    for a in alarms:  # records before alarms named their rule and action start with the rule
        kind = a.get("rule", a["alarm"].split(":")[0]) + (f" ({a['action']})" if "action" in a else "")
        kinds[kind] = kinds.get(kind, 0) + 1
    first = "; ".join(f"step {a['step']}: {a['alarm']}" for a in alarms[:show])
    return (
        ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items()))
        + f". First: {first}"
        + ("; ..." if len(alarms) > show else "")
    )


def health_table(ts: dict) -> str:
    """What the plots show as numbers: token drops, the peak grad norm, the final imbalance, alarms."""
    return table(
        ["field", "value"],
        [
            ["token drop rate (mean over steps)", ts["token_drop_rate"]],
            ["peak grad norm", ts.get("peak_grad_norm", "-")],
            [
                "final load imbalance per MoE layer (max/mean)",
                ", ".join(map(str, ts.get("final_load_imbalance", []))),
            ],
            ["alarms", _alarms(ts.get("alarms", []))],
        ],
    )


def phase_health_table(ts: dict) -> str:
    """Token drops and load imbalance per curriculum phase and MoE layer (empty for a run recorded before)."""
    rows = [[p["phase"], p["seq_len"], p["steps"], p["token_drop_rate"], ", ".join(map(str, p["load_imbalance"]))]
            for p in ts.get("health_by_phase", [])]
    if not rows:
        return ""
    return table(["phase", "context length", "steps", "token drop rate (mean)",
                  "load imbalance per MoE layer (mean, max/mean)"], rows)


def ladder(lad: dict, ts: dict, ev: dict | None) -> dict:
    """The ladder's pre-registered fit and prediction against the loss the run reached: for the additive fit the
    held-out loss averaged over domains (evaluate's), then the final training loss the live band watched."""
    p = lad["stats"]
    additive = p["fit"].get("kind") == "additive"
    prediction = []
    if additive:
        actual = sum(r["loss"] for r in ev["stats"]["heldout"].values()) / len(ev["stats"]["heldout"]) if ev else None
        prediction += _predicted_actual("held-out loss (mean over domains)", p["predicted_heldout_loss"],
                                        p["heldout_band"], actual)
    prediction += _predicted_actual("final training loss (mean of the last tenth of steps)",
                                    p["predicted_final_loss"], p["band"], ts["tail_loss"])
    prediction.append(["training steps whose smoothed loss left the ladder's band",
                       ts.get("steps_outside_ladder_band", "-")])
    rungs = [[i, r["d_model"], r["n_layers"], f"{r['params_active']:,}", r["steps"], f"{r['flops']:.3g}",
              r["final_loss"], r.get("heldout_loss", "-")] for i, r in enumerate(p["rungs"])]
    return {
        "rungs": len(p["rungs"]),
        "fraction": f"{p['ladder_fraction']:.1%}",
        "fit_text": _fit_text(p),
        "artifact": f"ladder-{lad['artifact']['hash']}",
        "rungs_table": table(["rung", "d_model", "layers", "active parameters", "steps", "FLOPs", "final loss",
                              "held-out loss"], rungs),
        "prediction_table": table(["", "predicted (band)", "actual", "relative error (actual - predicted) / actual"],
                                  prediction),
    }


def _predicted_actual(what: str, predicted: float, band: list[float], actual: float | None) -> list[list]:
    if actual is None:
        return [[what, f"{predicted} ({band[0]} to {band[1]})", "not measured", "-"]]
    inside = "inside" if band[0] <= actual <= band[1] else "outside"
    return [[what, f"{predicted} ({band[0]} to {band[1]})", f"{actual:.4f} ({inside} the band)",
             f"{(actual - predicted) / actual:+.2%}"]]


def _fit_text(p: dict) -> str:
    fit = p["fit"]
    if fit.get("kind") == "additive":
        return ("Additive fit of the held-out loss: the narrow rung's loss at the target's steps plus the gain of the "
                "target's shape over it at a few steps, kept whole (Chinchilla's separable L(N, D) = g(N) + h(D)); "
                f"the band spans that gain doubled ({fit['gain_doubled']}) and washed out by the target's tokens "
                f"({fit['gain_washed_out']}), widened by {fit['bootstrap_fits']} resamples of the held-out rows."
                + _lead_text(fit.get("lead")))
    return (f"Fit L(C) = E + A (C / C_target)^-alpha: E = {fit['E']:.4g}, A = {fit['A']:.4g}, alpha = "
            f"{fit['alpha']:.4g} (residual RMS {fit['residual_rms']:.4g}; band from {fit['bootstrap_fits']} "
            "bootstrap refits).")


def _lead_text(lead: dict | None) -> str:
    """What the short rungs' training curves say about the gain the fit rests on (moe/ladder.py `lead_peak`)."""
    if not lead:
        return ""
    where = f"peaked at step {lead['peak_step']} of {lead['steps']}"
    if not lead["still_rising"]:
        return (f" The target's shape's lead over the narrow rung in the short rungs {where}, before they ended: "
                "the gain may shrink by the target's steps, towards the band's upper end.")
    return (f" The target's shape's lead over the narrow rung in the short rungs {where}: it was still growing when "
            "they ended, so expect the target below the prediction, and below the band if the gain more than "
            "doubles by its steps. A larger `ladder.budget_fraction` runs the short rungs longer.")


def mix_search(ms: dict, ev: dict) -> dict:
    """The mixture search's proxies, fit and chosen weights (all from its lineage), and the objective the target
    reached on its own held-out losses."""
    p = ms["stats"]
    domains = sorted(p["declared"])
    proxies = [[r["proxy"], *(f"{r['weights'][d]:.3f}" for d in domains), r["steps"], f"{r['flops']:.3g}",
                f"{r['objective']:.4f}", f"{loo:.4f}"] for r, loo in zip(p["proxies"], p["loo_predicted"])]
    weights = [[d, f"{p['declared'][d]:.3f}", f"{p['weights'][d]:.3f}", f"{p['epochs'].get(d, 0):.2f}"]
               for d in domains]
    actual = MixSearchConfig(objective=p["objective"]).reduce(
        {d: r["loss"] for d, r in ev["stats"]["heldout"].items()})
    return {
        "proxies": len(p["proxies"]),
        "fraction": f"{p['proxy_fraction']:.1%}",
        "tokens": f"{p['proxy_token_fraction']:.1%}" if "proxy_token_fraction" in p else "an unrecorded share",
        "rho": f"{p['loo_rank_correlation']:.3f}",
        "rho_per_domain": ", ".join(f"{d} {r:.3f}" for d, r in sorted(p["loo_rank_correlation_per_domain"].items())),
        "objective_rho": f"{p['loo_objective_rank_correlation']:.3f}",
        "ridge": "an infinite ridge penalty: no transfer" if p.get("ridge") is None
        else f"a ridge penalty of {p['ridge']:g}, chosen by leave-one-out error",
        "objective": "held-out loss averaged over domains" if p["objective"] == "heldout"
        else "held-out loss weighted " + ", ".join(f"{d} {w:g}" for d, w in p["objective"].items()),
        "artifact": f"mix_search-{ms['artifact']['hash']}",
        "registered_at": p["registered_at"],
        "proxies_table": table(["proxy", *(f"w {d}" for d in domains), "steps", "FLOPs", "objective",
                                "predicted without it"], proxies),
        "weights_table": table(["domain", "declared", "chosen", "target epochs (estimated)"], weights),
        "objective_table": table(["", "objective"], [
            ["chosen as", p["chosen_as"]],
            ["predicted for the chosen mix (at the proxies' scale)", f"{p['predicted_objective']:.4f}"],
            *_gain(p),
            ["the target reached (its evaluate stage)", f"{actual:.4f}"]]),
    }


def _gain(p: dict) -> list[list[str]]:
    """The fit's expected gain over the declared mix beside its leave-one-out error (absent from older records)."""
    if "predicted_gain" not in p:
        return []
    return [["predicted for the declared mix", f"{p['predicted_declared']:.4f}"],
            ["predicted gain over the declared mix (the fit's leave-one-out error on the objective)",
             f"{p['predicted_gain']:.4f} ({p['loo_objective_rmse']:.4f})"]]


def ranks(d: dict, model: dict) -> dict:
    """A torchrun run's ranks; with expert parallelism, the experts each held and the assignments it
    processed."""
    out = {"world_size": d["world_size"], "nnodes": d["nnodes"], "expert_parallel": d["expert_parallel"]}
    if not d["expert_parallel"]:
        return out
    per = model["num_experts"] // d["world_size"]
    total = sum(sum(map(sum, r["expert_tokens"])) for r in d["ranks"]) or 1
    rows = [
        [
            r["rank"],
            f"{r['rank'] * per}-{(r['rank'] + 1) * per - 1}",
            "; ".join(
                f"layer {i}: " + ", ".join(f"e{r['rank'] * per + e} {n:,}" for e, n in enumerate(layer))
                for i, layer in enumerate(r["expert_tokens"])
            ),
            f"{sum(map(sum, r['expert_tokens'])) / total:.1%}",
        ]
        for r in d["ranks"]
    ]
    return {**out, "experts": model["num_experts"], "per_rank": per,
            "table": table(["rank", "experts", "assignments processed per MoE layer and expert", "share"], rows)}

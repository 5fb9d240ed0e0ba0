"""The mixture search: draws, fit, choice within max_epochs, pre-registration, the card, and what a change reruns."""

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import write_config
from moeflow import card, configs
from moeflow.flows import why
from moeflow.moe import mix_search

DOMAINS = ["a", "b", "c"]
DECLARED = {"a": 0.5, "b": 0.3, "c": 0.2}


def test_draws_are_seeded_and_leave_unused_domains_out():
    one = mix_search.draws({**DECLARED, "d": 0.0}, 8.0, 50, seed=3)
    assert one == mix_search.draws({**DECLARED, "d": 0.0}, 8.0, 50, seed=3)
    assert one != mix_search.draws({**DECLARED, "d": 0.0}, 8.0, 50, seed=4)
    assert all(m["d"] == 0.0 and abs(sum(m.values()) - 1) < 1e-9 for m in one)
    mean = {d: np.mean([m[d] for m in one]) for d in DOMAINS}
    assert all(abs(mean[d] - DECLARED[d]) < 0.1 for d in DOMAINS)  # drawn around the declared mix


LAW = {"a": (3.0, -0.2), "b": (3.5, -0.05), "c": (4.0, -0.3)}


def _losses(mixes: list[dict], noise: float = 0.002, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{d: c + b * np.log(m[d]) + rng.normal(0, noise) for d, (c, b) in LAW.items()} for m in mixes]


def test_the_fit_recovers_each_domains_law_and_ranks_proxies_it_did_not_see():
    mixes = [DECLARED] + mix_search.draws(DECLARED, 8.0, 11, seed=0)
    losses = _losses(mixes)
    law = mix_search.fit(mixes, losses, DOMAINS)
    assert all(np.allclose([law[d][0], law[d][1 + k]], LAW[d], atol=0.02) for k, d in enumerate(DOMAINS))
    held = mix_search.loo(mixes, losses, DOMAINS)
    assert all(mix_search._rho([p[d] for p in held], [x[d] for x in losses]) > 0.9 for d in DOMAINS)
    noise = [{d: 7.0 + e for d, e in zip(DOMAINS, row)} for row in np.random.default_rng(0).normal(0, 1, (12, 3))]
    held = mix_search.loo(mixes, noise, DOMAINS)
    assert np.mean([mix_search._rho([p[d] for p in held], [x[d] for x in noise]) for d in DOMAINS]) < 0.5


def test_the_ridge_lets_a_domain_learn_from_another_when_the_proxies_show_it():
    """A domain whose loss falls with another domain's weight (transfer): the fit chosen by leave-one-out error
    keeps the transfer and predicts the proxies it leaves out better than a law of its own weight alone; on
    losses without transfer, the cross coefficients stay near zero."""
    mixes = [DECLARED] + mix_search.draws(DECLARED, 8.0, 11, seed=0)
    rng = np.random.default_rng(1)
    losses = [{**x, "c": x["c"] - 0.2 * np.log(m["b"]) + rng.normal(0, 0.002)} for m, x in zip(mixes, _losses(mixes))]
    ridge = mix_search.select_ridge(mixes, losses, DOMAINS)
    assert ridge < 0.1
    law = mix_search.fit(mixes, losses, DOMAINS, ridge)
    assert law["c"][2] == pytest.approx(-0.2, abs=0.05) and law["c"][3] == pytest.approx(-0.3, abs=0.05)

    def error(r):
        return sum((p["c"] - y["c"]) ** 2 for p, y in zip(mix_search.loo(mixes, losses, DOMAINS, r), losses))
    assert error(ridge) < error(float("inf")) / 4
    plain = mix_search.fit(mixes, _losses(mixes), DOMAINS, mix_search.select_ridge(mixes, _losses(mixes), DOMAINS))
    assert all(abs(v) < 0.03 for k, d in enumerate(DOMAINS) for j, v in enumerate(plain[d][1:]) if j != k)


def _slice(**over) -> dict:
    cfg = configs.load("smoke")
    phases = cfg.phases()
    s = {"search": configs.MixSearchConfig(), "weights": {"literature": 0.4, "python_docs": 0.3, "kernel_docs": 0.3},
         "max_epochs": 2.0, "heldout_fraction": 0.0, "phases": phases, "batch_size": 8, "seed": 0}
    return {**s, **over}


def test_the_choice_stays_within_max_epochs():
    s = _slice()
    mixes = [s["weights"]] + mix_search.draws(s["weights"], 8.0, 7, seed=0)
    y = [{"literature": 3.0 - 0.3 * np.log(m["literature"]), "python_docs": 3.0 - 0.01 * np.log(m["python_docs"]),
          "kernel_docs": 3.0 - 0.01 * np.log(m["kernel_docs"])} for m in mixes]  # literature gains most
    tokens = sum(p.steps * 8 * p.seq_len for p in s["phases"])
    plenty = {"literature": 10 * tokens, "python_docs": 10 * tokens, "kernel_docs": 10 * tokens}
    free = mix_search.choose(s, mixes, y, plenty)
    assert free["weights"]["literature"] > 0.6
    scarce = {**plenty, "literature": int(0.15 * tokens)}  # 2 epochs of it: about 30% of the run's tokens
    capped = mix_search.choose(s, mixes, y, scarce)
    assert max(capped["epochs"].values()) <= 2.0
    assert capped["weights"]["literature"] < free["weights"]["literature"] - 0.1
    assert max(capped["epochs"].values()) > 1.5  # it takes what the cap allows
    with pytest.raises(configs.ConfigError, match="max_epochs"):
        mix_search.choose(s, mixes, y, {**plenty, "literature": 1, "python_docs": 1, "kernel_docs": 1})


def test_without_out_of_sample_support_the_declared_mix_is_kept():
    s = _slice()
    mixes = [s["weights"]] + mix_search.draws(s["weights"], 8.0, 7, seed=0)
    plenty = {d: 10**9 for d in s["weights"]}
    noise = [{d: 7.0 + e for d, e in zip(s["weights"], row)}
             for row in np.random.default_rng(0).normal(0, 0.01, (len(mixes), 3))]
    kept = mix_search.choose(s, mixes, noise, plenty)
    assert kept["loo_rank_correlation"] < 0.5
    assert kept["weights"] == pytest.approx(s["weights"]) and kept["chosen_as"].startswith("declared")
    lax = mix_search.choose({**s, "search": configs.MixSearchConfig(min_rank_correlation=-1, min_gain_to_error=0)},
                            mixes, noise, plenty)
    assert lax["weights"] != pytest.approx(s["weights"])
    assert mix_search.inside(lax["weights"], mixes, list(s["weights"]))


def test_the_record_sets_the_predicted_gain_beside_the_fits_own_error():
    """The gain the fit expects over the declared mix, and its leave-one-out RMS error on the objective: a move
    the proxies support has a gain over that error; the declared mix kept has none."""
    s = _slice()
    mixes = [s["weights"]] + mix_search.draws(s["weights"], 8.0, 7, seed=0)
    rng = np.random.default_rng(2)
    y = [{"literature": 3.0 - 0.3 * np.log(m["literature"]), "python_docs": 3.0 - 0.05 * np.log(m["python_docs"]),
          "kernel_docs": 3.0 - 0.05 * np.log(m["kernel_docs"]) + rng.normal(0, 0.002)} for m in mixes]
    plenty = {d: 10**9 for d in s["weights"]}
    moved = mix_search.choose(s, mixes, y, plenty)
    assert moved["predicted_gain"] == pytest.approx(moved["predicted_declared"] - moved["predicted_objective"])
    objective = [np.mean(list(x.values())) for x in y]
    assert moved["loo_objective_rmse"] == pytest.approx(
        np.sqrt(np.mean(np.square(np.subtract(moved["loo_predicted"], objective)))))
    assert moved["predicted_gain"] > 5 * moved["loo_objective_rmse"] > 0
    noise = [{d: 7.0 + e for d, e in zip(s["weights"], row)}
             for row in np.random.default_rng(0).normal(0, 0.01, (len(mixes), 3))]
    kept = mix_search.choose(s, mixes, noise, plenty)
    assert kept["chosen_as"].startswith("declared") and kept["predicted_gain"] == 0.0


def test_a_gain_under_the_fits_own_error_keeps_the_declared_mix():
    """Domain laws that barely move with the weights, under noise the size of their differences: the fit still
    finds a lowest candidate, but its gain is under its leave-one-out error, so the declared weights train; with
    `min_gain_to_error: 0` the same fit moves the mix."""
    s = _slice()
    mixes = [s["weights"]] + mix_search.draws(s["weights"], 8.0, 7, seed=0)
    rng = np.random.default_rng(5)
    y = [{d: 3.0 - 0.01 * np.log(m[d]) + rng.normal(0, 0.01) for d in m} for m in mixes]
    plenty = {d: 10**9 for d in s["weights"]}
    ranked = configs.MixSearchConfig(min_rank_correlation=-1)
    kept = mix_search.choose({**s, "search": ranked}, mixes, y, plenty)
    assert kept["weights"] == pytest.approx(s["weights"]) and kept["predicted_gain"] == 0.0
    assert "gain" in kept["chosen_as"] and kept["chosen_as"].startswith("declared")
    free = mix_search.choose({**s, "search": ranked.model_copy(update={"min_gain_to_error": 0})}, mixes, y, plenty)
    assert free["weights"] != pytest.approx(s["weights"])
    assert 0 < free["predicted_gain"] < free["loo_objective_rmse"] == pytest.approx(kept["loo_objective_rmse"])
    assert kept["candidate"] == free["weights"] and kept["candidate_gain"] == pytest.approx(free["predicted_gain"])


def test_proxies_with_a_class_head_train_longer_for_the_same_budget():
    """`output_classes` shrinks the proxies' head, so the budget buys more steps, never past the target's."""
    cfg = configs.load("tiny")
    search = configs.MixSearchConfig(proxies=7, budget_fraction=0.25, output_classes=None)
    vocab = cfg.tokenizer.vocab_size
    full = mix_search.plan(cfg.model_copy(update={"mix": cfg.mix.model_copy(update={"search": search})}), vocab)
    assert all(p["cfg"].model.output_classes is None for p in full)
    cheap = cfg.mix.model_copy(update={"search": search.model_copy(update={"output_classes": 1024})})
    classes = mix_search.plan(cfg.model_copy(update={"mix": cheap}), vocab)
    assert all(p["cfg"].model.output_classes == 1024 and not p["cfg"].model.tie_embeddings for p in classes)
    steps = [p["cfg"].train.steps for p in (full[0], classes[0])]
    assert steps[0] < steps[1] <= cfg.train.steps
    assert sum(p["flops"] for p in classes) <= sum(p["flops"] for p in full) * 1.05
    wide = search.model_copy(update={"output_classes": vocab})  # no narrower than the vocabulary: the tokens
    plain = mix_search.plan(cfg.model_copy(update={"mix": cfg.mix.model_copy(update={"search": wide})}), vocab)
    assert plain[0]["cfg"].model == full[0]["cfg"].model


def test_tilting_keeps_the_curriculum_shape():
    mix = configs.load("smoke").mix
    new = mix.tilted({"literature": 0.8, "python_docs": 0.1, "kernel_docs": 0.1})
    assert new.weights == {"literature": 0.8, "python_docs": 0.1, "kernel_docs": 0.1} and new.search is None
    before, after = mix.phases[1].weights, new.phases[1].weights
    # each domain scaled by chosen / declared: literature x2, the others / 3
    assert after["literature"] / after["python_docs"] == pytest.approx(
        before["literature"] * 2 / (before["python_docs"] / 3))
    # the declared weights, tilted, are the declared mix to the bit: the same mix stage, the same draws
    for name in ("smoke", "tiny"):
        mix = configs.load(name).mix
        assert mix.tilted(dict(mix.weights)) == mix.model_copy(update={"search": None})


def test_bad_search_configs_fail_before_any_work(tmp_path):
    bad = write_config(tmp_path / "a.yaml", mix={"search": {"objective": {"poetry": 1.0}}})
    with pytest.raises(ValueError, match="poetry"):
        configs.load(bad)
    data = write_config(tmp_path / "b.yaml", mix={"search": {}, "phases": [
        {"name": "short", "seq_len": 32, "tokens": 4096}, {"name": "long"}]})
    with pytest.raises(ValueError, match="fraction"):
        configs.load(data)


def test_the_search_is_registered_before_the_mix_and_changes_it(prefect_server, smoke_data, tmp_path):
    from moeflow.flows.pretrain import pretrain

    path = write_config(tmp_path / "search.yaml", store=str(tmp_path / "store"),
                        mix={"search": {"proxies": 5, "width": 16, "min_steps": 8}})
    out = pretrain(config=str(path))
    labels = list(out["stages"])
    assert [k for k in labels if k.startswith("proxy")] == [f"proxy{x}{i}" for i in range(5) for x in ("_mix", "")]
    assert labels.index("mix_search") < labels.index("mix")
    lin = {k: json.loads((Path(v["artifact"]) / "lineage.json").read_text()) for k, v in out["stages"].items()}
    search = json.loads((Path(out["stages"]["mix_search"]["artifact"]) / "search.json").read_text())
    assert search["registered_at"] <= lin["mix"]["started_at"] <= lin["train"]["started_at"]
    assert lin["mix"]["inputs"]["search"]["hash"] == lin["mix_search"]["artifact"]["hash"]
    assert lin["mix"]["config"]["mix"]["weights"] == pytest.approx(search["weights"], abs=1e-6)
    assert search["proxy_fraction"] <= 0.25 and len(search["proxies"]) == 5
    # every proxy is judged on proxy 0's held-out rows: the same rows as any other mix's, the target's too
    held = {k: (Path(out["stages"][k]["artifact"]) / "heldout.arrow").read_bytes()
            for k in ("proxy_mix0", "proxy_mix3", "mix")}
    assert held["proxy_mix0"] == held["proxy_mix3"] == held["mix"]
    text = Path(out["card"]).read_text()
    assert "## Mixture search" in text and f"| {search['proxies'][3]['objective']:.4f} |" in text
    steps = lin["train"]["stats"]["steps"]  # every proxy trains the target's batch and curriculum, fewer steps
    assert search["proxy_token_fraction"] == pytest.approx(search["proxies"][0]["steps"] / steps, rel=0.05)
    assert f"each trained on {search['proxy_token_fraction']:.1%} of the target's training tokens" in text
    assert f"| {search['predicted_gain']:.4f} ({search['loo_objective_rmse']:.4f}) |" in text
    # the card's section is lineage alone: without search.json it renders the same
    (Path(out["stages"]["mix_search"]["artifact"]) / "search.json").unlink()
    graph = card.collect([Path(out["stages"]["evaluate"]["artifact"])])
    again = card.render_card(graph)
    assert again.split("## Mixture search")[1].split("## ")[0] == text.split("## Mixture search")[1].split("## ")[0]
    _a_changed_objective_reruns_the_search_only(path, tmp_path)


def _a_changed_objective_reruns_the_search_only(path: Path, tmp_path: Path) -> None:
    changed = write_config(tmp_path / "changed.yaml", base=str(path),
                           mix={"search": {"proxies": 5, "width": 16, "min_steps": 8,
                                           "objective": {"literature": 1.0}}})
    plans = {p.label: p for p in why.why(configs.load(changed))}
    assert plans["mix_search"].status == "rebuild"
    assert any("objective" in r for r in plans["mix_search"].reasons), plans["mix_search"].reasons
    # the mix waits on the search: its weights are not diffed against the earlier choice
    assert "config weights: chosen by mix_search, which is rebuilt first" in plans["mix"].reasons
    assert not [r for r in plans["mix"].reasons if "weights." in r], plans["mix"].reasons
    for label in ("ingest", "filter", "dedup", "decontaminate", "tokenize", "proxy_mix0", "proxy4"):
        assert plans[label].status == "reuse", (label, plans[label].reasons)

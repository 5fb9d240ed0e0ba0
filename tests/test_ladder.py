"""The scaling ladder: the fit recovers known laws, rungs keep the recipe.

The prediction is registered first.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from moeflow import configs
from moeflow.configs import LadderConfig
from moeflow.moe import ladder


@pytest.mark.parametrize("e,a,alpha", [(2.0, 1.5, 0.3), (3.5, 0.8, 0.5), (1.0, 4.0, 0.15)])
def test_fit_recovers_known_parameters(e, a, alpha):
    target = 1e15
    compute = np.geomspace(1e12, 1e14, 6)
    rng = np.random.default_rng(0)
    loss = ladder.law(compute / target, e, a, alpha) * (1 + rng.normal(0, 0.001, compute.size))
    fit = ladder.fit(compute.tolist(), loss.tolist(), target, bootstrap=50)
    assert fit["E"] == pytest.approx(e, rel=0.15)
    assert fit["alpha"] == pytest.approx(alpha, rel=0.15)
    assert fit["predicted"] == pytest.approx(e + a, rel=0.02)
    assert fit["band"][0] <= fit["predicted"] <= fit["band"][1]


def test_rungs_keep_the_recipe_and_the_budget():
    cfg = configs.load("tiny").model_copy(
        update={"ladder": LadderConfig(fit="compute", widths=(32, 64, 96), budget_fraction=0.5, min_steps=5)}
    )
    rungs = ladder.plan(cfg, vocab=8192)
    target, _ = ladder.flops(cfg.model, cfg.train, 8192, [(p.steps, p.seq_len) for p in cfg.phases()])
    assert [r["model"].d_model for r in rungs] == [32, 64, 96]
    for r in rungs:
        m = r["model"]
        assert m.d_model // m.n_heads == cfg.model.d_model // cfg.model.n_heads
        assert m.expert_hidden / m.d_model == cfg.model.expert_hidden / cfg.model.d_model
        assert (m.num_experts, m.top_k) == (cfg.model.num_experts, cfg.model.top_k)
        assert (r["train"].batch_size, r["train"].seq_len, r["train"].schedule) == (16, 128, "wsd")
    assert 0.45 * target <= sum(r["flops"] for r in rungs) <= 0.5 * target
    with pytest.raises(ValueError, match="head width"):
        ladder.plan(cfg.model_copy(update={"ladder": LadderConfig(fit="compute", widths=(40, 64, 96))}), vocab=8192)


def test_rungs_stay_within_the_budget_that_min_steps_pushes_on():
    tiny = configs.load("tiny").model_copy(update={"ladder": LadderConfig(  # tiny's compute ladder before 2026-12
        fit="compute", widths=(32, 64, 64, 96, 96), layers=(1, 1, 2, 1, 2), budget_fraction=0.25, min_steps=20)})
    target, _ = ladder.flops(tiny.model, tiny.train, 8192, [(p.steps, p.seq_len) for p in tiny.phases()])
    rungs = ladder.plan(tiny, vocab=8192)  # its narrowest rung sits at min_steps
    assert rungs[0]["train"].steps == tiny.ladder.min_steps
    assert sum(r["flops"] for r in rungs) <= tiny.ladder.budget_fraction * target * 1.0001
    over = tiny.model_copy(update={"ladder": tiny.ladder.model_copy(update={"min_steps": 60})})
    with pytest.raises(configs.ConfigError, match="min_steps=60 cost .* over ladder.budget_fraction=0.25"):
        ladder.plan(over, vocab=8192)


def test_the_additive_plan_spends_what_its_narrow_full_rung_leaves_on_two_short_rungs():
    tiny = configs.load("tiny")
    target, _ = ladder.flops(tiny.model, tiny.train, 8192, [(p.steps, p.seq_len) for p in tiny.phases()])

    def additive(**kw):
        return tiny.model_copy(update={"ladder": LadderConfig(fit="additive", widths=(32,), layers=(1,), **kw)})

    small, big, full = ladder.plan(additive(budget_fraction=0.3), vocab=8192)
    assert [(r["model"].d_model, r["model"].n_layers) for r in (small, big, full)] == [(32, 1), (128, 2), (32, 1)]
    assert full["train"].model_copy(update={"checkpoint_every": tiny.train.checkpoint_every}) == tiny.train
    assert small["train"].steps == big["train"].steps < tiny.train.steps
    spent = sum(r["flops"] for r in (small, big, full))
    assert spent <= 0.3 * target * 1.0001
    longer = [ladder._rung_at(tiny, m, big["train"].steps + 1, 8192) for m in (small["model"], big["model"])]
    assert full["flops"] + sum(r["flops"] for r in longer) > 0.3 * target  # one step more would not fit
    with pytest.raises(configs.ConfigError, match="width 32 at the target's 300 steps costs 17.5%"):
        ladder.plan(additive(budget_fraction=0.15), vocab=8192)
    with pytest.raises(configs.ConfigError, match="the target's own shape"):
        ladder.plan(tiny.model_copy(update={"ladder": LadderConfig(fit="additive", widths=(128,))}), vocab=8192)
    with pytest.raises(ValueError, match="at least 3 widths"):
        LadderConfig(fit="compute", widths=(32,))
    default = ladder.plan(tiny.model_copy(update={"ladder": LadderConfig()}), vocab=8192)  # `ladder: {}`
    assert [(r["model"].d_model, r["train"].steps) for r in default] == [(32, 27), (128, 27), (32, 300)]


def _law(d_model: int, steps: int, rows: int, rng, growth: float) -> np.ndarray:
    """Held-out row losses of a known L(N, D): a width's gain the same at every D (growth 1: separable), washed
    out by 300 steps (growth 0), or grown to `growth` times its 30-step size by 300 steps; row-to-row noise."""
    gain = 40.0 / d_model * (1 + (growth - 1) * (steps - 30) / 270)
    return 2.0 + gain + 30.0 / steps ** 0.5 + rng.normal(0, 0.05, rows)


@pytest.mark.parametrize("growth", [0.0, 1.0, 2.0])
def test_the_additive_band_holds_a_separable_law_and_ones_whose_gain_washes_out_or_doubles(growth):
    rng = np.random.default_rng(0)
    shapes = [(32, 1, 30), (128, 2, 30), (32, 1, 300)]
    rows = [{"d_model": d, "n_layers": n, "steps": t, "final_loss": 5.0} for d, n, t in shapes]
    held = [{dom: _law(d, t, 64, rng, growth) for dom in ("a", "b")} for d, _, t in shapes]
    fit = ladder.additive(rows, held, configs.ModelConfig(d_model=128, n_layers=2), 300, bootstrap=200, seed=0)
    truth = 2.0 + 40.0 / 128 * growth + 30.0 / 300 ** 0.5
    near = {0.0: fit["ends"]["gain_washed_out"], 1.0: fit["predicted_heldout"], 2.0: fit["ends"]["gain_doubled"]}
    assert near[growth] == pytest.approx(truth, abs=0.03)
    lo, hi = fit["heldout_band"]
    assert lo < truth < hi and lo < fit["predicted_heldout"] < hi
    assert fit["predicted_heldout"] == pytest.approx(sum(fit["ends"].values()) / 2)
    assert fit["predicted"] == pytest.approx(5.0) and fit["band"][0] < 5.0 < fit["band"][1]


def _rung_folder(folder: Path, d_model: int, layers: int, steps: int, ce: float) -> Path:
    folder.mkdir()
    stats = {"d_model": d_model, "n_layers": layers, "params_active": d_model * 1000, "steps": steps,
             "tokens": steps * 100, "flops": d_model * steps * 1e6, "peak_grad_norm": 1.0,
             "final_load_imbalance": [1.1]}
    (folder / "lineage.json").write_text(json.dumps({"stats": stats}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"ce": ce + 1 / (i + 1)}) + "\n" for i in range(steps)))
    return folder


def test_an_additive_prediction_is_registered_and_carded_against_the_held_out_loss(tmp_path):
    from moeflow.card import training

    shapes = [(32, 1, 10, 6.0), (128, 2, 10, 5.5), (32, 1, 40, 5.0)]
    dirs = [_rung_folder(tmp_path / f"r{i}", *s) for i, s in enumerate(shapes)]
    held = [{"a": np.full(8, ce + 0.5), "b": np.full(8, ce + 0.7)} for *_, ce in shapes]
    model = configs.ModelConfig(d_model=128, n_layers=2)
    train = configs.TrainConfig(steps=40)
    (out := tmp_path / "out").mkdir()
    p = ladder.predict(LadderConfig(fit="additive", widths=(32,)), model, train, [], seed=0, rung_dirs=dirs,
                       vocab=100, out=out, heldout=held)
    assert p == json.loads((out / "prediction.json").read_text())
    # separable: 5.6 + 6.1 - 6.6 = 5.1; the gain doubled: 4.6; washed out: 5.6
    assert p["predicted_heldout_loss"] == pytest.approx(5.1) and p["heldout_band"] == [4.6, 5.6]
    assert [r["heldout_loss"] for r in p["rungs"]] == [6.6, 6.1, 5.6]
    ev = {"stats": {"heldout": {"a": {"loss": 5.0}, "b": {"loss": 5.4}}}}
    card = training.ladder({"stats": p, "artifact": {"hash": "h"}}, {"tail_loss": p["predicted_final_loss"]}, ev)
    assert "| held-out loss (mean over domains) | 5.1 (4.6 to 5.6) | 5.2000 (inside the band) | +1.92% |" in (
        card["prediction_table"])
    assert "that gain doubled (4.6) and washed out by the target's tokens (5.6)" in card["fit_text"]
    # the short rungs' curves differ by 0.5 at every step: the first window is as high as any
    assert p["fit"]["lead"] == {"steps": 10, "peak_step": 2, "still_rising": False}
    assert "lead over the narrow rung in the short rungs peaked at step 2 of 10, before" in card["fit_text"]


def _curve(steps: int, start: int) -> list[float]:
    """A training curve that stays at ln(2048) until `start`, then falls by 1 nat with a 5-step time constant."""
    return [7.62 - (1 - np.exp(-max(0, t - start) / 5)) for t in range(1, steps + 1)]


def test_the_lead_of_the_wider_shape_is_found_still_growing_in_short_rungs_and_past_its_peak_in_long_ones():
    from moeflow.card import training

    # the wider shape starts learning at once, the narrow one 8 steps later: the lead grows, peaks, then shrinks
    short = ladder.lead_peak(_curve(5, 8), _curve(5, 0))
    assert short == {"steps": 5, "peak_step": 5, "still_rising": True}
    long = ladder.lead_peak(_curve(40, 8), _curve(40, 0))
    assert not long["still_rising"] and 8 <= long["peak_step"] <= 16
    fit = {"kind": "additive", "gain_doubled": 4.6, "gain_washed_out": 5.6, "bootstrap_fits": 10, "lead": short}
    text = training._fit_text({"fit": fit})
    assert "lead over the narrow rung in the short rungs peaked at step 5 of 5: it was still growing" in text
    assert "below the band if the gain more than doubles" in text


def test_band_follows_the_ladder_curves(tmp_path):
    (tmp_path / "prediction.json").write_text(json.dumps({"band": [2.0, 2.2]}))
    curve = {"fraction": [0.5, 1.0], "ratio": [1.5, 1.0]}
    (tmp_path / "curves.json").write_text(json.dumps([curve, {"fraction": [0.5, 1.0], "ratio": [1.7, 1.0]}]))
    band = ladder.Band(tmp_path, steps=4, tolerance=0.0)
    assert band.at(2) == [3.0, pytest.approx(3.74)] and band.at(4) == [2.0, 2.2]
    assert band.check(4, 2.1) is None and "outside" in band.check(4, 2.5)


def _band(folder: Path) -> ladder.Band:
    """A flat band [2.0, 2.2] over 40 steps."""
    (folder / "prediction.json").write_text(json.dumps({"band": [2.0, 2.2]}))
    (folder / "curves.json").write_text(json.dumps([{"fraction": [0.0, 1.0], "ratio": [1.0, 1.0]}]))
    return ladder.Band(folder, steps=40, tolerance=0.0)


def _alarms(band: ladder.Band, **cfg):
    from moeflow.configs import AlarmConfig
    from moeflow.moe.alarms import Alarms, Monitor

    return Alarms(Monitor(AlarmConfig(**cfg)), band, warmup_steps=0)


def _run(alarms, losses: dict[int, float]) -> tuple[list[dict], list]:
    """Each step's record and the (step, alarm) pairs the steps fired, for a loss per step."""
    from moeflow.moe.metrics import Step

    records, fired = [], []
    for n, ce in losses.items():
        step = Step(number=n, phase=0, seq_len=8, lr=0.0, micro_batches=1, ce_sum=ce, load_balancing_sum=0.0,
                    sequence_balancing_sum=0.0,
                    router_z_sum=0.0, logit_z_sum=0.0, grad_norm=1.0, grad_norm_groups={},
                    tokens_per_expert=[], dropped=0, seconds=1.0, tokens=8, flops_per_token=1)
        record = {"step": n, "ce": ce, "grad_norm": 1.0}
        fired += [(n, a) for a in alarms.check(step, record)]
        records.append(record)
    return records, fired


def test_a_run_resumed_outside_the_band_does_not_alarm_again(tmp_path):
    """Leaving the band alarms once; a run resumed from a checkpoint taken outside it (its records replayed)
    does not alarm again until it has come back in and left once more."""
    band = _band(tmp_path)
    before, fired = _run(_alarms(band), {n: 2.1 if n <= 10 else 3.0 for n in range(1, 21)})  # out from step 11 or so
    assert len(fired) == 1
    resumed = _alarms(band)
    resumed.replay(before)
    assert _run(resumed, {n: 3.0 for n in range(21, 26)})[1] == []  # still out: no second alarm
    assert len(_run(resumed, {**{n: 2.1 for n in range(26, 36)}, **{n: 3.0 for n in range(36, 41)}})[1]) == 1


# two steps of 3.0 keep the smoothed loss (10 steps) at 2.28, above the band, for the 9 steps 12-20
EXCURSION = {n: 3.0 if n in (11, 12) else 2.1 for n in range(1, 41)}


def test_the_band_alarms_only_once_the_smoothed_loss_stays_out_for_band_patience_steps(tmp_path):
    band = _band(tmp_path)
    records, fired = _run(_alarms(band), EXCURSION)
    assert [r["step"] for r in records if r["outside_ladder_band"]] == list(range(12, 21))
    assert [(n, a.rule) for n, a in fired] == [(12, "ladder_band")]  # by default at the first step out
    assert _run(_alarms(band, band_patience=10), EXCURSION)[1] == []  # out for fewer than 10 steps
    [(n, alarm)] = _run(_alarms(band, band_patience=9), EXCURSION)[1]
    assert (n, alarm.rule, alarm.reading) == (20, "ladder_band", pytest.approx(2.28))
    assert "9 of the last 9" in alarm.text


def test_the_band_alarms_once_band_patience_of_the_last_band_of_steps_are_out(tmp_path):
    """Two stretches of 9 steps out, 5 steps apart: 12 in a row never happens, 12 of the last 25 does, at the
    third step of the second stretch; a resumed run's patience counts the replayed steps."""
    band = _band(tmp_path)
    twice = {**EXCURSION, 25: 3.0, 26: 3.0}  # out at 12-20 and 26-34
    assert _run(_alarms(band, band_patience=12), twice)[1] == []
    records, fired = _run(_alarms(band, band_patience=12, band_of=25), twice)
    assert [(n, a.rule, a.reading) for n, a in fired] == [(28, "ladder_band", pytest.approx(2.28))]
    assert "12 of the last 25" in fired[0][1].text
    resumed = _alarms(band, band_patience=12, band_of=25)
    resumed.replay(records[:27])  # a checkpoint at step 27: 11 of the 12 steps out are behind it
    assert _run(resumed, {n: twice[n] for n in range(28, 41)})[1] == fired


def test_prediction_is_registered_before_the_target_run(prefect_server, smoke_data, tmp_path):
    from helpers import write_config
    from moeflow.flows.pretrain import pretrain

    path = write_config(
        tmp_path / "ladder.yaml",
        store=str(tmp_path / "store"),
        # the additive fit (tiny's): a narrow rung of the target's 40 steps, it and the target's shape at 11
        ladder={"fit": "additive", "widths": [16], "layers": [1], "budget_fraction": 0.5, "min_steps": 5},
    )
    out = pretrain(config=str(path))
    assert [k for k in out["stages"] if k.startswith("rung")] == [
        "rung_mix0",
        "rung0",
        "rung_mix1",
        "rung1",
        "rung_mix2",
        "rung2",
    ]
    lin = {
        k: json.loads((Path(v["artifact"]) / "lineage.json").read_text()) for k, v in out["stages"].items()
    }
    for i in range(3):  # each rung runs the whole two-phase curriculum on its own mix
        assert lin[f"rung{i}"]["inputs"]["mix"]["hash"] == lin[f"rung_mix{i}"]["artifact"]["hash"]
        assert [p["phase"] for p in lin[f"rung{i}"]["stats"]["phases"]] == [0, 1]
    assert lin["ladder"]["finished_at"] <= lin["train"]["started_at"]
    assert lin["train"]["inputs"]["prediction"]["hash"] == lin["ladder"]["artifact"]["hash"]
    assert lin["ladder"]["inputs"]["mix"]["hash"] == lin["mix"]["artifact"]["hash"]  # its held-out rows
    prediction = json.loads((Path(out["stages"]["ladder"]["artifact"]) / "prediction.json").read_text())
    assert prediction["registered_at"] <= lin["train"]["started_at"]
    text = Path(out["card"]).read_text()
    assert f"| final training loss (mean of the last tenth of steps) | {prediction['predicted_final_loss']} (" in text
    assert f"| held-out loss (mean over domains) | {prediction['predicted_heldout_loss']} (" in text
    metrics = (Path(out["stages"]["train"]["artifact"]) / "metrics.jsonl").read_text().splitlines()
    assert "ladder_band" in json.loads(metrics[-1])
    _rungs_show_progress_in_the_ui(lin)


def _rungs_show_progress_in_the_ui(lin: dict) -> None:
    """Each rung's task run has its own progress artifact at 100% and its own live training table."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterTaskRunId

    with get_client(sync_client=True) as client:
        for i in range(3):
            task_run = lin[f"rung{i}"]["prefect"]["task_run_id"]
            arts = client.read_artifacts(artifact_filter=ArtifactFilter(
                task_run_id=ArtifactFilterTaskRunId(any_=[task_run])))
            by_key = {a.key: a for a in arts}
            assert by_key[f"rung{i}"].type == "progress" and by_key[f"rung{i}"].data == 100
            assert by_key[f"rung{i}-live"].data.startswith(f"### rung{i}: step ")

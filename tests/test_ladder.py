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
        update={"ladder": LadderConfig(widths=(32, 64, 96), budget_fraction=0.5, min_steps=5)}
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
        ladder.plan(cfg.model_copy(update={"ladder": LadderConfig(widths=(40, 64, 96))}), vocab=8192)


def test_rungs_stay_within_the_budget_that_min_steps_pushes_on():
    tiny = configs.load("tiny")
    target, _ = ladder.flops(tiny.model, tiny.train, 8192, [(p.steps, p.seq_len) for p in tiny.phases()])
    rungs = ladder.plan(tiny, vocab=8192)  # its narrowest rung sits at min_steps
    assert rungs[0]["train"].steps == tiny.ladder.min_steps
    assert sum(r["flops"] for r in rungs) <= tiny.ladder.budget_fraction * target * 1.0001
    over = tiny.model_copy(update={"ladder": tiny.ladder.model_copy(update={"min_steps": 60})})
    with pytest.raises(configs.ConfigError, match="min_steps=60 cost .* over ladder.budget_fraction=0.25"):
        ladder.plan(over, vocab=8192)


def test_band_follows_the_ladder_curves(tmp_path):
    (tmp_path / "prediction.json").write_text(json.dumps({"band": [2.0, 2.2]}))
    curve = {"fraction": [0.5, 1.0], "ratio": [1.5, 1.0]}
    (tmp_path / "curves.json").write_text(json.dumps([curve, {"fraction": [0.5, 1.0], "ratio": [1.7, 1.0]}]))
    band = ladder.Band(tmp_path, steps=4, tolerance=0.0)
    assert band.at(2) == [3.0, pytest.approx(3.74)] and band.at(4) == [2.0, 2.2]
    assert band.check(4, 2.1) is None and "outside" in band.check(4, 2.5)


def test_prediction_is_registered_before_the_target_run(prefect_server, smoke_data, tmp_path):
    from helpers import write_config
    from moeflow.flows.pretrain import pretrain

    path = write_config(
        tmp_path / "ladder.yaml",
        store=str(tmp_path / "store"),
        ladder={"widths": [16, 32, 48], "budget_fraction": 0.3, "min_steps": 8},
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
    prediction = json.loads((Path(out["stages"]["ladder"]["artifact"]) / "prediction.json").read_text())
    assert prediction["registered_at"] <= lin["train"]["started_at"]
    text = Path(out["card"]).read_text()
    assert f"| predicted | {prediction['predicted_final_loss']} " in text and "relative error" in text
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

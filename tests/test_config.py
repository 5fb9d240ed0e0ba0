"""Config loading: presets validate; errors name the file and the field."""

import pytest

from helpers import write_config
from moeflow import configs


def test_presets_load():
    for name in ("tiny", "smoke"):
        cfg = configs.load(name)
        assert cfg.name == name
        assert {s.domain for s in cfg.sources} >= set(cfg.mix.weights)


def test_bad_field_names_file_and_field(tmp_path):
    path = write_config(tmp_path / "bad.yaml", train={"steps": -3})
    with pytest.raises(configs.ConfigError, match=r"bad\.yaml.*field 'train\.steps'"):
        configs.load(path)


def test_unknown_domain_in_weights(tmp_path):
    path = write_config(tmp_path / "bad.yaml", mix={"weights": {"poetry": 1.0}})
    with pytest.raises(configs.ConfigError, match=r"unknown domains \['poetry'\]"):
        configs.load(path)


def test_weights_summing_to_zero(tmp_path):
    path = write_config(tmp_path / "bad.yaml", mix={"weights": {"literature": 0.0}})
    with pytest.raises(configs.ConfigError, match="mix.weights"):
        configs.load(path)


def test_a_cluster_address_for_another_runner_is_refused(tmp_path):
    path = write_config(tmp_path / "bad.yaml", execution={"runner": "ray", "dask_address": "tcp://h:8786"})
    with pytest.raises(
        configs.ConfigError, match=r"execution.dask_address is set but execution.runner is 'ray'"
    ):
        configs.load(str(path))



@pytest.mark.parametrize(
    "alarms, message",
    [
        ({"actions": {"ladder_band": "halt"}}, r"field 'train\.alarms\.actions\.ladder_band'"),
        ({"actions": {"loss_jump": "stop"}}, r"field 'train\.alarms\.actions\.loss_jump'"),
        ({"band_patience": 5, "band_of": 3}, r"band_of=3 must be at least band_patience=5"),
    ],
)
def test_alarm_errors_name_the_field(tmp_path, alarms, message):
    path = write_config(tmp_path / "bad.yaml", train={"alarms": alarms})
    with pytest.raises(configs.ConfigError, match=message):
        configs.load(path)


def test_alarms_stop_is_the_action_of_every_kind_actions_leaves_unset():
    from moeflow.configs import AlarmConfig

    assert AlarmConfig().action("ladder_band") == "log"  # today's presets: every alarm logged
    cfg = AlarmConfig(stop=True, actions={"loss_spike": "log"})
    assert (cfg.action("loss_spike"), cfg.action("grad_norm_ceiling")) == ("log", "stop")

def test_unknown_preset():
    with pytest.raises(configs.ConfigError, match="no such file or preset"):
        configs.load("huge")


@pytest.mark.parametrize(
    "phases, message",
    [
        (
            [{"name": "a", "weights": {"poetry": 1.0}}],
            r"mix\.phases\.0\.weights names unknown domains \['poetry'\]",
        ),
        (
            [{"name": "a", "weights": {"literature": 0.0}}],
            r"field 'mix\.phases\.0\.weights'.*sum to more than 0",
        ),
        (
            [{"name": "a", "fraction": 0.5}, {"name": "b", "fraction": 0.2}],
            r"come to 28 steps, but train\.steps is 40",
        ),
        ([{"name": "a"}, {"name": "b"}], r"mix\.phases\.0 \(a\): give `fraction` or `tokens`"),
        ([{"name": "a", "fraction": 0.5, "tokens": 100}], r"`fraction` or `tokens`, not both"),
    ],
)
def test_phase_errors_name_the_phase(tmp_path, phases, message):
    path = write_config(tmp_path / "bad.yaml", mix={"phases": phases})
    with pytest.raises(configs.ConfigError, match=message):
        configs.load(path)


def test_phases_resolve_to_whole_steps(tmp_path):
    path = write_config(
        tmp_path / "ok.yaml",
        mix={
            "phases": [
                {"name": "short", "seq_len": 32, "tokens": 5000},
                {"name": "long", "weights": {"literature": 1.0}},
            ]
        },
    )
    short, long = configs.load(path).phases()
    assert (short.steps, short.seq_len, long.start_step, long.steps, long.seq_len) == (20, 32, 20, 20, 64)
    assert long.weights == {"literature": 1.0} and short.weights == configs.load("smoke").mix.weights


def test_a_config_is_parsed_by_libyaml_and_a_bad_one_quoted_by_the_python_parser(tmp_path, monkeypatch):
    """A valid file never reaches PyYAML's pure-Python parser (15 ms a load against 1.5 ms: every part of a
    sharded stage may load its config); a file libyaml refuses is read again by it, for the message that
    quotes the line."""
    import yaml

    class Refused(yaml.SafeLoader):
        def __init__(self, stream):
            raise AssertionError("the pure-Python parser read a valid config")

    with monkeypatch.context() as m:
        m.setattr(yaml, "SafeLoader", Refused)
        assert configs.load("tiny").name == "tiny"
    (tmp_path / "broken.yaml").write_text("name: tiny\ntrain: [1, 2\n")
    with pytest.raises(configs.ConfigError, match=r"(?s)broken\.yaml: not valid YAML: .*\n +train: \[1, 2\n +\^"):
        configs.load(tmp_path / "broken.yaml")


def test_the_expert_bias_is_refused_with_megablocks_whose_router_is_dmoe_s(tmp_path):
    path = write_config(tmp_path / "c.yaml", model={"backend": "megablocks", "router_bias_rate": 1e-3})
    with pytest.raises(configs.ConfigError, match=r"router_bias_rate.*backend megablocks routes with dMoE's own"):
        configs.load(path)
    assert configs.load(write_config(tmp_path / "d.yaml", model={"router_bias_rate": 1e-3})).model.router_bias_rate

"""Config loading: presets validate; errors name the file and the field."""

import pytest

from moeflow import configs
from helpers import write_config


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


def test_unknown_preset():
    with pytest.raises(configs.ConfigError, match="no such file or preset"):
        configs.load("huge")

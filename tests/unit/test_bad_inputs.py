"""Every bad input named (issue #19 item 5): the key, the value, and what is allowed."""
from __future__ import annotations

import pytest
import torch

import zerokit
from zerokit.config import ConfigError, load_config

pytestmark = pytest.mark.robustness

BASE = {"train_micro_batch_size_per_gpu": 1}


@pytest.mark.parametrize("opt,params,expected", [
    ("Adam", {"betas": 0.9}, ["optimizer.params.betas", "0.9", "two numbers", "[0, 1)"]),
    ("AdamW", {"betas": [0.9]}, ["optimizer.params.betas", "[0.9]", "two numbers"]),
    ("Adam", {"betas": [0.9, 1.5]}, ["optimizer.params.betas[1]", "1.5", "[0, 1)"]),
    ("Lion", {"betas": [-0.1, 0.99]}, ["optimizer.params.betas[0]", "-0.1", "[0, 1)"]),
    ("Adam", {"eps": -1e-8}, ["optimizer.params.eps", "-1e-08", ">= 0"]),
    ("Adagrad", {"eps": -1.0}, ["optimizer.params.eps", "-1.0", ">= 0"]),
    ("SGD", {"lr": 0.1, "momentum": -0.5}, ["optimizer.params.momentum", "-0.5", ">= 0"]),
    ("AdamW", {"weight_decay": -0.01}, ["optimizer.params.weight_decay", "-0.01", ">= 0"]),
])
def test_optimizer_values_out_of_range_name_key_value_and_range(opt, params, expected) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, "optimizer": {"type": opt, "params": params}})
    for part in expected:
        assert part in str(info.value), str(info.value)


def test_valid_optimizer_values_still_pass() -> None:
    cfg = load_config({**BASE, "optimizer": {"type": "Adam", "params": {
        "betas": [0.0, 0.999], "eps": 0.0, "weight_decay": 0}}})
    assert cfg.optimizer.params["betas"] == [0.0, 0.999]


@pytest.mark.parametrize("empty", [[], (), iter([]), [{"params": []}]])
def test_empty_model_parameters_is_named(empty) -> None:
    with pytest.raises(ValueError) as info:
        zerokit.initialize(model=torch.nn.Linear(4, 4), model_parameters=empty,
                           config={**BASE, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    text = str(info.value)
    assert "model_parameters" in text and "is empty" in text and "model.parameters()" in text, text


def test_json_syntax_error_names_file_and_line(tmp_path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text('{\n  "train_micro_batch_size_per_gpu": 1,\n  "fp16": {"enabled": true,}\n}\n')
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    text = str(info.value)
    assert f"config file {path}, line 3 column" in text, text
    assert '"fp16": {"enabled": true,}' in text, text

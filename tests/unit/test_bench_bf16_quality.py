"""bench_bf16_quality's rows: each row's config is what its name says, zerokit accepts its rows'
configs, DeepSpeed's rows carry DeepSpeed's keys (and the stochastic-rounding row zerokit's, for
DeepSpeed to answer), and the plot's smoothing is a trailing mean (the rows themselves train for
minutes: benchmarks are run by hand, not here)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_bf16_quality as Q  # noqa: E402


@pytest.mark.parametrize("row", list(Q.ROWS))
def test_row_configs(row):
    args = Q.parse_args(["--steps", "20"])
    lib, master16, states16, sr, _ = Q.ROWS[row]
    cfg = Q.row_config(row, args)
    b = cfg["bf16"]
    assert b["enabled"] and b.get("bf16_master_weights_and_grads", False) == master16
    assert b.get("bf16_optimizer_states", False) == states16 and b.get("stochastic_rounding", False) == sr
    assert cfg["zero_optimization"]["stage"] == 2
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cfg["optimizer"]["params"]["lr"] == args.lr
    assert ("fp32_optimizer_states" in cfg["optimizer"]["params"]) == (lib == "deepspeed" and master16)
    if lib == "zerokit":
        from zerokit.config import load_config

        load_config(cfg)


def test_defaults_and_smoothing():
    args = Q.parse_args([])
    assert args.lr == 1e-4 and args.last_k == args.steps // 10 and "zk-bf16-sr" in Q.DEFAULT_ROWS
    assert Q.smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    with pytest.raises(SystemExit):
        Q.parse_args(["--steps", "5", "--last-k", "6"])


def test_comparisons_are_against_the_same_librarys_fp32_row():
    rows = [{"row": "zk-fp32", "library": "zerokit", "bf16_master": False, "status": "ok",
             "final_loss": 2.0, "eval_loss": 2.5},
            {"row": "zk-bf16-rtn", "library": "zerokit", "bf16_master": True, "status": "ok",
             "final_loss": 2.1, "eval_loss": 2.5},
            {"row": "ds-bf16-rtn", "library": "deepspeed", "bf16_master": True, "status": "ok",
             "final_loss": 2.2, "eval_loss": 2.6},
            {"row": "ds-bf16-sr", "library": "deepspeed", "bf16_master": True, "status": "refused"}]
    Q.add_comparisons(rows)
    assert rows[1]["final_vs_fp32_pct"] == pytest.approx(5.0) and rows[1]["eval_vs_fp32_pct"] == 0.0
    assert "final_vs_fp32_pct" not in rows[2] and "final_vs_fp32_pct" not in rows[3]

"""bench_step's and bench_offload's rounds (issue #29's check: rows alternated, medians of >= 2
rounds): every row once per round, the order reversed every other round, the median of the
rounds' medians reported; and bench_offload refuses bench_step's options it has no use for,
instead of dropping them (it used to ignore --rounds). The rows themselves take minutes: the row
runner is replaced here."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_offload as O  # noqa: E402
import bench_step as S  # noqa: E402


def _row(t: float) -> dict:
    part = {"median": t, "min": t, "max": t}
    return {"status": "ok", "label": "a row", "final_loss_rank0": 5.5, "step_s": dict(part), "forward_s": dict(part), "backward_s": dict(part),
            "optimizer_s": dict(part), "peak_rss_mb": 100 * t, "wall_s": 1.0}


def test_rounds_alternate_the_order_and_report_the_median_of_the_rounds(monkeypatch, tmp_path):
    times = {"a": iter([1.0, 3.0, 2.0]), "b": iter([10.0, 30.0, 20.0])}
    order = []

    def fake_run_row(name, args, log_dir):
        order.append(name)
        return _row(next(times[name]))

    monkeypatch.setattr(S, "run_row", fake_run_row)
    monkeypatch.setattr(S.C, "results_dir", lambda *a: tmp_path)
    args = S.parse_args(["--only", "ddp,zk-z2", "--rounds", "3"])
    times = {"ddp": times["a"], "zk-z2": times["b"]}
    got = S.run_rounds(["ddp", "zk-z2"], args)
    assert order == ["ddp", "zk-z2", "zk-z2", "ddp", "ddp", "zk-z2"]
    assert got["ddp"]["step_s"]["median"] == 2.0 and got["zk-z2"]["step_s"]["median"] == 20.0
    assert got["ddp"]["step_s_rounds"] == [1.0, 3.0, 2.0]
    assert got["zk-z2"]["step_s"]["min"] == 10.0 and got["zk-z2"]["peak_rss_mb"] == 3000.0


def test_bench_offload_runs_its_rows_in_rounds(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(S, "run_row", lambda name, args, log_dir: calls.append(name) or _row(1.0))
    monkeypatch.setattr(S.C, "results_dir", lambda *a: tmp_path)
    assert O.main(["--only", "zk-z2-off,ds-z2-off", "--rounds", "2",
                   "--out", str(tmp_path / "o.json")]) == 0
    assert calls == ["zk-z2-off", "ds-z2-off", "ds-z2-off", "zk-z2-off"]


@pytest.mark.parametrize("flag", [["--compare", "HEAD"], ["--zero3"], ["--profile"]])
def test_bench_offload_refuses_bench_steps_options_it_does_not_use(flag):
    with pytest.raises(SystemExit, match=flag[0]):
        O.main(flag)

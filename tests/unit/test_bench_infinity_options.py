"""bench_infinity's options reach both sides' configs: gradient_clipping and accumulation are the
same keys for DeepSpeed and zerokit, a row's own clipping wins, and bad values are refused naming
the option (the rows themselves take minutes: benchmarks are run by hand, not here)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_infinity as B  # noqa: E402


@pytest.mark.parametrize("clip,accum", [(1.0, 1), (0.0, 4), (1e-3, 1)])
def test_clipping_and_accumulation_go_to_both_sides(clip, accum):
    ds = B.ds_config("/swap", "1b", clip, accum)
    zk = B.zk_config("/swap", "1b", None, clipping=clip, accumulation=accum)
    for cfg in (ds, zk):
        assert cfg["gradient_clipping"] == clip and cfg["gradient_accumulation_steps"] == accum


def test_defaults_are_deepspeeds_and_the_clip_row_always_clips():
    args = B.parse_args([])
    assert args.clipping == 1.0 and args.accumulation == 1
    assert B.ROW_CLIPPING["zk-inf-ds-clip"] == 1e-3
    # zk-inf is DeepSpeed's config with zerokit's stream keys: step_in_backward is left to
    # zerokit's default, as a DeepSpeed user's config leaves it; zk-inf-files keeps gradients in
    # files, zk-inf-sib sets it on; the budgeted rows leave it to the planner
    assert B._steps_in_backward("zk-inf-sib") is True
    assert B._steps_in_backward("zk-inf-files") is False
    assert B._steps_in_backward("zk-inf") is None and B._steps_in_backward("zk-inf-ds-clip") is None
    zk = B.zk_config("/swap", "1b", None)
    assert "step_in_backward" not in zk["zero_optimization"]["offload_optimizer"]
    files = B.zk_config("/swap", "1b", None, step_in_backward=False)
    assert files["zero_optimization"]["offload_optimizer"]["step_in_backward"] is False
    sib = B.zk_config("/swap", "1b", None, step_in_backward=True)
    assert sib["zero_optimization"]["offload_optimizer"]["step_in_backward"] is True
    assert sib["zero_optimization"]["offload_optimizer"]["max_in_cpu"] == 0
    dpu = B.zk_config("/swap", "1b", None, delayed=True)  # the delayed update excludes it
    assert dpu["zero_optimization"]["offload_optimizer"]["step_in_backward"] is False
    # the worker gets what the row sets, and nothing where the row leaves it out
    cmd = lambda row: B.parse_args(["--worker", row, "--step-in-backward", "off"]).step_in_backward  # noqa: E731
    assert cmd("zk-inf-files") == "off" and B.parse_args([]).step_in_backward is None
    assert "memory" not in zk


# The keys that say where state lives and how it streams: a budgeted row sets none of them
# (issue #28 point 4); the planner chooses them, the sizes beside them.
PLACEMENT_KEYS = {"max_in_cpu", "buffer_count", "buffer_size", "ratio", "step_in_backward",
                  "pipeline_read", "pipeline_write"}
SIZE_KEYS = {"sub_group_size", "reduce_bucket_size"}


@pytest.mark.parametrize("row", ["zk-inf-ds", "zk-inf-half", "zk-inf-8g", "zk-inf-ds-dpu", "zk-inf-ds-clip"])
def test_budgeted_rows_pass_a_host_budget_and_nothing_else(row):
    assert B._budgeted(row)
    cfg = B.zk_config("/swap", "1b", 7.5, delayed=row.endswith("-dpu"))
    assert cfg["memory"] == {"host": int(7.5 * 2**30)}
    zero = cfg["zero_optimization"]
    for section in ("offload_optimizer", "offload_param"):
        assert zero[section]["device"] == "auto" and zero[section]["nvme_path"] == "/swap"
        assert not PLACEMENT_KEYS & set(zero[section]), (section, zero[section])
    assert not SIZE_KEYS & set(zero), zero
    assert not hasattr(B, "budget_keys") and not hasattr(B, "allowance_gib")
    # the config is one zerokit accepts
    from zerokit.config import load_config

    load_config(cfg)


@pytest.mark.parametrize("argv,word", [(["--clipping", "-1"], "--clipping"),
                                       (["--accumulation", "0"], "--accumulation"),
                                       (["--settle-quiet-s", "-1"], "--settle-quiet-s"),
                                       (["--settle-max-s", "-5"], "--settle-max-s"),
                                       (["--rounds", "0"], "--rounds")])
def test_bad_values_are_refused_naming_the_option(argv, word, capsys):
    with pytest.raises(SystemExit):
        B.parse_args(argv)
    assert word in capsys.readouterr().err


def test_table_cells_say_n_a_without_counters():
    row = {"disk_idle": None, "speculation": None}
    assert B._idle_cell(row) == "n/a" and B._redo_cell(row) == "n/a"
    row = {"disk_idle": {"idle_s": 6.4, "read_idle_s": 7.8, "write_idle_s": 9.8, "window_s": 24.7},
           "speculation": {"committed": 0, "redone": 1, "skipped": 0, "redo_s": 3.25}}
    assert B._idle_cell(row) == "6.4 (7.8/9.8)"
    assert B._redo_cell(row) == "3.25 s, 1/1 redone"
    row["speculation"] = {"committed": 0, "redone": 0, "skipped": 0, "redo_s": 0.0}
    row["speculation_warmup"] = {"committed": 0, "redone": 1, "skipped": 0, "redo_s": 8.03}
    assert B._redo_cell(row) == "0.00 s, 0/0 redone (warm-up: 8.03 s, 1/1)"
    row["speculation_warmup"] = {"committed": 0, "redone": 0, "skipped": 1, "redo_s": 0.0}
    assert B._redo_cell(row) == "0.00 s, 0/0 redone"


@pytest.mark.parametrize("row", ["zk-inf-bf16", "zk-inf-sib-bf16", "zk-inf-ds-bf16", "zk-inf-ds-dpu-bf16",
                                 "zk-inf-ds-clip-bf16"])
def test_bf16_rows_are_their_fp32_twins_with_bf16_master_and_states(row):
    base = B._base(row)
    assert B._bf16_state(row) and not B._bf16_state(base) and B.ROWS[row][:2] == B.ROWS[base][:2]
    assert B._steps_in_backward(row) == B._steps_in_backward(base)
    assert B._budgeted(row) == B._budgeted(base)
    cfg = B.zk_config("/swap", "1b", 7.5 if B._budgeted(row) else None, bf16_state=True,
                      step_in_backward=B._steps_in_backward(row))
    assert cfg["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert "bf16_master_weights_and_grads" not in B.zk_config("/swap", "1b", None)["bf16"]
    from zerokit.config import load_config

    load_config(cfg)


def test_expected_disk_bytes_per_parameter():
    # bf16 weights 2 + master 4 + gradients 4 + moments 8; stepping in backward: no gradient
    # files, a second slot of master and moments (1b zk-inf-sib measured 27.05 GB = 26 B x 1.04B)
    # files; zk-inf steps in backward by zerokit's default, a budgeted row is counted without
    rows = ("zk-inf-files", "zk-inf-sib", "zk-inf", "zk-inf-files-bf16", "zk-inf-sib-bf16", "zk-inf-bf16",
            "zk-inf-ds", "ds-inf")
    per = {row: B.expected_disk_bytes("1b", row, 4) / B.n_params("1b") for row in rows}
    assert per == {"zk-inf-files": 18, "zk-inf-sib": 26, "zk-inf": 26, "zk-inf-files-bf16": 10,
                   "zk-inf-sib-bf16": 14, "zk-inf-bf16": 14, "zk-inf-ds": 18, "ds-inf": 18}
    # at accumulation 1 zerokit's gradient files are bf16 (offload_optimizer.gradient_dtype
    # 'auto'); DeepSpeed's stay in the master's dtype
    per = {row: B.expected_disk_bytes("1b", row, 1) / B.n_params("1b") for row in rows}
    assert per == {"zk-inf-files": 16, "zk-inf-sib": 26, "zk-inf": 26, "zk-inf-files-bf16": 10,
                   "zk-inf-sib-bf16": 14, "zk-inf-bf16": 14, "zk-inf-ds": 16, "ds-inf": 18}
    assert B.n_params("7b") >= 7e9 and B.expected_disk_bytes("7b", "zk-inf-files-bf16") < 72e9


def test_hand_rows_merge_their_keys_into_the_all_nvme_config():
    """--hand LABEL=JSON adds a row 'hand-LABEL' run after --rows; its keys reach the worker's
    config merged section by section, and a worker started for it knows the row."""
    args = B.parse_args(["--rows", "zk-inf", "--hand",
                         'cpu={"zero_optimization": {"offload_param": {"device": "cpu", '
                         '"max_in_cpu": null}, "offload_optimizer": {"device": "cpu"}}}'])
    assert list(args.hand_keys) == ["hand-cpu"] and B.ROWS["hand-cpu"][0] == "zerokit"
    cfg = B.zk_config("/swap", "125m", None, overrides=args.hand_keys["hand-cpu"])
    param, opt = cfg["zero_optimization"]["offload_param"], cfg["zero_optimization"]["offload_optimizer"]
    assert param["device"] == "cpu" and "max_in_cpu" not in param
    assert param["nvme_path"] == "/swap"  # the rest of the section stays
    assert opt["device"] == "cpu" and opt["max_in_cpu"] == 0
    worker = B.parse_args(["--worker", "hand-other", "--overrides", "{}"])
    assert B.ROWS["hand-other"][0] == "zerokit" and worker.overrides == "{}"


@pytest.mark.parametrize("spec,word", [("cpu={", "does not parse"), ("cpu=[1]", "JSON object"),
                                       ("={}", "LABEL=JSON")])
def test_bad_hand_rows_are_refused_naming_the_option(spec, word, capsys):
    with pytest.raises(SystemExit):
        B.parse_args(["--hand", spec])
    err = capsys.readouterr().err
    assert "--hand" in err and word in err


def _ok(row, model, s, rss_gib, budget=None):
    return {"row": row, "model": model, "status": "ok", "step_s": {"median": s},
            "peak_rss_mb": rss_gib * 1024, "budget_gib": budget}


def test_the_planner_table_compares_with_the_fastest_hand_row_that_fits():
    results = [_ok("zk-inf-8g", "125m", 2.0, 5.0, 8.0), _ok("zk-inf-4g", "125m", 3.0, 4.5, 4.0),
               _ok("hand-ram", "125m", 1.5, 7.0), _ok("hand-nvme", "125m", 2.9, 3.0),
               _ok("hand-big", "1b", 0.1, 1.0)]  # another model: never compared
    lines = B.planner_report(results).splitlines()
    eight = next(line for line in lines if "zk-inf-8g" in line)
    four = next(line for line in lines if "zk-inf-4g" in line)
    assert "hand-ram" in eight and "1.33x" in eight and eight.rstrip().endswith("NO")
    assert "hand-nvme" in four and "1.03x" in four and four.rstrip().endswith("yes")
    assert " NO " in four  # its own RSS (4.5) is over its budget (4.0)
    assert B.planner_report([_ok("zk-inf", "125m", 1.0, 1.0)]) is None


def test_a_step_is_marked_stalled_when_the_busy_disk_moves_under_its_share_of_dd(tmp_path):
    dd = {"write_gb_s": 1.0, "read_gb_s": 1.2}  # the floor: 0.4 x 1.0 GB/s
    steps = [20.0, 40.0, 21.0, 30.0]
    paces = [{"gb": 20.0, "busy_s": 16.0, "gb_s": 1.25},
             {"gb": 10.0, "busy_s": 36.0, "gb_s": 0.28},  # busy and slow: stalled
             {"gb": 18.0, "busy_s": 15.0, "gb_s": 1.20},
             {"gb": 0.1, "busy_s": 1.0, "gb_s": 0.10}]  # slow but barely busy: not the disk's fault
    st = B.stalls(steps, paces, dd)
    assert st["steps"] == [1] and st["floor_gb_s"] == pytest.approx(0.4)
    assert st["median_unstalled_s"] == pytest.approx(21.0)
    row = {"budget_gib": None, "row": "zk-inf", "clipping": 1.0, "accumulation": 1, "stalls": st,
           "disk_pace": paces}
    assert "disk stalled in 1 of 4 steps (< 0.40 GB/s busy), the others 21.00 s" in B._note(row)
    assert B.busy_pace(row) == pytest.approx((0.28 + 1.20) / 2)  # the median of the 4 paces
    assert B.busy_pace({"disk_pace": [None, None]}) is None
    assert B.stalls(steps, paces[:3] + [None], dd) is None  # a step without counters: unknown
    assert B.stalls(steps, paces, {"write_gb_s": None, "read_gb_s": None}) is None
    # the counters of the disk holding a folder: bytes and busy seconds only grow
    path = B.block_stat_path(tmp_path)
    if path is not None:
        a = B.block_counters(path)
        (tmp_path / "f").write_bytes(b"x" * 4096)
        os.sync()
        b = B.block_counters(path)
        assert b[0] >= a[0] and b[1] >= a[1]
    assert B.disk_pace((0, 1.0), (3e9, 3.0)) == {"gb": 3.0, "busy_s": 2.0, "gb_s": 1.5}
    assert B.disk_pace((0, 1.0), (0, 1.0)) is None  # never busy: no pace


def test_a_hand_row_named_in_rows_too_runs_once():
    args = B.parse_args(["--rows", "ds-inf,hand-x,zk-inf", "--hand", 'x={"aio": {"queue_depth": 32}}'])
    assert B.row_list(args) == ["ds-inf", "hand-x", "zk-inf"]
    args = B.parse_args(["--rows", "ds-inf", "--hand", 'x={"aio": {"queue_depth": 32}}'])
    assert B.row_list(args) == ["ds-inf", "hand-x"]


class FakeDisk:
    """A clock that moves only when slept on, and a disk whose sectors-written counter grows by 8 at
    each of `writes_at` (seconds) and that has a request in flight until `in_flight_until`."""

    def __init__(self, writes_at=(), in_flight_until=0.0):
        self.t, self.writes_at, self.in_flight_until = 0.0, writes_at, in_flight_until

    def clock(self):
        return self.t

    def sleep(self, s):
        self.t += s

    def sample(self):
        return 8 * sum(w <= self.t for w in self.writes_at), int(self.t < self.in_flight_until)

    def settle(self, quiet_s=10, max_s=120):
        return B.settle(self.sample, quiet_s, max_s, clock=self.clock, sleep=self.sleep)


def _no_disk():
    raise AssertionError("sampled or slept with settling off")


def test_the_settle_ends_after_quiet_s_without_writes():
    assert FakeDisk().settle() == {"waited_s": 10.0, "settled": True}
    assert FakeDisk(writes_at=[-50.0]).settle(quiet_s=4) == {"waited_s": 4.0, "settled": True}
    args = B.parse_args([])
    assert args.settle_quiet_s == 30 and args.settle_max_s == 120
    worker = B.parse_args(["--worker", "zk-inf", "--settle-quiet-s", "5", "--settle-max-s", "0"])
    assert worker.settle_quiet_s == 5 and worker.settle_max_s == 0


def test_a_write_or_a_request_in_flight_restarts_the_quiet_clock():
    # writes at 3, 7.5 and 15 s: quiet from 15 s on, settled at 25
    assert FakeDisk(writes_at=[3.0, 7.5, 15.0]).settle() == {"waited_s": 25.0, "settled": True}
    # no writes, but a request in flight until 30 s (seen at 29): settled at 39
    assert FakeDisk(in_flight_until=30.0).settle() == {"waited_s": 39.0, "settled": True}


def test_the_settle_gives_up_at_max_s_and_the_note_says_so():
    busy = FakeDisk(writes_at=[5.0 * i for i in range(1, 100)])  # a write every 5 s
    wait = busy.settle(quiet_s=10, max_s=120)
    assert wait == {"waited_s": 120.0, "settled": False}
    row = {"budget_gib": None, "row": "zk-inf", "clipping": 1.0, "accumulation": 1,
           "settle": {"row": wait, "steps": {"waited_s": 34.2, "settled": True}}}
    assert B._note(row).endswith("disk still busy after 120 s before the row, settled 34 s before the steps")


def test_max_0_does_not_wait():
    assert B.settle(_no_disk, 10, 0, clock=_no_disk, sleep=_no_disk) is None
    row = {"budget_gib": None, "row": "zk-inf", "clipping": 1.0, "accumulation": 1}  # no "settle": off
    assert "disk" not in B._note(row)


def test_no_block_device_no_wait_and_the_note_says_so_once(tmp_path):
    assert B.write_counters(None) is None
    assert B.settle(lambda: B.write_counters(None), 10, 120, clock=_no_disk, sleep=_no_disk) is None
    row = {"budget_gib": None, "row": "zk-inf", "clipping": 1.0, "accumulation": 1,
           "settle": {"row": None, "steps": None}}
    assert B._note(row).count("no block device") == 1
    path = B.block_stat_path(tmp_path)  # a real disk's counters, where the tests run on one
    if path is not None:
        written, in_flight = B.write_counters(path)
        assert written >= 0 and in_flight >= 0


def _run(step: float, rss_mb: float, read: float = 1e9, status: str = "ok") -> dict:
    return {"row": "zk-inf-8g", "model": "1b", "status": status, "reason": "exit 1",
            "step_s": {"median": step, "min": step - 0.1, "max": step + 0.1},
            "peak_rss_mb": rss_mb, "disk_peak_bytes": int(rss_mb), "read_bytes_per_step": read,
            "write_bytes_per_step": 0.0, "tokens_per_s": 128 / step}


def test_rounds_report_the_median_of_their_medians_and_the_largest_peak():
    merged = B.merge_rounds([_run(11.0, 5000, 3e9), _run(14.0, 5200, 4e9), _run(10.0, 4900, 2e9)])
    assert merged["step_s"]["median"] == 11.0 and merged["step_s_rounds"] == [11.0, 14.0, 10.0]
    assert merged["step_s"]["min"] == pytest.approx(9.9) and merged["step_s"]["max"] == pytest.approx(14.1)
    assert merged["peak_rss_mb"] == 5200 and merged["read_bytes_per_step"] == 3e9
    assert merged["tokens_per_s"] == pytest.approx(128 / 11.0)
    assert merged["io_gb_s"] == pytest.approx(3.0 / 11.0)
    assert B._rounds_cell(merged) == "11.00/14.00/10.00"
    assert B._rounds_cell(B.merge_rounds([_run(10.0, 5000)])) == ""
    failed = B.merge_rounds([_run(10.0, 5000), _run(1.0, 0, status="error")])
    assert failed["status"] == "error" and failed["rounds_ok"] == 1


def test_odd_rounds_run_the_rows_reversed_with_deepspeed_first():
    rows = ["ds-inf", "zk-inf-ds", "zk-inf-half", "hand-x"]
    assert B.round_order(rows, 0) == rows and B.round_order(rows, 2) == rows
    assert B.round_order(rows, 1) == ["ds-inf", "hand-x", "zk-inf-half", "zk-inf-ds"]
    assert B.round_order(["zk-inf-4g", "hand-x"], 1) == ["hand-x", "zk-inf-4g"]


def test_every_round_runs_every_row_and_the_table_has_one_line_per_row(monkeypatch, capsys, tmp_path):
    order = []

    def fake_row(name, model, args, parent, budget, dd):
        order.append((name, budget))
        step = {"hand-x": 2.0, "zk-inf-ds": 3.0}[name] + 0.5 * (len(order) > 2)
        return dict(_run(step, 1000), row=name, model=model, budget_gib=budget, clipping=1.0,
                    accumulation=1, label=name)

    monkeypatch.setattr(B, "run_row", fake_row)
    monkeypatch.setattr(B, "disk_bandwidth", lambda folder: {"write_gb_s": 1.0, "read_gb_s": 1.0})
    out = tmp_path / "r.json"
    rc = B.main(["--models", "1b", "--rows", "zk-inf-ds", "--hand", 'x={"aio": {}}', "--rounds", "2",
                 "--ds-rss-gib", "6", "--nvme-dir", str(tmp_path / "swap"), "--out", str(out)])
    assert rc == 0
    assert order == [("zk-inf-ds", 6.0), ("hand-x", None), ("hand-x", None), ("zk-inf-ds", 6.0)]
    import json
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"zk-inf-ds", "hand-x"}
    assert rows["zk-inf-ds"]["step_s_rounds"] == [3.0, 3.5] and rows["zk-inf-ds"]["step_s"]["median"] == 3.25
    assert "3.00/3.50" in capsys.readouterr().out


def test_round_0s_deepspeed_rss_sizes_every_rounds_budget(monkeypatch, tmp_path):
    budgets, rss = [], iter([6144.0, 9216.0])  # DeepSpeed's RSS: 6 GiB in round 0, 9 in round 1

    def fake_row(name, model, args, parent, budget, dd):
        budgets.append((name, budget))
        return dict(_run(2.0, next(rss) if name == "ds-inf" else 1000), row=name, model=model,
                    budget_gib=budget, clipping=1.0, accumulation=1, label=name)

    monkeypatch.setattr(B, "run_row", fake_row)
    monkeypatch.setattr(B, "disk_bandwidth", lambda folder: {"write_gb_s": 1.0, "read_gb_s": 1.0})
    B.main(["--models", "1b", "--rows", "ds-inf,zk-inf-half", "--rounds", "2", "--ds-rss-gib", "10",
            "--nvme-dir", str(tmp_path / "swap"), "--out", str(tmp_path / "r.json")])
    assert budgets == [("ds-inf", None), ("zk-inf-half", 3.0), ("ds-inf", None), ("zk-inf-half", 3.0)]

"""What rank 0 shows at start-up and while training: the plan, the ignored keys, the steps_per_print
lines and the auto-ratio reason, visible by default, once, and only on rank 0; ZEROKIT_LOG and a
user's own logging set-up turn them down or take them over."""
from __future__ import annotations

import contextlib
import io
import logging
import os
import re

from harness import run_world
from reference import engine_train, global_batches, tiny_gpt

CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1, "wall_clock_breakdown": True,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 1, "contiguous_gradients": False,
                                "offload_optimizer": {"device": "cpu", "ratio": "auto"}}}

PLAN, STEP, AUTO, IGNORED = "zerokit plan", "step=2 ", "finish together", "zero_optimization.contiguous_gradients"


def _fresh_logging() -> None:
    """Each scenario starts as a new process would: no handlers, default levels."""
    for name in (None, "zerokit"):
        logger = logging.getLogger(name)
        for h in list(logger.handlers):
            logger.removeHandler(h)
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("zerokit").setLevel(logging.NOTSET)
    os.environ.pop("ZEROKIT_LOG", None)


def _train_captured(rank: int, world: int, setup) -> dict[str, str]:
    import zerokit

    _fresh_logging()
    streams = {"stdout": io.StringIO(), "stderr": io.StringIO(), "user": io.StringIO()}
    with contextlib.redirect_stdout(streams["stdout"]), contextlib.redirect_stderr(streams["stderr"]):
        setup(streams["user"])
        engine, *_ = zerokit.initialize(model=tiny_gpt(), config=CONFIG)
        engine_train(engine, global_batches(2, 2 * world), rank, world)
        engine.destroy()
    return {k: v.getvalue() for k, v in streams.items()}


def _scenarios(rank: int, world: int) -> dict:
    def user_logging(stream) -> None:
        logging.basicConfig(stream=stream, level=logging.INFO, format="USER %(message)s")
    return {
        "default": _train_captured(rank, world, lambda _: None),
        "warning": _train_captured(rank, world, lambda _: os.environ.__setitem__("ZEROKIT_LOG", "warning")),
        "user": _train_captured(rank, world, user_logging),
    }


def test_rank0_shows_plan_steps_and_auto_reason_by_default_and_logging_controls_them() -> None:
    rank0, rank1 = run_world(_scenarios, 2)
    shown = rank0["default"]["stderr"]
    for fragment in (PLAN, STEP, "ms/step", AUTO, IGNORED):
        assert fragment in shown, f"{fragment!r} missing from rank 0's stderr:\n{shown}"
    assert shown.count(PLAN) == 1 and shown.count(IGNORED) == 1
    for scenario in rank1.values():
        for fragment in (PLAN, STEP, AUTO, IGNORED):
            assert all(fragment not in text for text in scenario.values()), (fragment, scenario)
    # ZEROKIT_LOG=warning: the info lines go; the warning about ignored keys stays.
    quiet = rank0["warning"]["stderr"] + rank0["warning"]["stdout"]
    assert PLAN not in quiet and STEP not in quiet and AUTO not in quiet and IGNORED in quiet
    # The user's logging set-up takes the lines (with the user's format), nothing goes around it.
    user = rank0["user"]
    assert f"USER {PLAN}" in user["user"] and STEP in user["user"] and IGNORED in user["user"]
    assert PLAN not in user["stderr"] + user["stdout"] and STEP not in user["stderr"] + user["stdout"]


def _cli(rank: int, world: int) -> dict[str, str]:
    from zerokit import cli

    _fresh_logging()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        cli.main(["train", "--steps", "2", "--layers", "1", "--width", "32", "--heads", "2",
                  "--seq", "16", "--micro-batch", "2"])
    return {"stdout": out.getvalue(), "stderr": err.getvalue()}


def _cli_nvme(rank: int, world: int, swap: str) -> dict[str, str]:
    import json

    from zerokit import cli

    _fresh_logging()
    cfg = os.path.join(swap, "nvme.json")
    with open(cfg, "w") as f:
        json.dump({"zero_optimization": {"stage": 2, "offload_optimizer": {
            "device": "nvme", "nvme_path": swap}}}, f)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        cli.main(["train", "--steps", "2", "--layers", "1", "--width", "32", "--heads", "2",
                  "--seq", "16", "--micro-batch", "2", "--config", cfg])
    return {"stdout": out.getvalue(), "stderr": err.getvalue()}


def test_cli_bar_shows_the_nvme_io_of_each_step(tmp_path) -> None:
    (rank0,) = run_world(_cli_nvme, 1, str(tmp_path))
    # the optimizer stream of the last step: master + two Adam moments, read and written
    bar = [line for line in rank0["stdout"].replace("\r", "\n").splitlines() if "2/2" in line]
    assert bar and re.search(r"nvme=\d+\.\d+ [MG]iB at \d+\.\d\d GB/s, waited \d+\.\d\ds", bar[-1]), rank0["stdout"]


def test_cli_shows_the_plan_once_on_rank0() -> None:
    rank0, rank1 = run_world(_cli, 2)
    both = rank0["stdout"] + rank0["stderr"]
    assert both.count(PLAN) == 1, both
    assert PLAN not in rank1["stdout"] + rank1["stderr"]

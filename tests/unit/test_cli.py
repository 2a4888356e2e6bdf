"""cli.py: `zerokit train` (the demo) prints the engine's progress lines above its bar.

The bar redraws itself on one line with carriage returns; a line logged while it is live must
clear it first (tqdm.write), or it is glued to the bar's text ("... 3.2step/s]step=2 skipped=0").
The demo runs here as one rank without a launcher, stdout and stderr into one pipe (the bar
writes to stdout, the "zerokit" logger to stderr, as on a terminal).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def test_progress_lines_are_written_above_the_bar_not_through_it() -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env.pop("ZEROKIT_LOG", None)
    run = subprocess.run(
        [sys.executable, "-m", "zerokit.cli", "train", "--steps", "4", "--steps-per-print", "2",
         "--layers", "1", "--width", "32", "--heads", "2", "--seq", "16", "--micro-batch", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=240)
    text = run.stdout.decode(errors="replace")
    assert run.returncode == 0, text
    lines = list(re.finditer(r"step=(\d+) skipped=", text))
    assert [m.group(1) for m in lines] == ["2", "4"], text  # every steps_per_print steps
    assert "%|" in text, text  # the bar was drawn
    for m in lines:
        # What precedes the line on the screen since the last carriage return or newline: the
        # bar cleared to blanks, never the bar's own text.
        start = max(text.rfind("\r", 0, m.start()), text.rfind("\n", 0, m.start())) + 1
        assert text[start:m.start()].strip() == "", repr(text[max(0, m.start() - 120):m.end()])

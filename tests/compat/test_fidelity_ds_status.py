"""`ds_status` at one rank, ZeRO-3 on the CPU with Adam: the real DeepSpeed 0.19.8 and zerokit's
`deepspeed` run the same script (fidelity_api/ds_status_one_rank.py) and differ exactly as
docs/deepspeed.md says (the paragraph on ds_* attributes): zerokit's shard at one rank is the
weights ([Note: one rank's shard is its weights] in zerokit/policy/layout.py), nothing is
released between uses, so `ds_status` stays AVAILABLE and the parameter keeps its data, where
DeepSpeed frees its copy and says NOT_AVAILABLE. The test fails if either side changes; the doc
changes with it.

Not asserted (the doc says nothing of it): after the second forward DeepSpeed keeps every
parameter AVAILABLE until backward, its trace of the first step telling it the next use is near
(stage3_max_reuse_distance).
"""
from __future__ import annotations

import os

import pytest

from _fidelity_runner import real_deepspeed_or_skip, run

BODY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fidelity_api", "ds_status_one_rank.py")
NUMELS = [6 * 16, 16, 16 * 3, 3]  # the body's Linear(6, 16), Linear(16, 3): weights and biases
# where the doc speaks of: after initialize, after a forward and after a step
DOCUMENTED = ["initialize", "forward 0", "step 0", "step 1"]
EXPECTED = {"deepspeed": "NOT_AVAILABLE", "zerokit": "AVAILABLE"}  # docs/deepspeed.md

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    real_deepspeed_or_skip()
    with open(BODY) as f:
        body = f.read()
    return {impl: run(body, impl, world=1)[0] for impl in EXPECTED}


@pytest.mark.parametrize("impl", list(EXPECTED))
def test_ds_status_between_uses_at_one_rank_as_documented(runs, impl) -> None:
    seen = {when: runs[impl][when] for when in DOCUMENTED}
    assert seen == {when: [EXPECTED[impl]] * len(NUMELS) for when in DOCUMENTED}, (impl, seen)


def test_the_parameters_data_outside_a_gather_as_documented(runs) -> None:
    """zerokit's parameter keeps its storage (its ds_tensor); DeepSpeed's is freed to nothing.
    Both ds_tensors hold the whole parameter: one rank's shard is all of it."""
    assert runs["zerokit"]["numel_outside"] == NUMELS
    assert runs["deepspeed"]["numel_outside"] == [0] * len(NUMELS)
    assert runs["zerokit"]["ds_tensor_numel"] == runs["deepspeed"]["ds_tensor_numel"] == NUMELS

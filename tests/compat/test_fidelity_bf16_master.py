"""bf16 master weights with an optimizer that has no bf16 kernel (torch SGD with momentum, a client
optimizer), no offload: zerokit steps it with torch's optimizer on the bf16 master, which is what
DeepSpeed 0.19.8 does. The same script through the real DeepSpeed and through zerokit answering
`import deepspeed`, world 1, stage 2."""
from __future__ import annotations

import torch

from _fidelity_runner import real_deepspeed_or_skip, run

BODY = r'''
import torch, deepspeed
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0,
       "zero_allow_untested_optimizer": True,
       "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
       "zero_optimization": {"stage": 2}}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
g = torch.Generator().manual_seed(1)
losses = []
for _ in range(4):
    x = torch.randn(8, 16, generator=g).to(torch.bfloat16)
    y = torch.randn(8, 4, generator=g).to(torch.bfloat16)
    loss = ((engine(x) - y) ** 2).mean()
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
emit({"losses": losses, "w": [p.detach().float().flatten().tolist() for p in engine.module.parameters()]})
'''


def test_sgd_on_a_bf16_master_steps_as_deepspeed_does(tmp_path) -> None:
    real_deepspeed_or_skip()
    zk = run(BODY, "zerokit", tmp_path / "zk", world=1, timeout=300)[0]
    ds = run(BODY, "deepspeed", tmp_path / "ds", world=1, timeout=300)[0]
    assert zk["losses"] == ds["losses"]
    a = torch.tensor([x for p in zk["w"] for x in p])
    b = torch.tensor([x for p in ds["w"] for x in p])
    # Measured (2026-11-28): 2 of 676 weights one bf16 ulp apart after 4 steps, the losses equal;
    # a gradient scaled by 1.01 in zerokit's path already fails the losses.
    ulp = (b.abs() * 2 ** -7).clamp_min(2 ** -126)
    assert bool(((a - b).abs() <= ulp).all())
    assert int((a != b).sum()) <= a.numel() // 100, int((a != b).sum())

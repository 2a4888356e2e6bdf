"""Point 13 at stage 3: zero.Init parameters, enable_sanity_checks, empty_partition_cache (the body of a script run by tests/compat/test_fidelity_api.py)."""
import os, torch, deepspeed
import torch.distributed as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
out = {}
deepspeed.init_distributed(dist_backend="gloo")
base = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 20,
                              "enable_sanity_checks": True}}

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 16)
        self.b = torch.nn.Linear(16, 3)  # weight 48 elements; bias 3 (persistent in DeepSpeed)
        self.c = torch.nn.Linear(3, 3)  # 12 elements: persistent in both (a unit of its own here)
    def forward(self, x):
        return self.c(self.b(torch.relu(self.a(x))))

torch.manual_seed(0)
with deepspeed.zero.Init(config_dict_or_path=base):
    m = Net()
status = lambda: [p.ds_status.name for p in m.parameters()]
out["init_status"] = status()
out["init_ds_numel"] = [p.ds_numel for p in m.parameters()]
out["init_numel_outside"] = [p.numel() for p in m.parameters()]
with deepspeed.zero.GatheredParameters(list(m.parameters())):
    out["init_status_gathered"] = status()
    out["init_numel_gathered"] = [p.numel() for p in m.parameters()]
out["init_status_after"] = status()
# enable_sanity_checks: an in-place edit (rank 0 only) without modifier_rank
try:
    with deepspeed.zero.GatheredParameters([m.a.weight]):
        if rank == 0:
            with torch.no_grad():
                m.a.weight.add_(1.0)
    out["sanity"] = "no error"
except RuntimeError as ex:
    out["sanity"] = "RuntimeError" + ("/in-place" if "in-place modification" in str(ex) else str(ex)[:100])
with deepspeed.zero.GatheredParameters([m.a.weight]):
    out["after_sanity_first"] = [float(v) for v in m.a.weight.flatten()[:4]]
# reading without modifying passes
with deepspeed.zero.GatheredParameters([m.a.weight]):
    s = float(m.a.weight.sum())
out["read_only_ok"] = True

e, o, _, _ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), config=base)
g = torch.Generator().manual_seed(7 + rank)
x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
losses = []
for step in range(3):
    loss = torch.nn.functional.mse_loss(e(x), y)
    e.backward(loss)
    e.step()
    losses.append(float(loss))
    if step == 1:
        with torch.no_grad():
            e.eval(); e(x); e.train()
        out["status_before_epc"] = status()
        e.empty_partition_cache()
        out["status_after_epc"] = status()
out["losses"] = losses
# every parameter persistent: empty_partition_cache releases them too, the next step gathers again
torch.manual_seed(1)
m2 = Net()
cfg2 = dict(base, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 10**6})
e2, _, _, _ = deepspeed.initialize(model=m2, optimizer=torch.optim.SGD(m2.parameters(), lr=0.1), config=cfg2)
persist = []
for step in range(2):
    loss = torch.nn.functional.mse_loss(e2(x), y)
    e2.backward(loss)
    e2.step()
    persist.append(float(loss))
    if step == 0:
        out["persistent_before_epc"] = [p.ds_status.name for p in m2.parameters()]
        e2.empty_partition_cache()
        out["persistent_after_epc"] = [p.ds_status.name for p in m2.parameters()]
out["persistent_losses"] = persist
emit(out)

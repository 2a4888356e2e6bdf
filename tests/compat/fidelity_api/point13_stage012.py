"""Point 13, stages 0-2 (the body of a script run by tests/compat/test_fidelity_api.py)."""
import os, torch, deepspeed
import torch.distributed as dist
out = {}
store = "file://" + os.path.join(workdir, "store")
deepspeed.init_distributed(dist_backend="gloo", init_method=store, rank=rank, world_size=world)
out["world"] = dist.get_world_size()
out["config_error_is_exception"] = issubclass(deepspeed.DeepSpeedConfigError, Exception)
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
out["offload_devices"] = [e.value for e in OffloadDeviceEnum]
ops = deepspeed.ops.__compatible_ops__
out["ops_keys"] = sorted(ops)
out["ops_cpu_optimizers"] = [ops[k] for k in ("cpu_adam", "cpu_adagrad", "cpu_lion", "fused_adam")]

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))

def batch(step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)

def train(engine, steps=2):
    for s in range(steps):
        x, y = batch(s)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()

def weights(engine):
    return [float(v) for p in engine.module.parameters() for v in p.detach().flatten()[:5]]

base = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True}
# optimizer type in lower case, as DeepSpeed's own tests write it
cfg = dict(base, optimizer={"type": "adamw", "params": {"lr": 0.01}}, zero_optimization={"stage": 2})
e, o, _, _ = deepspeed.initialize(model=model(), model_parameters=None, config=cfg)
train(e)
out["adamw_lower_weights"] = weights(e)
out["cur_scale"], out["loss_scale"] = e.optimizer.cur_scale, e.optimizer.loss_scale
out["optimizer_is_engine_optimizer"] = o is e.optimizer
try:
    e.save_checkpoint(None)
    out["save_none"] = "no error"
except Exception as ex:
    out["save_none"] = type(ex).__name__
e.empty_partition_cache()  # stage 2: nothing partitioned, nothing to do
out["epc_stage2_weights_unchanged"] = weights(e) == out["adamw_lower_weights"]

# a client optimizer and a config section: the client's (SGD, scale-sensitive) is used
m = model()
cfg = dict(base, optimizer={"type": "AdamW", "params": {"lr": 0.5}}, zero_optimization={"stage": 1})
e, _, _, _ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), config=cfg)
train(e)
out["client_optimizer_weights"] = weights(e)

# gradient_allreduce_op sum, stages 0 and 2 (SGD: the update is the summed gradient's)
for stage in (0, 2):
    m = model()
    cfg = dict(base, gradient_allreduce_op="sum", zero_optimization={"stage": stage})
    e, _, _, _ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), config=cfg)
    train(e)
    out[f"sum_stage{stage}_weights"] = weights(e)
try:
    m = model()
    deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                         config=dict(base, gradient_allreduce_op="sum", zero_optimization={"stage": 3}))
    out["sum_stage3"] = "accepted"
except Exception as ex:
    out["sum_stage3"] = f"ValueError: {isinstance(ex, ValueError)}" + ("/stage 3" if "stage 3" in str(ex) else str(ex)[:200])

# checkpoint.tag_validation
d = workdir
for mode in ("Warn", "Ignore", "Fail"):
    m = model()
    cfg = dict(base, checkpoint={"tag_validation": mode}, zero_optimization={"stage": 2})
    e, _, _, _ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), config=cfg)
    train(e, 1)
    try:
        e.save_checkpoint(os.path.join(d, "ckpt-" + mode), tag=f"tag-{rank}")
        out["tag_" + mode] = "saved"
    except AssertionError:
        out["tag_" + mode] = "AssertionError"
    dist.barrier()
    e.save_checkpoint(os.path.join(d, "ckpt-same-" + mode), tag="same")
    listing = os.listdir(os.path.join(d, "ckpt-same-" + mode))
    out["tag_same_" + mode] = {"same", "latest"} <= set(listing)
try:
    deepspeed.initialize(model=model(), optimizer=torch.optim.SGD(model().parameters(), lr=0.1),
                         config=dict(base, checkpoint={"tag_validation": "foo"}))
    out["tag_foo"] = "accepted"
except deepspeed.DeepSpeedConfigError:
    out["tag_foo"] = "DeepSpeedConfigError"
emit(out)

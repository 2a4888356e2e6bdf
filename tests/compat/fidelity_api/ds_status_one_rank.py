"""ds_status at one rank, ZeRO-3 on the CPU with Adam (the body of a script run by
tests/compat/test_fidelity_ds_status.py): each parameter's status after initialize, after a
forward, after backward and after a step, for two steps (DeepSpeed records its trace of
submodules in the first), and what each parameter holds outside a gather."""
import torch, deepspeed

deepspeed.init_distributed(dist_backend="gloo")
config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
          # every parameter partitioned in DeepSpeed (none kept whole for being small)
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
status = lambda: [p.ds_status.name for p in model.parameters()]
x, y = torch.randn(4, 6), torch.randn(4, 3)
out = {"names": [n for n, _ in model.named_parameters()], "initialize": status()}
for step in range(2):
    loss = torch.nn.functional.mse_loss(engine(x), y)
    out[f"forward {step}"] = status()
    engine.backward(loss)
    out[f"backward {step}"] = status()
    engine.step()
    out[f"step {step}"] = status()
out["ds_tensor_numel"] = [p.ds_tensor.numel() for p in model.parameters()]
out["numel_outside"] = [p.numel() for p in model.parameters()]
emit(out)

"""zerokit's engine in fp16 on the CPU: engine.optimizer's cur_scale / loss_scale / overflow after
each step, an overflow forced by an infinite loss where the reference sequence has one."""
import torch, deepspeed
deepspeed.init_distributed(dist_backend="gloo")
OVERFLOWS = [False, True, False, False, False, True, False]
torch.manual_seed(0)
m = torch.nn.Linear(4, 2)
cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": 0.0,
       "zero_optimization": {"stage": 2},
       "fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 1,
                "min_loss_scale": 1}}
e, o, _, _ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.01), config=cfg)
scales, flags, same = [], [], []
for overflow in OVERFLOWS:
    x = torch.randn(2, 4).half()
    loss = e(x).float().pow(2).mean() * (float("inf") if overflow else 1.0)
    e.backward(loss)
    e.step()
    scales.append(e.optimizer.cur_scale)
    flags.append(e.optimizer.overflow)
    same.append(e.optimizer.loss_scale == e.optimizer.cur_scale and o is e.optimizer)
emit({"cur_scale": scales, "overflow": flags, "dynamic": e.optimizer.dynamic_loss_scale, "same": all(same)})

"""Point 7: what the engine hands out (tput_timer, timers, monitor, lr_scheduler, training_dataloader, the optimizer wrapper) (the body of a script run by tests/compat/test_fidelity_api.py)."""
import os, torch, deepspeed
import torch.distributed as dist
out = {}
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
data = torch.utils.data.TensorDataset(torch.arange(64, dtype=torch.float32).view(32, 2).repeat(1, 3),
                                      torch.zeros(32, 3))
cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
       "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
       "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
       "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                   "warmup_num_steps": 4, "warmup_type": "linear"}}}
e, o, loader, sched = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg,
                                           training_data=data)
t = e.tput_timer
out["tput_attrs"] = {k: getattr(t, k) for k in ("batch_size", "start_step", "epoch_count",
                                                 "micro_step_count", "global_step_count", "started")}
out["loader_same"] = loader is e.training_dataloader
out["loader_len"] = [len(loader), loader.len]
out["loader_sampler_has_set_epoch"] = hasattr(loader.data_sampler, "set_epoch")
first = next(iter(loader))
out["loader_first"] = [first[0].tolist()]
out["sched_same"] = sched is e.lr_scheduler
counts = []
lrs = []
for epoch in range(2):
    for i, (x, y) in enumerate(loader):
        if i == 4:
            break
        loss = torch.nn.functional.mse_loss(e(x), y)
        e.backward(loss)
        e.step()
        counts.append([t.epoch_count, t.micro_step_count, t.global_step_count])
        lrs.append(e.lr_scheduler.get_last_lr())
    t.update_epoch_count()
    counts.append([t.epoch_count, t.micro_step_count, t.global_step_count])
out["tput_counts"] = counts
out["lrs"] = lrs
out["sched_get_lr"] = e.lr_scheduler.get_lr()
out["sched_last_batch_iteration"] = e.lr_scheduler.last_batch_iteration
out["sched_state_keys"] = sorted(e.lr_scheduler.state_dict())
out["avg_samples_per_sec_finite"] = t.avg_samples_per_sec() > 0
# the optimizer wrapper
opt = e.optimizer
out["opt"] = {"is_returned": opt is o, "cur_scale": opt.cur_scale, "loss_scale": opt.loss_scale,
              "overflow": opt.overflow, "dynamic_loss_scale": opt.dynamic_loss_scale,
              "clip_grad": opt.clip_grad, "lr": opt.param_groups[0]["lr"],
              "basic_lr": opt.optimizer.param_groups[0]["lr"], "get_lr": opt.get_lr(),
              "state_len": len(opt.state) > 0}
# engine.timers
tm = e.timers
tm("probe").start()
sum(range(100000))
tm("probe").stop()
try:
    tm("probe").stop()
    out["timer_double_stop"] = "no error"
except AssertionError:
    out["timer_double_stop"] = "AssertionError"
out["timer_keys"] = sorted(k for k in tm.get_timers() if k == "probe")
out["timer_elapsed_positive"] = tm("probe").elapsed(reset=False) > 0
out["timer_elapsed_after_reset"] = [tm("probe").elapsed() > 0, tm("probe").elapsed()]
out["timer_mean_zero"] = tm.get_mean(["probe"]) == {"probe": 0}
# engine.monitor with no monitor configured
out["monitor_enabled"] = e.monitor.enabled
e.monitor.write_events([("x", 1.0, 1)])
out["monitor_writers"] = [getattr(e.monitor, n) for n in ("tb_monitor", "wandb_monitor", "csv_monitor", "comet_monitor")]
emit(out)

"""DeepSpeed's fp16 loss scale over a given overflow sequence: its DynamicLossScaler itself, built
as its ZeRO optimizers build it (DeepSpeed cannot train in fp16 on the CPU accelerator)."""
import deepspeed
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
deepspeed.init_distributed(dist_backend="gloo")
OVERFLOWS = [False, True, False, False, False, True, False]
s = DynamicLossScaler(init_scale=2 ** 4, scale_window=2, min_scale=1, delayed_shift=1,
                      consecutive_hysteresis=False)
scales = []
for overflow in OVERFLOWS:
    s.update_scale(overflow)
    scales.append(s.cur_scale)
emit({"cur_scale": scales, "overflow": OVERFLOWS, "dynamic": s.dynamic})

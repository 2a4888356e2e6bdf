"""A unit's optimizer range as parts: each a contiguous element range stepped on one tier.

[Note: optimizer parts]
The partition policy gives a rank its optimizer range [a, b) of each unit; the placement policy
splits it into parts (policy/layout.py `plan_layout`): with offload, the host part [a, a + k) first,
then the device part [a + k, b). Twin-Flow is both; ZeRO-Offload at ratio 1 leaves the device
part empty. Each part holds its master and master gradient (from the unit's buffer records; fp32,
or bf16 on every tier with bf16.bf16_master_weights_and_grads: engine/bf16_state.py) and offers
the same operations: gradients in (`take_grad`), their norm, clearing, an edit of the compute
weights (`absorb`), and its new weights out to the weights' home (`write_weights`). An executor
(parts/executors.py) steps the parts of its tier: torch's optimizer the device parts (the host
kernel's math in torch for a bf16 master, optim/device_kernels.py), the native kernel the host
parts, the streaming NVMe executor the nvme parts (parts/nvme.py:
master and state are file ranges). Host and nvme parts are separate classes with one small
interface for their executors (`KernelPart` in parts/kernel_part.py); what they share, the route
of their new weights (`WeightsOut`) and a held gradient (parts/held_gradient.py), they hold.
"""

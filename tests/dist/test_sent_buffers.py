"""Every kind of buffer the engine hands to a collective, against a plain torch run.

DeepSpeed-Chat's SFT at ZeRO-3 aborted both gloo ranks in initialize ("writev: Bad address"):
its two weight-decay groups put a module's weight and bias into two units, and the construction
unit zero.Init built for the module was freed once the first unit was laid out, leaving the bias
a view of freed memory that the second unit's broadcast sent. The grid here builds that shape
(zero.Init, a module split across two optimizer groups, an embedding resized under
GatheredParameters, small persistent parameters next to large partitioned ones, tied weights) and
trains it at stages 2 and 3, overlap_comm on and off, CPU offload on and off: the losses and the
final weights equal plain torch's: SGD, whose update shows any error in a gradient's scale, and
Adam where the optimizer is offloaded (the host kernels step Adam, Adagrad and Lion).
"""
from __future__ import annotations

import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_world

V, D, SEQ, STEPS, MICRO, LR, ADAM_LR = 40, 32, 8, 3, 2, 0.5, 0.01
NEW_V = 48  # resize_token_embeddings to a multiple of 8, as DeepSpeed-Chat does


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.ln = nn.LayerNorm(D)               # 64 elements: persistent at threshold 100
        self.fc1 = nn.Linear(D, 4 * D)          # weight partitioned, bias persistent
        self.fc2 = nn.Linear(4 * D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight      # tied: one parameter, two modules

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.emb(x))
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _resized_embedding(model: Net, gathered) -> None:
    """resize_token_embeddings as transformers does it: a new embedding (built partitioned under
    zero.Init when one is on), the old rows copied in under GatheredParameters, the head re-tied."""
    torch.manual_seed(5)
    new = nn.Embedding(NEW_V, D)
    with gathered([model.emb.weight, new.weight]):
        new.weight.data[:V] = model.emb.weight.data
    model.emb = new
    model.head.weight = new.weight


def _split(model: Net) -> list[dict]:
    """DeepSpeed-Chat's split: biases and norms in their own group (here with another lr, so a
    parameter stepped in the wrong group shows)."""
    no_decay = [p for n, p in model.named_parameters() if "bias" in n or n.startswith("ln.")]
    decay = [p for n, p in model.named_parameters() if not ("bias" in n or n.startswith("ln."))]
    return [{"params": decay, "lr": LR}, {"params": no_decay, "lr": LR / 2}]


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, NEW_V, (STEPS, MICRO * world, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _optimizer(offload: bool) -> dict:
    return {"type": "Adam", "params": {"lr": ADAM_LR}} if offload else {"type": "SGD", "params": {"lr": LR}}


def _groups(model: Net, offload: bool) -> list[dict]:
    lr = ADAM_LR if offload else LR
    return [dict(g, lr=g["lr"] * lr / LR) for g in _split(model)]


def _reference(world: int, offload: bool) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = Net()
    _resized_embedding(model, lambda params: _nothing())
    groups = _groups(model, offload)
    opt = torch.optim.Adam(groups) if offload else torch.optim.SGD(groups)
    losses = []
    for x, y in _batches(world):
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


CASES = [dict(stage=s, overlap=o, offload=f, init=s == 3)
         for s, o, f in itertools.product((2, 3), (True, False), (True, False))]


def _grid(rank: int, world: int) -> list[dict]:
    import zerokit

    out = []
    for case in CASES:
        zero = {"stage": case["stage"], "overlap_comm": case["overlap"],
                "stage3_param_persistence_threshold": 100, "reduce_bucket_size": 1000}
        if case["offload"]:
            zero["offload_optimizer"] = {"device": "cpu"}
            if case["stage"] == 3:
                zero["offload_param"] = {"device": "cpu"}
        config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
                  "optimizer": _optimizer(case["offload"]), "zero_optimization": zero}
        torch.manual_seed(0)
        if case["init"]:
            with zerokit.zero.Init(config=config):
                model = Net()
                _resized_embedding(model, lambda ps: zerokit.zero.GatheredParameters(ps, modifier_rank=0))
        else:
            model = Net()
            _resized_embedding(model, lambda params: _nothing())
        engine, *_ = zerokit.initialize(model=model, model_parameters=_groups(model, case["offload"]),
                                        config=config)
        losses = []
        for x, y in _batches(world):
            per = x.shape[0] // world
            loss = engine(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
            engine.backward(loss)
            engine.step()
            t = loss.detach().reshape(1).clone()
            torch.distributed.all_reduce(t)
            losses.append(t.item() / world)
        out.append({"case": case, "losses": losses, "final": engine.consolidated_fp32_state_dict()})
        engine.destroy()
    return out


def test_every_sent_buffer_trains_as_plain_torch() -> None:
    refs = {offload: _reference(2, offload) for offload in (True, False)}
    for rank_results in run_world(_grid, 2, timeout=400):
        for r in rank_results:
            case = r["case"]
            ref_losses, ref_weights = refs[case["offload"]]
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses),
                                       rtol=1e-5, atol=1e-6, msg=lambda m: f"{case}: {m}")
            for name, v in ref_weights.items():
                if name == "head.weight":
                    continue  # tied to emb.weight
                torch.testing.assert_close(r["final"][name], v, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name: f"{case} {n}: {m}")


def test_a_collective_refuses_a_buffer_whose_storage_was_freed() -> None:
    """The guard behind every collective: a view outliving its storage's bytes is named, never
    sent (gloo would abort with 'writev: Bad address', or send whatever lies there now)."""
    import pytest

    from zerokit.comm.collectives import CollectiveError, require_backed

    flat = torch.zeros(100)
    bias = flat[60:90]
    assert require_backed(bias, "broadcast", "x") is bias
    flat.untyped_storage().resize_(0)
    with pytest.raises(CollectiveError, match=r"broadcast for unit 'u' \(b\): its buffer's storage holds 0 bytes"):
        require_backed(bias, "broadcast", "unit 'u' (b)")
    assert require_backed(torch.empty(0), "broadcast", "x").numel() == 0

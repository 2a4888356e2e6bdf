"""One Hugging Face Trainer run under whatever `import deepspeed` resolves to (zerokit's
compatibility distribution, or the real DeepSpeed). The tests run body(spec) through
_fidelity_runner.run (the run's workdir is `out`); run as a script, it prints one JSON line.

    python _hf_trainer_run.py '{"stage": 2, "offload": true, "out": "/tmp/x", ...}'

Spec keys: stage, offload, out (a fresh directory), steps, resize (call resize_token_embeddings
before training), save_at (save a checkpoint every that many steps), resume_from (a checkpoint
directory under out: resume from it and train to `steps`), config (a full DeepSpeed config with "auto" values instead of
the built one). The model is a tiny GPT-2 from a config (no download); the data is a fixed
random token set, so both runs see the same batches.
"""
from __future__ import annotations

import json
import os
import sys

VOCAB, SEQ, MICRO, LR = 128, 16, 2, 1e-2


def ds_config(stage: int, offload: bool) -> dict:
    """A config in the shape of HF's documented ones: "auto" wherever the Trainer fills values."""
    zero: dict = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                  "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update({"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                     "stage3_gather_16bit_weights_on_model_save": True, "sub_group_size": 1e9})
        if offload:
            zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    return {
        # torch_adam: DeepSpeed on the CPU would otherwise JIT-compile FusedAdam / CPUAdam.
        "optimizer": {"type": "Adam", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                 "weight_decay": "auto", "torch_adam": True,
                                                 "adam_w_mode": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto"}},
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "steps_per_print": 1e9, "wall_clock_breakdown": False,
    }


def _model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    # Built outside zero.Init, so that every stage starts from the same weights (the engine
    # partitions them at initialize).
    return GPT2LMHeadModel(cfg)


class _Tokens:
    def __init__(self, n: int):
        import torch

        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(spec: dict, steps: int, config: dict):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=spec["out"], per_device_train_batch_size=MICRO, gradient_accumulation_steps=2,
        learning_rate=LR, max_steps=steps, logging_steps=1, save_steps=spec.get("save_at", 10**6),
        save_strategy="steps", report_to=[], deepspeed=config, seed=0, data_seed=0,
        max_grad_norm=1.0, warmup_steps=2, lr_scheduler_type="constant_with_warmup",
        dataloader_num_workers=0, disable_tqdm=True, use_cpu=not _cuda())


def _trainer(args, model):
    from transformers import Trainer, TrainerCallback

    losses: list[float] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(64), callbacks=[Record()])
    return trainer, losses


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(spec: dict) -> dict:
    import deepspeed
    import torch
    from transformers import GPT2LMHeadModel

    config = spec.get("config") or ds_config(spec["stage"], spec.get("offload", False))
    result: dict = {"deepspeed": deepspeed.__version__}
    steps = spec.get("steps", 6)
    args = _args(spec, steps, config)  # first: it turns on zero.Init for ZeRO-3 (HF's order)
    model = _model()
    if spec.get("resize"):
        model.resize_token_embeddings(VOCAB + 8)
    trainer, losses = _trainer(args, model)
    if spec.get("resume_from"):  # a fresh process (Accelerate allows one DeepSpeed plugin each)
        trainer.train(resume_from_checkpoint=os.path.join(spec["out"], spec["resume_from"]))
    else:
        trainer.train()
    result["losses"] = losses
    saved = os.path.join(spec["out"], "final")
    trainer.save_model(saved)
    trainer.accelerator.wait_for_everyone()
    if int(os.environ.get("RANK", "0")) == 0:
        # Load as a user does after training: outside the Trainer's ZeRO-3 context (inside it,
        # from_pretrained builds a partitioned model under zero.Init, which only an engine runs).
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        loaded, info = GPT2LMHeadModel.from_pretrained(saved, output_loading_info=True)
        result["loading_info"] = {k: sorted(map(str, v)) for k, v in info.items()}
        result["saved_files"] = sorted(os.listdir(saved))
        ids = _Tokens(4).ids
        with torch.no_grad():
            result["loaded_loss"] = float(loaded(input_ids=ids, labels=ids).loss)
    return result


def body(spec: dict) -> str:
    """The _fidelity_runner body that runs main(spec) with the run's workdir as `out`."""
    here = os.path.dirname(os.path.abspath(__file__))
    return (f"import json, sys\nsys.path.insert(0, {here!r})\nimport _hf_trainer_run\n"
            f"emit(_hf_trainer_run.main(dict(json.loads({json.dumps(spec)!r}), out=workdir)))\n")


if __name__ == "__main__":
    out = main(json.loads(sys.argv[1]))
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(out))

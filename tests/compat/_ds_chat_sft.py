"""DeepSpeed-Chat's step-1 SFT (applications/DeepSpeed-Chat/training/step1_supervised_finetuning/
main.py and dschat/utils) in miniature, run unchanged under whatever `import deepspeed` is: a tiny
OPT built from its config under HfDeepSpeedConfig (so under zero.Init at ZeRO-3), then
resize_token_embeddings, a client DeepSpeedCPUAdam over DeepSpeed-Chat's two weight-decay groups,
transformers' cosine schedule, an evaluation pass (perplexity, all-reduced) before training,
training with engine.backward / engine.step, and DeepSpeed-Chat's ZeRO-3 save (each parameter
gathered). The body of a _fidelity_runner run (its `workdir` receives the saved model): SPEC (json
in the environment) picks the stage, offload, overlap_comm and steps.
"""
import json
import math
import os

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from transformers import AutoModelForCausalLM, OPTConfig, get_scheduler
from transformers.integrations.deepspeed import HfDeepSpeedConfig

SPEC = json.loads(os.environ.get("SPEC", "{}"))
STAGE, OFFLOAD = SPEC.get("stage", 3), SPEC.get("offload", True)
STEPS, MICRO, SEQ = SPEC.get("steps", 10), 2, 16
# The tokenizer adds tokens to the vocabulary: DeepSpeed-Chat resizes to a multiple of 8.
VOCAB, TOKENS, HIDDEN = SPEC.get("vocab", 50), SPEC.get("tokens", 53), SPEC.get("hidden", 32)

deepspeed.init_distributed()
world, rank = dist.get_world_size(), dist.get_rank()


def ds_config() -> dict:  # dschat/utils/ds_utils.py get_train_ds_config
    device = "cpu" if OFFLOAD else "none"
    return {
        "train_batch_size": MICRO * world, "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 10,
        "zero_optimization": {"stage": STAGE, "overlap_comm": SPEC.get("overlap_comm", True),
                              "offload_param": {"device": device}, "offload_optimizer": {"device": device},
                              "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 3e7,
                              "stage3_prefetch_bucket_size": 3e7, "memory_efficient_linear": False},
        "bf16": {"enabled": True}, "gradient_clipping": 1.0, "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                          "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8},
    }


def create_hf_model(ds_config: dict):  # dschat/utils/model/model_utils.py create_hf_model
    model_config = OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, ffn_dim=4 * HIDDEN,
                             num_attention_heads=2, max_position_embeddings=SEQ + 2, word_embed_proj_dim=HIDDEN,
                             dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0)
    # A local, as there: zero.Init is on while the model is built and resized, gone afterwards.
    dschf = HfDeepSpeedConfig(ds_config) if ds_config["zero_optimization"]["stage"] == 3 else None  # noqa: F841
    model = AutoModelForCausalLM.from_config(model_config)
    model.config.end_token_id = 2
    model.config.pad_token_id = model.config.eos_token_id
    model.resize_token_embeddings(int(8 * math.ceil(TOKENS / 8.0)))
    return model


config = ds_config()
torch.manual_seed(1234)
model = create_hf_model(config)


def grouped_parameters(model, weight_decay=0.0, no_decay=("bias", "layer_norm.weight", "layernorm.weight")):
    return [
        {"params": [p for n, p in model.named_parameters()
                    if not any(nd in n.lower() for nd in no_decay) and p.requires_grad],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters()
                    if any(nd in n.lower() for nd in no_decay) and p.requires_grad],
         "weight_decay": 0.0},
    ]


Adam = DeepSpeedCPUAdam if OFFLOAD else FusedAdam
optimizer = Adam(grouped_parameters(model, 0.1), lr=1e-2, betas=(0.9, 0.95))
lr_scheduler = get_scheduler(name="cosine", optimizer=optimizer, num_warmup_steps=2, num_training_steps=STEPS)
model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                         lr_scheduler=lr_scheduler, dist_init_required=True)

g = torch.Generator().manual_seed(7)
data = torch.randint(3, TOKENS, (MICRO * world * (STEPS + 2), SEQ), generator=g)
mine = data[rank::world]  # DistributedSampler without shuffling
device = next(model.module.parameters()).device


def evaluation() -> float:  # main.py evaluation(): perplexity of a few batches, all-reduced
    model.eval()
    losses = 0.0
    for step in range(2):
        batch = mine[step * MICRO:(step + 1) * MICRO].to(device)
        with torch.no_grad():
            losses += float(model(input_ids=batch, labels=batch).loss)
    loss = torch.tensor(losses / 2)
    dist.all_reduce(loss)
    return float(loss) / world


eval_loss = evaluation()
model.train()
losses = []
for step in range(STEPS):
    batch = mine[step * MICRO:(step + 1) * MICRO].to(device)
    loss = model(input_ids=batch, labels=batch, use_cache=False).loss
    model.backward(loss)
    model.step()
    full = torch.tensor(float(loss))
    dist.all_reduce(full)
    losses.append(float(full) / world)
eval_after = evaluation()

# save_zero_three_model: gather each parameter, rank 0 keeps a CPU copy.
state = {}
for name, p in model.module.named_parameters():
    with deepspeed.zero.GatheredParameters([p], enabled=STAGE == 3):
        if rank == 0:
            state[name] = p.detach().float().cpu().clone()
if rank == 0:
    torch.save(state, os.path.join(workdir, "pytorch_model.bin"))
emit({"deepspeed": deepspeed.__version__, "eval_loss": eval_loss, "losses": losses, "eval_after": eval_after,
      "saved": sorted(state)[:3], "n_saved": len(state),
      "embed": list(state["model.decoder.embed_tokens.weight"].shape) if rank == 0 else None})

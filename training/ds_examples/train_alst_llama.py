r"""A DeepSpeed ALST (Ulysses for Hugging Face) training script, written as a DeepSpeed user writes one.

A tiny Llama built from a ``transformers`` config (no downloaded weights), attention "sdpa",
``UlyssesSPAttentionHF.register_with_transformers`` as in DeepSpeed's ALST tutorial, each rank
holding its shard of the sequence with global ``position_ids``, and ``deepspeed.initialize`` with
the JSON config. It does not know megatron_sp_ext: with megatron_sp_ext installed, a
``"sequence_parallel_ext"`` block in the JSON switches the exchange (see docs/deepspeed.md).

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 training/ds_examples/train_alst_llama.py \
        --deepspeed_config training/ds_examples/configs/ds_sp2.json --steps 10
"""
from __future__ import annotations

import argparse
import json
import math
import os

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
from transformers import AutoModelForCausalLM, LlamaConfig


def batch(step: int, batch_size: int, seq_len: int, vocab: int, seed: int):
    """Counting sequences with a random start and stride: learnable, the same on every rank."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, vocab, (batch_size, 1), generator=g)
    stride = torch.randint(1, 4, (batch_size, 1), generator=g)
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deepspeed_config", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=97)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-json", default=None, help="write per-step loss and grad norm here (rank 0)")
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args(argv)
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)

    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", args.local_rank)))
    sp = ds_config.get("sequence_parallel_size", 1)

    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq_len)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp,
        micro_batch_size=args.batch_size, seq_length=args.seq_len, seq_length_is_variable=True)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=args.deepspeed_config, mpu=mpu)
    device = engine.device
    sp_rank = mpu.get_sequence_parallel_rank() if mpu is not None else 0
    s_loc = args.seq_len // sp
    pos = torch.arange(sp_rank * s_loc, (sp_rank + 1) * s_loc).expand(args.batch_size, s_loc).to(device)
    tokens_per_step = args.batch_size * args.seq_len
    losses, grad_norms = [], []
    for step in range(args.steps):
        ids, labels = batch(step * (world // sp) + rank // sp, args.batch_size, args.seq_len, args.vocab, args.seed)
        ids, labels = (t[:, sp_rank * s_loc:(sp_rank + 1) * s_loc].to(device) for t in (ids, labels))
        logits = engine(input_ids=ids, position_ids=pos).logits
        loss_sum = F.cross_entropy(logits.float().reshape(-1, args.vocab), labels.reshape(-1), reduction="sum")
        # DeepSpeed averages gradients over the sequence x data ranks: scaling this shard's share of the
        # sequence's mean loss by sp makes that average the gradient of the mean loss
        engine.backward(loss_sum * (sp / tokens_per_step))
        engine.step()
        mean = loss_sum.detach() / tokens_per_step
        torch.distributed.all_reduce(mean)  # sum over the SP shards, and over data-parallel sequences
        losses.append(mean.item() / (world // sp))
        gn = engine.get_global_grad_norm()
        grad_norms.append(float(gn) if gn is not None and math.isfinite(float(gn)) else float("nan"))
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f} grad_norm {grad_norms[-1]:.6f}", flush=True)
    if args.log_json and rank == 0:
        with open(args.log_json, "w") as f:
            json.dump({"loss": losses, "grad_norm": grad_norms}, f)
    return {"loss": losses, "grad_norm": grad_norms, "engine": engine}


if __name__ == "__main__":
    main()

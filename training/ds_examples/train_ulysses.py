r"""A DeepSpeed Ulysses training script, written as a DeepSpeed user writes one.

A tiny causal GPT whose attention is ``deepspeed.sequence.layer.DistributedAttention`` (as in
DeepSpeed's Ulysses examples and Megatron-DeepSpeed), DeepSpeed's own sequence-parallel groups
(``parallel_state_sp``), and ``deepspeed.initialize`` with the JSON config. It does not know
megatron_sp_ext: with megatron_sp_ext installed, a ``"sequence_parallel_ext"`` block in the JSON
switches the attention (see docs/deepspeed.md).

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 training/ds_examples/train_ulysses.py \
        --deepspeed_config training/ds_examples/configs/ds_sp2.json --steps 10
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import deepspeed
import deepspeed.runtime.sequence_parallel.parallel_state_sp as sp_state
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.sequence.layer import DistributedAttention


def local_attention(q_bshd, k_bshd, v_bshd, *args, **kwargs):
    """Causal attention on the gathered sequence, [b, s, h, d] in and out."""
    o_bhsd = F.scaled_dot_product_attention(q_bshd.transpose(1, 2), k_bshd.transpose(1, 2), v_bshd.transpose(1, 2),
                                            is_causal=True)
    return o_bhsd.transpose(1, 2)


class Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, sp_group) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(4 * hidden, hidden))
        # batch_dim_idx=0: [b, s, h, d]; heads are scattered (dim 2), the sequence gathered (dim 1)
        self.attn = DistributedAttention(local_attention, sp_group, scatter_idx=2, gather_idx=1)

    def forward(self, x_bsh):
        b, s, hid = x_bsh.shape
        q, k, v = self.qkv(self.norm1(x_bsh)).view(b, s, 3, self.heads, hid // self.heads).unbind(2)
        x_bsh = x_bsh + self.proj(self.attn(q, k, v, 0).reshape(b, s, hid))
        return x_bsh + self.mlp(self.norm2(x_bsh))


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, max_len: int, sp_group) -> None:
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, hidden), torch.nn.Embedding(max_len, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, heads, sp_group) for _ in range(layers))
        self.norm, self.head = torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, vocab)

    def forward(self, ids_bs, pos_bs):
        x = self.tok(ids_bs) + self.pos(pos_bs)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


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
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=97)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-json", default=None,
                   help="write per-step loss, grad norm and wall time, and the attention classes here (rank 0)")
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args(argv)
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)

    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", args.local_rank)))
    sp = ds_config.get("sequence_parallel_size", 1)
    if sp > 1:
        sp_state.initialize_sequence_parallel(sp)  # DeepSpeed's SP groups (it refuses a size of 1)
        sp_group, sp_rank, mpu = sp_state.get_sequence_parallel_group(), sp_state.get_sequence_parallel_rank(), sp_state
    else:  # no sequence parallelism: each rank its own group of one (DistributedAttention is then local attention)
        groups = [torch.distributed.new_group([r]) for r in range(world)]
        sp_group, sp_rank, mpu = groups[rank], 0, None

    torch.manual_seed(args.seed)
    model = TinyGPT(args.vocab, args.hidden, args.heads, args.layers, args.seq_len, sp_group)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=args.deepspeed_config, mpu=mpu)
    device = engine.device
    s_loc = args.seq_len // sp
    pos = torch.arange(sp_rank * s_loc, (sp_rank + 1) * s_loc).expand(args.batch_size, s_loc).to(device)
    losses, grad_norms, step_s = [], [], []
    t_last = time.perf_counter()
    for step in range(args.steps):
        ids, labels = batch(step * (world // sp) + rank // sp, args.batch_size, args.seq_len, args.vocab, args.seed)
        ids, labels = (t[:, sp_rank * s_loc:(sp_rank + 1) * s_loc].to(device) for t in (ids, labels))
        logits = engine(ids, pos)
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), labels.reshape(-1))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)  # over every rank: the mean loss of the step's tokens
        losses.append(mean.item() / world)
        gn = engine.get_global_grad_norm()
        grad_norms.append(float(gn) if gn is not None and math.isfinite(float(gn)) else float("nan"))
        now = time.perf_counter()  # the loss's .item() above waited for the step
        step_s.append(now - t_last)
        t_last = now
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f} grad_norm {grad_norms[-1]:.6f}", flush=True)
    attention = sorted({type(m).__name__ for m in engine.module.modules() if isinstance(m, DistributedAttention)})
    if args.log_json and rank == 0:
        with open(args.log_json, "w") as f:
            json.dump({"loss": losses, "grad_norm": grad_norms, "step_s": step_s, "attention": attention}, f)
    return {"loss": losses, "grad_norm": grad_norms, "step_s": step_s, "attention": attention, "engine": engine}


if __name__ == "__main__":
    main()

"""Data-parallel mixed-precision training with dispatch_amp under torchrun (DDP or FSDP2).

    torchrun --nproc_per_node=2 examples/distributed_train.py            # DDP
    torchrun --nproc_per_node=2 examples/distributed_train.py --fsdp     # FSDP2 fully_shard
    torchrun --nproc_per_node=2 examples/distributed_train.py --inf-step 3   # rank 1 overflows once

On GPUs it uses NCCL, on CPU gloo; float16 autocast with a GradScaler either way
(``--dtype bf16`` runs bfloat16, which needs no loss scaling: the scaler is then
created disabled). The GradScaler is the same object under DDP and FSDP2: under FSDP2 the
gradients are DTensor shards and the scaler reduces its inf/nan flag across ranks, so
every rank skips the same steps and keeps the same scale. Rank 0 prints, for each rank,
the loss of its last batch, its scale and its count of skipped steps; the last two agree.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dispatch_amp as amp


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 fully_shard instead of DDP")
    parser.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16", help="autocast dtype (bf16 disables the scaler)")
    parser.add_argument("--inf-step", type=int, default=-1, help="put an inf into rank 1's batch at this step")
    return parser.parse_args()


def train(args: argparse.Namespace, device: torch.device, rank: int, world: int) -> str:
    """Train; return this rank's summary line."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)).to(device)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        fully_shard(model)  # parameters and gradients become DTensor shards
    else:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # process_group=None (the default): reduce found_inf over the world group when the
    # parameters are DTensors (FSDP2); under DDP gradients are already identical everywhere.
    scaler = amp.GradScaler(device.type, init_scale=2.0**12, growth_interval=5, enabled=dtype is torch.float16)

    generator = torch.Generator().manual_seed(1234)
    for step in range(args.steps):
        x = torch.randn(16 * world, 32, generator=generator)  # one global batch, split by rank
        y = torch.randint(0, 10, (16 * world,), generator=generator)
        x, y = x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)
        if step == args.inf_step and rank == 1 % world:
            x[0, 0] = float("inf")
        optimizer.zero_grad(set_to_none=True)
        with amp.autocast(device.type, dtype=dtype):  # forward inside, backward outside
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # skipped on every rank when any rank overflowed
        scaler.update()
    return f"rank {rank}/{world}: final loss {loss.item():.4f} scale {scaler.get_scale():g} skipped {scaler.skipped_steps}"


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    # torchrun sets MASTER_ADDR/PORT, RANK and WORLD_SIZE; the timeout bounds every collective,
    # so a rank that dies makes the others fail instead of waiting forever.
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=60))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        # train() returns before the group is destroyed, so the model (and DDP's reducer) is
        # freed while the group still exists: freeing a DDP model after destroy_process_group()
        # hung at exit about one run in four here (torch 2.13, gloo).
        line = train(args, device, rank, world)
        lines = [None] * world
        dist.all_gather_object(lines, line)  # rank 0 prints every rank's line, in rank order
        if rank == 0:
            print("\n".join(lines), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

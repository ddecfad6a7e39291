"""Bytes FSDP2 all-gathers per training step, weights in high precision vs in fp8.

Two gloo ranks on the CPU train one step of a small GPT-shaped stack (2 blocks of width
512: qkv 512 -> 1536, out 512 -> 512, MLP 512 -> 2048 -> 512, each block and the root
``fully_shard``-ed, LayerNorms and biases left as they are) under each fp8 recipe, once
with FSDP2's own all-gather and once after ``fp8.all_gather_in_fp8``. A custom all-gather
(``set_custom_all_gather``) adds up the bytes each rank sends; the forward and the
backward all-gather once per block each. Nothing is timed: the counts are exact.

    python -m benchmarks.fp8_all_gather_bytes            # the table (about a minute on 2 cores)
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import tempfile

if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["WIDTH", "BLOCKS", "RECIPES", "measure", "table", "main"]

WIDTH, BLOCKS, WORLD = 512, 2, 2
RECIPES = ("CurrentScaling", "DelayedScaling", "RowwiseScaling", "BlockScaling")


class _Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + self.out(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _step_bytes(recipe_name: str, param_dtype, in_fp8: bool, rank: int) -> int:
    import dispatch_amp as amp
    from dispatch_amp import fp8
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    sent = [0]

    class Counting(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            sent[0] += input_tensor.numel() * input_tensor.element_size()
            return super().__call__(output_tensor, input_tensor, group, async_op)

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block(WIDTH) for _ in range(BLOCKS)])
    recipe = getattr(fp8, recipe_name)().bind(model)
    if in_fp8:
        fp8.all_gather_in_fp8(model, recipe)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    for block in model:
        fully_shard(block, mp_policy=policy)
        block.set_custom_all_gather(Counting())
    fully_shard(model, mp_policy=policy)
    x = torch.randn(2, 16, WIDTH, generator=torch.Generator().manual_seed(rank))
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    return sent[0]


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    rows = []
    for name in RECIPES:
        for dtype in (torch.bfloat16, torch.float32):
            high = _step_bytes(name, dtype, False, rank)
            low = _step_bytes(name, dtype, True, rank)
            rows.append([name, str(dtype)[6:], high, low])
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def measure() -> list[list]:
    """``[recipe, param dtype, bytes sent per step (high precision), (fp8)]`` per row, from
    rank 0 of 2 spawned gloo ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(port, out), nprocs=WORLD)
        with open(out) as f:
            return json.load(f)


def table(rows: list[list]) -> str:
    from dispatch_amp import _markdown

    body = [[name, dtype, f"{high:,}", f"{low:,}", f"{low / high:.3f}"] for name, dtype, high, low in rows]
    return _markdown.table(["recipe", "all-gather dtype", "bytes/step, high precision", "bytes/step, fp8", "ratio"],
                           body, align="llrrr")


def main(argv=None) -> None:
    print(f"FSDP2 all-gather, bytes one rank sends per training step ({BLOCKS} blocks of width {WIDTH}, "
          f"{WORLD} ranks)\n")
    print(table(measure()))


if __name__ == "__main__":
    sys.exit(main())

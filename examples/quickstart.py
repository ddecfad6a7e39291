"""Train a small classifier for a few steps with dispatch_amp's autocast, next to native.

Run: python examples/quickstart.py
"""

import time

import torch

import dispatch_amp as amp


def train(context_factory, steps: int = 30, warmup: int = 3, seed: int = 0) -> tuple[float, float]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256), torch.nn.Linear(256, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(512, 64)
    y = (x[:, :10].argmax(dim=1) + 3) % 10          # a learnable target
    start = None
    for step in range(steps + warmup):
        if step == warmup:                          # time only after the first steps
            start = time.perf_counter()
        optimizer.zero_grad()
        with context_factory():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    return loss.item(), (time.perf_counter() - start) / steps * 1e3


if __name__ == "__main__":
    rows = [
        ("fp32", lambda: amp.autocast("cpu", enabled=False)),
        ("torch.autocast (bf16)", lambda: torch.autocast("cpu")),
        ("dispatch_amp.autocast (bf16)", lambda: amp.autocast("cpu")),
    ]
    print("| run | final loss | ms/step |\n|---|---|---|")
    for name, factory in rows:
        loss, ms = train(factory)
        print(f"| {name} | {loss:.6f} | {ms:.2f} |")

"""Run unchanged PyTorch recipe code (torch.autocast, torch.amp.GradScaler) on dispatch_amp.

recipe() below is written against torch only; patch_torch() makes its calls reach ours for
the duration of the with-block, then puts torch's own objects back.

Run: python examples/patch_torch_recipe.py [--steps 20]
"""

import argparse

import torch

import dispatch_amp as amp


def recipe(steps: int) -> tuple[float, float, str]:
    """Typical recipe code: it names torch.autocast and torch.amp.GradScaler at the call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    x = torch.randn(64, 32)
    y = x[:, :4].argmax(dim=1)
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return loss.item(), scaler.get_scale(), type(scaler).__module__


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    native = recipe(args.steps)
    with amp.patch_torch():
        ours = recipe(args.steps)
    for name, (loss, scale, module) in (("torch", native), ("patched", ours)):
        print(f"{name:8s} loss {loss:.6f}  scale {scale}  scaler from {module}")
    print("identical" if native[:2] == ours[:2] else "different")


if __name__ == "__main__":
    main()

"""Train a small regressor with accelerate on dispatch_amp: install_amp(accelerator), then as usual.

Run: python examples/accelerate_train.py [--steps 20] [--mixed-precision bf16]
"""

import argparse

import torch
from accelerate import Accelerator

from dispatch_amp.integrations.accelerate import install_amp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mixed-precision", default="fp16", choices=["fp16", "bf16"])
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True, mixed_precision=args.mixed_precision)
    install_amp(accelerator)                       # the one added line, before prepare()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randn(256, 32)
    y = x[:, :1] * 2 - x[:, 1:2]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    step = 0
    while step < args.steps:
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)   # forward under our autocast
            accelerator.backward(loss)                           # scaled by our GradScaler
            accelerator.clip_grad_norm_(model.parameters(), 1.0) # on unscaled gradients
            optimizer.step()                                     # skipped on overflow
            optimizer.zero_grad()
            step += 1
            if step == args.steps:
                break
    scaler = accelerator.scaler
    print(f"accelerate + dispatch_amp: {step} steps, loss {loss.item():.4f}, loss scale "
          f"{scaler.get_scale() if scaler is not None else 'none (bf16)'}")


if __name__ == "__main__":
    main()

"""Train a small classifier with Lightning Fabric on dispatch_amp (float16 + GradScaler).

The only change from Fabric's own AMP plugin is where MixedPrecision is imported from.
(Or keep ``Fabric(precision="16-mixed")`` and import ``Fabric`` from
``dispatch_amp.integrations.fabric``.)

Run: python examples/lightning_fabric.py [--steps 20] [--precision bf16-mixed] [--inf-step 5]
"""

import argparse

import torch
from lightning.fabric import Fabric

from dispatch_amp.integrations.fabric import MixedPrecision  # was: lightning.fabric.plugins


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--precision", default="16-mixed", choices=["16-mixed", "bf16-mixed"])
    parser.add_argument("--inf-step", type=int, default=None, help="make this step's loss overflow")
    args = parser.parse_args()

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision(args.precision, "cpu")])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    x = torch.randn(256, 32)
    y = x[:, :4].argmax(dim=1)

    for step in range(args.steps):
        batch = slice(32 * (step % 8), 32 * (step % 8 + 1))
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])   # forward under our autocast
        if step == args.inf_step:
            loss = loss * float("inf")
        fabric.backward(loss)                                                  # scaled
        # Unscaled first. error_if_nonfinite=False: an overflowing step has inf/nan
        # gradients, and the scaler skips it below; Fabric's default (True) would raise
        # on exactly that step.
        fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        optimizer.step()                                                       # skipped on overflow

    state = fabric.strategy.precision.state_dict()   # save it with your checkpoint
    scaler = fabric.strategy.precision.scaler
    skipped = scaler.skipped_steps if scaler is not None else 0
    print(f"lightning Fabric + dispatch_amp: {args.steps} steps ({skipped} skipped), loss {loss.item():.4f}, "
          f"loss scale {state.get('scale', 'none (bf16)')}")


if __name__ == "__main__":
    main()

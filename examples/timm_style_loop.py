"""A training loop shaped like timm's train_one_epoch, with our autocast and GradScaler behind timm's calls.

timm is not needed: NativeScaler has the shape of timm's, so in a timm script two lines
change: the one that builds ``amp_autocast`` (timm's ``partial(torch.autocast, ...)``) and
the one that builds the loss scaler.

Run: python examples/timm_style_loop.py [--steps 20] [--accum 2]
"""

import argparse
import functools

import torch

import dispatch_amp as amp
from dispatch_amp.integrations.timm_scaler import NativeScaler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp_autocast = functools.partial(amp.autocast, device_type="cpu", dtype=torch.float16)  # was: partial(torch.autocast, ...)
    loss_scaler = NativeScaler(amp.GradScaler("cpu", init_scale=2.0**12))   # was: timm's NativeScaler()
    x = torch.randn(256, 32)
    y = x[:, :4].argmax(dim=1)

    for step in range(args.steps):
        for micro in range(args.accum):
            batch = slice(16 * ((step * args.accum + micro) % 16), 16 * ((step * args.accum + micro) % 16 + 1))
            with amp_autocast():
                loss = torch.nn.functional.cross_entropy(model(x[batch]).float(), y[batch])
            need_update = micro == args.accum - 1
            loss_scaler(loss / args.accum, optimizer, clip_grad=1.0, clip_mode="norm",
                        parameters=model.parameters(), need_update=need_update)
            if need_update:
                optimizer.zero_grad()

    checkpoint = {"model": model.state_dict(), loss_scaler.state_dict_key: loss_scaler.state_dict()}
    print(f"timm-style loop + dispatch_amp: {args.steps} steps, loss {loss.item():.4f}, "
          f"loss scale {checkpoint['amp_scaler']['scale']}")


if __name__ == "__main__":
    main()

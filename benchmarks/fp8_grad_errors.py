"""fp8's gradient error against bfloat16 at a GPT's first calls, every parameter.

The GPT of the fp8 suite (``benchmarks/suites/fp8.py``) at the GPU run's token count
(8 x 2048), by default narrower (d_model 64, vocab 512), which keeps the gradients as
small as there (the loss is a mean over 16384 tokens: about 2**-14). One batch, no
optimizer step: bfloat16 gives the reference gradients; each fp8 recipe (a fresh one,
bound to the model) then runs ``calls`` forward + backward passes on the same batch, and
each parameter's error is ``max|fp8 - bf16| / max|bf16|`` at each call.

Delayed scaling's first calls are the point: a recipe that started from scale 1 would lose
the e5m2 gradients below 2**-16 at call 1 and zero whole layers' gradients at call 2.

    python -m benchmarks.fp8_grad_errors            # the table, CPU, about 20 s
    python -m benchmarks.fp8_grad_errors --check    # and exit 1 if a first call fails
    python -m benchmarks.fp8_grad_errors --device cuda --d-model 2048 --vocab 32000

``tests/fp8/test_first_calls.py`` checks the same at 2 x 64 tokens with ``--loss-tokens
16384`` (the gradients of 8 x 2048 tokens at a 128th of the compute); ``--check`` at the
default size is the full-size run.

``gradient_errors()`` returns the numbers, ``table()`` formats them, ``problems()`` says
what a first call got wrong.
"""

from __future__ import annotations

import argparse

import torch

import dispatch_amp
from dispatch_amp import _markdown, fp8

from .suites.fp8 import Decoder, GPTSize

__all__ = ["DEFAULT_SIZE", "RECIPES", "DELAYED_MARGIN", "gradient_errors", "table", "problems", "main"]

DEFAULT_SIZE = GPTSize(vocab=512, d_model=64, layers=2, heads=4, seq=2048, batch=8)
RECIPES = {"fp8 current": fp8.CurrentScaling, "fp8 delayed": fp8.DelayedScaling}
# How much worse than current scaling's worst error delayed scaling may be at any first call.
DELAYED_MARGIN = 0.02


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max()
    diff = (got - ref).abs().max()
    return float(diff / scale) if scale > 0 else float(diff)


def gradient_errors(size: GPTSize = DEFAULT_SIZE, calls: int = 3, device: str = "cpu",
                    recipes: dict | None = None, loss_tokens: int | None = None) -> dict:
    """``{config: [{parameter: error} for each call]}``, plus ``"zero"``: ``{config:
    [names of parameters whose gradient is exactly zero, per call]}``.

    ``loss_tokens``: the loss is the sum over the batch's tokens divided by this many
    (default: the batch's own count, a mean), so a small batch gets the gradients a large
    one would, as small as the first calls must not lose. A power of two over the batch's
    count scales every gradient exactly.

    Example::

        errors = gradient_errors(calls=2)
        errors["fp8 delayed"][1]["blocks.0.qkv.weight"]
    """
    torch.manual_seed(0)
    with torch.device(device):
        model = Decoder(size).train()
    idx = torch.randint(0, size.vocab, (size.batch, size.seq + 1), generator=torch.Generator().manual_seed(1))
    batch = idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device)

    factor = 1.0 if loss_tokens is None else size.batch * size.seq / loss_tokens

    def grads(recipe):
        model.zero_grad(set_to_none=True)
        with dispatch_amp.autocast(torch.device(device).type, dtype=torch.bfloat16, fp8=recipe):
            loss = model.loss(*batch) * factor
        loss.backward()
        return {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}

    ref = grads(None)
    out: dict = {"zero": {}}
    for config, make in (recipes or RECIPES).items():
        recipe = make().bind(model)
        out[config], out["zero"][config] = [], []
        for _ in range(calls):
            got = grads(recipe)
            out[config].append({n: _relative(got[n], ref[n]) for n in ref})
            out["zero"][config].append([n for n, g in got.items() if not g.any()])
    return out


def table(errors: dict) -> str:
    """The errors as a Markdown table: one row per parameter, one column per recipe and
    call, then the worst row."""
    configs = [c for c in errors if c != "zero"]
    calls = len(errors[configs[0]])
    head = ["parameter"] + [f"{c.removeprefix('fp8 ')} call {i + 1}" for c in configs for i in range(calls)]
    rows = [[name] + [f"{errors[c][i][name]:.3f}" for c in configs for i in range(calls)]
            for name in errors[configs[0]][0]]
    rows.append(["**worst**"] + [f"**{max(errors[c][i].values()):.3f}**" for c in configs for i in range(calls)])
    return _markdown.table(head, rows, align="l" + "r" * (len(head) - 1))


def problems(errors: dict) -> list[str]:
    """What the first calls got wrong, one line each (none: ``[]``): a parameter whose
    gradient is zero at some call, or delayed scaling more than ``DELAYED_MARGIN`` above
    current scaling's worst error at some call.

    Example::

        assert problems(gradient_errors(calls=2)) == []
    """
    out = [f"{config} call {i + 1}: zero gradient: {', '.join(names)}"
           for config, per_call in errors["zero"].items() for i, names in enumerate(per_call) if names]
    if "fp8 current" in errors and "fp8 delayed" in errors:
        current = max(max(call.values()) for call in errors["fp8 current"])
        for i, call in enumerate(errors["fp8 delayed"]):
            worst = max(call, key=call.get)
            if not call[worst] <= current + DELAYED_MARGIN:
                out.append(f"fp8 delayed call {i + 1}: {worst} {call[worst]:.3f}, more than {DELAYED_MARGIN} "
                           f"above current scaling's worst {current:.3f}")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--check", action="store_true",
                   help=f"exit 1 if a gradient is zero or delayed is more than {DELAYED_MARGIN} above current")
    p.add_argument("--loss-tokens", type=int, default=None,
                   help="divide the loss's sum by this many tokens (default: the batch's, a mean)")
    for field, value in vars(DEFAULT_SIZE).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=value)
    args = p.parse_args(argv)
    size = GPTSize(**{f: getattr(args, f) for f in vars(DEFAULT_SIZE)})
    errors = gradient_errors(size, args.calls, args.device, loss_tokens=args.loss_tokens)
    mean = "" if args.loss_tokens is None else f", loss over {args.loss_tokens} tokens"
    print(f"fp8 gradient error vs bf16, max|fp8 - bf16| / max|bf16| per parameter; {size.describe()}{mean}; "
          f"{args.device}")
    print()
    print(table(errors))
    found = problems(errors)
    for line in found:
        print(line)
    if args.check:
        print("check:", "FAILED" if found else "passed")
        if found:
            raise SystemExit(1)


if __name__ == "__main__":
    main()

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
    python -m benchmarks.fp8_grad_errors --device cuda --d-model 2048 --vocab 32000

``gradient_errors()`` returns the numbers, ``table()`` formats them.
"""

from __future__ import annotations

import argparse

import torch

import dispatch_amp
from dispatch_amp import _markdown, fp8

from .suites.fp8 import Decoder, GPTSize

__all__ = ["DEFAULT_SIZE", "RECIPES", "gradient_errors", "table", "main"]

DEFAULT_SIZE = GPTSize(vocab=512, d_model=64, layers=2, heads=4, seq=2048, batch=8)
RECIPES = {"fp8 current": fp8.CurrentScaling, "fp8 delayed": fp8.DelayedScaling}


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max()
    diff = (got - ref).abs().max()
    return float(diff / scale) if scale > 0 else float(diff)


def gradient_errors(size: GPTSize = DEFAULT_SIZE, calls: int = 3, device: str = "cpu",
                    recipes: dict | None = None) -> dict:
    """``{config: [{parameter: error} for each call]}``, plus ``"zero"``: ``{config:
    [names of parameters whose gradient is exactly zero, per call]}``.

    Example::

        errors = gradient_errors(calls=2)
        errors["fp8 delayed"][1]["blocks.0.qkv.weight"]
    """
    torch.manual_seed(0)
    with torch.device(device):
        model = Decoder(size).train()
    idx = torch.randint(0, size.vocab, (size.batch, size.seq + 1), generator=torch.Generator().manual_seed(1))
    batch = idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device)

    def grads(recipe):
        model.zero_grad(set_to_none=True)
        with dispatch_amp.autocast(torch.device(device).type, dtype=torch.bfloat16, fp8=recipe):
            loss = model.loss(*batch)
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--calls", type=int, default=3)
    for field, value in vars(DEFAULT_SIZE).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=value)
    args = p.parse_args(argv)
    size = GPTSize(**{f: getattr(args, f) for f in vars(DEFAULT_SIZE)})
    errors = gradient_errors(size, args.calls, args.device)
    print(f"fp8 gradient error vs bf16, max|fp8 - bf16| / max|bf16| per parameter; {size.describe()}; {args.device}")
    print()
    print(table(errors))
    for config, per_call in errors["zero"].items():
        for i, names in enumerate(per_call):
            if names:
                print(f"{config} call {i + 1}: zero gradient: {', '.join(names)}")


if __name__ == "__main__":
    main()

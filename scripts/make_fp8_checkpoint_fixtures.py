"""Writes tests/fp8/data/*.pt: fp8 recipe checkpoints, and what the step after each gives.

Every recipe variant (``VARIANTS``) trains a small model with self-attention for ``STOP``
steps under ``amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe)``, then saves what a
resumed run needs, in the forms checkpoints hold it: ``recipe.state_dict()`` (what every
integration files: Lightning's checkpoint key, Fabric's module entry, the transformers
Trainer's file, accelerate's registered object, timm's scaler state all hold exactly this
dict), the model's and the optimizer's state dicts, and the module state dict Fabric
writes (``MODULE_ENTRY`` inside). The run then goes on for one more step, and what that
step gives (output, loss, gradients, parameters, the recipe's new state) is stored too:
``tests/fp8/test_checkpoint_fixtures.py`` loads each file into fresh objects and checks
that the step after the resume gives the same bits.

The files are written once, by the code of the commit the script names in them, and
kept: later code must load them and continue as that code did. Run it again only to add
variants (the old files' expectations are those of the code that wrote them)::

    TRITON_INTERPRET=1 python scripts/make_fp8_checkpoint_fixtures.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import pathlib
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel variant runs Triton's interpreter on CPU

import torch
import torch.nn as nn

import dispatch_amp as amp
from dispatch_amp import fp8
from dispatch_amp.integrations import _fp8_state

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "fp8" / "data"
STOP = 3  # steps before the checkpoint; the fixture's expectations are of step STOP


class AttnNet(nn.Module):
    """A projection, self-attention (its in-projection a parameter, not a module's
    ``weight``) and an output projection; every gemm fp8-eligible (2 x 8 tokens, widths
    multiples of 16)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        h = self.inp(x)
        return self.out(torch.nn.functional.gelu(self.attn(h, h, h, need_weights=False)[0]))


# name -> (recipe class name, keyword arguments, quantize with the Triton kernels)
VARIANTS: dict[str, tuple[str, dict, bool]] = {
    "current": ("CurrentScaling", {}, False),
    "current_pow2": ("CurrentScaling", {"power_of_two": True}, False),
    "rowwise": ("RowwiseScaling", {}, False),
    "rowwise_wgrad_high": ("RowwiseScaling", {"weight_grad_high_precision": True}, False),
    "delayed_h4": ("DelayedScaling", {"amax_history_len": 4}, False),
    "delayed_h16_recent_margin": ("DelayedScaling", {"amax_history_len": 16, "amax_compute_algo": "most_recent",
                                                     "margin": 1}, False),
    "delayed_h8_no_reduce_pow2": ("DelayedScaling", {"amax_history_len": 8, "reduce_amax": False,
                                                     "power_of_two": True}, False),
    "delayed_h4_kernels": ("DelayedScaling", {"amax_history_len": 4}, True),
}


def make_recipe(cls_name: str, kwargs: dict):
    return getattr(fp8, cls_name)(**kwargs)


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(2, 8, 16, generator=g) * (1 + step), torch.randn(2, 8, 16, generator=g)


@contextlib.contextmanager
def kernels(on: bool):
    """The Triton kernels for the per-tensor quantize (through the interpreter on CPU)."""
    if not on:
        yield
        return
    try:
        from dispatch_amp.kernels import fp8_quantize as holder
        name = "BACKEND"
    except ImportError:  # the code that wrote the first fixtures chose the backend in fp8/_rules.py
        from dispatch_amp.fp8 import _rules as holder
        name = "_BACKEND"
    previous = getattr(holder, name)
    setattr(holder, name, "triton")
    try:
        yield
    finally:
        setattr(holder, name, previous)


def new_run(cls_name: str, kwargs: dict):
    model = AttnNet()
    recipe = make_recipe(cls_name, kwargs).bind(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, recipe, optimizer


def step(model, recipe, optimizer, k: int) -> dict:
    """One training step; what it gives."""
    x, y = batch(k)
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
        out = model(x)
    loss = torch.nn.functional.mse_loss(out.float(), y)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    optimizer.zero_grad()
    return {"out": out.detach().clone(), "loss": loss.detach().clone(), "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" (with uncommitted changes under src/)" if dirty else "")


def write(name: str) -> pathlib.Path:
    cls_name, kwargs, use_kernels = VARIANTS[name]
    with kernels(use_kernels):
        model, recipe, optimizer = new_run(cls_name, kwargs)
        for k in range(STOP):
            step(model, recipe, optimizer, k)
        carrier = AttnNet()
        carrier.load_state_dict(model.state_dict())
        _fp8_state.carry_in_state_dict(carrier, recipe)
        saved = {
            "written_by": commit(),
            "torch": str(torch.__version__),
            "recipe_class": cls_name,
            "recipe_kwargs": kwargs,
            "kernels": use_kernels,
            "steps": STOP,
            "recipe_state": copy.deepcopy(recipe.state_dict()),
            "module_state": copy.deepcopy(carrier.state_dict()),  # Fabric's form: the recipe's state inside
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": copy.deepcopy(optimizer.state_dict()),  # its tensors change in place
        }
        saved["expected"] = {**step(model, recipe, optimizer, STOP), "recipe_state": recipe.state_dict()}
    DATA.mkdir(parents=True, exist_ok=True)
    path = DATA / f"{name}.pt"
    torch.save(saved, path)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="variants to write (default: all)")
    args = parser.parse_args(argv)
    for name in args.only or VARIANTS:
        path = write(name)
        print(f"{path.relative_to(ROOT)}: {path.stat().st_size:,} bytes, written by {commit()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

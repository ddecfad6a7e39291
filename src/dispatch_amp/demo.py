"""The demo: train a small character-level GPT in fp32, native AMP and dispatch-amp.

Run ``python -m dispatch_amp.demo`` (about a minute on a 2-core CPU). It trains the same
model from the same seed on text shipped with the package (``data/corpus.txt``) three
times, prints a table of step time, peak memory, final loss, skipped steps and what share
of the matmul FLOPs ran in 16 bits, prints a sample from our model, and writes a plot of
loss, of our loss minus native's, and of the loss scale (when a scaler ran) to ``demo.png``.
The three runs are interleaved step by step in rotating order, so load on the machine
slows them alike; each keeps its own model, optimizer and batch generator.

On CPU the default is bfloat16 without a scaler; ``--dtype float16`` (or a CUDA device)
adds a GradScaler (torch's for the native run, ours for ours).

Options: ``--steps``, ``--dtype``, ``--device``, ``--plot PATH`` / ``--no-plot``,
``--batch``, ``--seq``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.resources
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import GradScaler, autocast
from .diagnostics.census import PrecisionCensus
from .diagnostics.plotting import _pyplot, draw_scales

__all__ = ["main", "CharGPT", "load_corpus"]

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def load_corpus() -> str:
    """The demo's training text (generated, licence-free; see scripts/make_demo_corpus.py)."""
    return importlib.resources.files("dispatch_amp").joinpath("data/corpus.txt").read_text()


class CharGPT(nn.Module):
    """A small GPT: embeddings, pre-norm transformer blocks with causal attention, a head."""

    def __init__(self, vocab: int, d: int = 192, heads: int = 6, layers: int = 3, seq: int = 128):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        block = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        x = self.blocks(x, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))


@dataclass
class RunResult:
    name: str
    losses: list[float] = field(default_factory=list)
    step_ms: float = math.nan
    peak_mb: float = math.nan
    skipped: int = 0
    low_precision_share: float = 0.0
    scales: list[tuple[int, float, bool]] = field(default_factory=list)
    sample: str = ""


# -- memory -------------------------------------------------------------------------------
def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    # Linux resets the resident-set high-water mark on this write; elsewhere the peak
    # stays process-wide (reported as such).
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- one run --------------------------------------------------------------------------------
def _contexts(name: str, device: torch.device, dtype: torch.dtype):
    if name == "fp32":
        return contextlib.nullcontext, None
    use_scaler = dtype == torch.float16
    if name == "torch.autocast":
        scaler = torch.amp.GradScaler(device.type) if use_scaler else None
        return (lambda: torch.autocast(device.type, dtype=dtype)), scaler
    scaler = GradScaler(device.type) if use_scaler else None
    return (lambda: autocast(device.type, dtype=dtype)), scaler


class _Run:
    """One of the three trainings, advanced a step at a time so the runs can be interleaved.

    Each run owns its model, optimizer, scaler and batch generator: interleaving changes
    only when a step runs, never what it computes, so the losses are those of three runs
    one after another. The global RNG is used only to build the model, from seed 0.
    """

    def __init__(self, name, data, vocab, args, device, dtype):
        torch.manual_seed(0)
        self.model = CharGPT(vocab, seq=args.seq).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.context, self.scaler = _contexts(name, device, dtype)
        self.generator = torch.Generator().manual_seed(1)
        self.data, self.vocab, self.args, self.device = data, vocab, args, device
        self.result = RunResult(name)
        self.times: list[float] = []

    def batch(self):
        args, data = self.args, self.data
        starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=self.generator)
        x = torch.stack([data[s : s + args.seq] for s in starts.tolist()])
        y = torch.stack([data[s + 1 : s + args.seq + 1] for s in starts.tolist()])
        return x.to(self.device), y.to(self.device)

    def loss_of(self, x, y):
        with self.context():
            logits = self.model(x)
            return F.cross_entropy(logits.reshape(-1, self.vocab), y.reshape(-1))

    def step(self, step: int) -> None:
        scaler, result = self.scaler, self.result
        x, y = self.batch()
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_of(x, y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(self.optimizer)
            before = scaler.get_scale() if isinstance(scaler, torch.amp.GradScaler) else None
            scaler.update()
            if before is not None:  # torch's scaler keeps no record: a drop means a skip
                skipped = scaler.get_scale() < before
                result.skipped += skipped
                result.scales.append((step, before, skipped))
        else:
            loss.backward()
            self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter() - start)
        result.losses.append(loss.item())

    def finish(self) -> RunResult:
        result, times = self.result, self.times
        warm = times[min(3, len(times) - 1):] if len(times) > 1 else times
        result.step_ms = statistics.median(warm) * 1e3
        if isinstance(self.scaler, GradScaler):
            result.skipped = self.scaler.skipped_steps
            result.scales = self.scaler.scale_history()
        # Untimed: the peak of one forward and backward (all three runs' weights and
        # optimizer states are resident by now, the same baseline for each).
        self.optimizer.zero_grad(set_to_none=True)
        x, y = self.batch()
        _reset_peak(self.device)
        self.loss_of(x, y).backward()
        result.peak_mb = _peak_mb(self.device)
        # One more forward and backward to see what ran in which precision.
        x, y = self.batch()
        with PrecisionCensus() as census:
            self.loss_of(x, y).backward()
        result.low_precision_share = 1.0 - census.matmul_flops_fraction(torch.float32)
        if result.name == "dispatch_amp":
            result.sample = _sample(self.model, self.data, self.vocab, self.args, self.device, self.context)
        return result


def _train_interleaved(runs: list[_Run], steps: int, progress) -> list[RunResult]:
    # Step by step in rotating order (A B C, B C A, ...), like the benchmarks: load on the
    # machine then slows every run alike instead of whichever ran during it.
    for step in progress(range(steps), desc="training"):
        k = step % len(runs)
        for run in runs[k:] + runs[:k]:
            run.step(step)
    return [run.finish() for run in runs]


def _sample(model, data, vocab, args, device, context, length: int = 120) -> str:
    idx = data[: args.seq // 2].unsqueeze(0).to(device)
    model.eval()
    with torch.no_grad():
        for _ in range(length):
            with context():
                logits = model(idx[:, -args.seq :])
            idx = torch.cat([idx, logits[:, -1].float().argmax(-1, keepdim=True)], dim=1)
    model.train()
    return "".join(args.alphabet[i] for i in idx[0, args.seq // 2 :].tolist())


# -- the table and the command line ---------------------------------------------------------
def format_table(results: list[RunResult], dtype: torch.dtype) -> str:
    """The demo's Markdown table."""
    base = results[0].step_ms
    low = str(dtype).replace("torch.", "")
    lines = [
        f"| run | ms/step | vs fp32 | peak MB | final loss | skipped steps | matmul FLOPs in {low} |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        tail = r.losses[-10:]
        final = sum(tail) / len(tail) if tail else math.nan
        lines.append(
            f"| {r.name} | {r.step_ms:.1f} | {base / r.step_ms:.2f}x | {r.peak_mb:.0f} | "
            f"{final:.3f} | {r.skipped} | {100 * r.low_precision_share:.1f}% |"
        )
    return "\n".join(lines)


def _plot_demo(results: list[RunResult], path, *, title: str) -> str:
    # Three panels: the losses, ours minus native per step (the AMP curves lie on top of
    # each other at the loss panel's scale; a divergence shows here), and loss scales.
    plt = _pyplot()
    by_name = {r.name: r for r in results}
    with_scale = any(r.scales for r in results)
    fig, axes = plt.subplots(3 if with_scale else 2, 1, figsize=(8, 8.5 if with_scale else 6), squeeze=False)
    ax = axes[0][0]
    for r, style in zip(results, ("-", "--", ":")):
        ax.plot(range(1, len(r.losses) + 1), r.losses, style, label=r.name, linewidth=1.4)
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    ax = axes[1][0]
    ours, native = by_name["dispatch_amp"].losses, by_name["torch.autocast"].losses
    ax.plot(range(1, len(ours) + 1), [a - b for a, b in zip(ours, native)], color="C2", linewidth=1.2)
    ax.axhline(0.0, color="gray", linewidth=0.8)
    ax.set(xlabel="step", ylabel="loss: dispatch_amp - torch.autocast")
    ax.grid(alpha=0.3)
    if with_scale:
        draw_scales(axes[2][0], {r.name: r.scales for r in results})
    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _progress_bar():
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency; this only guards odd environments
        return lambda it, desc="": it
    return lambda it, desc="": tqdm(it, desc=desc, leave=False, file=sys.stderr, dynamic_ncols=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dispatch_amp.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="training steps per run (default 150)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="16-bit dtype (default: bfloat16 on CPU, float16 on CUDA)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--plot", default="demo.png", help="where to write the plot (PNG)")
    parser.add_argument("--no-plot", action="store_true", help="do not write a plot")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the demo; returns the process exit code."""
    args = build_parser().parse_args(argv)
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device must be cpu or cuda, got {device.type!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for, but torch sees no CUDA device")
    dtype = _DTYPES[args.dtype] if args.dtype else (torch.float16 if device.type == "cuda" else torch.bfloat16)

    text = load_corpus()
    args.alphabet = sorted(set(text))
    lookup = {c: i for i, c in enumerate(args.alphabet)}
    data = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    vocab = len(args.alphabet)

    print(f"dispatch-amp demo: char GPT on {len(text) / 1e3:.0f} KB of text, {args.steps} steps, "
          f"{device.type}, {str(dtype).replace('torch.', '')}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    progress = _progress_bar()
    runs = [_Run(name, data, vocab, args, device, dtype) for name in ("fp32", "torch.autocast", "dispatch_amp")]
    results = _train_interleaved(runs, args.steps, progress)
    print()
    print(format_table(results, dtype))
    print()
    print("sample from the dispatch_amp run:", repr(results[-1].sample[:100]))
    if not args.no_plot:
        try:
            path = _plot_demo(results, args.plot, title=f"char GPT, {device.type} {str(dtype).replace('torch.', '')}")
            print(f"plot written to {os.path.abspath(path)}")
        except ImportError as error:
            print(f"no plot: {error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

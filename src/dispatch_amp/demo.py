"""The demo: train a small character-level GPT in fp32, native AMP and dispatch-amp.

Run ``python -m dispatch_amp.demo`` (about a minute on a 2-core CPU). It trains the same
model from the same seed on text shipped with the package (``data/corpus.txt``) three
times, one run after another, and prints each run's row of a table as the run finishes:
step time, peak memory, final loss, skipped steps and what share of the matmul FLOPs ran
in 16 bits. It then prints a sample from our model, writes the table to ``demo.md`` and a
plot to ``demo.png``: loss, our loss minus native's (the word "identical" where that
difference is zero at every step), and the loss scale when a scaler ran.

Stopped early (Ctrl-C), it writes the table and the plot of the runs that finished and
exits with status 130. The step time is the median over each run's steps after the first
(the first carries one-time setup, such as the first region's kernels and the optimizer's
state), on ``torch.utils.benchmark``'s clock (the accelerator synchronized); a line under
the table says so. ``python -m benchmarks`` gives the careful, interleaved speed comparison.

Before the first step the demo settles which engine runs our regions (``amp.engine()``)
and prints it; where the compiled engine is built then, that line says so, with the
build's time, which no row counts.

The table's rows go to stdout; the progress bars to stderr, and only when stderr is a
terminal, so that a log of the output (``> demo.log 2>&1``) holds whole rows.

On CPU the default is bfloat16 without a scaler; ``--dtype float16`` (or a CUDA device)
adds a GradScaler (torch's for the native run, ours for ours).

Options: ``--steps``, ``--dtype``, ``--device``, ``--table PATH``, ``--plot PATH`` /
``--no-plot``, ``--batch``, ``--seq``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.resources
import math
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import GradScaler, _markdown, autocast
from ._compiled import choice as _engine_choice
from ._compiled import loader as _engine_loader
from ._devices import default_device_type, device_available
from ._peak_rss import peak_rss_mb, reset_peak_rss
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
    else:  # Linux restarts the RSS high-water mark; elsewhere the peak stays process-wide
        reset_peak_rss()


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_mb()


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
    """One of the three trainings, advanced a step at a time.

    Each run owns its model, optimizer, scaler and batch generator; the global RNG is used
    only to build the model, from seed 0. So every run starts from the same weights and
    sees the same batches.
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
        # Imported here, not at the top: torch.utils.benchmark pulls in torch.utils.cpp_extension
        # (half a second, and a log line on a CUDA build of torch with no GPU), which importing
        # the demo for its corpus, as the fp8 tests do, has no need of.
        from torch.utils.benchmark import timer as clock

        scaler, result = self.scaler, self.result
        x, y = self.batch()
        start = clock()  # torch.utils.benchmark's clock: the accelerator synchronized first
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
        self.times.append(clock() - start)
        result.losses.append(loss.item())

    def finish(self) -> RunResult:
        result, times = self.result, self.times
        # The first step carries one-time setup (the first region's kernels, the
        # optimizer's state): with a few steps it would dominate the median.
        warm = times[1:] if len(times) > 1 else times
        result.step_ms = statistics.median(warm) * 1e3
        if isinstance(self.scaler, GradScaler):
            result.skipped = self.scaler.skipped_steps
            result.scales = self.scaler.scale_history()
        # Untimed: the peak of one forward and backward, with this run's weights and
        # optimizer state resident (the runs before it are freed: the same baseline).
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


RUNS = ("fp32", "torch.autocast", "dispatch_amp")


def _train_run(name: str, data, vocab, args, device, dtype, progress) -> RunResult:
    """One whole run: ``args.steps`` steps, then the untimed measurements."""
    run = _Run(name, data, vocab, args, device, dtype)
    for step in progress(range(args.steps), desc=name):
        run.step(step)
    return run.finish()


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


# -- the table, the plot and the command line ------------------------------------------------
def _table_header(dtype: torch.dtype) -> tuple[list[str], str]:
    low = str(dtype).replace("torch.", "")
    names = ["run", "ms/step", "vs fp32", "peak MB", "final loss", "skipped steps", f"matmul FLOPs in {low}"]
    return names, "lrrrrrr"


def _table_row(r: RunResult, fp32_ms: float) -> list[str]:
    tail = r.losses[-10:]
    final = sum(tail) / len(tail) if tail else math.nan
    return [r.name, f"{r.step_ms:.1f}", f"{fp32_ms / r.step_ms:.2f}x", f"{r.peak_mb:.0f}", f"{final:.3f}",
            str(r.skipped), f"{100 * r.low_precision_share:.1f}%"]


def _timing_note(steps: int) -> str:
    """The line under the table that says what ms/step measures.

    Example::

        >>> _timing_note(150)
        "ms/step: the median of each run's steps 2 to 150 (step 1 carries one-time setup)."
    """
    if steps < 2:
        return "ms/step: step 1, the only one, one-time setup included (--steps 2 or more leaves it out)."
    return f"ms/step: the median of each run's steps 2 to {steps} (step 1 carries one-time setup)."


def format_table(results: list[RunResult], dtype: torch.dtype) -> str:
    """The demo's Markdown table; "vs fp32" is against the first result (the fp32 run).

    Example::

        print(format_table(results, torch.bfloat16))
    """
    names, align = _table_header(dtype)
    fp32_ms = results[0].step_ms if results else math.nan
    return _markdown.table(names, [_table_row(r, fp32_ms) for r in results], align)


def _identical(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) > 0 and all(x == y for x, y in zip(a, b))


def _draw_demo(results: list[RunResult], *, title: str):
    """The demo's figure: the losses; ours minus native per step (the AMP curves lie on top
    of each other at the loss panel's scale; a divergence shows here), when both ran; and
    the loss scales, when a scaler ran."""
    plt = _pyplot()
    by_name = {r.name: r for r in results}
    with_diff = "dispatch_amp" in by_name and "torch.autocast" in by_name
    with_scale = any(r.scales for r in results)
    panels = 1 + with_diff + with_scale
    fig, axes = plt.subplots(panels, 1, figsize=(8, 2.8 * panels + 0.4), squeeze=False)
    axes = [row[0] for row in axes]
    ax = axes[0]
    for r, style in zip(results, ("-", "--", ":")):
        ax.plot(range(1, len(r.losses) + 1), r.losses, style, label=r.name, linewidth=1.4)
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    if with_diff:
        ax = axes[1]
        ours, native = by_name["dispatch_amp"].losses, by_name["torch.autocast"].losses
        ax.set(xlabel="step", ylabel="loss: dispatch_amp - torch.autocast")
        if _identical(ours, native):
            # A flat line at zero draws on an axis of a few hundredths either way, which
            # reads as a small difference; say what it is instead.
            ax.text(0.5, 0.5, f"identical: the same loss at all {len(ours)} steps", transform=ax.transAxes,
                    ha="center", va="center", fontsize=12)
            ax.set_yticks([])
            ax.set_xlim(1, max(len(ours), 2))
        else:
            ax.plot(range(1, len(ours) + 1), [a - b for a, b in zip(ours, native)], color="C2", linewidth=1.2)
            ax.axhline(0.0, color="gray", linewidth=0.8)
            ax.grid(alpha=0.3)
    if with_scale:
        draw_scales(axes[-1], {r.name: r.scales for r in results})
    fig.tight_layout()
    return fig


def _plot_demo(results: list[RunResult], path, *, title: str) -> str:
    fig = _draw_demo(results, title=title)
    path = os.fspath(path)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _write_outputs(results: list[RunResult], args, dtype: torch.dtype, title: str) -> None:
    """The table and the plot of the finished runs (all of them, or those before a Ctrl-C)."""
    table = Path(args.table)
    table.write_text(format_table(results, dtype) + "\n\n" + _timing_note(args.steps) + "\n")
    print(f"table written to {table.resolve()}")
    if not args.no_plot:
        try:
            path = _plot_demo(results, args.plot, title=title)
            print(f"plot written to {os.path.abspath(path)}")
        except ImportError as error:
            print(f"no plot: {error}")


def _progress_bar(stream=None):
    """Progress bars on ``stream`` (stderr) where it is a terminal; elsewhere none: in a
    log, a bar's carriage returns would run into the table's rows on the same lines."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if not (callable(isatty) and isatty()):
        return lambda it, desc="": it
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency; this only guards odd environments
        return lambda it, desc="": it
    return lambda it, desc="": tqdm(it, desc=desc, leave=False, file=stream, dynamic_ncols=True)


def _engine_line() -> str:
    """Decides the engine before any step is timed, and says which: a build of the compiled
    engine made now is said here, once, with its time, and no row counts it.

    Example::

        print(_engine_line())   # "engine: compiled" (or python), plus the build if one ran now
    """
    try:
        name = "python" if _engine_choice.compiled_module(quiet=True) is None else "compiled"
    except _engine_loader.CompiledEngineError as error:  # DISPATCH_AMP_ENGINE=compiled that cannot build
        raise SystemExit(str(error)) from None
    seconds = _engine_loader.PROCESS_LOADER.build_seconds
    if name == "compiled" and seconds is not None:
        return (f"dispatch_amp engine: compiled, built now in {seconds:.0f} s (once per torch release, "
                f"before the first step: no row counts it; cached in {_engine_loader.PROCESS_LOADER.directory})")
    return f"dispatch_amp engine: {name}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dispatch_amp.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="training steps per run (default 150)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="16-bit dtype (default: bfloat16 on CPU, float16 on CUDA)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--table", default="demo.md", help="where to write the table (Markdown)")
    parser.add_argument("--plot", default="demo.png", help="where to write the plot (PNG)")
    parser.add_argument("--no-plot", action="store_true", help="do not write a plot")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the demo; returns the process exit code."""
    args = build_parser().parse_args(argv)
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    device = torch.device(args.device or default_device_type(among=("cuda",)))
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device must be cpu or cuda, got {device.type!r}")
    if not device_available(device.type):
        raise SystemExit("--device cuda was asked for, but torch sees no CUDA device")
    dtype = _DTYPES[args.dtype] if args.dtype else (torch.float16 if device.type == "cuda" else torch.bfloat16)

    title = f"char GPT, {device.type} {str(dtype).replace('torch.', '')}"
    text = load_corpus()
    args.alphabet = sorted(set(text))
    lookup = {c: i for i, c in enumerate(args.alphabet)}
    data = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    vocab = len(args.alphabet)

    print(f"dispatch-amp demo: char GPT on {len(text) / 1e3:.0f} KB of text, {args.steps} steps, "
          f"{device.type}, {str(dtype).replace('torch.', '')}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(_engine_line(), flush=True)
    progress = _progress_bar()
    names, align = _table_header(dtype)
    print()
    print(_markdown.header(names, align), flush=True)
    results: list[RunResult] = []
    try:
        for name in RUNS:
            results.append(_train_run(name, data, vocab, args, device, dtype, progress))
            print(_markdown.row(_table_row(results[-1], results[0].step_ms)), flush=True)
        print()
        print(_timing_note(args.steps))
    except KeyboardInterrupt:
        print(f"\nstopped: {len(results)} of {len(RUNS)} runs finished", flush=True)
        if results:
            print(_timing_note(args.steps))
            _write_outputs(results, args, dtype, title)
        return 130  # the shell's status for a process ended by Ctrl-C (128 + SIGINT)
    print()
    print("sample from the dispatch_amp run:", repr(results[-1].sample[:100]))
    _write_outputs(results, args, dtype, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""host-cost: what our autocast adds on the host, at widths where the kernels cost nothing.

On a GPU whose step is host-bound every microsecond of Python shows. This suite measures
the host time ours adds over native autocast on models that keep real models' op
structure at trivial widths, and how often the engine's Python runs. Each engine
(``DISPATCH_AMP_ENGINE=python``, ``=compiled``) is measured in a process of its own and
the rows are merged, with a column naming the engine that ran (``run``, ``child``):

1. Added host time per forward and per training step (forward, loss, backward, SGD step),
   ours against native, interleaved in rotating order; the median of per-round
   differences (ms) and, for the step, both ratio estimators with their bootstrap
   intervals (``timing.ratio_stats``). Models: GPT-2 small's structure (12
   pre-norm blocks, 12 heads, tied head; d_model 48), ResNet-50's (bottleneck blocks 3,
   4, 6, 3; width 4, 32x32 images), and the 24-layer residual MLP (width 64, batch 16).
2. Entries into our Python (``PythonEntries``: frames of dispatch_amp entered from code
   that is not ours) per forward, against the calls of that forward the policy casts,
   and per compiled training step (``torch.compile``, aot_eager; target 0).
3. Gradient accumulation (4 micro-batches, one optimizer step) and an eval loop (8
   forwards under no_grad, each in its own region): ours, and ours inside
   ``dispatch_amp.cast_cache()``, against native.
4. Where the added time per forward goes: ours again with the built-in policy's
   ``lower`` calls swapped, in this process, for native's C++ casts behind our kernel
   (what entering a Python kernel costs) and for bare Python casts without native's rules
   or the weight cache (what casting from Python costs); the rest is the rules and the
   cache. The Python engine's process only: the variants swap its handlers.

Targets (this CPU, medians of interleaved runs): added per forward <= 0.5 ms (GPT-2
structure), <= 0.35 ms (ResNet-50 structure); MLP training step <= 1.05x native; 0
entries per compiled step; accumulation with cast_cache < 1.00x native. No test asserts
a time: the verdict column is information.
"""

from __future__ import annotations

import collections
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import dispatch_amp
from dispatch_amp.autocast import _handlers, _routing

from ..models import GPT, GPTConfig, ResidualMLP, ResNet, gpt_batch
from ..timing import interleaved, prefixed, ratio_stats
from . import common
from .common import ESTIMATORS_NOTE, Table, failure, ratio_columns, verdict

NAME = "host-cost"
CHILD_TIMEOUT_S = 1800  # a hang guard: an engine's first region may build the compiled kernel
_PACKAGE = str(Path(dispatch_amp.__file__).resolve().parent)


class PythonEntries:
    """Counts entries into dispatch_amp's Python while open: calls of a function of the
    package made from code that is not the package's (a kernel the dispatcher calls, a
    region's ``__enter__``). ``by_function`` tells them apart; ``kernel_ops`` names the
    op of each kernel entry.

    Example::

        with amp.autocast("cpu"):
            with PythonEntries() as entries:
                model(x)
        entries.count, entries.kernel_ops.most_common(3)
    """

    def __init__(self):
        self.count = 0
        self.by_function: collections.Counter = collections.Counter()
        self.kernel_ops: collections.Counter = collections.Counter()

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(_PACKAGE):
            return
        back = frame.f_back
        if back is not None and back.f_code.co_filename.startswith(_PACKAGE):
            return
        self.count += 1
        self.by_function[code.co_name] += 1
        if code.co_name == "kernel":
            op = frame.f_locals.get("op")
            self.kernel_ops[str(op)] += 1

    def __enter__(self) -> PythonEntries:
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(self._previous)


def gpt2_structure() -> tuple[torch.nn.Module, tuple]:
    cfg = GPTConfig(vocab=64, d_model=48, n_heads=12, n_blocks=12, max_len=16)
    model = GPT(cfg)
    model.head.weight = model.tok.weight  # tied, as GPT-2's
    gen = torch.Generator().manual_seed(0)
    return model, gpt_batch(cfg, 2, 16, generator=gen)


def resnet50_structure() -> tuple[torch.nn.Module, tuple]:
    model = ResNet(width=4, classes=10).to(memory_format=torch.channels_last)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 32, 32, generator=gen).to(memory_format=torch.channels_last)
    return model, (x, torch.randint(0, 10, (2,), generator=gen))


def mlp24() -> tuple[torch.nn.Module, tuple]:
    gen = torch.Generator().manual_seed(0)
    return ResidualMLP(width=64, depth=24), (torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen))


MODELS = {"GPT-2 structure": gpt2_structure, "ResNet-50 structure": resnet50_structure, "MLP 24 x 64": mlp24}
# Targets: added ms per forward, training-step ratio.
FORWARD_TARGET_MS = {"GPT-2 structure": 0.5, "ResNet-50 structure": 0.35}
STEP_TARGET = {"MLP 24 x 64": 1.05}


def _loss(model, batch):
    if isinstance(model, GPT):
        return model.loss(*batch)
    x, y = batch
    return F.cross_entropy(model(x), y)


def _region(mode: str):
    if mode == "native":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return dispatch_amp.autocast("cpu", dtype=torch.bfloat16)


def _interleaved(fns: dict, calls: int, rounds: int, inside=None) -> dict[str, list[float]]:
    """Milliseconds per call, interleaved after a warm-up sample (memos, kernel registration, caches)."""
    return {name: [t * 1e3 for t in v] for name, v in interleaved(fns, rounds, calls=calls, inside=inside).items()}


def _forward(model, batch, mode):
    def run():
        with _region(mode):
            _loss(model, batch)
    return run


def _step(model, batch, mode, optimizer):
    def run():
        with _region(mode):
            loss = _loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return run


def _accumulate(model, batches, mode, optimizer, keep_casts: bool):
    def run():
        with dispatch_amp.cast_cache() if keep_casts else contextlib.nullcontext():
            for batch in batches:
                with _region(mode):
                    loss = _loss(model, batch) / len(batches)
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return run


def _eval_loop(model, batches, mode, keep_casts: bool):
    def run():
        with torch.no_grad(), dispatch_amp.cast_cache() if keep_casts else contextlib.nullcontext():
            for batch in batches:
                with _region(mode):
                    _loss(model, batch)
    return run


# -- where the added time goes: the built-in policy's `lower` handler swapped, in-process ------
_OUR_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)


def _native_casts(ctx, st, op, keyset, args, kwargs):
    """Our kernel entered, then the call handed to native autocast below our key: what
    entering a Python kernel costs, with native's casts in C++."""
    with torch._C._ExcludeDispatchKeyGuard(_OUR_KEY):
        return op._op(*args, **kwargs)


def _bare_casts(ctx, st, op, keyset, args, kwargs):
    """Every float32 tensor argument cast in Python, without native's rules or the weight
    cache: the floor of casting from Python. The op is called as ours calls it, so the
    variant differs from ours in the casting alone."""
    args = [a.bfloat16() if isinstance(a, torch.Tensor) and a.dtype is torch.float32 else a for a in args]
    return _handlers.run_without_autocast(op, args, kwargs)


@contextlib.contextmanager
def _lower_calls_as(replacement):
    """Inside: the built-in CPU policy's ``lower`` calls go to ``replacement`` (a
    measurement only: the plan is the engine's memoized one, restored on exit)."""
    plan = _routing.plan_for(dispatch_amp.Policy.for_device("cpu"), "cpu")
    saved = dict(plan.handlers)
    try:
        for key, handler in saved.items():
            if handler is _handlers.lower:
                plan.handlers[key] = replacement
        yield
    finally:
        plan.handlers.update(saved)


_VARIANTS = {"native casts": _native_casts, "bare casts": _bare_casts}


def breakdown(rounds: int, calls: int, models=("GPT-2 structure", "ResNet-50 structure")) -> Table:
    """Where the host time ours adds per forward goes, from three variants of ours timed
    interleaved with native: kernel entry (our kernel called, native's casts), casting from
    Python (bare casts, no rules, no cache) and native's rules with the weight cache."""
    table = Table(
        f"host-cost: where the added time per forward+loss goes (ms; {rounds} interleaved rounds of {calls} "
        f"calls, medians of per-round differences from native)",
        [("model", "model", "{}"), ("casts", "calls cast", "{}"), ("added_ms", "added", "{:+.3f}"),
         ("entry_ms", "kernel entry", "{:+.3f}"), ("python_casts_ms", "casts from Python", "{:+.3f}"),
         ("rules_ms", "rules + weight cache", "{:+.3f}"), ("entry_us_per_call", "entry per call (us)", "{:.1f}")],
        note="kernel entry: ours with each cast call handed to native autocast's C++ casts; casts from Python: "
             "ours casting every float32 argument without rules or cache, minus kernel entry; rules + weight "
             "cache: the rest of ours. Measurement variants only, swapped in this process.",
    )
    for name in models:
        model, batch = MODELS[name]()
        _, cast, _ = entries_per_forward(model, batch)
        fns = {m: _forward(model, batch, m) for m in ("native", "ours")}
        fns.update({v: _forward(model, batch, "ours") for v in _VARIANTS})
        samples = _interleaved(fns, calls, rounds,
                               inside=lambda n: _lower_calls_as(_VARIANTS[n]) if n in _VARIANTS else contextlib.nullcontext())
        added = {n: _median_diff(samples[n], samples["native"]) for n in ("ours", *_VARIANTS)}
        table.rows.append({
            "model": name, "casts": cast, "added_ms": added["ours"], "entry_ms": added["native casts"],
            "python_casts_ms": added["bare casts"] - added["native casts"],
            "rules_ms": added["ours"] - added["bare casts"],
            "entry_us_per_call": added["native casts"] / cast * 1e3 if cast else float("nan"),
        })
    return table


def _met(ok: bool) -> str:
    """``verdict`` for a combined check."""
    return "smoke test" if common.SMOKE_TEST else ("met" if ok else "missed")


def _median_diff(a, b):
    return statistics.median(x - y for x, y in zip(a, b))


def entries_per_forward(model, batch) -> tuple[int, int, collections.Counter]:
    """(entries into our Python, of them kernel calls for ops the policy casts, the
    kernels' ops) for one forward and loss under the built-in CPU policy."""
    plan_policy = dispatch_amp.Policy.for_device("cpu")
    with dispatch_amp.autocast("cpu"):
        _loss(model, batch)  # warm: kernels registered, memos filled
        with PythonEntries() as entries:
            _loss(model, batch)
    cast = 0
    for op, n in entries.kernel_ops.items():  # "aten.mm.default"
        namespace, name, overload = op.split(".")
        if plan_policy.kind_of(f"{namespace}::{name}.{overload}") is not None:
            cast += n
    return entries.count, cast, entries.kernel_ops


def entries_per_compiled_step(model, batch) -> int:
    """Entries into our Python during one compiled training step (aot_eager), after the
    compile: the region is opened around the compiled call."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        loss = _loss(model, batch)
        loss.backward()
        return loss

    compiled = torch.compile(step, backend="aot_eager")
    for _ in range(2):
        with dispatch_amp.autocast("cpu"):
            compiled()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    with dispatch_amp.autocast("cpu"):
        with PythonEntries() as entries:
            compiled()
    return entries.count


ENGINES = ("python", "compiled")  # DISPATCH_AMP_ENGINE, one child process each


def engine_name() -> str:
    """The engine this process runs (``dispatch_amp.engine()``; "python" where the package
    has no choice of engine)."""
    engine = getattr(dispatch_amp, "engine", None)
    return engine() if callable(engine) else "python"


def _sizes(quick: bool) -> tuple[int, int]:
    """(calls per sample, rounds)."""
    return (1, 3) if quick else (5, 21)


def tables(quick: bool) -> dict[str, Table]:
    """The suite's tables, empty, by name: the parent process fills them with the rows of
    each engine's child."""
    calls, rounds = _sizes(quick)
    engine = ("engine", "engine", "{}")
    forward = Table(
        f"host-cost: ms per forward+loss and per training step (CPU bfloat16, trivial widths); "
        f"{rounds} interleaved rounds of {calls} calls, medians",
        [engine, ("model", "model", "{}"), ("native_fwd_ms", "native fwd", "{:.2f}"),
         ("ours_fwd_ms", "ours fwd", "{:.2f}"), ("added_fwd_ms", "added per fwd (ms)", "{:+.3f}"),
         ("fwd_target", "target", "{}"), ("native_step_ms", "native step", "{:.2f}"),
         ("ours_step_ms", "ours step", "{:.2f}"), *ratio_columns("step_", "step ours/native"),
         ("step_target", "target", "{}"), ("entries_fwd", "entries per fwd", "{}"),
         ("cast_calls", "of which casts", "{}"), ("met", "met?", "{}")],
        note="Entries: calls into dispatch_amp's Python from outside it during one forward+loss "
             "(with the Python engine every one a kernel of an op the policy casts). Each engine measured in a "
             "process of its own (DISPATCH_AMP_ENGINE). The step verdict reads the median of per-round ratios. "
             + ESTIMATORS_NOTE,
    )
    where = Table(
        f"host-cost: where the added time per forward+loss goes, Python engine (ms; {2 * rounds - 1} interleaved "
        f"rounds of {calls} calls, medians of per-round differences from native)",
        [("model", "model", "{}"), ("casts", "calls cast", "{}"), ("added_ms", "added", "{:+.3f}"),
         ("entry_ms", "kernel entry", "{:+.3f}"), ("python_casts_ms", "casts from Python", "{:+.3f}"),
         ("rules_ms", "rules + weight cache", "{:+.3f}"), ("entry_us_per_call", "entry per call (us)", "{:.1f}")],
        note="kernel entry: ours with each cast call handed to native autocast's C++ casts; casts from Python: "
             "ours casting every float32 argument without rules or cache, minus kernel entry; rules + weight "
             "cache: the rest of ours. Measurement variants only, swapped in this process: they replace the "
             "Python engine's handlers, so they run in its process alone.",
    )
    compiled = Table(
        "host-cost: entries into our Python per compiled training step (torch.compile, aot_eager; target 0)",
        [engine, ("model", "model", "{}"), ("entries", "entries per compiled step", "{}"), ("met", "met?", "{}")],
    )
    repeated = Table(
        f"host-cost: gradient accumulation (4 micro-batches, one SGD step) and an eval loop (8 forwards "
        f"under no_grad, one region each), ms, {rounds} interleaved rounds; ratio to native",
        [engine, ("case", "case", "{}"), ("model", "model", "{}"), ("native_ms", "native", "{:.2f}"),
         ("ours_ms", "ours", "{:.2f}"), *ratio_columns("ours_", "ours/native"),
         ("kept_ms", "ours + cast_cache", "{:.2f}"), *ratio_columns("kept_", "kept/native"),
         ("target", "target", "{}"), ("met", "met?", "{}")],
        note="The verdict reads the median of per-round ratios. " + ESTIMATORS_NOTE,
    )
    return {"forward": forward, "where": where, "compiled": compiled, "repeated": repeated}


def measure(quick: bool, with_breakdown: bool = True) -> dict[str, list[dict]]:
    """Every table's rows, measured in this process with its engine (each row names it);
    the breakdown (``where``) only ``with_breakdown``."""
    calls, rounds = _sizes(quick)
    rows: dict[str, list[dict]] = {name: [] for name in ("forward", "where", "compiled", "repeated")}
    for name, make in MODELS.items():
        if quick and name != "MLP 24 x 64":
            continue
        model, batch = make()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        fwd = _interleaved({m: _forward(model, batch, m) for m in ("native", "ours")}, calls, rounds)
        step = _interleaved({m: _step(model, batch, m, optimizer) for m in ("native", "ours")}, calls, rounds)
        entries, cast, _ = entries_per_forward(model, batch)
        added = _median_diff(fwd["ours"], fwd["native"])
        st = ratio_stats(step["ours"], step["native"])
        checks = []
        if name in FORWARD_TARGET_MS:
            checks.append(added <= FORWARD_TARGET_MS[name])
        if name in STEP_TARGET:
            checks.append(st["ratio"] <= STEP_TARGET[name])
        checks.append(entries == cast)
        rows["forward"].append({
            "model": name, "native_fwd_ms": statistics.median(fwd["native"]),
            "ours_fwd_ms": statistics.median(fwd["ours"]), "added_fwd_ms": added,
            "fwd_target": f"<= {FORWARD_TARGET_MS[name]}" if name in FORWARD_TARGET_MS else "-",
            "native_step_ms": statistics.median(step["native"]), "ours_step_ms": statistics.median(step["ours"]),
            **prefixed(st, "step_"), "step_target": f"<= {STEP_TARGET[name]}" if name in STEP_TARGET else "-",
            "entries_fwd": entries, "cast_calls": cast, "met": _met(all(checks)),
        })

    for name in ("MLP 24 x 64",) if quick else tuple(MODELS):
        model, batch = MODELS[name]()
        n = entries_per_compiled_step(model, batch)
        rows["compiled"].append({"model": name, "entries": n, "met": verdict(n, 0)})

    for name in ("MLP 24 x 64",) if quick else ("GPT-2 structure", "MLP 24 x 64"):
        model, batch = MODELS[name]()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        batches = [batch] * 4
        acc = _interleaved({
            "native": _accumulate(model, batches, "native", optimizer, False),
            "ours": _accumulate(model, batches, "ours", optimizer, False),
            "kept": _accumulate(model, batches, "ours", optimizer, True),
        }, max(1, calls // 2), rounds)
        evals = _interleaved({
            "native": _eval_loop(model, [batch] * 8, "native", False),
            "ours": _eval_loop(model, [batch] * 8, "ours", False),
            "kept": _eval_loop(model, [batch] * 8, "ours", True),
        }, max(1, calls // 2), rounds)
        for case, samples, target in (("accumulation", acc, 1.0), ("eval loop", evals, 1.0)):
            kept = ratio_stats(samples["kept"], samples["native"])
            rows["repeated"].append({
                "case": case, "model": name, "native_ms": statistics.median(samples["native"]),
                "ours_ms": statistics.median(samples["ours"]),
                **prefixed(ratio_stats(samples["ours"], samples["native"]), "ours_"),
                "kept_ms": statistics.median(samples["kept"]), **prefixed(kept, "kept_"),
                "target": f"kept < {target:.2f}", "met": _met(kept["ratio"] < target),
            })
    if with_breakdown:
        # Four variants share the rounds: twice as many keep the split steady between runs.
        rows["where"] = breakdown(2 * rounds - 1, calls,
                                  ("MLP 24 x 64",) if quick else ("GPT-2 structure", "ResNet-50 structure")).rows
    engine = engine_name()  # after the regions: the engine that ran them
    for table_rows in rows.values():
        for row in table_rows:
            row.setdefault("engine", engine)
    return rows


def child(args: list[str], opts) -> None:
    """``run.py --child host-cost ENGINE [--quick]``, run with ``DISPATCH_AMP_ENGINE=ENGINE``:
    prints every table's rows as one JSON line. The breakdown runs in the Python engine's
    child only (it swaps that engine's handlers)."""
    (engine,) = args
    common.SMOKE_TEST = opts.quick
    print(json.dumps(measure(opts.quick, with_breakdown=engine == "python")))


def _engine_cell(asked: str, ran: str) -> str:
    return ran if ran == asked else f"{ran} (asked for {asked})"


def run(opts) -> list[Table]:
    """Each engine's measurement in a process of its own (``DISPATCH_AMP_ENGINE`` set), the
    rows merged into one set of tables with an engine column. A child that fails (the
    compiled engine cannot build here, say) gives a row that says so."""
    out = tables(opts.quick)
    for engine in ENGINES:
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "benchmarks.run", "--child", NAME, engine] + (["--quick"] if opts.quick else [])
        rc, stdout, stderr = common.run_children({engine: cmd}, timeout=CHILD_TIMEOUT_S,
                                                 env={"DISPATCH_AMP_ENGINE": engine})[engine]
        try:
            if rc != 0:
                last = (stderr.strip().splitlines() or [f"exit status {rc}"])[-1]
                raise RuntimeError(f"the {engine} engine's process failed: {last}")
            rows = json.loads(stdout.strip().splitlines()[-1])
        except Exception as e:  # noqa: BLE001 - the row says why; the other engine's rows stand
            print(f"(host-cost, {engine} engine: {e}; its stderr ends:\n{stderr[-2000:]})", flush=True)
            for name, table in out.items():
                if name != "where":
                    table.rows.append({"engine": f"{engine}: not measured ({failure(e)})"})
            continue
        for name, table in out.items():
            for row in rows[name]:
                row["engine"] = _engine_cell(engine, row.get("engine", "python"))
                table.rows.append(row)
        print(f"(host-cost: the {engine} engine's process took {time.perf_counter() - t0:.1f} s)", flush=True)
    return [out["forward"], out["where"], out["compiled"], out["repeated"]]

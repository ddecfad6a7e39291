"""GradScaler and autocast under torch.distributed: DDP and FSDP2 on CPU, gloo, 2 processes.

Every multi-process case runs its ranks through :func:`run_ranks`: spawned processes
(torch.multiprocessing), a free TCP port on 127.0.0.1 picked at run time, a timeout on
``init_process_group`` (which also bounds every gloo collective) and a hard deadline after
which the parent kills what is left. Each spawn costs a few seconds, so each worker below
runs one scenario and several tests read its results (module-scoped fixtures).

The references are single-process runs of the same model on the same global batch:

* "accumulated": the two ranks' halves as two micro-batches, each loss divided by 2. DDP
  and FSDP2 average the ranks' gradients, (g0 + g1) / 2, and halving is exact in binary
  floating point, so this reference has the same arithmetic: results must be bit-identical.
* "global": one pass over the whole batch (mean loss). Its low-precision matmuls sum the
  8 rows in one reduction instead of two halves of 4, so results differ by rounding: they
  are compared within a tolerance scaled to the autocast dtype.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import dispatch_amp as amp
from dispatch_amp import GradScaler
from dispatch_amp.scaler.distributed import NO_REDUCTION, local_tensor, resolve_process_group
from dispatch_amp.kernels import unscale as unscale_mod

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"),
    # The ranks and the single-process references run bfloat16 with a GradScaler on purpose
    # (the found_inf reduction is what is tested), which our scaler warns about.
    pytest.mark.filterwarnings("ignore:GradScaler is used with bfloat16 autocast:dispatch_amp.AmpNumericsWarning"),
]

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
STEPS = 5
INF_STEP = 2  # the step at which one rank's input or gradient shard gets an inf
INIT_SCALE = 2.0**12
GROWTH_INTERVAL = 2  # steps 0-1 grow the scale, step 2 backs off, steps 3-4 grow again
TRITON_ON_CPU = unscale_mod.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["torch", "triton"] if TRITON_ON_CPU else ["torch"]
# Rounding difference allowed against the "global" reference, per autocast dtype: the
# gradients differ by about the dtype's epsilon (bf16 2**-8, fp16 2**-11) relative, and
# lr 0.1 x 4 applied steps with momentum 0.9 x |grad| <~ 0.5 turns that into about
# 0.5 * eps. Measured: bf16 4.3e-4, fp16 7e-5, with parameters moving by 0.15.
GLOBAL_ATOL = {torch.bfloat16: 2e-3, torch.float16: 4e-4}


# ------------------------------------------------------------------------------------------
# Process harness
# ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, port: int, out_dir: str, timeout_s: float, args: tuple) -> None:
    """Child process: join the group, run ``fn(rank, *args)``, save its result or the error."""
    out = Path(out_dir) / f"rank{rank}.pt"
    if "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        report = {"ok": True, "result": fn(rank, *args)}
    except BaseException as e:  # report every failure to the parent
        report = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(), "at": time.time()}
        # Free the failed frames' models now: a DDP/FSDP model freed after
        # destroy_process_group() can hang at exit (seen with DDP on gloo).
        traceback.clear_frames(e.__traceback__)
    torch.save(report, out)
    if dist.is_initialized():
        dist.destroy_process_group()
    if not report["ok"]:
        sys.exit(1)


@contextlib.contextmanager
def _children_can_import_this_module():
    # Spawned children unpickle `fn` by module name; they inherit sys.path at start().
    top = str(Path(__file__).resolve().parents[__name__.count(".")])
    added = top not in sys.path
    if added:
        sys.path.insert(0, top)
    try:
        yield
    finally:
        if added:
            sys.path.remove(top)


def run_ranks(fn, out_dir: Path, *args, timeout_s: float = 30.0, deadline_s: float = 60.0,
              wait_for: int | None = None) -> dict:
    """Run ``fn(rank, *args)`` on 2 ranks; return {"results", "errors", "failed_after", "killed", "seconds"}.

    Never hangs: ranks still alive after ``deadline_s`` are killed and listed in "killed".
    ``wait_for``: wait (up to the deadline) for that rank alone, then kill the others.
    "failed_after": seconds from the start to each failing rank's report.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    start, start_wall = time.monotonic(), time.time()
    with _children_can_import_this_module():
        procs = [ctx.Process(target=_entry, args=(fn, r, port, str(out_dir), timeout_s, args), daemon=True) for r in range(WORLD)]
        for p in procs:
            p.start()
    killed = []
    try:
        for p in procs if wait_for is None else [procs[wait_for]]:
            p.join(max(0.0, deadline_s - (time.monotonic() - start)))
    finally:
        for r, p in enumerate(procs):
            if p.is_alive():
                killed.append(r)
                p.kill()
                p.join(10)
    results, errors, failed_after = {}, {}, {}
    for r in range(WORLD):
        path = out_dir / f"rank{r}.pt"
        if not path.exists():
            errors[r] = f"no report (exit code {procs[r].exitcode})"
            continue
        report = torch.load(path, weights_only=False)
        if report["ok"]:
            results[r] = report["result"]
        else:
            errors[r] = report["error"] + "\n" + report["traceback"]
            failed_after[r] = report["at"] - start_wall
    return {"results": results, "errors": errors, "failed_after": failed_after, "killed": killed, "seconds": time.monotonic() - start}


def all_results(run: dict) -> list:
    assert not run["killed"] and not run["errors"], f"killed {run['killed']}; errors: {run['errors']}"
    return [run["results"][r] for r in range(WORLD)]


# ------------------------------------------------------------------------------------------
# Model, data, one training loop for every setting
# ------------------------------------------------------------------------------------------


# conftest.py has the same counter as a fixture; the spawned ranks import this module by
# name and cannot reach conftest, so the workers keep their own copy.
class SyncCounter(TorchDispatchMode):
    """Counts host reads: every .item()/bool() on a tensor reaches aten._local_scalar_dense,
    and every Tensor.tolist() (which reads memory directly, below the dispatcher) is counted
    by a wrapper installed while the counter is active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        counter, tolist = self, self._tolist

        def counted_tolist(t):
            counter.count += 1
            return tolist(t)

        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def make_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def global_batch(step: int, inject_input: bool):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
    if inject_input and step == INF_STEP:
        x[5, 1] = float("inf")  # row 5 belongs to rank 1's half
    return x, y


def make_opt(model, kind):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)


def train(model, opt, scaler, dtype, parts, inject, count_syncs=False, native=False):
    """STEPS steps; ``parts(x, y)`` -> the micro-batches this process runs, as (x, y, divisor).

    ``inject``: "input" puts an inf into row 5 of the global batch at INF_STEP; a callable
    is called after the backward of INF_STEP (to poison a gradient by hand).
    Returns per-step scales, skipped-step counts and host-sync counts of the scaler calls.
    """
    scales, skipped, syncs = [], [], []
    ctx = (lambda: torch.autocast("cpu", dtype=dtype)) if native else (lambda: amp.autocast("cpu", dtype=dtype))
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for x, y, div in parts(*global_batch(step, inject == "input")):
            with ctx():
                loss = F.cross_entropy(model(x), y) / div
            scaler.scale(loss).backward()
        if callable(inject) and step == INF_STEP:
            inject(model)
        with SyncCounter() if count_syncs else contextlib.nullcontext() as counter:
            scaler.step(opt)
            scaler.update()
        syncs.append(counter.count if count_syncs else None)
        scales.append(scaler.get_scale())
        skipped.append(scaler.skipped_steps)
    return {"scales": scales, "skipped": skipped, "syncs": syncs}


def full_params(model) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def own_half(rank):
    return lambda x, y: [(x.chunk(WORLD)[rank], y.chunk(WORLD)[rank], 1)]


def accumulated_halves(x, y):
    return [(xs, ys, WORLD) for xs, ys in zip(x.chunk(WORLD), y.chunk(WORLD))]


def whole_batch(x, y):
    return [(x, y, 1)]


def reference(kind, dtype, parts, inject, backend="torch"):
    model = make_model()
    opt = make_opt(model, kind)
    scaler = GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, backend=backend)
    log = train(model, opt, scaler, dtype, parts, inject)
    return {**log, "params": full_params(model)}


def poison_rank1_shard(rank):
    """Inject: an inf into rank 1's LOCAL gradient shard of the first weight (rank 0's stays clean)."""

    def inject(model):
        if rank == 1:
            local_tensor(model[0].weight.grad)[0, 0] = float("inf")

    return inject


def poison_row_8(model):
    """The single-process equivalent of poison_rank1_shard: row 8 is rank 1's first row."""
    model[0].weight.grad[8, 0] = float("inf")


def bits_equal(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------
# Workers (run in the spawned ranks)
# ------------------------------------------------------------------------------------------

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def ddp_worker(rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for name, dtype in DTYPES.items():
        model = DDP(make_model())
        scaler = GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
        log = train(model, make_opt(model, "sgd"), scaler, dtype, own_half(rank), "input", count_syncs=True)
        out[name] = {**log, "params": full_params(model.module), "reduces": resolve_process_group(None, make_opt(model, "sgd")) is not NO_REDUCTION}
        # (c) one backward under our autocast and one under native autocast, same DDP setup.
        grads = {}
        for which, ctx in (("ours", amp.autocast), ("native", torch.autocast)):
            m = DDP(make_model())
            x, y = global_batch(0, False)
            with ctx("cpu", dtype=dtype):
                loss = F.cross_entropy(m(x.chunk(WORLD)[rank]), y.chunk(WORLD)[rank])
            loss.backward()  # outside the context, as with native AMP
            grads[which] = [p.grad.clone() for p in m.parameters()]
        out[name]["grads"] = grads
    return out


def fsdp_model():
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    return model


def fsdp_worker(rank):
    out = {}
    # (b) inf in rank 1's local gradient shard only, our default process_group (None: world,
    # because the parameters are DTensors), for each kernel backend; then reduction disabled.
    for backend in BACKENDS:
        for pg in (None, False):
            if pg is False and backend != "torch":
                continue
            model = fsdp_model()
            scaler = GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, backend=backend, process_group=pg)
            log = train(model, make_opt(model, "sgd"), scaler, torch.bfloat16, own_half(rank), poison_rank1_shard(rank), count_syncs=True)
            grad_types = sorted({type(p.grad).__name__ for p in model.parameters()})
            out[(backend, pg)] = {**log, "params": full_params(model), "grad_types": grad_types}
    # Fused AdamW: found_inf is consumed on the device, no host sync.
    model = fsdp_model()
    scaler = GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    log = train(model, make_opt(model, "fused_adamw"), scaler, torch.bfloat16, own_half(rank), poison_rank1_shard(rank), count_syncs=True)
    out["fused_adamw"] = {**log, "params": full_params(model)}
    # (c) gradients under our autocast equal native autocast's, FSDP2-wrapped (local shards).
    for name, dtype in DTYPES.items():
        grads = {}
        for which, ctx in (("ours", amp.autocast), ("native", torch.autocast)):
            m = fsdp_model()
            x, y = global_batch(0, False)
            with ctx("cpu", dtype=dtype):
                loss = F.cross_entropy(m(x.chunk(WORLD)[rank]), y.chunk(WORLD)[rank])
            loss.backward()
            grads[which] = [p.grad.to_local().clone() for p in m.parameters()]
        out[("grads", name)] = grads
    # Hand-made sharding without DTensors: each rank owns different plain parameters.
    # An explicit group reduces; the default (None) does not, since nothing is a DTensor.
    for pg in (dist.group.WORLD, None):
        torch.manual_seed(rank)
        lin = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        scaler = GradScaler("cpu", init_scale=INIT_SCALE, process_group=pg)
        scaler.scale(lin(torch.ones(1, 3) * (float("inf") if rank == 1 else 1.0)).sum()).backward()
        before = lin.weight.detach().clone()
        scaler.step(opt)
        scaler.update()
        stepped = not torch.equal(before, lin.weight)
        out[("plain", "explicit" if pg is not None else "default")] = {"stepped": stepped, "scale": scaler.get_scale()}
    return out


def failing_worker(rank, how):
    """Rank 1 fails between backward and step; rank 0 goes on into the found_inf all_reduce.

    how="raise": rank 1 raises and exits (rank 0 sees the connection close).
    how="stall": rank 1 stays alive and never joins (rank 0 must hit the collective timeout).
    """
    model = fsdp_model()
    opt = make_opt(model, "sgd")
    scaler = GradScaler("cpu")
    x, y = global_batch(0, False)
    with amp.autocast("cpu"):
        loss = F.cross_entropy(model(x.chunk(WORLD)[rank]), y.chunk(WORLD)[rank])
    scaler.scale(loss).backward()
    if rank == 1:
        if how == "stall":
            time.sleep(3600)  # the parent kills this rank once rank 0 has failed
        raise RuntimeError("injected failure on rank 1")
    scaler.step(opt)  # waits for rank 1 in the all_reduce: must fail within the timeout
    scaler.update()
    # Not reached normally; a second collective makes sure rank 0 cannot finish silently.
    dist.barrier()
    return "finished"


def fp8_worker(rank):
    """DelayedScaling under DDP and FSDP2: each rank sees other activations (rank 1's are
    three times larger); with amax reduction every rank keeps the same histories, equal to
    the max of the ranks' own amaxes; without it they differ. "ddp-closure" runs the forward
    and backward inside ``optimizer.step(closure)``, as Lightning's Trainer does without a
    loss scaler: each step's amaxes must still be in the history once the step is done."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dispatch_amp import fp8

    def fp8_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))

    out = {}
    for setup in ("ddp", "ddp-closure", "ddp-no-reduce", "fsdp2"):
        model = fp8_model()
        if setup == "fsdp2":
            fully_shard(model[0])
            fully_shard(model[2])
            fully_shard(model)
        else:
            model = DDP(model)
        recipe = fp8.DelayedScaling(amax_history_len=4, reduce_amax=setup != "ddp-no-reduce")
        if setup != "fsdp2":
            recipe.bind(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        local_amax = []
        for step in range(3):
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(10 * step + rank)) * (1 + 2 * rank)
            local_amax.append(x.abs().max())

            def closure(x=x):
                with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
                    loss = model(x).float().pow(2).mean()
                loss.backward()
                return loss

            if setup == "ddp-closure":
                opt.step(closure)
            else:
                closure()
                opt.step()
            opt.zero_grad()
        sites = recipe.state.sites()
        out[setup] = {
            "input_history": [site.history["input"][0].clone() for site in sites],
            "grad_history": [site.history["grad_output"][0].clone() for site in sites],
            "local_amax": torch.stack(local_amax),
            "sites": len(sites),
        }
    return out


def fp8_skip_worker(rank):
    """DelayedScaling under DDP where rank 1 skips the middle layer at step 1 (a
    data-dependent branch): the ranks must keep pairing their collectives and their
    histories, as native bf16 trains on."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dispatch_amp import fp8

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.first, self.middle, self.last = (torch.nn.Linear(32, 32) for _ in range(3))

        def forward(self, x, skip):
            h = self.first(x)
            if not skip:
                h = h + self.middle(h)
            return self.last(h)

    model = Branchy()
    recipe = fp8.DelayedScaling(amax_history_len=4).bind(model)
    ddp = DDP(model, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    middle = []
    model.middle.register_forward_pre_hook(lambda module, args: middle.append(args[0].detach().abs().max().float()))
    for step in range(3):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(10 * step + rank)) * (1 + 2 * rank)
        skip = rank == 1 and step == 1
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
            loss = ddp(x, skip).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if skip:
            middle.append(None)
    state = recipe.state_dict()
    return {"state": state, "middle_amax": middle, "weights": [p.detach().clone() for p in model.parameters()]}


# ------------------------------------------------------------------------------------------
# Fixtures: one spawn per scenario
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return all_results(run_ranks(ddp_worker, tmp_path_factory.mktemp("ddp")))


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    return all_results(run_ranks(fsdp_worker, tmp_path_factory.mktemp("fsdp"), deadline_s=120.0))


# ------------------------------------------------------------------------------------------
# (a) DDP
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_ddp_inf_on_one_rank_both_skip_and_back_off(ddp_run, dtype_name):
    r0, r1 = ddp_run[0][dtype_name], ddp_run[1][dtype_name]
    assert not r0["reduces"]  # DDP: default process_group does no reduction; all-reduced grads agree
    expected_scales = [INIT_SCALE, 2 * INIT_SCALE, INIT_SCALE, INIT_SCALE, 2 * INIT_SCALE]
    assert r0["scales"] == r1["scales"] == expected_scales
    assert r0["skipped"] == r1["skipped"] == [0, 0, 1, 1, 1]
    assert bits_equal(r0["params"], r1["params"])
    assert r0["syncs"] == r1["syncs"] == [1] * STEPS  # one host read per step, as single-process


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_ddp_matches_single_process_on_the_global_batch(ddp_run, dtype_name):
    dtype = DTYPES[dtype_name]
    ddp = ddp_run[0][dtype_name]
    acc = reference("sgd", dtype, accumulated_halves, "input")
    assert acc["scales"] == ddp["scales"] and acc["skipped"] == ddp["skipped"]
    assert bits_equal(ddp["params"], acc["params"])  # same arithmetic: bit-identical
    glob = reference("sgd", dtype, whole_batch, "input")
    assert glob["scales"] == ddp["scales"] and glob["skipped"] == ddp["skipped"]
    for a, b in zip(ddp["params"], glob["params"]):
        torch.testing.assert_close(a, b, atol=GLOBAL_ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_ddp_autocast_gradients_equal_native(ddp_run, dtype_name):
    for rank in range(WORLD):
        grads = ddp_run[rank][dtype_name]["grads"]
        assert bits_equal(grads["ours"], grads["native"])
    assert bits_equal(ddp_run[0][dtype_name]["grads"]["ours"], ddp_run[1][dtype_name]["grads"]["ours"])


# ------------------------------------------------------------------------------------------
# (b) FSDP2 (fully_shard): DTensor gradient shards
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp2_inf_in_one_local_shard_both_skip_and_back_off(fsdp_run, backend):
    r0, r1 = fsdp_run[0][(backend, None)], fsdp_run[1][(backend, None)]
    assert r0["grad_types"] == ["DTensor"]
    expected_scales = [INIT_SCALE, 2 * INIT_SCALE, INIT_SCALE, INIT_SCALE, 2 * INIT_SCALE]
    assert r0["scales"] == r1["scales"] == expected_scales
    assert r0["skipped"] == r1["skipped"] == [0, 0, 1, 1, 1]
    assert bits_equal(r0["params"], r1["params"])
    assert r0["syncs"] == r1["syncs"] == [1] * STEPS  # the reduction adds no host sync


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp2_matches_single_process(fsdp_run, backend):
    fsdp = fsdp_run[0][(backend, None)]
    acc = reference("sgd", torch.bfloat16, accumulated_halves, poison_row_8, backend=backend)
    assert acc["scales"] == fsdp["scales"] and acc["skipped"] == fsdp["skipped"]
    assert bits_equal(fsdp["params"], acc["params"])
    glob = reference("sgd", torch.bfloat16, whole_batch, poison_row_8, backend=backend)
    assert glob["scales"] == fsdp["scales"]
    for a, b in zip(fsdp["params"], glob["params"]):
        torch.testing.assert_close(a, b, atol=GLOBAL_ATOL[torch.bfloat16], rtol=0)


def test_fsdp2_without_reduction_ranks_diverge(fsdp_run):
    # process_group=False: rank 1 sees its inf and skips, rank 0 does not: scales and
    # parameter shards drift apart. This is what the default reduction prevents.
    r0, r1 = fsdp_run[0][("torch", False)], fsdp_run[1][("torch", False)]
    assert r0["skipped"] == [0] * STEPS and r1["skipped"] == [0, 0, 1, 1, 1]
    assert r0["scales"] != r1["scales"]
    acc = reference("sgd", torch.bfloat16, accumulated_halves, poison_row_8)
    assert not bits_equal(r0["params"], acc["params"])


def test_fsdp2_fused_adamw_skips_on_device_without_syncs(fsdp_run):
    r0, r1 = fsdp_run[0]["fused_adamw"], fsdp_run[1]["fused_adamw"]
    assert r0["syncs"] == r1["syncs"] == [0] * STEPS
    assert r0["scales"] == r1["scales"] and r0["skipped"] == r1["skipped"] == [0, 0, 1, 1, 1]
    acc = reference("fused_adamw", torch.bfloat16, accumulated_halves, poison_row_8)
    assert acc["scales"] == r0["scales"]
    assert bits_equal(r0["params"], r1["params"]) and bits_equal(r0["params"], acc["params"])


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_fsdp2_autocast_gradients_equal_native(fsdp_run, dtype_name):
    for rank in range(WORLD):
        grads = fsdp_run[rank][("grads", dtype_name)]
        assert bits_equal(grads["ours"], grads["native"])


def test_explicit_group_reduces_plain_tensor_shards(fsdp_run):
    explicit = [fsdp_run[r][("plain", "explicit")] for r in range(WORLD)]
    default = [fsdp_run[r][("plain", "default")] for r in range(WORLD)]
    assert [e["stepped"] for e in explicit] == [False, False]
    assert explicit[0]["scale"] == explicit[1]["scale"] == INIT_SCALE / 2
    assert [d["stepped"] for d in default] == [True, False]  # no DTensors: no reduction by default


# ------------------------------------------------------------------------------------------
# (d) failures are bounded in time
# ------------------------------------------------------------------------------------------


def test_a_rank_that_raises_does_not_hang_the_other(tmp_path):
    run = run_ranks(failing_worker, tmp_path, "raise", timeout_s=5.0, deadline_s=45.0)
    assert run["killed"] == [], f"rank(s) {run['killed']} hung until the deadline"
    assert "injected failure on rank 1" in run["errors"][1]
    assert 0 in run["errors"], f"rank 0 finished although rank 1 never joined: {run['results']}"


def test_a_rank_that_stalls_makes_the_other_time_out(tmp_path):
    # Rank 1 neither joins nor exits: rank 0's found_inf all_reduce must fail on the
    # collective timeout (5 s, set in init_process_group) by itself. The parent waits
    # for rank 0 alone, however slow the machine (the deadline only guards against a
    # hang), then kills the stalled rank.
    run = run_ranks(failing_worker, tmp_path, "stall", timeout_s=5.0, deadline_s=900.0, wait_for=0)
    assert run["killed"] == [1]
    # Rank 0 reported its own failure: the collective's timeout, not a kill.
    assert 0 in run["errors"] and "timed out" in run["errors"][0].lower(), run["errors"].get(0)


# ------------------------------------------------------------------------------------------
# Single-process behaviour of the process_group argument, and the example
# ------------------------------------------------------------------------------------------


def test_reduction_starts_in_unscale_and_is_awaited_before_the_read(tmp_path, monkeypatch):
    # A 1-rank gloo group in this process: enough to watch when the all_reduce is issued.
    import pickle

    calls = []
    real_all_reduce = dist.all_reduce

    def spy(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append((tuple(tensor.shape), op, async_op))
        return real_all_reduce(tensor, op=op, group=group, async_op=async_op)

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=10))
    try:
        monkeypatch.setattr(dist, "all_reduce", spy)
        model = make_model()
        params = list(model.parameters())
        opts = [torch.optim.SGD(params[:2], lr=0.1), torch.optim.SGD(params[2:], lr=0.1)]
        scaler = GradScaler("cpu", process_group=dist.group.WORLD)
        scaler.scale(model(torch.randn(4, 6)).sum()).backward()
        scaler.unscale_(*opts)
        # One asynchronous MAX for both optimizers' flags, still pending.
        assert calls == [((2,), dist.ReduceOp.MAX, True)]
        assert all(scaler._records[id(o)].work is not None for o in opts)
        with SyncCounter() as counter:
            for opt in opts:
                scaler.step(opt)  # the first step waits, then reads both flags in one sync
            assert all(scaler._records[id(o)].work is None for o in opts)
            scaler.update()
        assert counter.count == 1 and len(calls) == 1
        # Default (None): a process group exists, but no DTensor parameters -> no reduction.
        plain = GradScaler("cpu")
        plain.scale(model(torch.randn(4, 6)).sum()).backward()
        plain.step(opts[0])
        assert len(calls) == 1
        # A ProcessGroup does not pickle; the copy falls back to the default rule.
        assert pickle.loads(pickle.dumps(GradScaler("cpu", process_group=dist.group.WORLD)))._process_group is None
    finally:
        dist.destroy_process_group()


def test_process_group_argument_is_validated_and_pickles():
    import pickle

    with pytest.raises(TypeError, match="process_group"):
        GradScaler("cpu", process_group="world")
    for pg in (None, False):
        scaler = GradScaler("cpu", process_group=pg)
        assert pickle.loads(pickle.dumps(scaler))._process_group is pg
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    assert resolve_process_group(None, opt) is NO_REDUCTION  # not initialized
    assert resolve_process_group(False, opt) is NO_REDUCTION


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc), children before their parents' siblings."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def test_torchrun_example_runs(tmp_path):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}", str(ROOT / "examples" / "distributed_train.py"),
        "--steps", "3", "--inf-step", "1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Output goes to files, not pipes: a leftover worker holding a pipe cannot block us.
    with open(tmp_path / "out.txt", "w") as fout, open(tmp_path / "err.txt", "w") as ferr:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fout, stderr=ferr, env=env)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            # torchrun starts each worker in its own session: kill the whole tree by pid.
            for pid in [*_descendants(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait(10)
    stdout, stderr = (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()
    assert proc.returncode == 0, f"exit code {proc.returncode} (-9: killed after 120 s)\n{stdout}\n{stderr[-3000:]}"
    lines = sorted(line for line in stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2, stdout
    # Both ranks skipped the poisoned step and hold the same scale.
    assert [line.split("scale", 1)[1] for line in lines] == [" 2048 skipped 1"] * 2, lines


# ------------------------------------------------------------------------------------------
# fp8: delayed scaling's amax is reduced across ranks
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    return all_results(run_ranks(fp8_worker, tmp_path_factory.mktemp("fp8"), deadline_s=120.0))


@pytest.mark.parametrize("setup", ["ddp", "ddp-closure", "fsdp2"])
def test_fp8_delayed_scaling_keeps_one_history_across_ranks(fp8_run, setup):
    r0, r1 = fp8_run[0][setup], fp8_run[1][setup]
    assert r0["sites"] == r1["sites"] == 2
    for key in ("input_history", "grad_history"):
        assert bits_equal(r0[key], r1[key]), key
    # The first layer's input is x itself: its history holds the max over both ranks,
    # newest first (3 steps in a history of 4).
    want = torch.maximum(r0["local_amax"], r1["local_amax"]).flip(0)
    assert torch.equal(r0["input_history"][0][:3], want)


def test_fp8_without_reduction_the_ranks_histories_differ(fp8_run):
    r0, r1 = fp8_run[0]["ddp-no-reduce"], fp8_run[1]["ddp-no-reduce"]
    assert torch.equal(r0["input_history"][0][:3], r0["local_amax"].flip(0))
    assert not torch.equal(r0["input_history"][0], r1["input_history"][0])


@pytest.fixture(scope="module")
def fp8_skip_run(tmp_path_factory):
    return all_results(run_ranks(fp8_skip_worker, tmp_path_factory.mktemp("fp8-skip"), deadline_s=120.0))


def test_fp8_ddp_where_one_rank_skips_a_site_trains_on_with_one_history(fp8_skip_run):
    r0, r1 = fp8_skip_run
    for name, entries in r0["state"]["sites"].items():
        for key, value in entries.items():
            assert bits_equal([value], [r1["state"]["sites"][name][key]]), (name, key)
    assert bits_equal(r0["weights"], r1["weights"])
    # The middle layer's input history: each step's max over the ranks that called it
    # (only rank 0 at step 1), newest first.
    want = [max(a for a in (r0["middle_amax"][s], r1["middle_amax"][s]) if a is not None) for s in range(3)]
    history = r0["state"]["sites"]["middle"]["input_history"]
    assert history[:3].tolist() == torch.stack(want).flip(0).tolist()

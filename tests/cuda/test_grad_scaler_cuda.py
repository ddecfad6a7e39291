"""dispatch_amp.GradScaler("cuda") against torch.amp.GradScaler("cuda"), on a CUDA model.

Both runs of every comparison build the same model from the same seed, feed it the same
batches under ``torch.autocast("cuda", dtype=torch.float16)`` and inject the same inf/nan
into the same gradients, so the scaler is the only thing that differs. Compared:

* the scale and growth tracker after every step, which optimizer skipped which step, and
  every parameter bit for bit, over 12 steps with growth (growth_interval=2) and backoffs;
  for SGD, Adam and AdamW each plain, foreach=True and fused=True (fused optimizers take
  ``grad_scale``/``found_inf`` inside their step), and for two optimizers over different
  parameter groups where one overflows and the other steps;
* ``state_dict()`` round trips, ours -> torch's and torch's -> ours, continued training;
* host syncs per step, counted twice: the warnings of ``torch.cuda.set_sync_debug_mode("warn")``
  and the ``sync_counter`` fixture (``.item()``/``.tolist()``), for both scalers;
* a whole training step captured in a CUDA graph (fused, capturable AdamW) and replayed,
  against the same steps run eagerly; and what cannot be captured (a host-synced step).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

from dispatch_amp import GradScaler
from dispatch_amp.kernels import scale_update as scale_update_mod
from dispatch_amp.kernels import unscale as unscale_mod

# Our kernels must run compiled on the GPU (tests/cuda/conftest.py).
pytestmark = pytest.mark.usefixtures("compiled_triton")

CUDA = torch.device("cuda")
INF, NAN = float("inf"), float("nan")
SYNC_WARNING = "called a synchronizing CUDA operation"
TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=False),
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=False),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=False),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
}


@pytest.fixture
def kernel_spy(monkeypatch, launch_counter):
    """Launch counts of our two GradScaler kernels (unscale/check and the scale update)."""
    unscale = launch_counter(unscale_mod._unscale_check_kernel)
    update = launch_counter(scale_update_mod._update_scale_kernel)
    monkeypatch.setattr(unscale_mod, "_unscale_check_kernel", unscale)
    monkeypatch.setattr(scale_update_mod, "_update_scale_kernel", update)
    return {"unscale": unscale, "update": update}


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    return model.to(CUDA)


def batches(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    return [(torch.randn(16, 32, device=CUDA, generator=gen), torch.randn(16, 8, device=CUDA, generator=gen)) for _ in range(n)]


def inject_(opts, plan) -> None:
    """plan: [(optimizer index, value)]; the value goes into that optimizer's first gradient."""
    for k, value in plan:
        opts[k].param_groups[0]["params"][0].grad.view(-1)[1] = value


def found_of(scaler, opt) -> float:
    """The optimizer's recorded inf/nan flag of this iteration (both scalers keep torch's
    ``_found_inf_per_device``); read after step(), before update() clears it."""
    return float(sum(f.item() for f in scaler._found_inf_per_device(opt).values()))


def train(scaler, model, opts, data, inject=None, *, pre_unscale=False, clip=None):
    """One record per step: scale and growth tracker after update(), each optimizer's
    flag, and every parameter."""
    inject = inject or {}
    records = []
    for step, (x, y) in enumerate(data):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        inject_(opts, inject.get(step, []))
        if pre_unscale:
            for opt in opts:
                scaler.unscale_(opt)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for opt in opts:
            scaler.step(opt)
        flags = [found_of(scaler, opt) for opt in opts]
        scaler.update()
        records.append(
            {
                "scale": scaler.get_scale(),
                "tracker": int(scaler._growth_tracker.item()),
                "flags": flags,
                "params": [p.detach().clone() for p in model.parameters()],
            }
        )
    return records


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    ints = {4: torch.int32, 2: torch.int16, 8: torch.int64}[a.element_size()]
    return torch.equal(torch.where(a.isnan(), 0, a).view(ints), torch.where(b.isnan(), 0, b).view(ints))


def assert_same_run(ours, ref) -> None:
    assert len(ours) == len(ref)
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert (a["scale"], a["tracker"], a["flags"]) == (b["scale"], b["tracker"], b["flags"]), f"step {step}"
        for k, (p, q) in enumerate(zip(a["params"], b["params"])):
            assert bits_equal(p, q), f"step {step}: parameter {k} differs"


def assert_schedule_did_something(records, n_opts: int = 1) -> None:
    """The comparison is only worth something if the scale grew, backed off and steps were skipped."""
    scales = [r["scale"] for r in records]
    assert any(b > a for a, b in zip(scales, scales[1:])), f"no growth in {scales}"
    assert any(b < a for a, b in zip(scales, scales[1:])), f"no backoff in {scales}"
    for k in range(n_opts):
        assert any(r["flags"][k] for r in records) and not all(r["flags"][k] for r in records)


# --------------------------------------------------------------------------------------
# Trajectories
# --------------------------------------------------------------------------------------

# Step -> [(optimizer, value)]: overflows of every kind, two in a row, and clean stretches
# long enough (growth_interval=2) for the scale to grow in between.
SCHEDULE = {2: [(0, INF)], 5: [(0, NAN)], 6: [(0, -INF)], 10: [(0, INF)]}
STEPS = 12


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_trajectory_and_parameters_match_torch(kernel_spy, kind):
    data = batches(1, STEPS)
    runs = {}
    for name, cls in (("torch", torch.amp.GradScaler), ("ours", GradScaler)):
        model = make_model()
        opt = OPTIMIZERS[kind](model.parameters())
        scaler = cls("cuda", init_scale=2.0**12, growth_interval=2)
        runs[name] = train(scaler, model, [opt], data, SCHEDULE)
        if name == "ours":
            assert scaler.skipped_steps == sum(1 for r in runs[name] if r["flags"][0])
    assert_schedule_did_something(runs["torch"])
    assert_same_run(runs["ours"], runs["torch"])
    # Every step of ours went through the compiled kernels (unscale, or the read-only check
    # for fused optimizers, and the update).
    assert kernel_spy["unscale"].launches == STEPS and kernel_spy["update"].launches == STEPS


@pytest.mark.parametrize("pre_unscale", [False, True], ids=["lazy", "unscale_then_clip"])
def test_two_optimizers_one_overflowing(kernel_spy, pre_unscale):
    # The first Linear under SGD, the rest under Adam; each skips on its own overflow only.
    schedule = {3: [(1, INF)], 5: [(0, NAN)], 7: [(1, -INF)], 9: [(0, INF), (1, NAN)]}
    data = batches(2, STEPS)
    runs = {}
    for name, cls in (("torch", torch.amp.GradScaler), ("ours", GradScaler)):
        model = make_model(3)
        params = list(model.parameters())
        opts = [torch.optim.SGD(params[:2], lr=0.05, momentum=0.9), torch.optim.Adam(params[2:], lr=1e-3)]
        scaler = cls("cuda", init_scale=2.0**12, growth_interval=2)
        runs[name] = train(scaler, model, opts, data, schedule, pre_unscale=pre_unscale, clip=1.0 if pre_unscale else None)
    assert [r["flags"] for r in runs["torch"]][3] == [0.0, 1.0]  # one skipped, the other stepped
    assert [r["flags"] for r in runs["torch"]][5] == [1.0, 0.0]
    assert_schedule_did_something(runs["torch"], n_opts=2)
    assert_same_run(runs["ours"], runs["torch"])
    assert kernel_spy["unscale"].launches == 2 * STEPS


# --------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("direction", ["ours_to_torch", "torch_to_ours"])
def test_state_dict_round_trip_continues_identically(direction):
    src_cls, dst_cls = (GradScaler, torch.amp.GradScaler) if direction == "ours_to_torch" else (torch.amp.GradScaler, GradScaler)
    data = batches(4, 12)
    schedule = {1: [(0, INF)], 4: [(0, NAN)], 8: [(0, INF)]}
    later = {k - 6: v for k, v in schedule.items() if k >= 6}
    model = make_model(5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    src = src_cls("cuda", init_scale=2.0**10, growth_interval=2, growth_factor=4.0, backoff_factor=0.25)
    train(src, model, [opt], data[:6], schedule)
    sd = src.state_dict()
    assert set(TORCH_KEYS) <= set(sd)
    assert isinstance(sd["scale"], float) and isinstance(sd["_growth_tracker"], int)
    model_sd, opt_sd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())

    runs = {}
    for name, cls in (("src", src_cls), ("dst", dst_cls)):
        # Default construction: everything must come from the state dict.
        scaler = cls("cuda")
        scaler.load_state_dict(copy.deepcopy(sd))
        assert {k: scaler.state_dict()[k] for k in TORCH_KEYS} == {k: sd[k] for k in TORCH_KEYS}
        m = make_model(99)
        m.load_state_dict(model_sd)
        o = torch.optim.AdamW(m.parameters(), lr=1e-3)
        # A copy per load: a non-capturable Adam keeps the loaded "step" tensors themselves
        # and counts them up in place, so a second load of the same dict would start later.
        o.load_state_dict(copy.deepcopy(opt_sd))
        runs[name] = (train(scaler, m, [o], data[6:], later), scaler)
    uninterrupted = train(src, model, [opt], data[6:], later)
    assert_same_run(runs["dst"][0], uninterrupted)
    assert_same_run(runs["src"][0], uninterrupted)
    end = {k: runs["dst"][1].state_dict()[k] for k in TORCH_KEYS}
    assert end == {k: src.state_dict()[k] for k in TORCH_KEYS}


# --------------------------------------------------------------------------------------
# Host syncs
# --------------------------------------------------------------------------------------


def count_syncs(cls, sync_counter, kind, n_opts, pre_unscale, warmup=3, steps=5, overflow_at=(1, 3)):
    """Syncs of each step's unscale_/step/update, after warm-up: (sync-debug warnings,
    host reads seen by sync_counter) per counted step. Overflows are injected into some
    counted steps: a skipped step must cost no more than a clean one."""
    model = make_model(6)
    params = list(model.parameters())
    opts = [OPTIMIZERS[kind](params)] if n_opts == 1 else [OPTIMIZERS[kind](params[:2]), OPTIMIZERS[kind](params[2:])]
    scaler = cls("cuda", init_scale=2.0**12, growth_interval=3)
    warned, read = [], []
    for step, (x, y) in enumerate(batches(7, warmup + steps)):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if step - warmup in overflow_at:
            inject_(opts, [(0, INF)])
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with sync_counter() as counter:
                    if pre_unscale:
                        if cls is GradScaler:
                            scaler.unscale_(*opts)  # ours: all at once, so one read serves every step()
                        else:
                            for opt in opts:
                                scaler.unscale_(opt)
                    for opt in opts:
                        scaler.step(opt)
                    scaler.update()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        if step >= warmup:
            warned.append(sum(SYNC_WARNING in str(w.message) for w in caught))
            read.append(counter.count)
    return warned, read


@pytest.mark.parametrize(
    "kind, n_opts, pre_unscale, expected",
    [
        ("sgd", 1, False, 1),
        ("sgd", 2, True, 1),  # unscaled together: one read of both flags serves both steps
        ("sgd", 2, False, 2),  # torch's lazy order: each step() must see its own flag
        ("adamw_fused", 1, False, 0),  # the flag goes to the optimizer on the device
        ("adamw_fused", 2, False, 0),
        ("sgd_fused", 1, False, 0),
    ],
)
def test_host_syncs_per_step(sync_counter, kind, n_opts, pre_unscale, expected):
    theirs = count_syncs(torch.amp.GradScaler, sync_counter, kind, n_opts, pre_unscale)
    ours = count_syncs(GradScaler, sync_counter, kind, n_opts, pre_unscale)
    print(f"\n{kind} x{n_opts} pre_unscale={pre_unscale}: syncs per step (debug-mode warnings, host reads): ours {ours}, torch {theirs}")
    assert ours == ([expected] * 5, [expected] * 5)
    assert sum(ours[0]) <= sum(theirs[0]) and sum(ours[1]) <= sum(theirs[1])
    # torch reads each ordinary optimizer's flag with its own .item(); fused ones not at all.
    assert theirs[1] == [0 if "fused" in kind else n_opts] * 5


# --------------------------------------------------------------------------------------
# CUDA graphs
# --------------------------------------------------------------------------------------


def _graph_step(scaler, model, opt, x, y, zero_inside: bool):
    if zero_inside:
        opt.zero_grad(set_to_none=False)
    # Autocast's weight cache must be off under capture (torch's CUDA-graph notes); it is
    # off in the eager twin too, so both run the same kernels.
    with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
        loss = F.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def _capturable_setup(cls):
    model = make_model(8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    scaler = cls("cuda", init_scale=2.0**12, growth_interval=2)
    return model, opt, scaler


def _record(scaler, model):
    return {
        "scale": scaler._scale.item(),
        "tracker": int(scaler._growth_tracker.item()),
        "flags": [],
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _graph_data():
    data = batches(9, 3 + 8)
    x_bad = data[3 + 4][0].clone()
    x_bad[0, 0] = INF  # an overflow in replay 4: the forward itself produces inf/nan
    data[3 + 4] = (x_bad, data[3 + 4][1])
    return data[:3], data[3:]


def eager_run(cls, zero_inside: bool):
    warm, steps = _graph_data()
    model, opt, scaler = _capturable_setup(cls)
    records = []
    for k, (x, y) in enumerate(warm + steps):
        if not zero_inside:
            opt.zero_grad(set_to_none=True)
        _graph_step(scaler, model, opt, x, y, zero_inside)
        if k >= len(warm):
            records.append(_record(scaler, model))
    return records, scaler


def graphed_run(cls, zero_inside: bool):
    """torch's whole-network recipe: warm up on a side stream, capture one full step with
    static inputs, then copy each batch into them and replay."""
    warm, steps = _graph_data()
    model, opt, scaler = _capturable_setup(cls)
    static_x, static_y = torch.zeros_like(warm[0][0]), torch.zeros_like(warm[0][1])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in warm:
            static_x.copy_(x)
            static_y.copy_(y)
            if not zero_inside:
                opt.zero_grad(set_to_none=True)
            _graph_step(scaler, model, opt, static_x, static_y, zero_inside)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if not zero_inside:
        opt.zero_grad(set_to_none=True)  # backward allocates .grad from the graph's pool
    with torch.cuda.graph(graph):
        _graph_step(scaler, model, opt, static_x, static_y, zero_inside)
    records = []
    for x, y in steps:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        records.append(_record(scaler, model))
    return records, scaler


@pytest.mark.parametrize("zero_inside", [False, True], ids=["grads_from_graph_pool", "persistent_grads"])
@pytest.mark.parametrize("cls", [torch.amp.GradScaler, GradScaler], ids=["torch", "ours"])
def test_cuda_graph_of_a_whole_fused_step_replays_like_eager(cls, zero_inside):
    """A full step (forward under fp16 autocast, scaled backward, scaler.step with a fused
    capturable AdamW, scaler.update) captured once and replayed 8 times, overflow included.

    It can be captured because no part of it reads the device from the host: with an
    optimizer that has ``_step_supports_amp_scaling``, both scalers hand ``found_inf`` and
    ``grad_scale`` to the optimizer on the device (it skips on the device), and update()
    is a kernel. Two ways to keep gradients: torch's recipe (``.grad`` set to None before
    capture, so backward allocates them from the graph's pool; our kernel's gradient table
    is then built and uploaded during capture), and ``zero_grad(set_to_none=False)``
    inside the graph (the warm-up's gradients persist, our table is reused from the cache).
    """
    graphed, g_scaler = graphed_run(cls, zero_inside)
    eager, e_scaler = eager_run(cls, zero_inside)
    scales = [r["scale"] for r in eager]
    assert any(b < a for a, b in zip(scales, scales[1:])) and any(b > a for a, b in zip(scales, scales[1:]))
    assert_same_run(graphed, eager)
    if cls is GradScaler:
        # The skip count lives on the device, so replays keep it right.
        assert g_scaler.skipped_steps == e_scaler.skipped_steps >= 1


def test_cuda_graphs_ours_and_torchs_replay_identically():
    ours, _ = graphed_run(GradScaler, zero_inside=True)
    theirs, _ = graphed_run(torch.amp.GradScaler, zero_inside=True)
    assert_same_run(ours, theirs)


_CAPTURE_PROBE = textwrap.dedent(
    """
    import sys, traceback
    import torch
    import torch.nn.functional as F
    from dispatch_amp import GradScaler

    cls = GradScaler if sys.argv[1] == "ours" else torch.amp.GradScaler
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = cls("cuda", init_scale=1024.0)
    x = torch.randn(4, 8, device="cuda")

    def step():
        opt.zero_grad(set_to_none=False)  # persistent gradients: nothing new to upload
        scaler.scale(model(x).square().mean()).backward()
        scaler.step(opt)
        scaler.update()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except Exception as exc:
        first = exc
        while first.__context__ is not None:
            first = first.__context__
        print("RAISED", type(exc).__name__, "|", str(exc).strip().splitlines()[0])
        print("FIRST", type(first).__name__, "|", str(first).strip().splitlines()[0])
        print("FRAMES", " ".join(f.name for f in traceback.extract_tb(first.__traceback__)))
    else:
        print("CAPTURED")
    """
)


@pytest.mark.parametrize(
    "which, reader, error",
    [
        # .item() -> cudaMemcpyAsync into pageable memory, refused by the CUDA runtime.
        ("torch", "_maybe_opt_step", "operation not permitted when stream is capturing"),
        # .tolist() -> a copy to a CPU tensor, refused by torch's own check before CUDA sees it.
        ("ours", "_read_one", "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned"),
    ],
    ids=["torch", "ours"],
)
def test_a_host_synced_step_cannot_be_captured(which, reader, error):
    """With an ordinary optimizer (plain SGD) scaler.step() must know on the host whether
    to call optimizer.step(): torch reads each flag with .item() in _maybe_opt_step, ours
    reads them once in flag_read (_read_one for one optimizer on one device, with .tolist()
    because the kernel's per-gradient flags ride along). A device->host read cannot be
    captured, so the capture fails right there, in both, each with its own error.

    Run in a child process: a failed capture leaves the CUDA context in a state that the
    rest of this test session should not inherit.
    """
    out = subprocess.run(
        [sys.executable, "-c", _CAPTURE_PROBE, which], capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {line.partition(" ")[0]: line.partition(" ")[2] for line in out.stdout.splitlines()}
    assert "CAPTURED" not in lines and "RAISED" in lines, out.stdout
    assert error in lines["FIRST"], out.stdout
    assert reader in lines["FRAMES"].split(), out.stdout

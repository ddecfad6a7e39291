"""fp8 weight all-gather under FSDP2 (``fp8/all_gather/``): 2 gloo ranks on CPU, one spawn.

The reference is the same model, sharded the same way, whose weights FSDP2 all-gathers in
high precision (bf16, its ``param_dtype``) and our fp8 path then casts. For every recipe the
fp8 run must give the same bits: the gathered fp8 weights and their scales, and over a few
training steps the losses, gradient shards, parameters and the recipe's state. The bytes
each all-gather sends are counted by a custom all-gather (``set_custom_all_gather``).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dispatch_amp as amp
from dispatch_amp import fp8
from dispatch_amp.fp8._gathered import Gathered, GatheredFp8Weight
from dispatch_amp.fp8._rules import amax, cast, scale_from_amax
from dispatch_amp.fp8.all_gather import ShardedFp8Weight
from dispatch_amp.kernels import quantize_blocks_reference

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"),
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module"),
]

WORLD = 2
STEPS = 3
RECIPES = {
    "current": lambda: fp8.CurrentScaling(),
    "delayed": lambda: fp8.DelayedScaling(amax_history_len=4),
    "rowwise": lambda: fp8.RowwiseScaling(),
    "block": lambda: fp8.BlockScaling(),
}
# (in, out) of the model's linears: rows (out) split over the ranks, all multiples of 16;
# block scaling's at least 128 features, and whole 128 x 128 blocks on each rank.
SHAPES = [(32, 64), (64, 32)]
BLOCK_SHAPES = [(128, 256), (256, 256)]


def shapes_of(name: str):
    return BLOCK_SHAPES if name == "block" else SHAPES


# ------------------------------------------------------------------------------------------
# Two ranks, one spawn
# ------------------------------------------------------------------------------------------


def _entry(fn, rank: int, port: int, out_dir: str) -> None:
    out = Path(out_dir) / f"rank{rank}.pt"
    if "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        report = {"ok": True, "result": fn(rank)}
    except BaseException as e:
        report = {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        traceback.clear_frames(e.__traceback__)
    torch.save(report, out)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(fn, out_dir: Path, deadline_s: float = 240.0) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    top = str(Path(__file__).resolve().parents[__name__.count(".")])  # children import this module by name
    sys.path.insert(0, top)
    try:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_entry, args=(fn, r, port, str(out_dir)), daemon=True) for r in range(WORLD)]
        for p in procs:
            p.start()
    finally:
        sys.path.remove(top)
    start = time.monotonic()
    for p in procs:
        p.join(max(0.0, deadline_s - (time.monotonic() - start)))
    killed = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    assert not killed, f"rank(s) {killed} still running after {deadline_s} s"
    reports = [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    errors = [r["error"] for r in reports if not r["ok"]]
    assert not errors, "\n".join(errors)
    return [r["result"] for r in reports]


# ------------------------------------------------------------------------------------------
# The worker
# ------------------------------------------------------------------------------------------


def _counting_all_gather(log: list):
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class Counting(DefaultAllGather):
        """FSDP2's own all-gather, logging the bytes this rank sends."""

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            log.append(input_tensor.numel() * input_tensor.element_size())
            return super().__call__(output_tensor, input_tensor, group, async_op)

    return Counting()


def _model(recipe, in_fp8: bool, param_dtype=torch.bfloat16, reshard_after_forward=None, shapes=SHAPES):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    (i0, o0), (i1, o1) = shapes
    model = torch.nn.Sequential(torch.nn.Linear(i0, o0), torch.nn.GELU(), torch.nn.Linear(i1, o1))
    recipe.bind(model)
    handle = fp8.all_gather_in_fp8(model, recipe) if in_fp8 else None
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    log: list = []
    for m in (model[0], model[2]):
        fully_shard(m, mp_policy=policy, reshard_after_forward=True if reshard_after_forward is None else False)
        m.set_custom_all_gather(_counting_all_gather(log))
    fully_shard(model, mp_policy=policy)
    return model, handle, log


def _reference_cast(recipe, weight: torch.Tensor, shown: float):
    """"All-gather in high precision, then our cast": the full weight's fp8 bits and scale."""
    fmt = recipe.forward_format
    if isinstance(recipe, fp8.BlockScaling):
        q, _, inv = quantize_blocks_reference(weight, fmt, power_of_two=recipe.power_of_two)
        return q, inv
    if recipe.rowwise:
        scale = scale_from_amax(amax(weight, rowwise=True), fmt, power_of_two=recipe.power_of_two)
        return cast(weight, scale, fmt)[0], scale.reciprocal()
    scale = torch.tensor(shown, dtype=torch.float32)
    return cast(weight, scale, fmt)[0], torch.stack([scale, scale.reciprocal()])


def _snapshot(weight):
    """What a forward's weight is: the gathered fp8 weight and its scales (fp8 all-gather),
    else the full high-precision weight."""
    box = getattr(weight, "_gathered", None)
    if box is not None:
        return box, (box.data.clone(), box.sc.clone(), box.mode)
    return None, weight.detach().clone()


def _train(model, recipe, rank, steps, seen=None):
    """``steps`` steps of SGD; per step the loss, the gradient shards and the recipe's report;
    ``seen`` (a dict) gets each forward's weights (``_snapshot``), read in pre-forward hooks
    (FSDP2's own, which all-gathers, runs first)."""
    from torch.distributed.tensor import DTensor

    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    hooks = []
    if seen is not None:
        for index in (0, 2):
            def pre(module, args, index=index):
                seen.setdefault(index, []).append(_snapshot(module.weight))
            hooks.append(model[index].register_forward_pre_hook(pre))
    log = {"loss": [], "grads": [], "report": [], "sharded_after_forward": [], "sharded_after_backward": []}
    for step in range(steps):
        x = torch.randn(16, model[0].in_features, generator=torch.Generator().manual_seed(10 * step + rank)) * (1 + rank)
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
            loss = model(x).float().pow(2).mean()
        log["sharded_after_forward"].append([isinstance(model[i].weight, DTensor) for i in (0, 2)])
        loss.backward()
        log["sharded_after_backward"].append([isinstance(model[i].weight, DTensor) for i in (0, 2)])
        log["loss"].append(loss.detach())
        log["grads"].append([p.grad.to_local().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        log["report"].append(recipe.report())
    for h in hooks:
        h.remove()
    log["params"] = [p.full_tensor() for p in model.parameters()]
    return log


def worker(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    out = {}
    for name, make in RECIPES.items():
        runs = {}
        for in_fp8 in (False, True):
            recipe = make()
            model, handle, log = _model(recipe, in_fp8, shapes=shapes_of(name))
            seen: dict = {}
            run = _train(model, recipe, rank, STEPS, seen)
            run["bytes"] = list(log)
            run["state"] = recipe.state_dict()
            run["seen"] = {i: [snap for _, snap in snaps] for i, snaps in seen.items()}
            if in_fp8:
                boxes = [box for snaps in seen.values() for box, _ in snaps]
                run["freed"] = [box.data.untyped_storage().size() == 0 for box in boxes]
                run["types"] = sorted({type(model[i].weight).__name__ for i in (0, 2)})
                state_dict = model.state_dict()
                run["state_dict"] = {k: (type(v.to_local()).__name__, v.full_tensor()) for k, v in state_dict.items()}
                run["local_types_before"] = [type(p.to_local()).__name__ for p in model.parameters()]
                handle.remove()
                run["local_types_after"] = [type(p.to_local()).__name__ for p in model.parameters()]
            # One more step, now in high precision on both (the fp8 all-gather removed).
            log.clear()
            run["after_remove"] = _train(model, recipe, rank + 100, 1)
            run["after_remove"]["bytes"] = list(log)
            runs[in_fp8] = run
        out[name] = runs
    # Kept unsharded from the forward to the backward (no backward all-gather): the
    # tensorwise recipes' backward takes the forward's fp8 layouts; float32 all-gathers.
    for name in ("current", "delayed"):
        runs = {}
        for in_fp8 in (False, True):
            recipe = RECIPES[name]()
            model, _, log = _model(recipe, in_fp8, torch.float32, reshard_after_forward=False)
            runs[in_fp8] = {**_train(model, recipe, rank, 2), "bytes": list(log)}
        out[("kept", name)] = runs
    # Refusals: a sharded model, and a gathered weight used outside its fp8 gemm.
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    fully_shard(model)
    try:
        fp8.all_gather_in_fp8(model, fp8.CurrentScaling())
        out["sharded_refused"] = None
    except RuntimeError as e:
        out["sharded_refused"] = str(e)
    # RowwiseScaling's backward needs FSDP2 to gather again: the root module keeps its
    # forward's weight by default (refused), not when told to reshard.
    for reshard in (None, True):
        recipe = fp8.RowwiseScaling()
        # Two layers: the second's input gradient needs its weight scaled per column.
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
        fp8.all_gather_in_fp8(model, recipe)
        fully_shard(model, **({} if reshard is None else {"reshard_after_forward": reshard}))
        try:
            with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
                loss = model(torch.randn(16, 32)).float().pow(2).mean()
            loss.backward()
            out[("rowwise_root", reshard)] = None
        except RuntimeError as e:
            out[("rowwise_root", reshard)] = str(e)
    # Block scaling where a rank would hold half of a 128 x 128 block (128 rows on 2 ranks).
    recipe = fp8.BlockScaling()
    model = torch.nn.Sequential(torch.nn.Linear(128, 128))
    fp8.all_gather_in_fp8(model, recipe)
    fully_shard(model)
    try:
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
            model(torch.randn(16, 128))
        out["block_straddles"] = None
    except ValueError as e:
        out["block_straddles"] = str(e)
    recipe = fp8.CurrentScaling()
    model, _, _ = _model(recipe, True)
    try:
        with amp.autocast("cpu", dtype=torch.bfloat16):  # no fp8: the weight is needed in bf16
            model(torch.randn(16, 32))
        out["outside_refused"] = None
    except RuntimeError as e:
        out["outside_refused"] = str(e)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(worker, tmp_path_factory.mktemp("fp8-all-gather"))


def bits_equal(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------
# Bit-identity with "all-gather in high precision, then cast"
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(RECIPES))
def test_gathered_fp8_weights_are_the_cast_of_the_full_weight(ranks, name):
    recipe = RECIPES[name]()
    for rank in range(WORLD):
        ours, ref = ranks[rank][name][True], ranks[rank][name][False]
        for index in (0, 2):
            assert len(ours["seen"][index]) == len(ref["seen"][index]) == STEPS
            # The scale each step's cast used, as the reference's recipe reports it.
            shown = [[r for r in report if r.name == str(index)][0].scale["weight"] for report in ref["report"]]
            for (data, sc, mode), weight, shown in zip(ours["seen"][index], ref["seen"][index], shown):
                want_data, want_sc = _reference_cast(recipe, weight, shown)
                assert mode == {"rowwise": "rows", "block": "blocks"}.get(name, "tensor")
                assert data.dtype == recipe.forward_format and data.shape == weight.shape
                assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8)), (name, index)
                assert torch.equal(sc.reshape(-1), want_sc.reshape(-1)), (name, index)


@pytest.mark.parametrize("name", list(RECIPES))
def test_training_is_bit_identical(ranks, name):
    for rank in range(WORLD):
        ref, ours = ranks[rank][name][False], ranks[rank][name][True]
        assert bits_equal(ours["loss"], ref["loss"])
        for g_ours, g_ref in zip(ours["grads"], ref["grads"]):
            assert bits_equal(g_ours, g_ref)
        assert bits_equal(ours["params"], ref["params"])
        assert ours["report"] == ref["report"]  # amax, scale, saturated per site and role, every step
        assert ours["report"][-1][0].calls == STEPS
    # The ranks agree with each other too (every rank sees the same gathered weights).
    assert bits_equal(ranks[0][name][True]["params"], ranks[1][name][True]["params"])


def test_delayed_scaling_state_is_bit_identical(ranks):
    for rank in range(WORLD):
        ref, ours = ranks[rank]["delayed"][False]["state"], ranks[rank]["delayed"][True]["state"]
        assert ref.keys() == ours.keys() and ref["sites"].keys() == ours["sites"].keys() == {"0", "2"}
        for site, entries in ref["sites"].items():
            for key, value in entries.items():
                assert bits_equal([ours["sites"][site][key]], [value]), (site, key)


# ------------------------------------------------------------------------------------------
# Bytes moved
# ------------------------------------------------------------------------------------------


def _expected_bytes(name: str, fp8_weights: bool) -> int:
    """Bytes one rank sends in the FSDP2 all-gathers of one step's forward: per linear its
    weight shard (bf16, or fp8 plus what is sent along: 8 bytes of statistics; rowwise 4
    bytes per row and 4 more; block 4 bytes per 128 x 128 block) and its bias shard (bf16)."""
    total = 0
    for i, o in shapes_of(name):
        rows = o // WORLD
        if not fp8_weights:
            weight = rows * i * 2
        elif name == "rowwise":
            weight = rows * i + 8 + rows * 4 + 4
        elif name == "block":
            weight = rows * i + 8 + (rows // 128) * (-(-i // 128)) * 4
        else:
            weight = rows * i + 8
        total += weight + rows * 2
    return total


@pytest.mark.parametrize("name", list(RECIPES))
def test_bytes_moved_per_all_gather(ranks, name):
    ref, ours = ranks[0][name][False]["bytes"], ranks[0][name][True]["bytes"]
    # Per step: one all-gather per linear for the forward and one for the backward.
    assert len(ref) == len(ours) == 2 * len(shapes_of(name)) * STEPS
    assert sum(ref) == STEPS * 2 * _expected_bytes(name, False)
    assert sum(ours) == STEPS * 2 * _expected_bytes(name, True)
    ratio = sum(ours) / sum(ref)
    print(f"\n{name}: {sum(ref) // len(ref)} -> {sum(ours) // len(ours)} bytes per all-gather and rank "
          f"({ratio:.3f} of bf16's)")
    assert ratio < (0.6 if name == "rowwise" else 0.53)


@pytest.mark.parametrize("name", ["current", "delayed"])
def test_kept_unsharded_through_the_backward_and_float32_gathers(ranks, name):
    for rank in range(WORLD):
        ref, ours = ranks[rank][("kept", name)][False], ranks[rank][("kept", name)][True]
        assert bits_equal(ours["loss"], ref["loss"]) and bits_equal(ours["params"], ref["params"])
        assert ours["report"] == ref["report"]
        # Forward all-gathers only (FSDP2 keeps the weights for the backward): float32's
        # 4 bytes per weight element against fp8's 1 (plus 8 bytes of statistics).
        assert len(ours["bytes"]) == len(ref["bytes"]) == 2 * len(SHAPES)
        per_step = sum(o // WORLD * i for i, o in SHAPES)
        biases = sum(o // WORLD * 4 for _, o in SHAPES)
        assert sum(ref["bytes"]) == 2 * (4 * per_step + biases)
        assert sum(ours["bytes"]) == 2 * (per_step + 8 * len(SHAPES) + biases)


# ------------------------------------------------------------------------------------------
# FSDP2's life cycle, state_dict, turning it off
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(RECIPES))
def test_resharded_after_forward_and_backward(ranks, name):
    ours = ranks[0][name][True]
    assert ours["sharded_after_forward"] == ours["sharded_after_backward"] == [[True, True]] * STEPS
    assert ours["types"] == ["DTensor"]
    assert ours["freed"] and all(ours["freed"])  # the gathered fp8 weights' memory is freed


@pytest.mark.parametrize("name", list(RECIPES))
def test_state_dict_gives_high_precision_weights(ranks, name):
    ours, ref = ranks[0][name][True], ranks[0][name][False]
    assert set(ours["local_types_before"]) == {"ShardedFp8Weight", "Tensor"}
    params = ours["params"]
    for (key, (local_type, full)), param in zip(ours["state_dict"].items(), params):
        assert local_type == "Tensor", key
        assert full.dtype == torch.float32 and torch.equal(full, param), key
    assert bits_equal([v for _, v in ours["state_dict"].values()], ref["params"])


@pytest.mark.parametrize("name", list(RECIPES))
def test_remove_restores_plain_parameters_and_high_precision_gathers(ranks, name):
    ours, ref = ranks[0][name][True], ranks[0][name][False]
    assert ours["local_types_after"] == ["Tensor"] * 4
    after, ref_after = ours["after_remove"], ref["after_remove"]
    assert after["bytes"] == ref_after["bytes"]  # FSDP2's own all-gather again
    assert bits_equal(after["loss"], ref_after["loss"]) and bits_equal(after["params"], ref_after["params"])


def test_refusals(ranks):
    assert "before fully_shard" in ranks[0]["sharded_refused"]
    message = ranks[0]["outside_refused"]
    assert message is not None and "all-gathered in fp8" in message and "'0'" in message
    assert "reshard_after_forward=True" in ranks[0][("rowwise_root", None)]
    assert "multiple of 128 rows" in ranks[0]["block_straddles"]
    assert ranks[0][("rowwise_root", True)] is None


def test_one_rank_gathers_nothing_and_matches_the_plain_weight(tmp_path):
    # On one rank FSDP2 copies the first all-gather input across and nothing travels: the
    # statistics come from the metadata. Same bits as FSDP2's own (plain) weight.
    from torch.distributed.fsdp import fully_shard

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        results = []
        for in_fp8 in (False, True):
            torch.manual_seed(0)
            model, recipe = torch.nn.Sequential(torch.nn.Linear(32, 32)), fp8.DelayedScaling()
            recipe.bind(model)
            if in_fp8:
                fp8.all_gather_in_fp8(model, recipe)
            fully_shard(model)
            with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
                loss = model(torch.randn(16, 32, generator=torch.Generator().manual_seed(1))).float().pow(2).mean()
            loss.backward()
            results.append((loss.detach(), model[0].weight.grad.full_tensor(), recipe.report()))
        assert bits_equal(results[0][:2], results[1][:2]) and results[0][2] == results[1][2]
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------
# One process: the wrapper is its high-precision tensor everywhere else
# ------------------------------------------------------------------------------------------


def _toy():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8),
                               torch.nn.Linear(8, 16))


def test_which_weights_are_wrapped():
    model = _toy()
    handle = fp8.all_gather_in_fp8(model, fp8.CurrentScaling())
    # 48 x 32 yes; 8 x 48 and 16 x 8 have a dimension that is not a multiple of 16; biases no.
    assert handle.names == ["0"]
    assert [type(p).__name__ for p in model.parameters()] == ["ShardedFp8Weight"] + ["Parameter"] * 5
    tied = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    tied[1].weight = tied[0].weight
    assert fp8.all_gather_in_fp8(tied, fp8.CurrentScaling()).names == []  # read by two modules
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    assert fp8.all_gather_in_fp8(model, fp8.CurrentScaling(), filter_fn=lambda n: n != "1").names == ["0"]
    assert type(model[1].weight) is torch.nn.Parameter
    with pytest.raises(RuntimeError, match="already"):
        fp8.all_gather_in_fp8(model, fp8.CurrentScaling())


def test_wrapped_weights_train_as_the_plain_ones():
    # Without FSDP2 (or between its all-gathers) a wrapped weight is its tensor: the same
    # fp8 gemms, optimizer, state and state_dict as the plain model's.
    plain, wrapped = _toy(), _toy()
    recipes = fp8.CurrentScaling(), fp8.CurrentScaling()
    handle = fp8.all_gather_in_fp8(wrapped, recipes[1])
    for model, recipe in zip((plain, wrapped), recipes):
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
        for step in range(2):
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
            with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
                model(x).float().pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        model.opt_state = {type(v).__name__ for s in opt.state.values() for v in s.values()}
    assert recipes[0].report() == recipes[1].report() and recipes[1].report()[0].calls == 2  # fp8 ran
    assert bits_equal([p.detach() for p in plain.parameters()], [p.detach() for p in wrapped.parameters()])
    assert wrapped.opt_state == {"Tensor"}  # the optimizer's state is plain
    state = wrapped.state_dict()
    assert type(state["0.weight"]) is torch.Tensor and torch.equal(state["0.weight"], plain.state_dict()["0.weight"])
    before = wrapped[0].weight.detach().clone()
    handle.remove()
    assert type(wrapped[0].weight) is torch.nn.Parameter and torch.equal(wrapped[0].weight, before)
    handle.remove()  # twice: nothing more


def test_wrapped_model_converts_and_meta_is_refused():
    model = _toy()
    fp8.all_gather_in_fp8(model, fp8.CurrentScaling())
    model.to(torch.bfloat16)  # Module._apply swaps the wrapper in place
    weight = model[0].weight
    assert type(weight) is ShardedFp8Weight and weight.dtype == weight._data.dtype == torch.bfloat16
    with torch.device("meta"):
        meta = _toy()
    with pytest.raises(RuntimeError, match="meta device"):
        fp8.all_gather_in_fp8(meta, fp8.CurrentScaling())


def test_gathered_weight_refuses_other_ops():
    plan = type("Plan", (), {"name": "blocks.0.fc"})()
    box = Gathered(plan, data=torch.zeros(16, 16, dtype=torch.float8_e4m3fn), mode="tensor")
    w = GatheredFp8Weight(box, torch.Size([16, 16]), (16, 1), torch.bfloat16, torch.device("cpu"))
    assert w.detach()._gathered is box and torch.zeros_like(w).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match=r"blocks\.0\.fc.*all-gathered in fp8"):
        w + 1
    with pytest.raises(RuntimeError, match="all-gathered in fp8"):
        w.view(-1)  # only the whole weight as it is: the gemm reads the fp8 data by its shape
    with pytest.raises(RuntimeError, match="all-gathered in fp8"):
        torch.nn.functional.linear(torch.randn(4, 16, dtype=torch.bfloat16), w)

"""``PrecisionPlan``: precision by module path, against the same regions written by hand.

The reference for every plan is the same GPT-style model (``benchmarks/models.py``) whose
forward opens the regions by hand: ``torch.autocast`` regions for dtypes and float32,
``dispatch_amp.autocast`` regions where fp8 is involved. Trained a few steps from one
seed, the two give the same losses and parameters bit for bit, eagerly and compiled.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import fnmatch
import inspect
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import dispatch_amp as amp
from dispatch_amp.autocast.plan import PrecisionPlan, _Pattern

from benchmarks import models as M

BF16 = torch.bfloat16
CFG = M.GPTConfig(vocab=64, d_model=32, n_heads=2, n_blocks=4, max_len=16)
ENDS = (0, CFG.n_blocks - 1)


class HandGPT(M.GPT):
    """The GPT with its first and last blocks and its head in float32 and the middle
    blocks in ``middle()``, written by hand as nested regions."""

    def __init__(self, cfg, middle, fp32=lambda: torch.autocast("cpu", enabled=False)):
        super().__init__(cfg)
        self.middle, self.fp32 = middle, fp32

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        for i, block in enumerate(self.blocks):
            if i in ENDS:
                with self.fp32():
                    x = block(x.float(), mask)
            else:
                with self.middle():
                    x = block(x, mask)
        h = self.ln_f(x)
        with self.fp32():
            return self.head(h.float())


def models(hand_middle, seed=0):
    torch.manual_seed(seed)
    planned = M.GPT(CFG)
    hand = HandGPT(CFG, hand_middle)
    hand.load_state_dict(planned.state_dict())
    return planned, hand


def batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [M.gpt_batch(CFG, 2, 8, generator=g) for _ in range(n)]


def train(model, region, steps):
    """Losses and final parameters after SGD steps; the forward and loss in ``region()``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in steps:
        with region():
            loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, [p.detach().clone() for p in model.parameters()]


def assert_same(a, b):
    (la, pa), (lb, pb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(la, lb)), (la, lb)
    assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(pa, pb))


# -- the done-when ------------------------------------------------------------------------------
def test_first_last_blocks_and_head_in_float32_train_like_nested_native_regions():
    planned, hand = models(lambda: torch.autocast("cpu", dtype=BF16))
    plan = PrecisionPlan.keep_ends(planned, head="head", rest=torch.bfloat16).bind(planned)
    got = train(planned, lambda: amp.autocast("cpu"), batches())
    want = train(hand, lambda: torch.autocast("cpu"), batches())
    assert_same(got, want)
    # Not the model run without a plan: the plan changed the numbers.
    plan.unbind()
    planned2, _ = models(None)
    plain = train(planned2, lambda: amp.autocast("cpu"), batches())
    assert not torch.equal(plain[0][0], want[0][0])


def test_fp8_in_the_middle_trains_like_nested_regions_written_by_hand():
    recipe_hand = amp.fp8.CurrentScaling()
    planned, hand = models(lambda: amp.autocast("cpu", dtype=BF16, fp8=recipe_hand))
    hand.fp32 = lambda: amp.autocast("cpu", enabled=False)
    PrecisionPlan.keep_ends(planned, head="head", rest=amp.fp8.CurrentScaling(), dtype=torch.bfloat16).bind(planned)
    with amp.PrecisionCensus() as census:
        got = train(planned, lambda: amp.autocast("cpu"), batches())
    want = train(hand, lambda: amp.autocast("cpu"), batches())
    assert_same(got, want)
    assert census.fp8_flops_fraction() > 0


def _explain_breaks(fn, *args):
    return torch._dynamo.explain(fn)(*args).graph_break_count


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_compiled_plan_has_no_graph_break_and_the_same_numbers(fp8):
    torch._dynamo.reset()
    if fp8:
        # The recipe on the region around the compiled call; the plan keeps the ends and
        # the head out of it (float32 regions trace as torch.autocast's own).
        recipe = amp.fp8.CurrentScaling()
        outer = lambda: amp.autocast("cpu", dtype=BF16, fp8=recipe)  # noqa: E731
        planned, hand = models(contextlib.nullcontext)
        plan = PrecisionPlan.keep_ends(planned, head="head")
        hand_outer = outer
    else:
        planned, hand = models(lambda: torch.autocast("cpu", dtype=BF16))
        plan = PrecisionPlan.keep_ends(planned, head="head", rest=torch.bfloat16)
        outer, hand_outer = (lambda: amp.autocast("cpu")), (lambda: torch.autocast("cpu"))
    plan.bind(planned)
    x, y = batches(1)[0]
    with outer():
        assert _explain_breaks(planned.loss, x, y) == 0
    compiled = torch.compile(planned, backend="aot_eager", fullgraph=True)
    compiled.loss = lambda x, y: F.cross_entropy(compiled(x).reshape(-1, CFG.vocab), y.reshape(-1))
    hand_compiled = torch.compile(hand, backend="aot_eager", fullgraph=True)
    hand_compiled.loss = lambda x, y: F.cross_entropy(hand_compiled(x).reshape(-1, CFG.vocab), y.reshape(-1))
    assert_same(train(compiled, outer, batches(2)), train(hand_compiled, hand_outer, batches(2)))


def test_float32_setting_is_torch_autocast_disabled_with_float32_inputs():
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)
    with torch.autocast("cpu"):
        h = torch.mm(x, x.t()) @ x  # bf16
        with torch.autocast("cpu", enabled=False):
            want = lin(h.float())
    seq = torch.nn.Sequential(lin)
    PrecisionPlan({"0": torch.float32}).bind(seq)
    with amp.autocast("cpu"):
        got = seq(torch.mm(x, x.t()) @ x)
    assert got.dtype is torch.float32 and torch.equal(got, want)
    # Outside any region the module runs as it is (as custom_fwd(cast_inputs=...) does).
    assert torch.equal(seq(x), lin(x))


def test_a_dtype_setting_opens_its_region_without_an_enclosing_one():
    seq = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    PrecisionPlan({"1": "bf16"}).bind(seq)
    x = torch.randn(2, 8)
    out = seq(x)
    assert out.dtype is BF16 and seq[0](x).dtype is torch.float32


def test_no_fp8_keeps_the_enclosing_dtype_without_fp8():
    torch.manual_seed(0)
    seq = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    hand = copy.deepcopy(seq)
    x = torch.randn(16, 32)
    recipe = amp.fp8.CurrentScaling()
    PrecisionPlan({"1": "no_fp8"}).bind(seq)
    with amp.autocast("cpu", fp8=recipe):
        with amp.PrecisionCensus() as census:
            got = seq[1](x)
        h = hand[0](x)  # fp8
        with amp.autocast("cpu", dtype=BF16):
            want = hand[1](h)
        got = seq(x)
    assert census.fp8_flops_fraction() == 0 and census.flops_by_dtype().keys() == {BF16}
    assert torch.equal(got, want)
    # Outside any region: nothing.
    assert seq(x).dtype is torch.float32


def test_policy_setting_and_mapping_setting():
    seq = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    fp32_mm = amp.Policy.for_device("cpu").with_ops(fp32=["linear", "addmm", "mm"])
    PrecisionPlan({"0": fp32_mm, "1": {"dtype": "float16"}}).bind(seq)
    x = torch.randn(2, 8)
    with amp.PrecisionCensus() as census, warnings.catch_warnings():
        warnings.simplefilter("error")
        with amp.autocast("cpu"):
            out = seq(x)
    assert out.dtype is torch.float16
    assert set(census.flops_by_dtype()) == {torch.float32, torch.float16}


# -- with the rest ------------------------------------------------------------------------------
class CheckpointedGPT(M.GPT):
    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        for block in self.blocks:
            x = amp.checkpoint(block, x, mask, use_reentrant=False)
        return self.head(self.ln_f(x))


@pytest.mark.parametrize("rest", [torch.bfloat16, "fp8"])
def test_plan_with_amp_checkpoint_recomputes_the_same(rest):
    torch.manual_seed(0)
    plain = M.GPT(CFG)
    ckpt = CheckpointedGPT(CFG)
    ckpt.load_state_dict(plain.state_dict())
    for model in (plain, ckpt):
        r = amp.fp8.CurrentScaling() if rest == "fp8" else rest
        PrecisionPlan.keep_ends(model, head="head", rest=r, dtype=torch.bfloat16).bind(model)
    assert_same(train(ckpt, lambda: amp.autocast("cpu"), batches(2)),
                train(plain, lambda: amp.autocast("cpu"), batches(2)))


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_plan_bound_before_ddp_or_fsdp2_trains_as_without(tmp_path, wrap):
    # A one-process gloo group: the wrappers' hooks and collectives run as on many ranks.
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    planned, _ = models(None)
    single = M.GPT(CFG)
    single.load_state_dict(planned.state_dict())
    for model in (planned, single):
        PrecisionPlan.keep_ends(model, head="head", rest=torch.bfloat16).bind(model)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        if wrap == "ddp":
            wrapped = DDP(planned)
            wrapped.loss = lambda x, y: F.cross_entropy(wrapped(x).reshape(-1, CFG.vocab), y.reshape(-1))
        else:
            for block in planned.blocks:
                fully_shard(block)
            wrapped = fully_shard(planned)
        losses, params = train(wrapped, lambda: amp.autocast("cpu"), batches(2))
        params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]
    finally:
        dist.destroy_process_group()
    assert_same((losses, params), train(single, lambda: amp.autocast("cpu"), batches(2)))


def test_unbind_restores_the_model_exactly():
    torch.manual_seed(0)
    model = M.GPT(CFG)
    own = torch.nn.Linear(2, 2)
    model.ln_f.forward = own.forward  # an instance forward set by someone else stays
    before = {n: dict(m.__dict__) for n, m in model.named_modules()}
    plan = PrecisionPlan({"ln_f": "float32", "blocks.*": "fp16"}, default="bf16").bind(model)
    assert plan.model is model
    assert "forward" in model.__dict__ and "forward" in model.blocks[0].__dict__
    plan.unbind()
    after = {n: dict(m.__dict__) for n, m in model.named_modules()}
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].keys() == after[name].keys(), name
        assert all(before[name][k] is after[name][k] for k in before[name]), name
    assert plan.model is None
    plan.bind(model)  # binds again once unbound
    plan.unbind()


def test_copies_and_signatures_of_a_bound_model():
    torch.manual_seed(0)
    model = M.GPT(CFG)
    PrecisionPlan.keep_ends(model, head="head", rest="bf16", default="bf16").bind(model)
    assert list(inspect.signature(model.forward).parameters) == ["idx"]
    x, y = batches(1)[0]
    want = model(x)
    copied = copy.deepcopy(model)
    assert copied.blocks[0].forward.__wrapped__.__self__ is copied.blocks[0]
    assert torch.equal(copied(x), want)
    loaded = pickle.loads(pickle.dumps(model))
    assert torch.equal(loaded(x), want) and loaded(x).dtype is torch.float32


# -- patterns and the report ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "patterns, name, winner",
    [
        (["blocks.*", "blocks.0"], "blocks.0.fc", "blocks.0"),           # deeper literal
        (["blocks.*", "*.ln*"], "blocks.1.ln1", "*.ln*"),               # the norm, not the block
        (["blocks.*", "blocks.1.*"], "blocks.1.fc", "blocks.1.*"),
        (["*head", "head"], "head", "head"),                            # fewer wildcards
        (["blocks.?", "blocks.*"], "blocks.2", "blocks.?"),             # ? pins a character
        (["*", "blocks.3"], "blocks.3.attn", "blocks.3"),
    ],
)
def test_the_most_specific_pattern_wins(patterns, name, winner):
    model = M.GPT(CFG)
    settings = ["float32", "bf16"]
    plan = PrecisionPlan({p: settings[i % 2] for i, p in enumerate(patterns)})
    entry = plan.resolve(model)[name]
    assert entry.pattern == winner
    assert set(entry.overridden) == set(patterns) - {winner}
    assert winner in plan.explain(model, all_modules=True)


def test_explain_lists_regions_and_what_lost():
    model = M.GPT(CFG)
    plan = PrecisionPlan({"blocks.*": "bf16", "*.ln*": "float32", "head": torch.float32})
    text = plan.explain(model)
    assert "| blocks.1.ln1 | float32 (autocast off) | *.ln* | blocks.* | yes |" in text
    assert "| head | float32 (autocast off) | head |  | yes |" in text
    # A child with its parent's setting opens no region of its own.
    assert not plan.resolve(model)["blocks.1.fc"].opens_region


def test_pattern_reach():
    assert _Pattern("*.norm*").reach("a.norm.b.norm1") == len("a.norm.b.norm")
    assert _Pattern("[!a]x").reach("bx") == 2 and _Pattern("[!a]x").reach("ax") is None
    assert _Pattern("a[").reach("a[") == 2


def test_to_dict_round_trips():
    recipe = amp.fp8.CurrentScaling()
    plan = PrecisionPlan({"head": torch.float32, "blocks.*": recipe, "*.ln*": "no_fp8",
                          "blocks.0": {"dtype": torch.float16}}, default="bf16", dtype="bf16")
    data = plan.to_dict()
    assert data["modules"]["head"] == "float32" and data["modules"]["blocks.*"] is recipe
    assert data["modules"]["blocks.0"] == {"dtype": "float16"} and data["dtype"] == "bfloat16"
    again = PrecisionPlan.from_dict(data)
    assert again.to_dict() == data
    model = M.GPT(CFG)
    assert plan.resolve(model) == again.resolve(model)


# -- bad input ------------------------------------------------------------------------------------
def test_bad_input_is_a_clear_error_and_changes_nothing():
    model = M.GPT(CFG)
    with pytest.raises(ValueError, match=r"unknown dtype 'bfloat'.*'bfloat16'"):
        PrecisionPlan({"head": "bfloat"})
    with pytest.raises(ValueError, match="float64 is not a setting"):
        PrecisionPlan({"head": torch.float64})
    with pytest.raises(TypeError, match="a setting is a dtype"):
        PrecisionPlan({"head": 3})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['dtpye'\]"):
        PrecisionPlan({"head": {"dtpye": "bf16"}})
    with pytest.raises(ValueError, match=r"pattern '\[b-a\]' is not a valid pattern"):
        PrecisionPlan({"[b-a]": "bf16"})
    with pytest.raises(ValueError, match="empty pattern"):
        PrecisionPlan({"": "bf16"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['modles'\]"):
        PrecisionPlan.from_dict({"modles": {}})
    with pytest.raises(RuntimeError, match="unsupported device_type"):
        PrecisionPlan({"head": "bf16"}, device_type="tpu")

    before = {n: dict(m.__dict__) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=r"'haed' names no module of GPT \(nearest module names: \['head'"):
        PrecisionPlan({"haed": "float32"}).bind(model)
    with pytest.raises(ValueError, match=r"patterns '\?locks.0' and 'blocks.\?'|patterns 'blocks.\?' and '\?locks.0'"):
        PrecisionPlan({"head": "float32", "blocks.?": "float32", "?locks.0": "bf16"}).bind(model)
    with pytest.raises(ValueError, match=r"module 'ln_f' \(LayerNorm\) an fp8 recipe, but it holds no 2-D weight"):
        PrecisionPlan({"head": "float32", "ln_f": amp.fp8.CurrentScaling()}).bind(model)
    assert {n: dict(m.__dict__) for n, m in model.named_modules()} == before

    plan = PrecisionPlan({"head": "float32"}).bind(model)
    with pytest.raises(RuntimeError, match="bound already"):
        plan.bind(model)
    with pytest.raises(RuntimeError, match="bound to another PrecisionPlan"):
        PrecisionPlan({"head": "bf16"}).bind(model)
    plan.unbind()


def test_equal_settings_tied_are_no_error():
    model = M.GPT(CFG)
    entry = PrecisionPlan({"blocks.?": "float32", "?locks.0": "fp32"}).resolve(model)["blocks.0"]
    assert entry.setting in ("float32", "fp32")


def test_keep_ends_finds_the_blocks():
    model = M.GPT(CFG)
    plan = PrecisionPlan.keep_ends(model, first=2, last=1, head="head")
    assert plan.to_dict()["modules"] == {"blocks.0": "float32", "blocks.1": "float32", "blocks.3": "float32",
                                         "head": "float32"}
    with pytest.raises(ValueError, match="not an nn.ModuleList"):
        PrecisionPlan.keep_ends(model, blocks="head")
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        PrecisionPlan.keep_ends(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="first must be"):
        PrecisionPlan.keep_ends(model, first=-1)


def test_an_fp8_setting_inside_a_compiled_model_runs_eagerly_and_says_so():
    # A region with a recipe cannot be traced (docs/autocast.md, "torch.compile"): the
    # region's code runs eagerly, with the eager numbers, and autocast warns.
    torch._dynamo.reset()
    torch.manual_seed(0)
    seq = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    PrecisionPlan({"1": amp.fp8.CurrentScaling()}, dtype=BF16).bind(seq)
    x = torch.randn(16, 32)
    with amp.autocast("cpu"):
        want = seq(x)
    compiled = torch.compile(seq, backend="aot_eager")
    with pytest.warns(amp.CompileFallbackWarning), amp.autocast("cpu"):
        got = compiled(x)
    assert torch.equal(got, want)


def test_unbind_refuses_when_a_later_wrapper_holds_the_plan():
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4))
    plan = PrecisionPlan({"0": "bf16"}).bind(seq)
    ours = seq[0].forward
    seq[0].forward = lambda *a: ours(*a)
    with pytest.raises(RuntimeError, match="replaced after the plan was bound"):
        plan.unbind()
    assert plan.model is seq
    seq[0].forward = ours
    plan.unbind()
    assert "forward" not in seq[0].__dict__


@given(
    pattern=st.text(alphabet="ab.*?[]!-", min_size=1, max_size=8),
    name=st.text(alphabet="ab.[]!-", max_size=8),
)
def test_patterns_match_as_fnmatch_does(pattern, name):
    try:
        compiled = _Pattern(pattern)
    except ValueError as error:  # a reversed range: refused, where fnmatch matches nothing
        assert "bad character range" in str(error)
        return
    assert (compiled.reach(name) is not None) == fnmatch.fnmatchcase(name, pattern)


@given(names=st.lists(st.from_regex(r"[ab]{1,2}(\.[ab0-9]{1,2}){0,3}", fullmatch=True), min_size=1, max_size=6),
       others=st.lists(st.text(alphabet="ab.*?0", min_size=1, max_size=6), max_size=4))
def test_a_pattern_naming_the_module_itself_wins(names, others):
    # The module's own name pins its last character with no wildcard: nothing beats it.
    target = names[0]
    patterns = {target: "float32", **{p: "bf16" for p in others if p != target}}
    plan = PrecisionPlan(patterns)
    candidates = []
    for p in plan._patterns:
        r = max((p.reach(a) for a in [target[:i] for i, c in enumerate(target) if c == "."] + [target]
                 if p.reach(a) is not None), default=None)
        if r is not None:
            candidates.append(((r, -p.wildcards, p.literal), p.text))
    assert max(candidates)[1] == target


class _InBF16(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        with torch.autocast("cpu", dtype=BF16):
            return self.inner(x)


def test_no_fp8_inside_a_compiled_fp8_region_traces_as_the_hand_written_region():
    torch._dynamo.reset()
    torch.manual_seed(0)
    seq = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    hand = torch.nn.Sequential(copy.deepcopy(seq[0]), _InBF16(copy.deepcopy(seq[1])))
    PrecisionPlan({"1": "no_fp8"}).bind(seq)
    x = torch.randn(16, 32)
    recipe = amp.fp8.CurrentScaling()
    got_model = torch.compile(seq, backend="aot_eager", fullgraph=True)
    want_model = torch.compile(hand, backend="aot_eager", fullgraph=True)
    with amp.autocast("cpu", fp8=recipe):
        got, want = got_model(x), want_model(x)
        eager_fp8 = seq(x)  # eagerly: linear 0 in fp8, linear 1 in bfloat16
    assert got.dtype is BF16 and torch.equal(got, want)
    assert torch.equal(got, eager_fp8)


def test_a_default_runs_the_compiled_model_in_its_region_without_a_with_block():
    torch._dynamo.reset()
    torch.manual_seed(0)
    seq = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    PrecisionPlan({"2": torch.float32}, default=torch.bfloat16).bind(seq)
    x = torch.randn(4, 8)
    want = seq(x)
    got = torch.compile(seq, backend="aot_eager", fullgraph=True)(x)
    assert want.dtype is torch.float32 and seq[0](x).dtype is torch.float32  # linear 0 alone: no region
    with torch.autocast("cpu", dtype=BF16):
        h = seq[1](seq[0](x))
        with torch.autocast("cpu", enabled=False):
            by_hand = seq[2].__dict__["forward"].__wrapped__(h.float())
    assert torch.equal(got, want) and torch.equal(want, by_hand)

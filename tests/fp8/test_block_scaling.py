"""BlockScaling through the machinery every recipe goes through: the region, sites, report,
checkpoints, torch.compile, and a small GPT trained against bfloat16."""

import io

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F

import dispatch_amp as amp
from benchmarks import models
from dispatch_amp import fp8
from dispatch_amp.demo import load_corpus
from dispatch_amp.fp8._block_linear import BlockOptions, block_fp8_linear

E4M3 = torch.float8_e4m3fn


def test_defaults_are_deepseek_v3s():
    recipe = fp8.BlockScaling()
    assert recipe.forward_format == recipe.grad_format == E4M3
    assert recipe.power_of_two is False and recipe.block == 128
    assert "BlockScaling(" in repr(recipe)
    with pytest.raises(TypeError, match="True or False"):
        fp8.BlockScaling(power_of_two="false")


@pytest.mark.parametrize("rows,k,n,ok", [
    (16, 128, 128, True), (64, 256, 384, True), (48, 1024, 128, True),
    (16, 64, 256, False),   # in-features below one 128-element tile
    (16, 256, 64, False),   # out-features below one 128-row block
    (20, 128, 128, False),  # rows: not a multiple of 16, as for every recipe
    (16, 200, 128, False),  # in-features: not a multiple of 16
])
def test_shape_rule(rows, k, n, ok):
    assert fp8.BlockScaling().eligible("fc", torch.Size([rows, k]), torch.Size([n, k])) is ok


def _linear_step(recipe, lin, x, dy):
    with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
        y = lin(x)
    y.backward(dy)
    out = (y.detach(), x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone())
    x.grad = lin.weight.grad = lin.bias.grad = None
    return out


def test_a_linear_in_the_region_is_the_block_linear():
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 384)
    x = torch.randn(4, 32, 256, requires_grad=True)
    dy = torch.randn(4, 32, 384, dtype=torch.bfloat16)
    got = _linear_step(fp8.BlockScaling().bind(lin), lin, x, dy)
    y = block_fp8_linear(x, lin.weight, lin.bias, torch.bfloat16, BlockOptions())
    y.backward(dy)
    want = (y.detach(), x.grad, lin.weight.grad, lin.bias.grad)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_layer_too_small_for_a_tile_runs_in_the_regions_dtype():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 256)
    x = torch.randn(32, 64, requires_grad=True)
    dy = torch.randn(32, 256, dtype=torch.bfloat16)
    recipe = fp8.BlockScaling().bind(lin)
    got = _linear_step(recipe, lin, x, dy)
    want = _linear_step(None, lin, x, dy)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert recipe.report() == []  # no fp8 call there


def test_report_shows_each_roles_amax_and_its_largest_tile_scale():
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 128)
    recipe = fp8.BlockScaling().bind(lin)
    x = torch.randn(64, 256, requires_grad=True)
    x.data[3, 7] = 50.0
    _linear_step(recipe, lin, x, torch.ones(64, 128, dtype=torch.bfloat16))
    (r,) = recipe.report()
    assert r.name == "<root>" and r.calls == 1
    assert r.amax["input"] == 50.0 and r.amax["grad_output"] == 1.0
    assert r.amax["weight"] == lin.weight.detach().abs().max().item()
    # the scale shown is the one of the tile that holds the amax: fp8_max / amax
    assert r.scale["input"] == pytest.approx(448.0 / 50.0) and r.scale["grad_output"] == 448.0
    assert r.saturated == {"input": 0, "weight": 0, "grad_output": 0}


# -- a small GPT ----------------------------------------------------------------------------

CFG = models.GPTConfig(vocab=128, d_model=128, n_heads=4, n_blocks=2, max_len=32)
SEQ, BATCH = 32, 16


def _corpus():
    text = load_corpus()
    alphabet = sorted(set(text))
    return torch.tensor([alphabet.index(c) for c in text])


def _batch(ids, g):
    starts = torch.randint(0, len(ids) - SEQ - 1, (BATCH,), generator=g)
    return (torch.stack([ids[s:s + SEQ] for s in starts]), torch.stack([ids[s + 1:s + SEQ + 1] for s in starts]))


def _train(recipe, steps, model=None, opt=None, g=None, ids=None):
    ids = _corpus() if ids is None else ids
    if model is None:
        torch.manual_seed(0)
        model = models.GPT(CFG)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(0)
    if recipe is not None:
        recipe.bind(model)
    losses = []
    for _ in range(steps):
        x, y = _batch(ids, g)
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
            loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model, opt, g


def test_a_small_gpt_trains_within_002_of_bfloat16():
    # Every linear of the GPT is at least 128 wide (the attention's packed projection, its
    # output projection, the MLP, the head): all of them run block-scaled.
    recipe = fp8.BlockScaling()
    block, *_ = _train(recipe, 50)
    bf16, *_ = _train(None, 50)
    assert len(recipe.report()) == 1 + 4 * CFG.n_blocks  # the head and each block's four
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    assert bf16[0] - bf16[-1] > 1.0  # it learns
    assert abs(mean(block[-10:]) - mean(bf16[-10:])) < 0.02, (block[-10:], bf16[-10:])


def test_a_checkpoint_round_trip_resumes_bit_identically():
    recipe = fp8.BlockScaling()
    _, model, opt, g = _train(recipe, 2)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "fp8": recipe.state_dict(),
                "g": g.get_state()}, buf)
    going_on, *_ = _train(recipe, 2, model, opt, g)

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh = models.GPT(CFG)
    fresh.load_state_dict(saved["model"])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=3e-3)
    fresh_opt.load_state_dict(saved["opt"])
    fresh_recipe = fp8.BlockScaling()
    fresh_recipe.load_state_dict(saved["fp8"])
    g2 = torch.Generator()
    g2.set_state(saved["g"])
    resumed, *_ = _train(fresh_recipe, 2, fresh, fresh_opt, g2)
    assert resumed == going_on
    assert saved["fp8"] == {}  # stateless: scales come from the current tensors
    with pytest.raises(ValueError, match="keeps no state"):
        fp8.BlockScaling().load_state_dict({"sites": {}})


@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))


def _steps(model, recipe, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        x = torch.randn(64, 128, generator=torch.Generator().manual_seed(step))
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    return out


def test_aot_eager_is_bit_identical_to_eager_in_one_graph(_fresh_dynamo):
    eager_model = _mlp()
    eager_recipe = fp8.BlockScaling().bind(eager_model)
    eager = _steps(eager_model, eager_recipe)
    model = _mlp()
    recipe = fp8.BlockScaling().bind(model)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    got = _steps(torch.compile(model, backend=counter, fullgraph=True), recipe)
    for (loss_e, grads_e), (loss_c, grads_c) in zip(eager, got):
        assert torch.equal(loss_e, loss_c)
        assert all(torch.equal(a, b) for a, b in zip(grads_e, grads_c))
    assert counter.frame_count == 1
    assert [(r.name, r.calls, r.amax, r.scale) for r in eager_recipe.report()] == [
        (r.name, r.calls, r.amax, r.scale) for r in recipe.report()]


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_activation_checkpointing_recomputes_bit_identically_and_records_once(reentrant):
    def run(checkpointed):
        model = _mlp()
        recipe = fp8.BlockScaling().bind(model)
        x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = []
        for _ in range(2):
            with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
                y = amp.checkpoint(model, x, use_reentrant=reentrant) if checkpointed else model(x)
            y.float().pow(2).mean().backward()
            out.append((y.detach(), x.grad.clone(), [p.grad.clone() for p in model.parameters()]))
            model.zero_grad()
            x.grad = None
        return out, [(r.name, r.calls, r.amax) for r in recipe.report()]

    (plain, plain_report), (ckpt, ckpt_report) = run(False), run(True)
    for (ya, xa, ga), (yb, xb, gb) in zip(plain, ckpt):
        assert torch.equal(ya, yb) and torch.equal(xa, xb) and all(torch.equal(a, b) for a, b in zip(ga, gb))
    assert plain_report == ckpt_report and all(calls == 2 for _, calls, _ in ckpt_report)


def test_copies_and_pickles_keep_the_configuration():
    import copy
    import pickle

    recipe = fp8.BlockScaling(power_of_two=True)
    for other in (pickle.loads(pickle.dumps(recipe)), copy.deepcopy(recipe)):
        assert type(other) is fp8.BlockScaling and repr(other) == repr(recipe) and other.power_of_two is True


def test_inductor_compiles_it_in_one_graph(_fresh_dynamo):
    # Each quantize is one op in the graph (kernels/fp8_block.py, "Under torch.compile"),
    # running what runs eagerly; inductor fuses what lies around the fp8 path (the GELU and
    # its backward, the casts), so an element may land one fp8 step away from eager's.
    eager_model = _mlp()
    eager = _steps(eager_model, fp8.BlockScaling().bind(eager_model), steps=2)
    model = _mlp()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    got = _steps(torch.compile(model, backend=counter, fullgraph=True), fp8.BlockScaling().bind(model), steps=2)
    for (loss_e, grads_e), (loss_c, grads_c) in zip(eager, got):
        assert (loss_c - loss_e).abs() <= 0.01 * loss_e.abs()
        assert all((a - b).norm() <= 0.04 * a.norm() for a, b in zip(grads_e, grads_c))
    assert counter.frame_count == 1

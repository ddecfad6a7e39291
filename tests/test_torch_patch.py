"""patch_torch: torch's AMP names become ours while active, and exactly torch's again after."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch

import dispatch_amp as amp
from dispatch_amp.torch_patch import patch_torch

_NAMES = [
    (torch, "autocast"),
    (torch.amp, "autocast"),
    (torch.amp, "GradScaler"),
    (torch.cpu.amp, "autocast"),
    (torch.cpu.amp, "GradScaler"),
    (torch.cuda.amp, "autocast"),
    (torch.cuda.amp, "GradScaler"),
]


# What a patch says when it stops and nothing ran in mixed precision through it. Tests
# whose patch only checks names and objects, and runs nothing, expect it.
NOTHING_RAN = "nothing ran in mixed precision"


def _nothing_ran():
    return pytest.warns(amp.AmpNumericsWarning, match=NOTHING_RAN)


def _snapshot() -> dict[str, object]:
    return {f"{m.__name__}.{n}": getattr(m, n) for m, n in _NAMES if hasattr(m, n)}


def _assert_untouched(before: dict[str, object]) -> None:
    after = _snapshot()
    assert after.keys() == before.keys()
    changed = [k for k in before if after[k] is not before[k]]
    assert not changed, f"not restored exactly: {changed}"


def test_importing_dispatch_amp_patches_nothing():
    code = textwrap.dedent("""
        import torch
        names = [(torch, "autocast"), (torch.amp, "autocast"), (torch.amp, "GradScaler"),
                 (torch.cpu.amp, "autocast"), (torch.cuda.amp, "autocast"), (torch.cuda.amp, "GradScaler")]
        before = [getattr(m, n) for m, n in names]
        import dispatch_amp, dispatch_amp.torch_patch
        assert [getattr(m, n) for m, n in names] == before
        assert torch.autocast is torch.amp.autocast_mode.autocast
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_start_and_stop_restore_every_attribute_exactly():
    before = _snapshot()
    with _nothing_ran(), patch_torch() as patch:
        assert patch.active
        during = _snapshot()
        assert all(during[k] is not before[k] for k in before), "every present name is replaced"
        assert issubclass(torch.autocast, amp.autocast) and issubclass(torch.amp.GradScaler, amp.GradScaler)
    assert not patch.active
    _assert_untouched(before)

    patch = patch_torch()
    patch.start()
    assert torch.amp.autocast is torch.autocast and torch.autocast is not before["torch.autocast"]
    with _nothing_ran():
        patch.stop()
    _assert_untouched(before)


def test_an_exception_in_the_block_still_restores():
    before = _snapshot()
    with pytest.raises(KeyError):
        with patch_torch():
            raise KeyError("boom")
    _assert_untouched(before)


def test_a_second_patch_is_refused_and_the_first_stays():
    before = _snapshot()
    with _nothing_ran(), patch_torch():
        patched = _snapshot()
        with pytest.raises(RuntimeError, match="already patched by another dispatch_amp.patch_torch"):
            patch_torch().start()
        assert _snapshot() == patched
    _assert_untouched(before)


def test_misuse_of_one_patch_names_the_state():
    patch = patch_torch()
    with pytest.raises(RuntimeError, match="not started"):
        patch.stop()
    patch.start()
    try:
        with pytest.raises(RuntimeError, match="already started"):
            patch.start()
    finally:
        with _nothing_ran():
            patch.stop()
    with pytest.raises(TypeError, match="policy must be a dispatch_amp.Policy"):
        patch_torch(policy="cpu")


def test_patched_autocast_takes_every_torch_argument():
    with patch_torch():
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=True, cache_enabled=None):
            assert amp.is_autocast_enabled("cpu")
        with torch.amp.autocast("cpu", torch.float16, True, False):
            assert amp.get_autocast_dtype("cpu") is torch.float16
        # torch's reaction to a dtype it cannot autocast to: warn, run the region disabled.
        with pytest.warns(UserWarning, match="target dtype is not supported"):
            region = torch.autocast("cpu", dtype=torch.float32)
        with region:
            assert not amp.is_autocast_enabled("cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.autocast("cpu", dtype=torch.float32, enabled=False):
                assert not amp.is_autocast_enabled("cpu")
        # Device types dispatch_amp does not handle keep torch's own autocast.
        assert type(torch.autocast("hpu", enabled=False)) is torch.amp.autocast_mode.autocast
        assert isinstance(torch.autocast("mps", enabled=False), amp.autocast)
        with torch.cpu.amp.autocast():
            assert amp.get_autocast_dtype("cpu") is torch.bfloat16 and amp.is_autocast_enabled("cpu")
        assert isinstance(torch.cuda.amp.autocast(enabled=False), amp.autocast)

        @torch.autocast("cpu")
        def forward(x):
            return torch.nn.functional.linear(x, torch.ones(3, 3))

        assert forward(torch.ones(2, 3)).dtype is torch.bfloat16


def _autocast_as_torch_code_sees_it(**kwargs):
    """What code written for torch observes of ``torch.autocast("cpu", **kwargs)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        region = torch.autocast("cpu", **kwargs)
        with region:
            inside = (torch.get_autocast_dtype("cpu"), torch.is_autocast_enabled("cpu"))
    attributes = {name: getattr(region, name, "missing")
                  for name in ("device", "fast_dtype", "_enabled", "_cache_enabled")}
    return inside, [str(w.message) for w in caught], attributes


@pytest.mark.parametrize("kwargs", [
    {"dtype": torch.float32}, {"dtype": torch.float64}, {"dtype": torch.float32, "enabled": False},
    {}, {"dtype": torch.float16, "cache_enabled": False},
], ids=["float32", "float64", "float32-disabled", "default", "float16-no-cache"])
def test_patched_autocast_looks_like_torchs(kwargs):
    native = _autocast_as_torch_code_sees_it(**kwargs)
    with patch_torch():
        patched = _autocast_as_torch_code_sees_it(**kwargs)
    assert patched == native


def test_patched_autocast_decorates_a_generator_function_as_torch_does():
    def make(autocast_class):
        @autocast_class("cpu")
        def steps(x):
            yield torch.mm(x, x).dtype  # the body runs after the decorated call returns
        return steps

    native = list(make(torch.autocast)(torch.ones(2, 2)))
    with patch_torch():
        patched = list(make(torch.autocast)(torch.ones(2, 2)))
    assert patched == native == [torch.float32]
    with pytest.raises(TypeError, match="generator"):  # dispatch_amp.autocast itself refuses
        make(amp.autocast)


def test_patched_scalers_take_torch_arguments():
    with _nothing_ran(), patch_torch():  # scalers made, none scales
        scaler = torch.amp.GradScaler("cpu", 2.0**10, 2.0, 0.5, 100, True)
        assert isinstance(scaler, amp.GradScaler) and scaler.get_scale() == 2.0**10
        assert torch.cpu.amp.GradScaler(init_scale=8.0).get_scale() == 8.0
        if not torch.cuda.is_available():
            with pytest.warns(UserWarning, match="CUDA is not available"):
                assert not torch.cuda.amp.GradScaler().is_enabled()


def test_the_policy_reaches_the_patched_autocast():
    fp32_matmuls = amp.Policy.for_device("cpu").with_ops(fp32=["mm", "addmm", "linear", "matmul"])
    with patch_torch(policy=fp32_matmuls):
        with torch.autocast("cpu"):
            y = torch.nn.functional.linear(torch.ones(2, 3), torch.ones(3, 3))
    assert y.dtype is torch.float32


def _recipe(steps: int, inf_at: int | None) -> tuple[list, list, list, type]:
    """Plain PyTorch recipe code: it names torch.autocast and torch.amp.GradScaler at the call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    losses, grads, scales = [], [], []
    for step in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x if step != inf_at else x * float("inf"))
            loss = torch.nn.functional.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        grads.append([p.grad.clone() for p in model.parameters()])
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach().clone())
        scales.append(scaler.get_scale())
    grads.append([p.detach().clone() for p in model.parameters()])
    return losses, grads, scales, type(scaler)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        # NaN != NaN: compare where the NaNs are, then everything else.
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_recipe_code_under_the_patch_matches_native_bit_for_bit():
    native = _recipe(5, inf_at=2)
    with patch_torch():
        patched = _recipe(5, inf_at=2)
    losses, grads, scales, scaler_type = patched
    assert issubclass(scaler_type, amp.GradScaler) and not issubclass(native[3], amp.GradScaler)
    assert scales == native[2] and scales[2] == scales[1] / 2, "the overflow step backs off the same way"
    assert _same(losses, native[0]) and _same(grads, native[1])



def test_two_threads_starting_patches_at_once_leave_torch_as_it_was(monkeypatch):
    # Each start() is slowed between its check ("is torch patched already?") and its
    # writes, so both threads would pass the check before either writes. One patch
    # must start, the other be refused, and stopping the one leaves torch as it was.
    import threading
    import time

    from dispatch_amp import torch_patch

    originals = (torch.autocast, torch.amp.autocast, torch.amp.GradScaler)

    def slow_setattr(obj, name, value):
        time.sleep(0.01)
        setattr(obj, name, value)

    monkeypatch.setattr(torch_patch, "setattr", slow_setattr, raising=False)
    started, refused = [], []

    def start():
        patch = patch_torch()
        try:
            started.append(patch.start())
        except RuntimeError as error:
            refused.append(str(error))

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for patch in started:
        with _nothing_ran():
            patch.stop()
    assert len(started) == 1 and len(refused) == 1 and "already patched" in refused[0]
    assert (torch.autocast, torch.amp.autocast, torch.amp.GradScaler) == originals


def test_torchs_own_objects_pass_isinstance_against_the_patched_names():
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_region = torch.autocast("cpu")
    torch_cpu_region = torch.cpu.amp.autocast()
    with _nothing_ran(), patch_torch():  # regions made, none entered
        assert isinstance(torch_scaler, torch.amp.GradScaler)
        assert isinstance(torch_region, torch.autocast) and isinstance(torch_region, torch.amp.autocast)
        assert isinstance(torch_cpu_region, torch.cpu.amp.autocast)
        assert issubclass(torch.amp.grad_scaler.GradScaler, torch.amp.GradScaler)
        ours = torch.amp.GradScaler("cpu")
        assert isinstance(ours, torch.amp.GradScaler) and isinstance(ours, amp.GradScaler)
        assert isinstance(torch.autocast("cpu"), torch.autocast)
        assert not isinstance(object(), torch.amp.GradScaler)
    # Objects made under the patch are ours: torch's restored classes do not claim them
    # (docs/integrations.md, "Code that calls torch.autocast").
    assert not isinstance(ours, torch.amp.GradScaler)


def test_a_scaler_made_under_the_patch_pickles_and_saves_whole(tmp_path):
    import pickle

    with _nothing_ran(), patch_torch():
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        cpu_scaler = torch.cpu.amp.GradScaler(init_scale=4.0)
        again = pickle.loads(pickle.dumps(scaler))
        assert again.get_scale() == 8.0 and isinstance(again, torch.amp.GradScaler)
    torch.save({"scaler": scaler, "cpu": cpu_scaler}, tmp_path / "whole.pt")  # after the patch, too
    loaded = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert loaded["scaler"].get_scale() == 8.0 and loaded["cpu"].get_scale() == 4.0
    assert loaded["scaler"].state_dict() == scaler.state_dict()


# -- a patch that reached nothing says so ----------------------------------------------


def _script(region, scaler_enabled=False, dtype=torch.bfloat16):
    """Training code that picks its own context, as scripts do that open torch.autocast
    only on a GPU: ``region`` is what it opens around the forward. Its scaler is made
    through torch's name, enabled only for float16."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=scaler_enabled)
    for _ in range(2):
        with region():
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return loss


@contextlib.contextmanager
def _silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error", amp.AmpNumericsWarning)
        yield


def test_a_patch_through_which_nothing_ran_warns_where_it_stops():
    # nullcontext() around the forward and a scaler that is disabled (steps as plain
    # backward and step): the patch reaches nothing, and the user should hear it.
    with _nothing_ran() as caught:
        with patch_torch():
            loss = _script(contextlib.nullcontext)
    assert loss.dtype is torch.float32
    message = str(caught[0].message)
    assert "nullcontext()" in message and "dispatch_amp.autocast(...)" in message
    assert caught[0].filename == __file__, "points at the with-statement, not into dispatch_amp"

    patch = patch_torch().start()
    _script(contextlib.nullcontext)
    with _nothing_ran() as caught:
        patch.stop()
    assert caught[0].filename == __file__, "points at the stop() call"


@pytest.mark.parametrize("how", ["with-block", "disabled-region", "decorator", "cpu.amp", "other-thread"])
def test_a_region_entered_through_the_patched_names_keeps_it_silent(how):
    def decorated_region():
        @torch.autocast("cpu")
        def forward():
            return torch.mm(torch.ones(2, 2), torch.ones(2, 2))
        return forward

    with _silent(), patch_torch() as patch:
        if how == "with-block":
            _script(lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        elif how == "disabled-region":  # the code chose autocast, switched off
            _script(lambda: torch.amp.autocast("cpu", enabled=False))
        elif how == "decorator":
            assert decorated_region()().dtype is torch.bfloat16
        elif how == "cpu.amp":
            _script(torch.cpu.amp.autocast)
        else:
            losses = []
            worker = threading.Thread(target=lambda: losses.append(_script(lambda: torch.autocast("cpu"))))
            worker.start()
            worker.join()
            assert len(losses) == 1, "the thread's script ran to the end"
    assert not patch.active


def test_a_decorated_function_counts_when_called_not_when_decorated():
    with _nothing_ran(), patch_torch():
        @torch.autocast("cpu")
        def forward():
            return torch.mm(torch.ones(2, 2), torch.ones(2, 2))


def test_a_patched_scaler_that_steps_keeps_it_silent():
    # No region at all (the model could be cast by hand): an enabled scaler made through
    # torch's name under the patch is mixed-precision training that the patch reached.
    with _silent(), patch_torch():
        _script(contextlib.nullcontext, scaler_enabled=True)


def test_an_exception_leaving_the_block_is_not_covered_by_the_warning():
    with _silent(), pytest.raises(KeyError, match="boom"):
        with patch_torch():
            _script(contextlib.nullcontext)
            raise KeyError("boom")


def test_each_start_counts_afresh():
    patch = patch_torch()
    with _silent(), patch:
        _script(lambda: torch.autocast("cpu"))
    with _nothing_ran(), patch:
        _script(contextlib.nullcontext)


def test_a_patched_scalers_own_warnings_still_point_at_the_callers_line():
    # Counting its use must add no frame between the caller and the scaler's methods.
    with patch_torch():
        scaler = torch.amp.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.Linear(2, 1)(torch.ones(1, 2)).float().sum()
        with pytest.warns(amp.AmpNumericsWarning, match="does not need loss scaling") as caught:
            scaler.scale(loss)
    assert caught[0].filename == __file__


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_patched_autocast_on_a_missing_device_warns_at_the_callers_line_as_torchs():
    with pytest.warns(UserWarning, match="CUDA is not available") as native:
        torch.autocast("cuda")
    with patch_torch():
        with pytest.warns(UserWarning, match="CUDA is not available") as caught:
            region = torch.autocast("cuda")
        with region:  # enters disabled, as torch's
            assert not torch.is_autocast_enabled("cuda")
    assert native[0].filename == caught[0].filename == __file__
    assert len([w for w in caught if "CUDA is not available" in str(w.message)]) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("name", ["torch.cuda.amp.autocast", "torch.cuda.amp.GradScaler"])
def test_the_deprecated_cuda_names_warn_at_the_callers_line(name):
    # Their __init__ is one frame more than torch.autocast's / torch.amp.GradScaler's.
    make = {"torch.cuda.amp.autocast": lambda: torch.cuda.amp.autocast(),
            "torch.cuda.amp.GradScaler": lambda: torch.cuda.amp.GradScaler()}[name]
    with warnings.catch_warnings(record=True) as caught, patch_torch():
        warnings.simplefilter("always")
        made = make()
    unavailable = [w for w in caught if "CUDA is not available" in str(w.message)]
    assert len(unavailable) == 1 and unavailable[0].filename == __file__, [(w.filename, w.lineno) for w in unavailable]
    assert type(made).__module__ == "dispatch_amp.torch_patch"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("how", ["torch.autocast", "torch.cuda.amp.autocast", "decorator", "fp32-dtype"])
def test_regions_that_all_disabled_themselves_are_not_regions_that_ran(how):
    # CUDA names on a machine without CUDA (a recipe written for a GPU) run nothing in
    # mixed precision: the closing warning must say so, naming why.
    regions = {
        "torch.autocast": lambda: torch.autocast("cuda"),
        "torch.cuda.amp.autocast": lambda: torch.cuda.amp.autocast(),
        "decorator": lambda: torch.autocast("cuda"),
        "fp32-dtype": lambda: torch.autocast("cpu", dtype=torch.float32),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's own "Disabling" warnings
        with _nothing_ran() as caught, patch_torch():
            if how == "decorator":
                regions[how]()(lambda: torch.mm(torch.ones(2, 2), torch.ones(2, 2)))()
            else:
                _script(regions[how])
    [warning] = [w for w in caught if NOTHING_RAN in str(w.message)]
    message = str(warning.message)
    assert "disabled by itself" in message and warning.filename == __file__
    assert ("CUDA is not available" in message) != (how == "fp32-dtype")


def test_a_policy_naming_fp8_ops_without_a_recipe_is_refused_up_front():
    policy = amp.Policy.for_device("cpu").with_ops(fp8=["linear"])
    with pytest.raises(ValueError, match="marks \\['aten::linear'\\] as fp8, but no recipe was given"):
        amp.patch_torch(policy=policy)
    assert torch.autocast is torch.amp.autocast_mode.autocast  # nothing patched

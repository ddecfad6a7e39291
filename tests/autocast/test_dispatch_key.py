"""The dispatch key's registry: kernels registered once, safely, whoever opens a region.

The scripts run in a process of their own: the first region of a process registers the
kernels, and a registry that deadlocks must hang that process, not the suite.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

signal = pytest.importorskip("signal")
if not hasattr(signal, "pthread_kill") or not hasattr(signal, "setitimer"):
    pytest.skip("POSIX signals needed", allow_module_level=True)

HANG_GUARD_S = 240


def _run(script: str) -> str:
    try:
        res = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                             timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the process hung (no exit in {HANG_GUARD_S} s): a region waits for a lock its own thread holds")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Tried to register" not in res.stderr and "Overriding a previously registered kernel" not in res.stderr
    return res.stdout


def test_a_signal_handler_that_opens_a_region_while_the_first_region_registers_runs_and_nothing_hangs():
    # The handler is delivered to the main thread while the kernels of the first region
    # are being registered, and opens a region needing a kernel not registered yet.
    out = _run("""
        import signal, threading, time
        import torch, dispatch_amp as amp
        from dispatch_amp.autocast import _dispatch_key

        MAIN = threading.main_thread().ident
        a = torch.randn(4, 4)
        seen = []

        def handler(signum, frame):
            registering = _dispatch_key._REGISTRY.lock.locked()
            policy = amp.Policy.for_device("cpu").with_ops(lower=["tanh"], name="the handler's")
            with amp.autocast("cpu", policy=policy):
                seen.append((registering, torch.tanh(a).dtype, torch.mm(a, a).dtype))

        signal.signal(signal.SIGUSR1, handler)
        make_kernel, fired = _dispatch_key.make_kernel, []

        def make_kernel_and_signal(op):
            if not fired:
                fired.append(op)
                signal.pthread_kill(MAIN, signal.SIGUSR1)
                time.sleep(0.5)  # the handler runs in this window
            return make_kernel(op)

        _dispatch_key.make_kernel = make_kernel_and_signal
        with amp.autocast("cpu"):
            out = (torch.mm(a, a).dtype, torch.tanh(a).dtype)
        print(seen, out)
        assert seen == [(True, torch.bfloat16, torch.bfloat16)], seen  # ran while the registering went on
        assert out == (torch.bfloat16, torch.float32), out
        with amp.autocast("cpu", policy=amp.Policy.for_device("cpu").with_ops(lower=["tanh"])):
            assert torch.tanh(a).dtype == torch.bfloat16
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_a_periodic_signal_handler_opening_regions_with_new_policies_as_the_main_thread_does():
    # A preemption or checkpoint handler on a timer, while the main thread opens regions
    # with policies of its own: every first region of a policy registers (new ops) or
    # prepares (new plans). Native autocast runs this without an error; so must ours.
    out = _run("""
        import signal
        import torch, dispatch_amp as amp

        OPS = ["tanh", "sigmoid", "exp", "sin", "cos", "abs", "neg", "relu", "sqrt", "rsqrt",
               "log1p", "expm1", "erf", "atan", "asin", "acos", "sinh", "cosh", "floor", "ceil"]
        BASE = amp.Policy.for_device("cpu")
        a = torch.rand(4, 4) + 0.5
        runs = [0]
        # Made beforehand, so that a handler is short next to the timer's period (a slower
        # one piles up under any autocast); the first entry of each registers.
        REGIONS = [amp.autocast("cpu", policy=BASE.with_ops(lower=[op], name=f"handler {op}")) for op in OPS]

        def handler(signum, frame):
            runs[0] += 1
            i = runs[0] % len(OPS)
            with REGIONS[i]:
                assert getattr(torch, OPS[i])(a).dtype == torch.bfloat16

        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, 0.003, 0.003)
        try:
            for i in range(300):
                op = OPS[(7 * i) % len(OPS)]
                with amp.autocast("cpu", policy=BASE.with_ops(lower=[op], name=f"main {i}")):
                    assert torch.mm(a, a).dtype == torch.bfloat16
                    assert getattr(torch, op)(a).dtype == torch.bfloat16
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0, 0)
        assert runs[0] > 0
        assert not torch.is_autocast_enabled("cpu")
        torch.autocast_increment_nesting()
        assert torch.autocast_decrement_nesting() == 0
        print("ok", runs[0])
    """)
    assert out.startswith("ok")

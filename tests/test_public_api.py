"""The public names stay where users import them from, whatever the package's layout.

``dispatch_amp.autocast`` is the context class, although a subpackage of that name holds
it: see "Layout" in docs/design.md.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest
import torch

import dispatch_amp as amp

PARTS = ("autocast", "scaler", "diagnostics")


@pytest.mark.parametrize("name", amp.__all__)
def test_every_public_name_resolves_on_the_package(name):
    assert getattr(amp, name) is not None
    namespace: dict = {}
    exec(f"from dispatch_amp import {name}", namespace)
    assert namespace[name] is getattr(amp, name)


@pytest.mark.parametrize("part", PARTS)
def test_each_part_exports_the_objects_the_package_does(part):
    package = sys.modules[f"dispatch_amp.{part}"]
    assert package.__all__, f"dispatch_amp.{part} exports nothing"
    for name in package.__all__:
        assert getattr(package, name) is getattr(amp, name), f"dispatch_amp.{part}.{name} is not dispatch_amp.{name}"


def test_dispatch_amp_autocast_is_the_context_class():
    context = importlib.import_module("dispatch_amp.autocast.context")
    assert isinstance(amp.autocast, type) and amp.autocast is context.autocast
    assert sys.modules["dispatch_amp.autocast"].autocast is amp.autocast
    a = torch.ones(2, 2)
    with amp.autocast("cpu") as region:
        assert isinstance(region, amp.autocast)
        assert torch.mm(a, a).dtype == torch.bfloat16 and amp.is_autocast_enabled("cpu")
    assert torch.mm(a, a).dtype == torch.float32 and not amp.is_autocast_enabled("cpu")

    @amp.autocast("cpu", dtype=torch.float16)
    def f(x):
        return torch.mm(x, x)

    assert f(a).dtype == torch.float16


# Each is run first thing in a fresh interpreter: importing a part's module before the
# package must leave the same public names.
FIRST_IMPORTS = [
    "import dispatch_amp.autocast.context",
    "from dispatch_amp.autocast.policy import Policy",
    "import dispatch_amp.scaler.grad_scaler",
    "import dispatch_amp.integrations.metrics",
]


@pytest.mark.parametrize("first", FIRST_IMPORTS)
def test_importing_a_module_of_a_part_first_keeps_the_public_names(first):
    script = textwrap.dedent(
        f"""
        {first}
        import sys
        import dispatch_amp
        from dispatch_amp.autocast import context
        assert dispatch_amp.autocast is context.autocast, dispatch_amp.autocast
        assert sys.modules["dispatch_amp.autocast"].__name__ == "dispatch_amp.autocast"
        missing = [n for n in dispatch_amp.__all__ if not hasattr(dispatch_amp, n)]
        assert not missing, missing
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def test_the_forms_that_walk_attributes_fail_as_docs_design_says(monkeypatch):
    # The documented wart: these read attribute ``autocast`` of ``dispatch_amp``, the class.
    with pytest.raises(ImportError, match="cannot import name 'context'"):
        exec("import dispatch_amp.autocast.context as m", {})
    with pytest.raises(AttributeError, match="context"):
        monkeypatch.setattr("dispatch_amp.autocast.context._usable", None)
    # The ways that work: import the module object, patch it.
    from dispatch_amp.autocast import context

    monkeypatch.setattr(context, "_usable", None)
    assert sys.modules["dispatch_amp.autocast.context"]._usable is None

"""The private PyTorch APIs the engine relies on, looked up once, in one place.

Each entry below is something torch does not promise to keep. They are resolved when
this module is imported; if any is missing (a torch version we do not test), the import
fails with one error that names every missing API and the torch version the project is
tested with, instead of an AttributeError deep inside a forward pass.

What each is for:

- the Python dispatch-mode stack (``_len_torch_dispatch_stack``, ``_get_dispatch_stack_at``,
  ``_pop_torch_dispatch_stack``, ``_push_on_torch_dispatch_stack``): the function level
  takes the aten level off the stack around a call it has cast (``_engine._call_aside``);
- Dynamo's frame hook (``set_eval_frame``) and ``skip_code``: our own frames are kept out
  of Dynamo (see "Note: Dynamo and our frames" in ``_engine.py``);
  ``set_code_exec_strategy`` and ``FrameExecStrategy``: the frames of a compiled function
  that Dynamo skipped inside our region are handed back to it when the region closes;
- ``_top_saved_tensors_default_hooks`` and ``torch.utils.checkpoint.CheckpointFunction``:
  telling whether torch's checkpoint is running, to refuse it under a custom policy;
- ``Tensor._is_view``: native's weight-cast cache skips views, and so does ours.

``_engine._clone_without_dispatch_check`` also relies on torch's Python composites
reading ``has_torch_function*`` from their module globals; tests that expand
``F.multi_head_attention_forward`` and ``F.interpolate`` cover it.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

TESTED_TORCH = "2.13"

_missing: list[str] = []


def _lookup(owner, dotted: str, name: str):
    try:
        return getattr(owner, name)
    except AttributeError:
        _missing.append(f"{dotted}.{name}")
        return None


len_dispatch_stack = _lookup(torch._C, "torch._C", "_len_torch_dispatch_stack")
dispatch_stack_at = _lookup(torch._C, "torch._C", "_get_dispatch_stack_at")
pop_dispatch_stack = _lookup(torch._C, "torch._C", "_pop_torch_dispatch_stack")
push_dispatch_stack = _lookup(torch._C, "torch._C", "_push_on_torch_dispatch_stack")
top_saved_tensors_hooks = _lookup(
    torch._C._autograd, "torch._C._autograd", "_top_saved_tensors_default_hooks"
)
reentrant_checkpoint_function = _lookup(
    torch.utils.checkpoint, "torch.utils.checkpoint", "CheckpointFunction"
)
tensor_is_view = _lookup(torch.Tensor, "torch.Tensor", "_is_view")

try:
    from torch._C._dynamo.eval_frame import set_code_exec_strategy, set_eval_frame
    from torch._dynamo.eval_frame import skip_code
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    # What Dynamo does with a code object it has not been told anything about.
    DEFAULT_EXEC_STRATEGY = FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT)
    # The file of torch.compile's wrapper around a compiled function.
    DYNAMO_EVAL_FRAME_FILE = torch._dynamo.eval_frame.__file__
except ImportError:
    _missing.append(
        "torch._C._dynamo.eval_frame.set_eval_frame / set_code_exec_strategy, "
        "torch._dynamo.eval_frame.skip_code, torch._dynamo.types.FrameExecStrategy"
    )
    set_eval_frame = skip_code = set_code_exec_strategy = None

if _missing:
    raise ImportError(
        f"dispatch_amp needs private PyTorch APIs that torch {torch.__version__} does not "
        f"have: {', '.join(_missing)}. dispatch_amp is tested with torch {TESTED_TORCH}; "
        f"install that version (pip install 'torch=={TESTED_TORCH}.*')."
    )

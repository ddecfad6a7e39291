"""A recipe's runtime state: its sites, their per-role tensors, checkpoints, reports and the
cross-rank reduction, in one object.

A recipe (``recipes.py``) is a frozen description: formats, its scaling rule
(``_scaling.py``), the eligibility filter. Everything that changes while training lives in
its :class:`Fp8State`:

* the sites (``_sites.py``): one per weight, found by the weight's identity, named after
  the paths models hold it under, each with a ``RoleState`` per role (named fields over
  the packed tensors the kernels update);
* the checkpoint format (``_state_dict.py``): the rule's ``checkpoint_config`` says what
  the state was made under; a rule without state saves ``{}``;
* the report (:meth:`Fp8State.report`);
* the cross-rank reduction of pending amaxes (:meth:`Fp8State.reduce_amaxes`), which the
  rule asks for after each optimizer step;
* the optimizer-step hooks (``_step_hooks.py`` calls :meth:`before_optimizer_step` and
  :meth:`after_optimizer_step` while the state is watched).

What other code needs from a weight's site, it asks here: ``site`` / ``lookup``,
``prepare``, and, for code that casts a weight itself (an fp8 all-gather),
:meth:`weight_scale_choice`: the scale the weight will be cast with now.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .. import _torch_compat
from ..kernels.fp8_quantize import ScaleChoice
from ..kernels.fp8_scale import F_PENDING, NO_PENDING, advance_reference
from . import _quantize, _state_dict, _step_hooks
from ._rules import FORMATS
from ._scaling import ScalingRule
from ._sites import ROLES, RoleState, Site, SiteRegistry

__all__ = ["Fp8State", "SiteReport"]


@dataclass(frozen=True)
class SiteReport:
    """What one site's fp8 calls saw: per role, the last amax and scale, and how many
    values were clamped to the format's largest value (saturated) over all calls.

    Example::

        >>> SiteReport("fc", 3, {"input": 2.0}, {"input": 224.0}, {"input": 0}).saturated
        {'input': 0}
    """

    name: str
    calls: int
    amax: dict[str, float]
    scale: dict[str, float]
    saturated: dict[str, int]


@_torch_compat.assume_constant_result
def _refuse_unprepared_site(name: str, device: str) -> bool:
    # Runs while Dynamo traces: the error reaches the caller of the compiled function.
    raise RuntimeError(
        f"fp8 site {name!r} has no state on {device} yet, and a compiled graph cannot make it: "
        f"call recipe.bind(model) after moving the model to its device and before the first "
        f"compiled call (or run one step eagerly first)"
    )


class Fp8State:
    """The state of one recipe (``owner``: its class name, for errors) under ``rule``.

    Example::

        >>> from dispatch_amp import fp8
        >>> recipe = fp8.CurrentScaling()
        >>> isinstance(recipe.state, Fp8State), recipe.state.sites()
        (True, [])
    """

    def __init__(self, rule: ScalingRule, owner: str) -> None:
        self.rule = rule
        self.owner = owner
        self.registry = SiteRegistry()

    # -- sites --------------------------------------------------------------------------------
    def bind(self, model: torch.nn.Module, prefix: str) -> None:
        """Names the sites after ``model``'s weights and makes their state on the weights'
        devices (``Recipe.bind`` states the rules)."""
        for weight, site in self.registry.bind(model, prefix):
            self.prepare(site, weight.device)

    def site_now(self, weight: torch.Tensor) -> Site | None:
        """The weight's site: eagerly made and named on its first call; a graph being
        traced only reads the weight's slot."""
        if torch.compiler.is_compiling():
            return self.registry.lookup(weight)
        return self.registry.site(weight)

    def lookup(self, weight: torch.Tensor) -> Site | None:
        """The weight's site if it has one (reads the weight's slot only: safe to trace)."""
        return self.registry.lookup(weight)

    def site(self, weight: torch.Tensor) -> Site:
        """The weight's site, made and named on its first call."""
        return self.registry.site(weight)

    def sites(self) -> list[Site]:
        """Every site, in the order they were made."""
        return list(self.registry.sites)

    def role_states(self) -> list[RoleState]:
        return [state for site in self.registry.sites for state in site.roles.values()]

    def prepare(self, site: Site, device: torch.device) -> None:
        """Makes the site's tensors on ``device`` before a call (never inside the autograd
        Function, whose backward only updates them in place). A compiled graph cannot make
        them (its backward could not update tensors its forward made): ``bind`` does."""
        if site.on(device):
            return
        if torch.compiler.is_compiling():
            _refuse_unprepared_site(site.name or "<unnamed>", str(device))
        n = self.rule.history_len
        site.roles = {role: site.roles[role].moved(device) if role in site.roles else RoleState(n, device)
                      for role in ROLES}

    def weight_scale_choice(self, weight: torch.Tensor) -> ScaleChoice:
        """How ``weight`` will be scaled at its next fp8 call, before any cast: a scale
        known now (``mode == "given"``: delayed scaling's, from the site's history) or the
        rule to apply to the weight's amax (``choice.of_amax(amax, dtype)``: current
        scaling's, where a sharded weight's amax is reduced across shards first). Makes the
        site (and its state on the weight's device) if the weight has none yet.

        Example::

            choice = recipe.state.weight_scale_choice(weight)
            scale = choice.scale if choice.mode == "given" else choice.of_amax(global_amax, dtype)
        """
        site = self.site_now(weight)
        if site is None:
            return self.rule.choose(None, "weight")
        self.prepare(site, weight.device)
        return self.rule.choose(site.roles["weight"], "weight")

    # -- the optimizer step -----------------------------------------------------------------
    def watch(self) -> None:
        """Has ``_step_hooks`` call this state's step hooks around every optimizer step."""
        if not _step_hooks.watching(self):
            _step_hooks.watch(self)

    def before_optimizer_step(self, optimizer) -> None:
        """The weights are about to change: their fp8 copies are freed."""
        for site in self.registry.sites:
            site.cached = site.cached_bias = None

    def after_optimizer_step(self, optimizer) -> None:
        """The rule's work after the step (delayed scaling's cross-rank reduction)."""
        self.rule.after_optimizer_step(self)

    # -- across ranks -----------------------------------------------------------------------
    def reduce_amaxes(self, group) -> list[RoleState]:
        """One all_reduce(max) of every named site's pending amaxes, then each history
        advances by its reduced amax (where some rank recorded one), by the rule's
        ``record_rule``. Returns the states reduced."""
        import torch.distributed as dist

        named = self.registry.named()
        device = _collective_device(named.values(), group)
        names = sorted(named)
        # Every rank must reduce the same sites in the same order: compare the layouts
        # first (count and checksum, max and -max in one collective); on a mismatch take
        # the union, the missing sites getting state that no call has touched.
        digest = zlib.crc32("\0".join(names).encode()) & 0x7FFFFFFF
        probe = torch.tensor([len(names), -len(names), digest, -digest], dtype=torch.int64, device=device)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
        if probe[0] != -probe[1] or probe[2] != -probe[3]:
            gathered: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, names, group=group)
            for name in sorted(set().union(*gathered)):
                if name not in named:
                    named[name] = self.registry.vacant_site(name)
            names = sorted(named)
        states = []
        for name in names:
            site = named[name]
            self.prepare(site, device)
            states += [site.roles[role] for role in ROLES]
        if not states:
            return []
        pending = torch.stack([s.pending for s in states])
        dist.all_reduce(pending, op=dist.ReduceOp.MAX, group=group)
        f = torch.stack([s.f for s in states])
        maxes = torch.tensor([FORMATS[self.rule.dtype(ROLES[k % len(ROLES)])] for k in range(len(states))],
                             device=device)
        rule = self.rule.record_rule("input")
        advanced = advance_reference(f, pending.clamp_min(0), maxes, rule.margin, rule.power_of_two,
                                     rule.most_recent)
        called = ~(pending < 0)  # nan counts as called: it is recorded, as on one rank
        new = torch.where(called.unsqueeze(-1), advanced, f)
        new[:, F_PENDING] = NO_PENDING
        torch._foreach_copy_([s.f for s in states], list(new.unbind(0)))
        return states

    # -- report -------------------------------------------------------------------------------
    def report(self) -> list[SiteReport]:
        """Per site that has been called: calls, the last amax and scale per role,
        saturated values so far (one synchronization)."""
        out = []
        for i, site in enumerate(self.sites()):
            if not site.roles:
                continue
            calls = int(site.roles["input"].calls)
            if not calls:
                continue
            amax, scale, sat = {}, {}, {}
            for role, st in site.roles.items():
                if int(st.calls):
                    amax[role] = float(st.amax)
                    scale[role] = self.rule.shown_scale(role, st)
                    sat[role] = int(st.saturated)
            out.append(SiteReport(site.name or f"<unnamed {i}>", calls, amax, scale, sat))
        return out

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The checkpoint: ``{}`` for a rule without state, else ``_state_dict``'s format
        for every named site."""
        if self.rule.checkpoint_config() is None:
            return {}
        unnamed = self.registry.unnamed_alive()
        if any(s.roles and int(s.roles["input"].calls) for s in unnamed):
            raise RuntimeError(
                f"{self.owner}.state_dict(): {len(unnamed)} site(s) have no name: their weights belong to no "
                f"module (made in the forward, or called outside any module), so a fresh run could not find "
                f"them; call recipe.bind(model) on the model holding them, or keep such weights in a module"
            )
        return self._named_state()

    def _named_state(self) -> dict:
        sites = {}
        for name, site in sorted(self.registry.named().items()):
            entries = {}
            for role in ROLES:
                state = site.roles.get(role)
                if state is None:
                    state = RoleState(self.rule.history_len, torch.device("cpu"))
                entries.update(_state_dict.entries(state, role))
            kept = _quantize.kept_scale(site)
            if kept is not None:  # the rest of the accumulation window reuses it
                entries[_state_dict.COPY_SCALE] = kept.detach().clone()
            sites[name] = entries
        return {**self.rule.checkpoint_config(), "sites": sites}

    def portable_state(self) -> dict:
        """``state_dict()`` as Python numbers, for pickles (``_state_dict.portable``)."""
        if self.rule.checkpoint_config() is None:
            return {}
        return _state_dict.portable(self._named_state())

    def load_state_dict(self, state_dict: Mapping, strict: bool = True) -> None:
        """Restores ``state_dict()``, all or nothing (``Recipe.load_state_dict`` states the rules)."""
        config = self.rule.checkpoint_config()
        if config is None:
            if not isinstance(state_dict, Mapping):
                raise TypeError(f"{self.owner}.load_state_dict() takes what state_dict() returned (a dict), "
                                f"got {type(state_dict).__name__}")
            if dict(state_dict):
                raise ValueError(f"{self.owner} keeps no state; got keys {sorted(map(str, state_dict))} "
                                 f"(a DelayedScaling checkpoint?): load it into DelayedScaling")
            return
        parsed, copy_scales = _state_dict.parse(state_dict, config)
        registry = self.registry
        known = registry.named() if registry.sites else {}
        targets: dict[str, Site | None] = {}
        for name in parsed:
            site = registry.site_for_name(name)
            if site is not None and site in targets.values():
                other = next(n for n, s in targets.items() if s is site)
                raise ValueError(
                    f"{self.owner}.load_state_dict(): {other!r} and {name!r} both name one weight here (tied), "
                    f"but the checkpoint holds a state for each; load a checkpoint of this model")
            targets[name] = site
        if strict and known:
            unexpected = sorted(n for n, s in targets.items() if s is None)
            missing = sorted(n for n, s in known.items() if not any(t is s for t in targets.values()))
            if unexpected or missing:
                raise ValueError(
                    f"{self.owner}.load_state_dict(): the checkpoint's sites are not this recipe's"
                    + (f"; not in this recipe: {unexpected}" if unexpected else "")
                    + (f"; not in the checkpoint: {missing}" if missing else "")
                    + ". Load a checkpoint of this model, bound the same way (same module names, same "
                      "prefix), or pass strict=False to load the sites that match (the others wait for "
                      "weights of their names)")
        for name, roles in parsed.items():
            site = targets[name] or registry.vacant_site(name)
            for role, f in roles.items():
                state = site.roles.get(role)
                if state is None:
                    state = site.roles[role] = RoleState(0, torch.device("cpu"), f)
                else:
                    state.f.copy_(f.to(state.device))
                state.ready = bool(state.initialized > 0)  # read on the host: a checkpoint is there
                state.probe = None
            if site.roles and len(site.roles) < len(ROLES):
                device = next(iter(site.roles.values())).device
                for role in ROLES:
                    site.roles.setdefault(role, RoleState(self.rule.history_len, device))
            # The loaded state replaces the fp8 copy's too: the copy a checkpoint saved in
            # the middle of an accumulation window is made again with its scale.
            site.cached = None
            if name in copy_scales:
                _quantize.restored(site, copy_scales[name])
                self.watch()


def _collective_device(sites, group) -> torch.device:
    import torch.distributed as dist

    for site in sites:
        for state in site.roles.values():
            if state.device.type != "cpu" or dist.get_backend(group) == "gloo":
                return state.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_torch_compat.keep_out_of_dynamo(globals(), __name__)

"""Which policies are in force, in a form torch.compile guards on: one dtype per configuration.

Our regions switch on an autocast dispatch key of their own (``_dispatch_key.py``), which
torch reports as autocast being enabled for "privateuseone". torch.compile guards on
every device type's autocast state, enabled flag and dtype (Dynamo's global-state guard,
and AOTAutograd's cache key), so a graph traced inside our region is never reused outside
it or inside a native one. What the guards cannot see is *which* policy was in force:
two regions of the same dtype, one with native's table and one with a table of the
user's, trace different casts from the same code.

So the "privateuseone" autocast dtype carries that too: it keeps torch's default
(float16) under built-in policies, and under policies of one's own (and fp8 recipes)
each distinct configuration of the innermost frame gets a dtype of its own, a *token*,
which the guards then compare. Tokens are few (about 45 dtypes): one no graph was traced
under is given to a new configuration when they run out (least recently used first);
one a graph was traced under (``torch._dynamo``'s compile-start callback records the
token in force: it is *pinned*) is not given to another configuration while a compiled
graph may guard on it, that is until ``torch._dynamo.reset()``, which drops every
compiled graph (``release_pins``, called at the next region's entry, which finds
Dynamo's callbacks dropped).

An eager region is never refused: past the last token, a new configuration gets the
overflow token, which no graph is traced under. A compile that starts under it raises
``TokenExhausted`` with the way out; eagerly the overflow token only tells torch's
device threads (below) which configuration is in force, and where two configurations
share it that is ambiguous: a kernel called there raises rather than guess.

The same map lets a kernel called on a thread that torch started with our dispatch-key
state (the autograd engine's device threads run a backward called inside a region)
find the region's contexts (``contexts_for``).
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict

import torch

from .. import _torch_compat

__all__ = ["BUILTIN_TOKEN", "OVERFLOW_TOKEN", "token_for", "contexts_for", "pin_current", "release_pins",
           "TokenExhausted"]

# torch's default autocast dtype for "privateuseone": the token of built-in policies.
BUILTIN_TOKEN = torch.float16
_PU1 = "privateuseone"
_CANDIDATES = tuple(
    sorted(
        {getattr(torch, name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}
        - {BUILTIN_TOKEN},
        key=str,
    )
)
# The token of configurations past the last free one (never pinned, never a graph's).
OVERFLOW_TOKEN = _CANDIDATES[-1]
_CANDIDATES = _CANDIDATES[:-1]


class TokenExhausted(RuntimeError):
    """Every token is held by a configuration torch.compile traced a graph under, and a
    compile started under a new one (eager regions are never refused)."""


class _Tokens:
    # No lock: every step below is one dict, set or list operation, which the interpreter
    # makes atomic, and this runs in every region's enter and exit, where a lock left held
    # by an interrupt would hang the next region. Two threads adding a configuration at
    # once may spend two tokens on it; either is a correct guard for it.
    def __init__(self):
        # configuration key -> token, least recently used first; token -> (key, entries),
        # an entry (device type, policy, weak reference to the fp8 recipe or None): a token
        # keeps no recipe alive.
        self.by_key: OrderedDict = OrderedDict()
        self.by_token: dict = {}
        self.pinned: set = set()
        self.free = list(_CANDIDATES)
        # Keys of the configurations given the overflow token since the pins were last
        # released (more than one: the token no longer names one configuration).
        self.overflow_keys: set = set()
        # fp8 recipes are told apart by a serial number of their own (an id can be reused
        # once a recipe is collected; a weak map forgets a collected recipe).
        self.serials: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.next_serial = itertools.count()


_TOKENS = _Tokens()


def _serial(recipe) -> int:
    if recipe is None:
        return -1
    serial = _TOKENS.serials.get(recipe)
    if serial is None:
        serial = _TOKENS.serials.setdefault(recipe, next(_TOKENS.next_serial))
    return serial


def token_for(active) -> torch.dtype:
    """The token of the enabled contexts ``active`` of the innermost frame."""
    custom = tuple(ctx for ctx in active if ctx.custom or ctx.fp8 is not None)
    if not custom:
        return BUILTIN_TOKEN
    tokens = _TOKENS
    key = tuple((ctx.device_type, ctx.policy._key, _serial(ctx.fp8)) for ctx in custom)
    token = tokens.by_key.get(key)
    if token is not None:
        tokens.by_key.move_to_end(key)
        return token
    entries = tuple(
        (ctx.device_type, ctx.policy, None if ctx.fp8 is None else weakref.ref(ctx.fp8)) for ctx in custom
    )
    token = _free_token(tokens)
    if token is OVERFLOW_TOKEN:  # not kept: the next entry looks for a free token again
        tokens.overflow_keys.add(key)
    else:
        tokens.by_key[key] = token
    tokens.by_token[token] = (key, entries)
    return token


def _free_token(tokens: _Tokens) -> torch.dtype:
    while True:
        try:
            return tokens.free.pop(0)
        except IndexError:
            pass
        stale = next((k for k, t in list(tokens.by_key.items()) if t not in tokens.pinned), None)
        if stale is None:
            return OVERFLOW_TOKEN
        try:
            return tokens.by_key.pop(stale)
        except KeyError:  # another thread took it first: look again
            continue


def _exhausted_message(tokens: _Tokens) -> str:
    return (
        f"dispatch_amp.autocast: torch.compile traced graphs under {len(tokens.pinned)} different "
        f"configurations of policies and fp8 recipes in this process, as many as its guards can "
        f"tell apart, and this region's configuration is a new one, so a graph compiled under it "
        f"could be reused under another. Reuse policies and fp8 recipes across regions rather than "
        f"making new ones per region, or call torch._dynamo.reset() (it drops every compiled graph, "
        f"and with them the configurations they hold; the next region gets a token of its own), "
        f"or run such code in a new process. Eager regions run as they are."
    )


def contexts_for(token: torch.dtype):
    """``(device type, policy, fp8 recipe or None)`` of each context of the configuration
    that holds ``token`` (empty for built-in policies, or once its recipe is gone)."""
    if token is OVERFLOW_TOKEN and len(_TOKENS.overflow_keys) > 1:
        raise TokenExhausted(
            "dispatch_amp.autocast: a thread torch started inside a region (the autograd "
            "engine's device threads run a backward called inside one) cannot tell which "
            "configuration of policies is in force: more configurations than tokens are in "
            "use. Call backward() after the region closes, as with native AMP, or reuse "
            "policies and fp8 recipes across regions. " + _exhausted_message(_TOKENS)
        )
    entry = _TOKENS.by_token.get(token)
    if entry is None:
        return ()
    found = []
    for device_type, policy, recipe_ref in entry[1]:
        recipe = None if recipe_ref is None else recipe_ref()
        if recipe_ref is not None and recipe is None:
            return ()
        found.append((device_type, policy, recipe))
    return tuple(found)


def current_token() -> torch.dtype:
    return torch.get_autocast_dtype(_PU1)


def pin_current() -> bool:
    """Records that a graph is being traced under the token in force; True if it is a
    token of ours (a policy or recipe of one's own in force). Raises ``TokenExhausted``
    under the overflow token: no graph may be traced under it."""
    token = current_token()
    if token is OVERFLOW_TOKEN:
        raise TokenExhausted(_exhausted_message(_TOKENS))
    if token not in _TOKENS.by_token:
        return False
    _TOKENS.pinned.add(token)
    return True


def release_pins() -> None:
    """Forgets which tokens graphs were traced under: after ``torch._dynamo.reset()`` no
    compiled graph is left to guard on them. A configuration keeps its token (and gets
    it pinned again if it is compiled under again); the overflow token's configurations
    get tokens of their own at their next entry."""
    _TOKENS.pinned.clear()
    _TOKENS.overflow_keys.clear()


_torch_compat.keep_out_of_dynamo(globals(), __name__)

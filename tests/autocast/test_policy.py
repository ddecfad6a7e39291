"""Policy: validated op tables, derived copies, custom ops."""

import pytest
import torch

import dispatch_amp as amp
from dispatch_amp.autocast import op_tables
from dispatch_amp.autocast import policy as policy_module
from dispatch_amp.autocast.policy import Policy, policy_with_fp8_ops


def test_builtin_tables_resolve_and_have_no_duplicates():
    for device in op_tables.DEVICE_TABLES:
        p = Policy.for_device(device)
        names = [n for kind in op_tables.KINDS for n in p.ops(kind)]
        assert len(names) == len(set(names)) == len(p.rules)
        assert all(n.startswith("aten::") for n in names)


# Table names native autocast registers in some supported torch releases and not others,
# with the release range that registers them (first that does, first that no longer does).
_BY_VERSION = {
    "cuda": {"rms_norm": ("2.12", None), "linalg_matrix_sqrth": ("2.14", None)},
    "cpu": {"cholesky": (None, "2.14"), "qr": (None, "2.14"), "linalg_matrix_sqrth": ("2.14", None)},
    "xpu": {"rms_norm": ("2.12", None)},
    "mps": {},
}
# Table names only CUDA builds register (cuDNN's RNN).
_CUDA_BUILDS_ONLY = {"cuda": {"_cudnn_rnn"}, "cpu": set(), "xpu": set(), "mps": set()}


def _in_range(since, until):
    return (since is None or torch.__version__ >= since) and (until is None or torch.__version__ < until)


@pytest.mark.parametrize("device", sorted(op_tables.DEVICE_TABLES))
def test_builtin_policy_follows_the_installed_torch(device):
    # Only the names known to differ between releases may be left out (anything else
    # left out is a typo in op_tables.py or a change upstream), and each is in the
    # policy exactly on the releases that register it.
    policy = Policy.for_device(device)
    known = set(_BY_VERSION[device]) | _CUDA_BUILDS_ONLY[device]
    unknown = sorted(set(policy_module.OMITTED[device]) - known)
    assert not unknown, f"left out of the built-in {device} policy on torch {torch.__version__}: {unknown}"
    expected = {name: _in_range(since, until) for name, (since, until) in _BY_VERSION[device].items()}
    expected.update({name: torch.version.cuda is not None for name in _CUDA_BUILDS_ONLY[device]})
    for name, here in expected.items():
        assert (f"aten::{name}" in policy.rules) == here, name
        assert (name in policy_module.OMITTED[device]) == (not here), name
    table = op_tables.DEVICE_TABLES[device][0]  # (table, native's dispatch key)
    listed = sum(len(names) for names in table.values())
    assert len(policy.rules) + len(policy_module.OMITTED[device]) == listed


def test_device_tables_differ_where_native_differs():
    cuda, cpu = Policy.for_device("cuda"), Policy.for_device("cpu")
    # On CPU native leaves layer_norm, softmax and exp in the input dtype (their CUDA entries are fp32).
    for op in ("layer_norm", "softmax", "exp"):
        assert cpu.kind_of(op) is None
        assert cuda.kind_of(op) in (op_tables.FP32, op_tables.FP32_UNLESS_DTYPE)
    assert cuda.kind_of("binary_cross_entropy") == op_tables.BANNED
    assert cpu.kind_of("binary_cross_entropy") == op_tables.FP32
    assert cpu.kind_of("cat") == cuda.kind_of("addcmul") == op_tables.PROMOTE
    # Intel GPUs: CUDA's table less what only CUDA registers.
    xpu = Policy.for_device("xpu")
    assert set(cuda.rules) - set(xpu.rules) <= {"aten::cudnn_convolution", "aten::cudnn_convolution_transpose", "aten::_cudnn_rnn",
                                                "aten::linalg_matrix_sqrth"}
    assert set(xpu.rules) <= set(cuda.rules) and all(cuda.kind_of(op) == k for op, k in xpu.rules.items())
    # Apple GPUs: softmax and sums in float32 even with dtype= (the input is cast), a
    # float32 3-D transposed convolution, batch_norm in float32, no banned op.
    mps = Policy.for_device("mps")
    assert mps.kind_of("softmax") == mps.kind_of("sum") == mps.kind_of("conv_transpose3d") == op_tables.FP32
    assert mps.kind_of("batch_norm") == op_tables.FP32 and cuda.kind_of("batch_norm") is None
    assert mps.kind_of("conv3d") == mps.kind_of("_mps_convolution") == op_tables.LOWER
    assert mps.kind_of("binary_cross_entropy") is None and not mps.ops("banned")


def test_typo_fails_loudly():
    with pytest.raises(ValueError, match="unknown op aten::mmm"):
        Policy({op_tables.LOWER: ["mmm"]})
    with pytest.raises(ValueError, match="unknown cast kind"):
        Policy({"lowr": ["mm"]})
    with pytest.raises(TypeError, match="list of ops"):
        Policy({op_tables.LOWER: "mm"})


@pytest.mark.parametrize("kind, op, functional", [
    ("fp32", "aten::mm.out", "'aten::mm'"),
    ("fp32", "mm.dtype_out", "'aten::mm'"),
    ("fp32", torch.ops.aten.mm.out, "'aten::mm'"),
    ("lower", "aten::add_", "'aten::add'"),
    ("lower", torch.ops.aten.add_, "'aten::add'"),
    ("lower", "aten::add_.Tensor", "'aten::add'"),
    ("lower", "aten::add.out", "'aten::add'"),
    ("promote", "aten::_foreach_add_", "'aten::_foreach_add'"),
    ("fp32_unless_dtype", "aten::sum.IntList_out", "'aten::sum'"),
], ids=str)
def test_an_out_or_in_place_op_is_refused_naming_the_functional_one(kind, op, functional):
    # Out= and in-place overloads are never cast: a rule on one only would be kept and
    # never apply (and a rule on mm.out replaced mm's rule, silently running mm as given).
    base = Policy.for_device("cpu")
    with pytest.raises(ValueError, match=rf"out= or in-place.*never apply.*{functional}"):
        base.with_ops(**{kind: [op]})
    with pytest.raises(ValueError, match="never apply"):
        Policy({kind: [op]})
    assert base.kind_of("mm") == op_tables.LOWER
    # The functional op and its functional overloads are taken.
    assert base.with_ops(fp32=["mm.default"]).kind_of("mm") == op_tables.FP32
    assert base.with_ops(lower=["add"]).kind_of("add.Tensor") == op_tables.LOWER


def test_duplicate_registration_is_rejected():
    with pytest.raises(ValueError, match="aten::mm is registered twice"):
        Policy({op_tables.LOWER: ["mm"], op_tables.FP32: ["aten::mm"]})
    with pytest.raises(ValueError, match="registered twice"):
        Policy({op_tables.LOWER: ["mm", torch.ops.aten.mm.default]})


def test_with_ops_adds_and_moves_without_touching_the_original():
    base = Policy.for_device("cuda")
    derived = base.with_ops(fp32=["mm"], lower=["aten::exp"], name="mine")
    assert derived.kind_of(torch.ops.aten.mm) == op_tables.FP32
    assert derived.kind_of("exp") == op_tables.LOWER
    assert base.kind_of("mm") == op_tables.LOWER and base.kind_of("exp") == op_tables.FP32
    assert derived.name == "mine" and derived != base
    with pytest.raises(ValueError, match="registered twice"):
        base.with_ops(fp32=["mm"], lower=["mm"])


def test_without_ops_removes_and_refuses_unknown():
    p = Policy.for_device("cpu").without_ops("cat", torch.ops.aten.stack)
    assert p.kind_of("cat") is None and p.kind_of("stack") is None
    with pytest.raises(ValueError, match="not in policy"):
        p.without_ops("cat")


def test_policies_are_values():
    a = Policy.for_device("cpu").with_ops(fp32=["mm"])
    b = Policy.for_device("cpu").with_ops(fp32=["mm"])
    assert a == b and hash(a) == hash(b)
    assert Policy(a.table()) == a
    with pytest.raises(TypeError):
        a.rules["aten::mm"] = "lower"  # read-only mapping
    assert "fp32=" in repr(a)


def test_unknown_device_policy():
    with pytest.raises(ValueError, match="built-in policies"):
        Policy.for_device("tpu")


# A custom op, registered once for the whole module.
_lib = torch.library.Library("dispatch_amp_test", "DEF")  # noqa: TOR901
_lib.define("scale2(Tensor x) -> Tensor")
_lib.impl("scale2", lambda x: x * 2, "CompositeExplicitAutograd")


def test_custom_op_can_be_added_and_is_cast():
    policy = Policy.for_device("cpu").with_ops(lower=["dispatch_amp_test::scale2"])
    assert policy.kind_of(torch.ops.dispatch_amp_test.scale2) == op_tables.LOWER
    x = torch.randn(4)
    with amp.autocast("cpu", policy=policy):
        assert torch.ops.dispatch_amp_test.scale2(x).dtype == torch.bfloat16
        assert torch.ops.dispatch_amp_test.scale2.default(x).dtype == torch.bfloat16
    with amp.autocast("cpu"):
        assert torch.ops.dispatch_amp_test.scale2(x).dtype == torch.float32


def test_a_policy_read_back_from_json_casts_like_the_original():
    """Kinds given as strings (here parsed from JSON, so not the interned constants) become
    CastKind members when the policy is built, and the engine casts with them."""
    import json

    import dispatch_amp as amp

    table = json.loads(json.dumps(Policy.for_device("cpu").with_ops(fp32=["mm"]).table()))
    policy = Policy(table, name="from-json")
    assert policy == Policy.for_device("cpu").with_ops(fp32=["mm"])
    assert all(type(kind) is op_tables.CastKind for kind in policy.rules.values())
    a = torch.randn(4, 4)
    with amp.autocast("cpu", policy=policy):
        assert torch.mm(a, a).dtype == torch.float32
        assert torch.bmm(a[None], a[None]).dtype == torch.bfloat16
        assert torch.nn.functional.softmax(a.bfloat16(), -1).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown cast kind"):
        Policy({"lowr": ["mm"]})


def test_cast_kinds_compare_as_their_strings():
    assert op_tables.CastKind.LOWER == "lower" and Policy.for_device("cpu").kind_of("mm") == "lower"
    assert repr(op_tables.CastKind.FP32) == "'fp32'" and f"{op_tables.CastKind.FP32}" == "fp32"


def test_policies_pickle_and_deep_copy_as_values():
    import copy
    import pickle

    custom = Policy.for_device("cuda").with_ops(fp32=["mm"], name="mm-fp32")
    for policy in (Policy.for_device("cpu"), custom):
        for again in (pickle.loads(pickle.dumps(policy)), copy.deepcopy(policy), copy.copy(policy)):
            assert again == policy and hash(again) == hash(policy)
            assert again.name == policy.name and dict(again.rules) == dict(policy.rules)
            with amp.autocast("cpu", dtype=torch.float16, policy=again):
                assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == (
                    torch.float32 if policy is custom else torch.float16)


# -- fp8 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", "cuda", "xpu", "mps"])
def test_the_fp8_policy_marks_linear_and_the_matmuls_the_base_lowers(device):
    base = Policy.for_device(device)
    marked = policy_with_fp8_ops(base)
    assert marked.ops("fp8") == {"aten::linear", "aten::addmm", "aten::mm", "aten::matmul"}
    # Limited to the overloads the base lowers: the others keep their rule (none).
    for op in ("addmm", "mm", "matmul", "linear"):
        assert marked.overloads_of(op) == base.overloads_of(op)
    assert marked.kind_of("mm.dtype") is None and marked.kind_of("addmm.dtype") is None
    assert marked.without_ops("linear", "addmm", "mm", "matmul") == base.without_ops("linear", "addmm", "mm", "matmul")


def test_the_fp8_policy_leaves_a_matmul_of_another_kind_alone():
    base = Policy.for_device("cpu").with_ops(fp32=["mm"]).without_ops("matmul")
    marked = policy_with_fp8_ops(base)
    assert marked.kind_of("mm") == "fp32" and marked.kind_of("matmul") is None
    assert marked.ops("fp8") == {"aten::linear", "aten::addmm"}


def test_only_linear_and_its_matmuls_can_be_fp8_and_a_typo_fails():
    for op in ("linear", "addmm", "mm", "matmul", "mm.default"):
        assert Policy.for_device("cpu").with_ops(fp8=[op]).kind_of(op) == "fp8"
    with pytest.raises(ValueError, match=r"aten::bmm cannot be fp8: the fp8 path implements \['aten::linear', "
                                         r"'aten::addmm', 'aten::mm', 'aten::matmul'\]"):
        Policy.for_device("cpu").with_ops(fp8=["bmm"])
    with pytest.raises(ValueError, match="unknown op aten::adddmm"):
        Policy.for_device("cpu").with_ops(fp8=["adddmm"])


# -- numerics pinned to a release ----------------------------------------------------------
import warnings  # noqa: E402

from hypothesis import given, strategies as st  # noqa: E402

from dispatch_amp.autocast import release_tables  # noqa: E402


def _pinned(device, release):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amp.AmpNumericsWarning)
        return Policy.for_device(device, numerics=release)


@pytest.mark.parametrize("device", sorted(op_tables.DEVICE_TABLES))
def test_the_running_release_pinned_is_the_default_policy(device):
    release = release_tables.running_release()
    if release not in release_tables.RELEASES:
        pytest.skip(f"no table ships for torch {torch.__version__}")
    assert Policy.for_device(device, numerics=release) is Policy.for_device(device)


@pytest.mark.parametrize("release", release_tables.RELEASES)
@pytest.mark.parametrize("device", sorted(op_tables.DEVICE_TABLES))
def test_a_pinned_policy_casts_as_the_releases_recorded_table(device, release):
    # Every overload the release registers (and this torch has) gets the release's kind;
    # every other castable overload of a listed op, and every op not listed, none.
    pinned = _pinned(device, release)
    recorded = release_tables.registrations(release, device)
    listed = {}
    for kind, entries in recorded.items():
        for entry in entries:
            listed[entry if "." in entry else entry + ".default"] = kind
    for name in pinned.rules:
        for op in policy_module.castable_overloads(name):
            entry = f"{name}.{op._overloadname}"
            tensor_taking = any("Tensor" in str(a.type) for a in op._schema.arguments)
            if tensor_taking:
                assert pinned.kind_of(op) == listed.get(entry), entry
    assert {e.partition(".")[0] for e in listed if _exists(e)} == set(pinned.rules)


def _exists(entry):
    op, _, overload = entry.partition("::")[2].partition(".")
    packet = getattr(torch.ops.aten, op, None)
    return packet is not None and overload in packet.overloads()


def _running_before(release):
    def as_tuple(text):
        return tuple(int(part) for part in text.split("."))

    return as_tuple(release_tables.running_release()) < as_tuple(release)


def test_torch_2_11_cuda_left_rms_norm_alone_and_the_engine_follows(monkeypatch):
    # The CUDA tables applied to CPU tensors: 2.11 did not list rms_norm, so a float16
    # input stays float16; from 2.12 on it runs in float32. The running torch's own table
    # is 2.11's on 2.11 itself.
    from dispatch_amp.autocast._state import DeviceContext

    old, new = _pinned("cuda", "2.11"), _pinned("cuda", "2.12")
    assert old.kind_of("rms_norm") is None and new.kind_of("rms_norm") == "fp32"
    assert old != new and old.without_ops("mm") == _pinned("cuda", "2.11").without_ops("mm")
    here_dtype = torch.float16 if _running_before("2.12") else torch.float32
    assert (old == Policy.for_device("cuda")) == _running_before("2.12")
    x, w = torch.randn(4, 8, dtype=torch.float16), torch.rand(8, dtype=torch.float16)
    for policy, dtype in ((old, torch.float16), (new, torch.float32), (Policy.for_device("cuda"), here_dtype)):
        with amp.autocast("cpu", dtype=torch.float16, policy=policy):
            got = torch.nn.functional.rms_norm(x, (8,), w)
            assert got.dtype == dtype
            assert torch.mm(x.float(), x.float().t()).dtype == torch.float16
        want = torch.nn.functional.rms_norm(x.to(dtype), (8,), w.to(dtype))
        assert torch.equal(got, want)
    # On the CUDA device type another release's table is a policy of one's own for the
    # engine; the running release's is the built-in one.
    assert DeviceContext("cuda", True, torch.float16, old, True).custom == (release_tables.running_release() != "2.11")
    if release_tables.running_release() in release_tables.RELEASES:
        here = _pinned("cuda", release_tables.running_release())
        assert not DeviceContext("cuda", True, torch.float16, here, True).custom


def test_an_op_the_release_cast_and_this_torch_lacks_is_reported_once(monkeypatch):
    monkeypatch.setattr(policy_module, "_PINNED", {})
    lacking = "aten::linalg_matrix_sqrth" if release_tables.running_release() < "2.14" else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = Policy.for_device("cpu", numerics="2.14")
        again = Policy.for_device("cpu", numerics="2.14")
    assert first is again
    ours = [w for w in caught if issubclass(w.category, amp.AmpNumericsWarning)]
    if lacking is None:
        assert not ours
    else:
        assert len(ours) == 1 and lacking in str(ours[0].message) and "torch 2.14's cpu" in str(ours[0].message)
        assert ours[0].filename == __file__
    assert "aten::cholesky" not in first.rules and first.kind_of("linalg_cholesky") == "fp32"


@pytest.mark.parametrize("bad", ["2.10", "2.16", "latest", "2", 2.11, ""])
def test_a_release_no_table_ships_for_is_refused_listing_those_that_do(bad):
    with pytest.raises(ValueError, match=r"names no shipped torch release; shipped releases: \['2.11', "):
        Policy.for_device("cuda", numerics=bad)
    with pytest.raises(ValueError, match="built-in policies"):
        Policy.for_device("tpu", numerics="2.11")


def test_pinned_policies_are_values_sharing_their_plans():
    from dispatch_amp.autocast._routing import plan_for

    a = _pinned("cpu", "2.14").with_ops(fp32=["mm"])
    b = Policy(a.table(), name="another name")
    assert a == b and hash(a) == hash(b) and plan_for(a, "cpu") is plan_for(b, "cpu")
    # 2.13's CPU table is 2.14's with cholesky and qr (2.11 and 2.12 register named-tensor
    # overloads as well).
    if release_tables.running_release() == "2.13":
        c = Policy.for_device("cpu").without_ops("cholesky", "qr").with_ops(fp32=["mm"])
        assert c == a and plan_for(c, "cpu") is plan_for(a, "cpu")


def test_patch_torch_applies_a_pinned_policy():
    x, w = torch.randn(4, 8, dtype=torch.float16), torch.rand(8, dtype=torch.float16)
    with amp.patch_torch(policy=_pinned("cuda", "2.11")):
        with torch.autocast("cpu", dtype=torch.float16):
            assert torch.nn.functional.rms_norm(x, (8,), w).dtype == torch.float16
    with amp.patch_torch(policy=_pinned("cuda", "2.12")):
        with torch.autocast("cpu", dtype=torch.float16):
            assert torch.nn.functional.rms_norm(x, (8,), w).dtype == torch.float32


# -- as data --------------------------------------------------------------------------------
def test_to_dict_from_dict_round_trip_exactly():
    for policy in (Policy.for_device("cpu"), _pinned("cuda", "2.11").with_ops(fp8=["linear"], name="x"),
                   Policy.for_device("cpu").with_ops(lower=["dispatch_amp_test::scale2"]), Policy({})):
        again = Policy.from_dict(policy.to_dict())
        assert again == policy and again._key == policy._key and again.name == policy.name
        assert again.to_dict() == policy.to_dict()


_OPS = sorted(Policy.for_device("cuda").rules) + ["aten::cumsum.default", "aten::mm.dtype", "dispatch_amp_test::scale2"]


@st.composite
def policies(draw):
    device = draw(st.sampled_from(sorted(op_tables.DEVICE_TABLES)))
    release = draw(st.sampled_from([None, *release_tables.RELEASES]))
    policy = _pinned(device, release) if release else Policy.for_device(device)
    removed = draw(st.lists(st.sampled_from(sorted(policy.rules)), unique=True, max_size=5))
    if removed:
        policy = policy.without_ops(*removed)
    changes: dict = {}
    for op in draw(st.lists(st.sampled_from(_OPS), unique_by=lambda o: o.partition(".")[0], max_size=6)):
        kind = draw(st.sampled_from(["lower", "fp32", "fp32_unless_dtype", "promote", "banned"]))
        changes.setdefault(kind, []).append(op)
    if draw(st.booleans()):
        changes.setdefault("fp8", []).append("linear")
        changes = {k: [o for o in v if o.partition(".")[0] not in ("linear", "aten::linear") or k == "fp8"]
                   for k, v in changes.items()}
    name = draw(st.text(max_size=12))
    return policy.with_ops(**changes, name=name) if changes else policy


@given(policies())
def test_any_policy_round_trips_through_its_dict(policy):
    again = Policy.from_dict(policy.to_dict())
    assert again == policy and again.name == policy.name and again.table() == policy.table()


def test_from_dict_names_the_key_at_fault():
    from dispatch_amp.config import ConfigError

    good = Policy.for_device("cpu").to_dict()
    cases = [
        ({**good, "rulez": {}}, "rulez", r"unknown key 'rulez' \(did you mean 'rules'\?\)"),
        ({**good, "rules": {**good["rules"], "lowr": ["mm"]}}, "rules.lowr", "did you mean 'lower'"),
        ({**good, "rules": {"fp32": ["aten::mmm"]}}, "rules.fp32", "unknown op aten::mmm"),
        ({**good, "rules": {"fp32": "aten::mm"}}, "rules.fp32", "a list of op names"),
        ({**good, "rules": {"fp8": ["bmm"]}}, "rules.fp8", "cannot be fp8"),
        ({**good, "rules": {"fp32": ["mm"], "lower": ["mm"]}}, "rules", "registered twice"),
        ({**good, "format": 2}, "format", "newer dispatch_amp"),
        ({**good, "kind": "plan"}, "kind", "reads kind 'policy'"),
        ({k: v for k, v in good.items() if k != "rules"}, "rules", "missing"),
        ({**good, "name": 3}, "name", "a string"),
    ]
    for data, key, message in cases:
        with pytest.raises(ConfigError, match=message) as caught:
            Policy.from_dict(data)
        assert caught.value.key == key

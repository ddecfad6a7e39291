"""Precision plans as TOML and JSON files: exact round trips, errors naming the key (and
the line), and a loaded plan that runs a model to the same bits as the plan it was dumped from."""

from __future__ import annotations

import copy
import json
import tomllib

import pytest
import torch
from hypothesis import given, strategies as st

import dispatch_amp as amp
from dispatch_amp import Policy, PrecisionPlan
from dispatch_amp.config import ConfigError
from dispatch_amp.config.plan_file import plan_from_dict, plan_to_dict

from benchmarks import models as M

CFG = M.GPTConfig(vocab=64, d_model=32, n_heads=2, n_blocks=4, max_len=16)
MINE = Policy.for_device("cpu").with_ops(fp32=["bmm"], name="bmm in fp32")


def _recipe_config(recipe):
    data = plan_to_dict(PrecisionPlan({"x": recipe}))["fp8"]
    return next(iter(data.values()))


def _same_plan(a: PrecisionPlan, b: PrecisionPlan) -> None:
    """Every setting equal: patterns and their order, dtypes as given, policies (and their
    names), recipes by class and configuration, and which patterns share one recipe."""
    da, db = a.to_dict(), b.to_dict()
    assert list(da["modules"]) == list(db["modules"])
    assert {k: v for k, v in da.items() if k not in ("modules", "default")} == \
        {k: v for k, v in db.items() if k not in ("modules", "default")}
    recipes_a, recipes_b = {}, {}

    def same(x, y):
        if isinstance(x, Policy):
            assert isinstance(y, Policy) and x == y and x.name == y.name
        elif isinstance(x, amp.fp8.Recipe):
            assert type(x) is type(y) and _recipe_config(x) == _recipe_config(y)
            # One recipe in a is one recipe in b: shared state stays shared.
            assert recipes_a.setdefault(id(x), y) is y and recipes_b.setdefault(id(y), x) is x
        elif isinstance(x, dict):
            assert isinstance(y, dict) and list(x) == list(y)
            for k in x:
                same(x[k], y[k])
        else:
            assert x == y

    same(da["default"], db["default"])
    for pattern in da["modules"]:
        same(da["modules"][pattern], db["modules"][pattern])


def _plans():
    shared = amp.fp8.DelayedScaling(amax_history_len=4, margin=1, amax_compute_algo="most_recent")
    return [
        PrecisionPlan({"head": torch.float32}),
        PrecisionPlan({"lm_head": "fp32", "layers.*": shared, "layers.0": MINE,
                       "*.norm*": {"dtype": "fp16", "policy": MINE},
                       "layers.1": "no_fp8", "layers.2": {"fp8": shared}, "x[!0-3]?": amp.fp8.CurrentScaling(),
                       'odd "name" ü': amp.fp8.RowwiseScaling(weight_grad_high_precision=True, power_of_two=True),
                       "empty": {}},
                      default="bf16", dtype=torch.bfloat16, device_type="cuda", cache_enabled=False),
        PrecisionPlan({"a": torch.bfloat16}, default={"fp8": amp.fp8.CurrentScaling(forward_format=torch.float8_e5m2)}),
        PrecisionPlan({}, default=MINE),
    ]


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_a_plan_file_round_trips_exactly(tmp_path, suffix):
    for i, plan in enumerate(_plans()):
        path = amp.config.dump(plan, tmp_path / f"plan{i}{suffix}")
        again = amp.config.load(path)
        assert isinstance(again, PrecisionPlan)
        _same_plan(plan, again)
        # Written again, the file is the same text.
        assert amp.config.dumps(again, suffix[1:]) == path.read_text(encoding="utf-8")


def test_the_file_is_plain_data_in_both_formats_and_says_its_kind():
    plan = _plans()[1]
    text = amp.config.dumps(plan)
    assert text.startswith('kind = "precision_plan"\nformat = 1\n')
    data = tomllib.loads(text)
    assert data == json.loads(amp.config.dumps(plan, "json")) == plan_to_dict(plan)
    # Shared recipes are written once; policies under their names.
    assert list(data["fp8"]) == ["delayed_scaling", "current_scaling", "rowwise_scaling"]
    assert list(data["policies"]) == ["bmm_in_fp32"]
    assert data["fp8"]["delayed_scaling"] == {
        "recipe": "DelayedScaling", "amax_history_len": 4, "amax_compute_algo": "most_recent", "margin": 1,
        "forward_format": "float8_e4m3fn", "grad_format": "float8_e5m2", "power_of_two": False, "reduce_amax": True}
    # The recipe's configuration, never its runtime state.
    assert "sites" not in data["fp8"]["delayed_scaling"]


# -- property: any plan round-trips ---------------------------------------------------------------
_PATTERNS = st.one_of(
    st.sampled_from(["head", "layers.*", "layers.0", "*.norm*", "blocks.[0-2]", "a?b", "[!x]*"]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=10),
)
_DTYPES = st.sampled_from(["float32", "fp32", "float", "bfloat16", "bf16", "float16", "fp16", "half",
                           torch.float32, torch.bfloat16, torch.float16])
_LOW = st.sampled_from(["bf16", "float16", torch.bfloat16, torch.float16])


@st.composite
def _recipes(draw):
    kind = draw(st.sampled_from(["current", "delayed", "rowwise"]))
    p2 = draw(st.booleans())
    if kind == "current":
        return amp.fp8.CurrentScaling(power_of_two=p2, grad_format=draw(st.sampled_from(
            [torch.float8_e5m2, torch.float8_e4m3fn])))
    if kind == "rowwise":
        return amp.fp8.RowwiseScaling(power_of_two=p2, weight_grad_high_precision=draw(st.booleans()))
    return amp.fp8.DelayedScaling(draw(st.integers(1, 64)), draw(st.sampled_from(["max", "most_recent"])),
                                  draw(st.integers(0, 3)), reduce_amax=draw(st.booleans()), power_of_two=p2)


@st.composite
def _plans_drawn(draw):
    pool = draw(st.lists(_recipes(), min_size=1, max_size=3))
    policies = [MINE, Policy.for_device("cpu").without_ops("mm", name="no mm"), Policy({}, name="")]
    recipe = st.sampled_from(pool)
    policy = st.sampled_from(policies)
    table = st.fixed_dictionaries({}, optional={"dtype": _LOW, "policy": policy, "fp8": recipe})
    setting = st.one_of(_DTYPES, st.just("no_fp8"), policy, recipe, table,
                        st.fixed_dictionaries({"dtype": st.just("float32")}))
    patterns = []
    for text in draw(st.lists(_PATTERNS, unique=True, max_size=6)):
        try:
            PrecisionPlan({text: "bf16"})
        except ValueError:
            continue
        patterns.append(text)
    modules = {p: draw(setting) for p in patterns}
    return PrecisionPlan(modules, default=draw(st.none() | setting), dtype=draw(st.none() | _LOW),
                         device_type=draw(st.sampled_from([None, "cpu", "cuda"])), cache_enabled=draw(st.booleans()))


@given(plan=_plans_drawn(), fmt=st.sampled_from(["toml", "json"]))
def test_any_plan_round_trips_through_either_format(plan, fmt):
    text = amp.config.dumps(plan, fmt)
    again = amp.config.loads(text, fmt)
    _same_plan(plan, again)
    assert amp.config.dumps(again, fmt) == text


# -- errors ---------------------------------------------------------------------------------------
def _broken(tmp_path, old, new, suffix=".toml", plan=None):
    plan = plan if plan is not None else _plans()[1]
    path = amp.config.dump(plan, tmp_path / f"plan{suffix}")
    text = path.read_text()
    # JSON writes `"margin": 1` where TOML writes `margin = 1`.
    if suffix == ".json" and old.endswith(" ="):
        old, new = f'"{old[:-2]}":', f'"{new[:-2]}":'
    assert old in text, old
    path.write_text(text.replace(old, new, 1))
    lines = path.read_text().splitlines()
    return path, next(i for i, line in enumerate(lines, 1) if new.strip() in line)


@pytest.mark.parametrize("suffix", [".toml", ".json"])
@pytest.mark.parametrize("old, new, key, message", [
    ('"fp32"', '"fp23"', "modules[0].setting", r"unknown dtype \(did you mean 'fp32'\?\)"),
    ('"fp16"', '"fp61"', "modules[3].setting.dtype", "unknown dtype"),
    ('"bfloat16"', '"bfloat"', "dtype", r"dtype = 'bfloat': unknown dtype"),
    ('"DelayedScaling"', '"DelayedScalling"', "fp8.delayed_scaling.recipe",
     r"unknown recipe \(did you mean 'DelayedScaling'\?\)"),
    ("margin =", "margn =", "fp8.delayed_scaling.margn",
     r"unknown argument of DelayedScaling 'margn' \(did you mean 'margin'"),
    ('"x[!0-3]?"', '"x[3-0]?"', "modules[6].pattern", "not a valid pattern"),
    ("cache_enabled", "cache_enable", "cache_enable", r"unknown key 'cache_enable' \(did you mean 'cache_enabled'"),
    ('"aten::bmm"', '"aten::bmmm"', "policies.bmm_in_fp32.rules.fp32", "unknown op aten::bmmm"),
    ('"current_scaling"', '"curent_scaling"', "modules[6].fp8",
     r"no \[fp8.curent_scaling\].*did you mean 'current_scaling'"),
])
def test_a_typo_fails_at_load_naming_the_key_and_line(tmp_path, suffix, old, new, key, message):
    path, line = _broken(tmp_path, old, new, suffix)
    with pytest.raises(ConfigError, match=message) as caught:
        amp.config.load(path)
    assert caught.value.key == key and caught.value.line == line, (caught.value.key, caught.value.line, line)
    assert str(caught.value).startswith(f"{path}:{line}: {key}")


def test_an_unknown_key_of_an_entry_or_a_setting_table_is_named(tmp_path):
    path, line = _broken(tmp_path, '\npolicy = "bmm_in_fp32"', '\npolcy = "bmm_in_fp32"')
    with pytest.raises(ConfigError, match=r"unknown key 'polcy' \(did you mean 'policy'\?\)") as caught:
        amp.config.load(path)
    assert caught.value.key == "modules[2].polcy" and caught.value.line == line
    path, line = _broken(tmp_path, 'dtype = "fp16"', 'dtpye = "fp16"')
    with pytest.raises(ConfigError, match="unknown key 'dtpye'") as caught:
        amp.config.load(path)
    assert caught.value.key == "modules[3].setting.dtpye" and caught.value.line == line


def _data(**changes):
    data = plan_to_dict(_plans()[1])
    data.update(changes)
    return data


def test_bad_plans_are_refused_clearly():
    entry = {"pattern": "a", "setting": "bf16"}
    cases = [
        (_data(modules=[entry, dict(entry)]), "modules[1].pattern", "a second entry for this pattern"),
        (_data(modules=[{"setting": "bf16"}]), "modules[0].pattern", "missing"),
        (_data(modules=[{"pattern": "", "setting": "bf16"}]), "modules[0].pattern", "empty pattern"),
        (_data(modules=[{"pattern": "a", "setting": "bf16", "fp8": "current_scaling"}]), "modules[0]",
         "give one of"),
        (_data(modules=[{"pattern": "a", "setting": {"dtype": "fp32", "policy": "bmm_in_fp32"}}]), "modules[0]",
         "float32 turns autocast off"),
        (_data(modules=[entry]), "policies.bmm_in_fp32", "defined, but no setting names it"),
        (_data(modules={"a": "bf16"}), "modules", "a list of tables"),
        (_data(format=2), "format", "upgrade"),
        (_data(device_type="tpu"), "device_type", "tpu"),
        (_data(cache_enabled="yes"), "cache_enabled", "true or false"),
        ({"kind": "precision_plan", "format": 1}, "modules", "missing"),
    ]
    for data, key, message in cases:
        with pytest.raises(ConfigError, match=message) as caught:
            plan_from_dict(data)
        assert caught.value.key == key, (key, caught.value.key, str(caught.value))
    fp8 = _data()["fp8"]
    with pytest.raises(ConfigError, match="amax_history_len must be a positive int") as caught:
        plan_from_dict(_data(fp8={**fp8, "delayed_scaling": {**fp8["delayed_scaling"], "amax_history_len": 0}}))
    assert caught.value.key == "fp8.delayed_scaling.amax_history_len"
    with pytest.raises(ConfigError, match="not a torch dtype name") as caught:
        plan_from_dict(_data(fp8={**fp8, "current_scaling": {"recipe": "CurrentScaling", "forward_format": "e4m3"}}))
    assert caught.value.key == "fp8.current_scaling.forward_format"


def test_what_a_file_cannot_hold_fails_at_dump():
    with pytest.raises(ValueError, match="filter_fn, which is code"):
        amp.config.dumps(PrecisionPlan({"a": amp.fp8.CurrentScaling(filter_fn=lambda *a: True)}))

    class Mine(amp.fp8.CurrentScaling):
        pass

    with pytest.raises(TypeError, match="Mine is not one"):
        amp.config.dumps(PrecisionPlan({"a": Mine()}))


# -- end to end -----------------------------------------------------------------------------------
def test_a_plan_loaded_from_its_toml_runs_the_model_to_the_same_bits(tmp_path):
    torch.manual_seed(0)
    model = M.GPT(CFG)
    twin = copy.deepcopy(model)
    plan = PrecisionPlan.keep_ends(model, head="head", rest=amp.fp8.CurrentScaling(), dtype=torch.bfloat16)
    plan = PrecisionPlan({**plan.to_dict()["modules"], "blocks.1": MINE, "*.ln*": torch.float32}, dtype="bf16")
    loaded = amp.config.load(amp.config.dump(plan, tmp_path / "plan.toml"))
    plan.bind(model)
    loaded.bind(twin)
    x, y = M.gpt_batch(CFG, 2, 8, generator=torch.Generator().manual_seed(1))
    with amp.autocast("cpu"):
        want, got = model.loss(x, y), twin.loss(x, y)
    assert torch.equal(got, want)
    want.backward()
    got.backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), twin.parameters()))
    # The plan took effect: not the numbers of the model without one.
    plan.unbind()
    with amp.autocast("cpu"):
        plain = model.loss(x, y)
    assert not torch.equal(plain, want)


def test_a_plan_in_a_checkpoint_is_plain_data():
    import io

    plan = _plans()[1]
    buffer = io.BytesIO()
    torch.save({"plan": amp.config.state_dict(plan)}, buffer)
    buffer.seek(0)
    _same_plan(plan, amp.config.load_state_dict(torch.load(buffer, weights_only=True)["plan"]))

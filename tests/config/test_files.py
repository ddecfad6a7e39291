"""Policies as TOML and JSON files: exact round trips, and errors that name file, line and key."""

from __future__ import annotations

import json
import tomllib
import warnings

import pytest
from hypothesis import given, strategies as st

import dispatch_amp as amp
from dispatch_amp import Policy
from dispatch_amp.config import ConfigError


def _policies():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amp.AmpNumericsWarning)
        pinned = Policy.for_device("cuda", numerics="2.11")
    return [Policy.for_device("cpu"), pinned.with_ops(fp8=["linear"], fp32=["mm.default"], name='odd "name"\n\tü'),
            Policy({}, name="")]


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_a_policy_file_round_trips_exactly(tmp_path, suffix):
    for i, policy in enumerate(_policies()):
        path = amp.config.dump(policy, tmp_path / f"p{i}{suffix}")
        again = amp.config.load(path)
        assert again == policy and again.name == policy.name and again.table() == policy.table()
        assert amp.config.dumps(again, suffix[1:]) == path.read_text(encoding="utf-8")


_NAMES = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20)


@given(name=_NAMES, removed=st.lists(st.sampled_from(sorted(Policy.for_device("cpu").rules)), unique=True, max_size=4),
       fp32=st.lists(st.sampled_from(["mm", "bmm", "exp", "aten::mm.dtype", "softmax"]), unique=True, max_size=3),
       fmt=st.sampled_from(["toml", "json"]))
def test_any_policy_round_trips_through_either_format(name, removed, fp32, fmt):
    policy = Policy.for_device("cpu")
    if removed:
        policy = policy.without_ops(*removed)
    policy = policy.with_ops(fp32=[op for op in fp32 if op != "aten::mm.dtype" or "mm" not in fp32], name=name)
    text = amp.config.dumps(policy, fmt)
    again = amp.config.loads(text, fmt)
    assert again == policy and again.name == policy.name and again.to_dict() == policy.to_dict()


def test_the_toml_file_is_what_tomllib_reads_and_says_its_kind():
    text = amp.config.dumps(Policy.for_device("cpu"))
    data = tomllib.loads(text)
    assert data == Policy.for_device("cpu").to_dict() == json.loads(amp.config.dumps(Policy.for_device("cpu"), "json"))
    assert text.startswith('kind = "policy"\nformat = 1\n')


def _broken(tmp_path, old, new, suffix=".toml"):
    path = amp.config.dump(Policy.for_device("cpu"), tmp_path / f"p{suffix}")
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    lines = path.read_text().splitlines()
    return path, next(i for i, line in enumerate(lines, 1) if new.strip() in line)


@pytest.mark.parametrize("suffix", [".toml", ".json"])
@pytest.mark.parametrize("old, new, key, message", [
    ('"aten::conv2d"', '"aten::conv2dd"', "rules.lower", "unknown op aten::conv2dd"),
    ("promote", "promot", "rules.promot", r"unknown cast kind 'promot' \(did you mean 'promote'\?\)"),
    # stack: in the CPU table's promote list under the same name on every release (cat is
    # "aten::cat.default" there on 2.11 and 2.12, beside its named overload)
    ('"aten::stack"', '"aten::float32"', "rules.promote", "unknown op aten::float32"),
    ("name", "nmae", "nmae", r"unknown key 'nmae' \(did you mean 'name'\?\)"),
])
def test_a_typo_fails_at_load_naming_file_line_and_key(tmp_path, suffix, old, new, key, message):
    path, line = _broken(tmp_path, old, new, suffix)
    with pytest.raises(ConfigError, match=message) as caught:
        amp.config.load(path)
    assert caught.value.key == key and caught.value.line == line
    assert str(caught.value).startswith(f"{path}:{line}: {key}")


def test_bad_files_are_refused_clearly(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('kind = "policy"\nformat = 1\n[rules\n')
    with pytest.raises(ConfigError, match="not valid TOML"):
        amp.config.load(bad)
    bad.write_text('kind = "module_plan"\nformat = 1\n')
    with pytest.raises(ConfigError, match=r"kind = 'module_plan': unknown kind; known kinds: \['policy', 'precision_plan'\]"):
        amp.config.load(bad)
    bad.write_text('format = 1\n')
    with pytest.raises(ConfigError, match="kind: missing"):
        amp.config.load(bad)
    with pytest.raises(ValueError, match=r"ends in \.toml or \.json"):
        amp.config.dump(Policy.for_device("cpu"), tmp_path / "p.yaml")
    with pytest.raises(TypeError, match="cannot write a dict"):
        amp.config.dump({}, tmp_path / "p.toml")


def test_another_kind_plugs_in():
    class Note:
        def __init__(self, text):
            self.text = text

        def to_dict(self):
            return {"kind": "test_note", "format": 1, "text": self.text}

        @classmethod
        def from_dict(cls, data):
            return cls(data["text"])

    amp.config.register_kind("test_note", Note)
    try:
        assert amp.config.loads(amp.config.dumps(Note("hi"))).text == "hi"
        with pytest.raises(ValueError, match="already"):
            amp.config.register_kind("test_note", dict)
    finally:
        amp.config.files._KINDS.pop("test_note")


def test_state_dict_for_a_checkpoint():
    import torch

    policy = Policy.for_device("cpu").with_ops(fp32=["mm"])
    ckpt = {"scaler": amp.GradScaler("cpu").state_dict(), amp.config.CHECKPOINT_KEY: amp.config.state_dict(policy)}
    import io

    buffer = io.BytesIO()
    torch.save(ckpt, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert amp.config.load_state_dict(loaded[amp.config.CHECKPOINT_KEY]) == policy

"""policy_diff: per op, what differs between policies, releases and files."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.torch_version import TorchVersion

import dispatch_amp as amp
from dispatch_amp import Policy


def test_2_11_and_2_12_differ_on_cuda_in_rms_norm():
    diff = amp.policy_diff("2.11", "2.12", device_type="cuda")
    assert [(r.op, r.a, r.b) for r in diff] == [("aten::rms_norm", None, "fp32")]
    assert "| aten::rms_norm | - | fp32 |" in str(diff)
    assert not amp.policy_diff("2.14", "2.15", device_type="cpu")
    assert "cast every op alike" in str(amp.policy_diff("2.14", "2.15", device_type="cpu"))


def test_releases_compare_overload_by_overload():
    rows = {r.op: r for r in amp.policy_diff("2.12", "2.13", device_type="cpu")}
    assert set(rows) == {"aten::prod", "aten::index_copy"}
    assert rows["aten::prod"].a == "fp32 [default, dim_Dimname, dim_int]" and rows["aten::prod"].b == "fp32 [default, dim_int]"
    rows = {r.op: (r.a, r.b) for r in amp.policy_diff("2.13", "2.14", device_type="cpu")}
    assert rows == {"aten::cholesky": ("fp32", None), "aten::qr": ("fp32", None), "aten::linalg_matrix_sqrth": (None, "fp32")}


def test_policies_and_files(tmp_path):
    mine = Policy.for_device("cuda").with_ops(fp32=["mm"], fp8=["linear"]).without_ops("exp", name="mine")
    path = amp.config.dump(mine, tmp_path / "mine.toml")
    for side in (mine, path, str(path)):
        rows = {r.op: (r.a, r.b) for r in amp.policy_diff(Policy.for_device("cuda"), side)}
        assert rows["aten::exp"] == ("fp32", None) and rows["aten::linear"] == ("lower", "fp8")
        assert rows["aten::mm"][1] == "fp32"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amp.AmpNumericsWarning)
        rows = {r.op: (r.a, r.b) for r in amp.policy_diff("2.11", Policy.for_device("cuda"), device_type="cuda")}
    # The installed torch's table: rms_norm is float32 on CUDA from 2.12 on, as in 2.11's
    # file where 2.11 is installed (no difference then).
    installed_2_12 = TorchVersion(torch.__version__) >= (2, 12)
    assert rows.get("aten::rms_norm") == ((None, "fp32") if installed_2_12 else None)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="needs its device"):
        amp.policy_diff("2.11", "2.12")
    with pytest.raises(ValueError, match="shipped releases"):
        amp.policy_diff("2.10", "2.12", device_type="cuda")
    with pytest.raises(TypeError, match="compares policies"):
        amp.policy_diff(3, "2.12", device_type="cuda")

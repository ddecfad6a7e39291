"""The shipped native tables of each torch release: valid data, the running release's equal
to its own registrations, and differing between releases exactly where
docs/torch-releases.md says native's tables differ."""

from __future__ import annotations

import pytest
import torch

from dispatch_amp.autocast import op_tables, release_tables

DEVICES = sorted(op_tables.DEVICE_TABLES)


@pytest.mark.parametrize("release", release_tables.RELEASES)
def test_every_shipped_table_loads_and_says_how_it_was_produced(release):
    data = release_tables.load(release)
    assert data["torch"] == release and data["produced"]
    for device in DEVICES:
        assert release_tables.registrations(release, device)["lower"]


def test_the_shipped_table_of_the_running_release_is_its_own_registrations():
    # CI's newest-torch lane runs this too: there the newest release's file is checked
    # against that release itself.
    release = release_tables.running_release()
    if release not in release_tables.RELEASES:
        pytest.skip(f"torch {torch.__version__} is newer than the newest shipped table "
                    f"({release_tables.RELEASES[-1]}): the default policies run its own table")
    here = release_tables.record()
    for device in DEVICES:
        assert release_tables.registrations(release, device) == here[device], device


def _entries(release, device):
    return {e for entries in release_tables.registrations(release, device, cuda_build=True).values() for e in entries}


_NAMED = {
    "cpu": {"aten::index_copy.dimname", "aten::prod.dim_Dimname"},
    "cuda": {"aten::cumprod.dimname", "aten::cumsum.dimname", "aten::log_softmax.Dimname",
             "aten::norm.names_ScalarOpt_dim", "aten::prod.dim_Dimname", "aten::softmax.Dimname",
             "aten::sum.dim_DimnameList"},
}
_NAMED["xpu"] = _NAMED["cuda"]
_NAMED["mps"] = _NAMED["cuda"] - {"aten::norm.names_ScalarOpt_dim"}
# (from, to) -> device -> (added, removed): docs/torch-releases.md's table.
_CHANGES = {
    ("2.11", "2.12"): {"cuda": ({"aten::rms_norm"}, set()), "xpu": ({"aten::rms_norm"}, set())},
    ("2.12", "2.13"): {device: (set(), _NAMED[device]) for device in DEVICES},
    ("2.13", "2.14"): {"cuda": ({"aten::linalg_matrix_sqrth"}, set()),
                       "cpu": ({"aten::linalg_matrix_sqrth"}, {"aten::cholesky", "aten::qr"})},
    ("2.14", "2.15"): {},
}


@pytest.mark.parametrize("older, newer", _CHANGES, ids="-".join)
def test_tables_differ_between_releases_where_native_does(older, newer):
    for device in DEVICES:
        added, removed = _CHANGES[(older, newer)].get(device, (set(), set()))
        a, b = _entries(older, device), _entries(newer, device)
        assert (b - a, a - b) == (added, removed), device


def test_the_cuda_builds_only_entries_join_on_cuda_builds():
    assert "aten::_cudnn_rnn" in release_tables.registrations("2.13", "cuda", cuda_build=True)["lower"]
    assert "aten::_cudnn_rnn" not in release_tables.registrations("2.13", "cuda", cuda_build=False)["lower"]


def test_release_strings():
    assert release_tables.release_of("2.14.1+cu130") == "2.14" == release_tables.release_of("2.14")
    with pytest.raises(ValueError, match=r"shipped releases: \['2.11', '2.12', '2.13', '2.14', '2.15'\]"):
        release_tables.load("2.10")


def test_a_damaged_file_is_refused_naming_what(tmp_path, monkeypatch):
    import json

    data = json.loads((release_tables.DATA / "torch-2.13.json").read_text())
    data["devices"]["cpu"]["fp32"] = sorted([*data["devices"]["cpu"]["fp32"], "aten::mm"])  # lower in op_tables
    (tmp_path / "torch-2.13.json").write_text(json.dumps(data))
    monkeypatch.setattr(release_tables, "DATA", tmp_path)
    release_tables.load.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"cpu.fp32: \['aten::mm'\] have another kind"):
            release_tables.load("2.13")
    finally:
        monkeypatch.undo()
        release_tables.load.cache_clear()

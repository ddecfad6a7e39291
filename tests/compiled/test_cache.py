"""The cache's key and directories: a build never loads into another torch, CPython,
platform or source; the root follows the environment."""

from __future__ import annotations

import shutil
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
import torch

from dispatch_amp._compiled import cache

ROOT = Path(__file__).resolve().parents[2]


def _copy(tmp_path) -> Path:
    csrc = tmp_path / "csrc"
    shutil.copytree(cache.CSRC, csrc)
    return csrc


@pytest.mark.parametrize("change", [
    lambda mp: mp.setattr(torch, "__version__", "2.13.0+cu128"),
    lambda mp: mp.setattr(torch, "__version__", "2.14.0+cpu"),
    lambda mp: mp.setattr(torch.version, "git_version", "0" * 40),
    lambda mp: mp.setattr(torch.version, "cuda", "12.8"),
    lambda mp: mp.setattr(sys.implementation, "cache_tag", "cpython-399"),
    lambda mp: mp.setattr(sys, "abiflags", "t", raising=False),
    lambda mp: mp.setattr(sysconfig, "get_platform", lambda: "linux-aarch64"),
], ids=["local-tag", "release", "git", "cuda", "cpython", "abiflags", "platform"])
def test_every_input_of_the_binary_changes_the_key(monkeypatch, change):
    before = cache.build_key()
    change(monkeypatch)
    after = cache.build_key()
    assert after.digest != before.digest and after.module_name != before.module_name
    assert after.directory(Path("/r")) != before.directory(Path("/r"))


def test_the_sources_and_the_flags_change_the_key(tmp_path):
    csrc = _copy(tmp_path)
    base = cache.build_key(csrc)
    assert base == cache.build_key()  # the same bytes: the same key, wherever they lie
    (csrc / "engine.cpp").write_text((csrc / "engine.cpp").read_text() + "\n// changed\n")
    edited = cache.build_key(csrc)
    (csrc / "kernel.h").write_text("#pragma once\n")  # a header is hashed, though not compiled
    with_header = cache.build_key(csrc)
    flags = cache.build_key(csrc, cflags=("-O3",))
    sources = cache.build_key(csrc, sources=("engine.cpp", "kernel.cpp"))
    digests = {k.digest for k in (base, edited, with_header, flags, sources)}
    assert len(digests) == 5


def test_the_directory_names_torch_and_cpython_and_the_module_the_digest():
    key = cache.build_key()
    directory = key.directory(Path("/cache"))
    assert directory.parent.name == f"torch-{torch.__version__}-{key.python_tag}-{sysconfig.get_platform()}".replace(
        "/", "_")
    assert directory.name == f"engine-{key.digest}" and key.digest in key.module_name
    assert key.module_name.isidentifier()


def test_the_cache_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(cache.CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_root() == tmp_path / "home" / ".cache" / "dispatch_amp"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "dispatch_amp"
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "mine"))
    assert cache.cache_root() == tmp_path / "mine"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(cache.CACHE_ENV, "relative")
    assert cache.cache_root() == tmp_path / "relative"  # absolute: a worker that changes directory finds it


def test_every_source_exists_and_ships_in_the_package():
    assert cache.SOURCES and all((cache.CSRC / name).is_file() for name in cache.SOURCES)
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "dispatch_amp._compiled" in config["packages"]
    shipped = config["package-data"]["dispatch_amp._compiled"]
    for name in cache.SOURCES:
        assert any((cache.CSRC / name).match(str(cache.CSRC.parent / glob)) for glob in shipped), name

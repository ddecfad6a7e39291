"""Native autocast's table of each supported torch release, shipped as data.

``Policy.for_device("cuda", numerics="2.11")`` applies torch 2.11's table on whatever
torch is installed: a user who upgrades torch keeps the casts their model was trained
with. The tables live in ``release_data/torch-<release>.json``, one file per release:
per device type, per cast kind, the overloads native autocast registers for that device's
dispatch key (``"aten::mm"``, ``"aten::pow.Tensor_Scalar"``), exactly as
``torch._C._dispatch_get_registrations_for_dispatch_key`` lists them. Which kind each op
has is ``op_tables``' (the test suite checks those kinds against native on every
release); which ops a release registers is the release's own. ``scripts/
record_release_table.py`` writes the file of the running torch's release from its
registrations; docs/torch-releases.md says how each shipped file was produced.

An entry only CUDA builds register (cuDNN's RNN) is kept apart, under
``"cuda_builds_only"``: a pinned table has it where the installed torch is a CUDA build
too, as the installed torch's own table does.

Example::

    >>> from dispatch_amp.autocast import release_tables
    >>> "aten::rms_norm" in release_tables.registrations("2.12", "cuda")["fp32"]
    True
    >>> "aten::rms_norm" in release_tables.registrations("2.11", "cuda")["fp32"]
    False
"""

from __future__ import annotations

import functools
import json
import pathlib
from collections.abc import Mapping

import torch

from .. import _torch_compat
from . import op_tables

__all__ = ["RELEASES", "FORMAT", "release_of", "running_release", "registrations", "record", "load", "CUDA_BUILDS_ONLY"]

# The releases a table ships for, oldest first (the project's supported range).
RELEASES = ("2.11", "2.12", "2.13", "2.14", "2.15")
# The version of the file layout; a file of another version is refused.
FORMAT = 1
DATA = pathlib.Path(__file__).with_name("release_data")
# Registrations that only CUDA builds make (per device type): a CPU build cannot record them.
CUDA_BUILDS_ONLY = {"cuda": ("aten::_cudnn_rnn",)}
_FILE_KEYS = {"kind", "format", "torch", "produced", "devices", "cuda_builds_only"}


def release_of(version: str) -> str:
    """The release (``"2.13"``) of a torch version string (``"2.13.0+cpu"``).

    Example::

        >>> release_of("2.14.1+cu130")
        '2.14'
    """
    return ".".join(version.split("+")[0].split(".")[:2])


def running_release() -> str:
    """The release of the installed torch."""
    return release_of(torch.__version__)


def _is_cuda_build() -> bool:
    return torch.version.cuda is not None


def record(*, strict: bool = True) -> dict[str, dict[str, list[str]]]:
    """The installed torch's native tables: ``{device type: {kind: sorted overloads}}``,
    read from its registrations, each op given ``op_tables``' kind for the device.

    ``strict``: a registration of an op ``op_tables`` does not list raises ValueError
    (record a release only once ``op_tables`` knows its ops); otherwise it is left out.
    Entries only CUDA builds register stay in (``split_cuda_builds_only`` takes them out).
    """
    tables = {}
    unmapped = []
    for device_type, (table, key) in op_tables.DEVICE_TABLES.items():
        kind_of = {f"aten::{name}": kind.value for kind, names in table.items() for name in names}
        by_kind: dict[str, list[str]] = {kind.value: [] for kind in op_tables.KINDS}
        for entry in _torch_compat.autocast_registration_overloads(key):
            kind = kind_of.get(entry.partition(".")[0])
            if kind is None:
                unmapped.append(f"{key}: {entry}")
            else:
                by_kind[kind].append(entry)
        tables[device_type] = {kind: sorted(entries) for kind, entries in by_kind.items() if entries}
    if strict and unmapped:
        raise ValueError(
            f"torch {torch.__version__} registers ops that op_tables.py does not list: {sorted(unmapped)}; "
            f"add each to its device's table with native's kind before recording this release"
        )
    return tables


def record_file(produced: str) -> dict:
    """The content of the running release's file (``scripts/record_release_table.py``):
    ``record()``, with the entries only CUDA builds register kept apart. A CPU build cannot
    see those: they are taken from ``CUDA_BUILDS_ONLY``, and ``produced`` should say so."""
    devices = record()
    apart: dict[str, list[str]] = {}
    for device_type, entries in CUDA_BUILDS_ONLY.items():
        table = devices[device_type]
        for kind in list(table):
            kept = [e for e in table[kind] if e not in entries]
            apart.setdefault(device_type, []).extend(sorted(set(table[kind]) - set(kept)))
            if kept:
                table[kind] = kept
            else:
                del table[kind]
        if not _is_cuda_build():
            apart[device_type] = list(entries)
        apart[device_type] = sorted(apart[device_type])
    return {
        "kind": "release_table", "format": FORMAT, "torch": running_release(), "produced": produced,
        "devices": devices, "cuda_builds_only": apart,
    }


@functools.cache
def load(release: str) -> dict:
    """The shipped file of ``release`` (``"2.11"``), validated. ValueError for a release
    no table ships for, naming those that do."""
    if release not in RELEASES:
        raise ValueError(
            f"no native table ships for torch release {release!r}; shipped releases: {list(RELEASES)} "
            f"(give the release as 'major.minor', e.g. numerics='2.11')"
        )
    path = DATA / f"torch-{release}.json"
    data = json.loads(path.read_text())
    _validate(data, release, path)
    return data


def _validate(data: Mapping, release: str, path) -> None:
    def fail(what):
        raise ValueError(f"{path}: {what}")

    if set(data) != _FILE_KEYS:
        fail(f"keys {sorted(data)}, expected {sorted(_FILE_KEYS)}")
    if data["kind"] != "release_table" or data["format"] != FORMAT or data["torch"] != release:
        fail(f"kind/format/torch {data['kind']!r}/{data['format']!r}/{data['torch']!r}, "
             f"expected 'release_table'/{FORMAT}/{release!r}")
    if set(data["devices"]) != set(op_tables.DEVICE_TABLES):
        fail(f"devices {sorted(data['devices'])}, expected {sorted(op_tables.DEVICE_TABLES)}")
    kinds = {kind.value for kind in op_tables.KINDS}
    for device_type, table in data["devices"].items():
        listed = {f"aten::{name}": kind.value for kind, names in op_tables.DEVICE_TABLES[device_type][0].items()
                  for name in names}
        for kind, entries in table.items():
            if kind not in kinds:
                fail(f"{device_type}: unknown kind {kind!r}")
            if list(entries) != sorted(set(entries)):
                fail(f"{device_type}.{kind}: entries not sorted or repeated")
            wrong = [e for e in entries if listed.get(e.partition(".")[0]) != kind]
            if wrong:
                fail(f"{device_type}.{kind}: {wrong} have another kind (or none) in op_tables.py")
    for device_type, entries in data["cuda_builds_only"].items():
        if list(entries) != sorted(CUDA_BUILDS_ONLY.get(device_type, ())):
            fail(f"cuda_builds_only.{device_type}: {entries}, expected {CUDA_BUILDS_ONLY.get(device_type, ())}")


def registrations(release: str, device_type: str, *, cuda_build: bool | None = None) -> dict[str, list[str]]:
    """``{kind: overloads}`` that ``release`` registers for ``device_type``, as a build of
    the installed torch's kind would (``cuda_build``: default, whether it is a CUDA build).

    Example::

        >>> registrations("2.13", "cpu")["promote"]
        ['aten::cat', 'aten::index_copy', 'aten::stack']
    """
    data = load(release)
    if device_type not in data["devices"]:
        raise ValueError(
            f"no built-in policy for device type {device_type!r}; built-in policies: {sorted(data['devices'])}"
        )
    table = {kind: list(entries) for kind, entries in data["devices"][device_type].items()}
    if cuda_build if cuda_build is not None else _is_cuda_build():
        listed = {f"aten::{name}": kind.value for kind, names in op_tables.DEVICE_TABLES[device_type][0].items()
                  for name in names}
        for entry in data["cuda_builds_only"].get(device_type, ()):
            kind = listed[entry.partition(".")[0]]
            table[kind] = sorted([*table.get(kind, ()), entry])
    return table

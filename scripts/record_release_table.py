"""Record native autocast's table of the installed torch release as the shipped data file.

    python scripts/record_release_table.py --produced "recorded from torch 2.13.0+cpu"
    python scripts/record_release_table.py --check      # the shipped file matches this torch

Writes ``src/dispatch_amp/autocast/release_data/torch-<release>.json`` from the installed
torch's registrations (``release_tables.record_file``): per device type and cast kind, the
overloads native autocast registers. Needs no GPU: the registrations of every device's
autocast key are made when torch is imported. ``--check`` compares instead of writing and
exits 1, printing what differs, where the shipped file does not match (entries only CUDA
builds register are left out of the comparison on a CPU build).

Run it with the project importable (``pip install -e .``, or ``PYTHONPATH=src``) in an
environment holding the release to record.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

from dispatch_amp.autocast import release_tables


def render(data: dict) -> str:
    """The file's text: one entry per line, so a changed entry is a one-line diff."""
    return json.dumps(data, indent=1) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--produced", default=f"recorded from torch {torch.__version__}",
                        help="how the table was produced, kept in the file")
    parser.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing")
    parser.add_argument("--out", type=pathlib.Path, default=release_tables.DATA, help="folder of the files")
    args = parser.parse_args(argv)
    release = release_tables.running_release()
    if args.check:
        if release not in release_tables.RELEASES:
            print(f"torch {torch.__version__} is newer than the newest shipped table "
                  f"({release_tables.RELEASES[-1]}): the default policies run its own table")
            return 0
        here = release_tables.record()
        differs = []
        for device_type in here:
            shipped = release_tables.registrations(release, device_type)
            for kind in sorted(set(here[device_type]) | set(shipped)):
                a, b = set(shipped.get(kind, ())), set(here[device_type].get(kind, ()))
                if a != b:
                    differs.append(f"{device_type}.{kind}: only shipped {sorted(a - b)}, only here {sorted(b - a)}")
        print("\n".join(differs) or f"the shipped table of {release} matches torch {torch.__version__}")
        return 1 if differs else 0
    data = release_tables.record_file(args.produced)
    path = args.out / f"torch-{release}.json"
    path.write_text(render(data))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

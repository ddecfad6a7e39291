"""``python -m benchmarks [--quick] [--suite NAME] [--no-save]``: see benchmarks/run.py."""

from benchmarks.run import main

main()

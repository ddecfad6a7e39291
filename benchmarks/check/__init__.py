"""The GPU check's parts, run one per process by ``scripts/gpu_check.sh``.

``python -m benchmarks.check PART --out DIR [--dry-run] [--quick]`` runs one part (train,
profile, fp8, scaler), prints its Markdown tables as they are measured and writes
``DIR/PART.csv`` (every row) and ``DIR/PART.targets.csv`` (each target with its value).
``python -m benchmarks.check targets DIR`` prints the targets of every part found there;
``python -m benchmarks.check environment`` prints the machine lines of the report.

``--dry-run`` runs a part on CPU at tiny sizes: the same code, with CPU equivalents for
what needs a GPU (the host clock for CUDA events, CPU profiler activities only), so that
the check cannot rot between GPU runs. ``--quick`` runs tiny sizes on the GPU.
"""

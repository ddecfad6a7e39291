"""kernels: what the Triton kernels compile to for sm_80 / sm_90, without a GPU.

Registers, local-memory spills, the width of the global loads and stores on full tiles
(16 bytes is what makes them bandwidth-bound), and the found_inf stores per program, from
``tools/inspect_ptx.py`` (triton.compile for a CUDA target + the ptxas that
ships with triton). A GPU run later only confirms what this predicts. The same properties
are asserted by tests/kernels/test_ptx.py.
"""

from __future__ import annotations

from .common import Table, verdict

NAME = "kernels"


def _pct(x):
    return None if x is None else 100 * x


def run(opts) -> list[Table]:
    table = Table(
        "kernels: static PTX / ptxas report per kernel and target (nothing launched)",
        [("kernel", "kernel", "{}"), ("target", "target", "{}"), ("num_warps", "warps", "{}"),
         ("registers", "registers", "{}"), ("spills", "spill st/ld (B)", "{}"),
         ("full_loads", "full-tile loads", "{}"), ("full_stores", "full-tile stores", "{}"),
         ("vec_load_pct", "16-byte loads %", "{:.0f}"), ("vec_store_pct", "16-byte stores %", "{:.0f}"),
         ("ragged_loads", "ragged-tile loads", "{}"), ("flag_stores", "found_inf stores/program", "{}"),
         ("target_desc", "target", "{}"), ("met", "met?", "{}")],
        note="Full tile = unmasked [BLOCK] access (8 ld/st.global.v4.b32 per thread over the fp32, fp16 and bf16 paths); "
             "the ragged last tile is masked and stays scalar.",
    )
    try:
        from tools.loader import load  # the repository root is on sys.path here (benchmarks.run)

        reports = load("inspect_ptx").inspect_in_subprocess()
    except Exception as e:  # no triton / no nvidia backend on this machine
        table.note = f"skipped: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        return [table]
    for r in reports:
        tiles = bool(r.full_loads.elem_types)
        ok = r.spill_stores == 0 and r.spill_loads == 0
        if tiles:
            ok = ok and r.full_loads.vector_share == 1.0 and r.flag_stores == 1 and r.flag_stores_in_loops == 0
            if r.full_stores.elem_types:
                ok = ok and r.full_stores.vector_share == 1.0
        table.rows.append({
            "kernel": r.kernel, "target": r.target, "num_warps": r.num_warps, "registers": r.registers,
            "spills": f"{r.spill_stores}/{r.spill_loads}", "stack_frame": r.stack_frame,
            "full_loads": r.full_loads.describe(), "full_stores": r.full_stores.describe(),
            "vec_load_pct": _pct(r.full_loads.vector_share), "vec_store_pct": _pct(r.full_stores.vector_share),
            "ragged_loads": r.ragged_loads.describe(),
            "flag_stores": None if r.flag_stores is None else f"{r.flag_stores} ({r.flag_stores_in_loops} in loops)",
            "target_desc": "16-byte full tiles, 0 spills, 1 flag store" if tiles else "0 spills",
            "met": verdict(0 if ok else 1, 0),
        })
    return [table]

"""Static inspection of the Triton kernels as compiled for NVIDIA GPUs, on a machine without one.

A developer tool, outside the installed package: tests/kernels/test_ptx.py and the
benchmarks' kernels suite load it with :func:`load` from this folder.

Triton compiles for a GPU target without the GPU being present:
``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` gives the Triton IR, the
PTX and (through the ``ptxas`` that ships with triton) a cubin. That is enough to check,
before any GPU run, what makes the memory-bound kernels fast (docs/design.md, "Kernels"):

* full tiles use 16-byte global loads and stores (``ld.global.v4.b32``, also for 16-bit
  gradients, 8 values per access), so a warp moves 512 bytes per instruction;
* ``ptxas -v`` reports no local-memory spills, and how many registers a thread uses;
* the found_inf flag is stored once per program, after the loops, never per tile;
* with per-tensor flags (``PER_TENSOR``) the ``nonfinite`` store sits outside the tile loops
  too, once per tensor segment.

Usage::

    python tools/inspect_ptx.py [--targets 80 90] [--json]

Note: how PTX instructions are tied to the kernel source
--------------------------------------------------------
Triton keeps source locations: every op of the Triton IR (TTIR) carries a ``loc`` that
resolves, through inlined helper calls, to ``file:line`` of the ``tl.load``/``tl.store``
that produced it, and the PTX carries the same lines as ``.loc`` directives. The TTIR
says what each access is (a ``[BLOCK]`` tensor or a scalar, masked or not, which element
type, which pointer argument); the PTX says how wide the instructions are that the
compiler emitted for it. A *full-tile* access is an unmasked tensor ``tt.load``/``tt.store``;
the ragged last tile is masked and may stay scalar.

The ``@triton.jit`` objects must be real JIT functions: under ``TRITON_INTERPRET=1`` (set
by the tests on machines without a GPU) they are interpreter wrappers that cannot be
compiled, so :func:`inspect_in_subprocess` runs this module in a fresh interpreter with the
variable removed.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["KernelReport", "KERNELS", "inspect_kernels", "inspect_in_subprocess", "TARGETS"]

TARGETS = (80, 90)  # compute capabilities checked by default: A100 and H100
VECTOR_BYTES = 16  # the widest global access a thread can issue (ld.global.v4.b32)


# --------------------------------------------------------------------------------------
# What to compile
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelSpec:
    """One compilation: a kernel, its argument types and constexprs, as the launcher passes them."""

    name: str  # reported name
    module: str  # module under dispatch_amp.kernels
    kernel: str  # attribute holding the @triton.jit function
    signature: dict  # argument name -> Triton type string ("*fp32", "i32", "constexpr")
    constexprs: dict  # constexpr name -> value, or name of a module constant (str)
    num_warps: int | str  # value, or name of a module constant
    aligned: tuple = ()  # pointer arguments the launcher always passes 16-byte aligned
    flag_arg: str | None = None  # the found_inf pointer argument, if any
    tensor_flag_arg: str | None = None  # the per-tensor nonfinite pointer argument, if any
    read_only: bool = False  # the kernel must store nothing but the flags


_UNSCALE_SIG = {
    "table_ptr": "*i64",
    "n_tensors": "i32",
    "tiles_per_program": "i32",
    "search_steps": "i32",
    "inv_scale_ptr": "*fp32",
    "found_inf_ptr": "*fp32",
    "nonfinite_ptr": "*fp32",  # without per-tensor flags the launcher passes found_inf here
    "BLOCK": "constexpr",
    "STORE": "constexpr",
    "PER_TENSOR": "constexpr",
}
_UNSCALE_ALIGNED = ("table_ptr", "inv_scale_ptr", "found_inf_ptr", "nonfinite_ptr")
# With flags: the caller's int32 tensor, of unknown alignment (it is only indexed by slot).
_UNSCALE_SIG_PER_TENSOR = {**_UNSCALE_SIG, "nonfinite_ptr": "*i32"}
_UNSCALE_ALIGNED_PER_TENSOR = ("table_ptr", "inv_scale_ptr", "found_inf_ptr")

_BLOCK_SIG = {
    "x_ptr": "*fp32", "q_ptr": "*u8", "qt_ptr": "*u8", "s_ptr": "*fp32", "st_ptr": "*fp32", "amax_ptr": "*i32",
    "M": "i32", "N": "i32", "s_stride0": "i32", "s_stride1": "i32", "st_stride0": "i32", "st_stride1": "i32",
    **{name: "constexpr" for name in ("B", "R", "ROWWISE", "COLWISE", "BLOCKS", "WRITE_Q", "WRITE_QT", "ACC_AMAX",
                                      "IS_BF16", "FP8_MAX", "SAT_ABOVE", "MANT", "BIAS", "POW2")},
}
_BLOCK_CONSTS = {"B": "BLOCK", "R": "_ROWS", "ACC_AMAX": True, "IS_BF16": False, "FP8_MAX": 448.0,
                 "SAT_ABOVE": 464.0, "MANT": 3, "BIAS": 7, "POW2": False}

KERNELS = (
    KernelSpec("unscale_check_", "unscale", "_unscale_check_kernel", _UNSCALE_SIG,
               {"BLOCK": "_BLOCK", "STORE": True, "PER_TENSOR": False}, "_NUM_WARPS",
               aligned=_UNSCALE_ALIGNED, flag_arg="found_inf_ptr", tensor_flag_arg="nonfinite_ptr"),
    KernelSpec("check_finite_", "unscale", "_unscale_check_kernel", _UNSCALE_SIG,
               {"BLOCK": "_BLOCK", "STORE": False, "PER_TENSOR": False}, "_NUM_WARPS",
               aligned=_UNSCALE_ALIGNED, flag_arg="found_inf_ptr", tensor_flag_arg="nonfinite_ptr", read_only=True),
    KernelSpec("unscale_check_+nonfinite", "unscale", "_unscale_check_kernel", _UNSCALE_SIG_PER_TENSOR,
               {"BLOCK": "_BLOCK", "STORE": True, "PER_TENSOR": True}, "_NUM_WARPS",
               aligned=_UNSCALE_ALIGNED_PER_TENSOR, flag_arg="found_inf_ptr", tensor_flag_arg="nonfinite_ptr"),
    KernelSpec("check_finite_+nonfinite", "unscale", "_unscale_check_kernel", _UNSCALE_SIG_PER_TENSOR,
               {"BLOCK": "_BLOCK", "STORE": False, "PER_TENSOR": True}, "_NUM_WARPS",
               aligned=_UNSCALE_ALIGNED_PER_TENSOR, flag_arg="found_inf_ptr", tensor_flag_arg="nonfinite_ptr",
               read_only=True),
    KernelSpec("update_scale_", "scale_update", "_update_scale_kernel",
               {"scale_ptr": "*fp32", "growth_tracker_ptr": "*i32", "found_inf_ptr": "*fp32",
                "hysteresis_tracker_ptr": "*i32", "skipped_ptr": "*i64", "floor_hits_ptr": "*i64",
                "factors_ptr": "*fp64", "growth_interval": "i32", "hysteresis": "i32",
                "HAS_MIN": "constexpr", "HAS_MAX": "constexpr"},
               {"HAS_MIN": False, "HAS_MAX": False}, 4,
               aligned=("scale_ptr", "growth_tracker_ptr", "found_inf_ptr", "hysteresis_tracker_ptr",
                        "skipped_ptr", "floor_hits_ptr", "factors_ptr")),
    # Block scaling's quantize: activations both ways from one read, and weights.
    KernelSpec("quantize_tiles", "fp8_block", "_block_kernel", _BLOCK_SIG,
               {**_BLOCK_CONSTS, "ROWWISE": True, "COLWISE": True, "BLOCKS": False, "WRITE_Q": False,
                "WRITE_QT": False}, "_NUM_WARPS"),
    KernelSpec("quantize_blocks", "fp8_block", "_block_kernel", _BLOCK_SIG,
               {**_BLOCK_CONSTS, "ROWWISE": False, "COLWISE": False, "BLOCKS": True, "WRITE_Q": True,
                "WRITE_QT": True}, "_NUM_WARPS"),
)


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------


@dataclass
class Accesses:
    """The PTX instructions emitted for one class of accesses (e.g. full-tile loads)."""

    widths: dict = field(default_factory=dict)  # PTX instruction -> count, e.g. {"ld.global.v4.b32": 8}
    bytes: int = 0  # bytes per thread those instructions move
    vector_bytes: int = 0  # of which in 16-byte instructions
    expected_bytes: int = 0  # bytes per thread the TTIR accesses move (BLOCK * elem size / threads, summed)
    elem_types: list = field(default_factory=list)  # TTIR element type per access ("f32", "f16", "i16": raw bf16)

    @property
    def vector_share(self) -> float | None:
        return self.vector_bytes / self.bytes if self.bytes else None

    def describe(self) -> str:
        return ", ".join(f"{n} {k}" for k, n in sorted(self.widths.items())) or "-"


@dataclass
class KernelReport:
    kernel: str
    target: str  # "sm_80", "sm_90a"
    num_warps: int
    registers: int | None = None
    spill_stores: int | None = None  # bytes
    spill_loads: int | None = None  # bytes
    stack_frame: int | None = None  # bytes
    local_in_ptx: bool = False  # PTX declares .local memory itself
    full_loads: Accesses = field(default_factory=Accesses)  # unmasked [BLOCK] tensor loads
    full_stores: Accesses = field(default_factory=Accesses)
    ragged_loads: Accesses = field(default_factory=Accesses)  # masked: the last, partial tile
    ragged_stores: Accesses = field(default_factory=Accesses)
    flag_stores: int | None = None  # tt.store ops to the found_inf argument
    flag_stores_in_loops: int | None = None  # ... of which inside scf.for / scf.while
    tensor_flag_stores: int | None = None  # tt.store ops to the per-tensor nonfinite argument
    tensor_flag_stores_in_tile_loops: int | None = None  # ... of which inside scf.for (the tile loops)
    other_stores: int = 0  # tt.store ops to anything but the flags
    ptx_stores: int = 0  # st.global instructions in the PTX, all kinds
    ptxas_log: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> KernelReport:
        d = dict(d)
        for k in ("full_loads", "full_stores", "ragged_loads", "ragged_stores"):
            d[k] = Accesses(**d[k])
        return cls(**d)


# --------------------------------------------------------------------------------------
# Parsing TTIR and PTX (pure text functions)
# --------------------------------------------------------------------------------------

_LOC_DEF = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$")
_ADDPTR = re.compile(r"^(%[\w#]+) = tt\.addptr (%[\w#]+),")
_TT_MEM = re.compile(r"\btt\.(load|store) (.*?) : (.*?) loc\((#loc\d*|.*)\)\s*$")
_ELEM_BYTES = {"f32": 4, "i32": 4, "f16": 2, "bf16": 2, "i16": 2, "f64": 8, "i64": 8, "i8": 1, "i1": 1}


def _resolve_loc(ref: str, defs: dict, depth: int = 0):
    """(file, line) of a TTIR location, following names and inlined call sites to the callee."""
    if depth > 64:
        return None
    body = defs.get(ref, ref) if ref.startswith("#loc") else ref
    m = re.match(r'^"([^"]*)":(\d+):\d+$', body)
    if m:
        return m.group(1), int(m.group(2))
    m = re.match(r'^callsite\((#loc\d*) at', body)  # the callee's location: innermost source line
    if m:
        return _resolve_loc(m.group(1), defs, depth + 1)
    m = re.match(r'^"[^"]*"\((#loc\d*)\)$', body)  # a named location
    if m:
        return _resolve_loc(m.group(1), defs, depth + 1)
    return None


def ttir_memory_ops(ttir: str) -> list[dict]:
    """Every tt.load / tt.store: kind, pointer operand, the value it was offset from (``root``,
    through ``tt.addptr``; e.g. a kernel argument), tensor size, element type, masked,
    enclosing region ops (``scf.for``, ``scf.while``, ``scf.if``, ...) and source (file, line)."""
    defs, bases = {}, {}
    for line in ttir.splitlines():
        m = _LOC_DEF.match(line.strip())
        if m:
            defs[m.group(1)] = m.group(2)
        m = _ADDPTR.match(line.strip())
        if m:
            bases[m.group(1)] = m.group(2)

    def root(value: str) -> str:
        for _ in range(64):  # SSA names are defined once, but stay bounded on odd input
            if value not in bases:
                break
            value = bases[value]
        return value
    ops, stack = [], []
    for line in ttir.splitlines():
        s = line.strip()
        if s.startswith("#loc"):
            continue
        reopened = None
        if s.startswith("}") or s.startswith(")"):
            if stack:
                reopened = stack.pop()
        m = _TT_MEM.search(s)
        if m:
            kind, operands, ty, loc = m.groups()
            n_operands = len([o for o in operands.split(",") if o.strip()])
            tm = re.match(r"tensor<(\d+)x!tt\.ptr<(\w+)>>", ty)
            sm = re.match(r"!tt\.ptr<(\w+)>", ty)
            pointer = operands.split(",")[0].strip()
            ops.append({
                "kind": kind,
                "pointer": pointer,
                "root": root(pointer),
                "numel": int(tm.group(1)) if tm else 1,
                "elem": tm.group(2) if tm else (sm.group(1) if sm else "?"),
                "tensor": bool(tm),
                # tt.load ptr[, mask[, other]]; tt.store ptr, value[, mask]
                "masked": n_operands > (1 if kind == "load" else 2),
                "regions": list(stack),
                "loc": _resolve_loc(loc, defs) if loc.startswith("#loc") else _resolve_loc(loc, {}),
            })
        if s.endswith("{"):
            if reopened is not None and s.startswith("}"):
                stack.append(reopened)  # "} else {", "} do {": the same op's next region
            else:
                op = re.search(r'(?:= )?"?([a-z_]+\.[a-z_.]+)', s)
                stack.append(op.group(1) if op else "?")
    return ops


_PTX_MEM = re.compile(r"^\s*(@!?%p\d+\s+)?((?:ld|st)\.global(?:\.[a-z0-9]+)*)\s")


def _ptx_width(instr: str) -> int:
    parts = instr.split(".")
    vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
    bits = next((int(p[1:]) for p in reversed(parts) if re.fullmatch(r"[bsuf]\d+", p)), 0)
    return vec * bits // 8


def ptx_memory_ops(ptx: str) -> list[dict]:
    """Every ld.global / st.global in the PTX, in program order, with its width and predicate."""
    ops = []
    for line in ptx.splitlines():
        m = _PTX_MEM.match(line)
        if m:
            ops.append({"instr": m.group(2), "bytes": _ptx_width(m.group(2)), "predicated": bool(m.group(1))})
    return ops


_PTXAS_INFO = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack_frame": re.compile(r"(\d+) bytes stack frame"),
}


def parse_ptxas(log: str) -> dict:
    """Registers, spill and stack bytes from ``ptxas -v`` output (None when absent)."""
    out = {}
    for key, pattern in _PTXAS_INFO.items():
        m = pattern.search(log)
        out[key] = int(m.group(1)) if m else None
    return out


# --------------------------------------------------------------------------------------
# Compiling (needs real @triton.jit functions: not under TRITON_INTERPRET)
# --------------------------------------------------------------------------------------


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _run_ptxas(ptx: str, capability: int) -> str:
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    # The ptxas triton itself uses for this architecture, with its register-allocation flag.
    ptxas = get_ptxas(capability).path
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [ptxas, "-v", "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(capability)}", src, "-o", os.path.join(tmp, "kernel.cubin")]
        res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"ptxas failed ({' '.join(cmd)}):\n{res.stderr}")
    return res.stdout + res.stderr


def compile_kernel(spec: KernelSpec, capability: int) -> dict:
    """Compile one kernel for ``sm_<capability>``; returns its TTIR, PTX, num_warps and target name."""
    if _interpreting():
        raise RuntimeError("inspect_ptx: TRITON_INTERPRET is set, so the kernels are interpreter wrappers "
                           "that cannot be compiled; use inspect_in_subprocess().")
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod = importlib.import_module(f"dispatch_amp.kernels.{spec.module}")
    kernel = getattr(mod, spec.kernel)
    params = list(getattr(kernel, "arg_names", []))
    if params != list(spec.signature):
        raise RuntimeError(f"inspect_ptx: {spec.module}.{spec.kernel} now takes {params}; "
                           f"update KERNELS in inspect_ptx.py (it expects {list(spec.signature)}).")

    def value(v):
        return getattr(mod, v) if isinstance(v, str) else v

    constexprs = {k: value(v) for k, v in spec.constexprs.items()}
    num_warps = value(spec.num_warps)
    # What a launch with 16-byte-aligned tensors specializes on (triton marks such pointers).
    attrs = {(params.index(a),): [["tt.divisibility", 16]] for a in spec.aligned}
    src = ASTSource(fn=kernel, signature=spec.signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": num_warps})
    return {"ttir": compiled.asm["ttir"], "ptx": compiled.asm["ptx"],
            "num_warps": num_warps, "target": re.search(r"^\s*\.target\s+(\S+)", compiled.asm["ptx"], re.M).group(1)}


def _take(ptx_ops: list, tt_ops: list, threads: int) -> Accesses:
    """Accesses for a class of TTIR ops, given the PTX instructions of the same class."""
    acc = Accesses(widths=dict(sorted(Counter(p["instr"] for p in ptx_ops).items())))
    acc.bytes = sum(p["bytes"] for p in ptx_ops)
    acc.vector_bytes = sum(p["bytes"] for p in ptx_ops if p["bytes"] == VECTOR_BYTES)
    acc.expected_bytes = sum(o["numel"] * _ELEM_BYTES.get(o["elem"], 0) // threads for o in tt_ops)
    acc.elem_types = [o["elem"] for o in tt_ops]
    return acc


def analyze(spec: KernelSpec, ttir: str, ptx: str, num_warps: int, target: str, ptxas_log: str) -> KernelReport:
    """Classify the PTX global accesses with the TTIR as the key; see the module note."""
    threads = 32 * num_warps
    rep = KernelReport(kernel=spec.name, target=target, num_warps=num_warps, ptxas_log=ptxas_log.strip(),
                       local_in_ptx=bool(re.search(r"^\s*\.local\b", ptx, re.M)), **parse_ptxas(ptxas_log))
    tt_ops = ttir_memory_ops(ttir)
    px_ops = ptx_memory_ops(ptx)
    for kind, prefix in (("load", "ld"), ("store", "st")):
        tt = [o for o in tt_ops if o["kind"] == kind]
        px = [p for p in px_ops if p["instr"].startswith(prefix)]
        # Unpredicated: unmasked accesses. Scalar loads among them move one element each;
        # take one instruction of that width per scalar load, the rest are full tiles.
        free = [p for p in px if not p["predicated"]]
        for o in (o for o in tt if not o["tensor"] and not o["masked"] and kind == "load"):
            width = _ELEM_BYTES.get(o["elem"], 0)
            hit = next((p for p in free if p["bytes"] == width), None)
            if hit is not None:
                free.remove(hit)
        # Predicated: masked accesses, plus scalar stores (one thread writes them). The scalar
        # ones (the found_inf flag, after the loops) are the last in program order.
        guarded = [p for p in px if p["predicated"]]
        for o in (o for o in tt if not o["tensor"] and (o["masked"] or kind == "store")):
            width = _ELEM_BYTES.get(o["elem"], 0)
            hit = next((p for p in reversed(guarded) if p["bytes"] == width), None)
            if hit is not None:
                guarded.remove(hit)
        full = _take(free, [o for o in tt if o["tensor"] and not o["masked"]], threads)
        ragged = _take(guarded, [o for o in tt if o["tensor"] and o["masked"]], threads)
        if kind == "load":
            rep.full_loads, rep.ragged_loads = full, ragged
        else:
            rep.full_stores, rep.ragged_stores = full, ragged
            rep.ptx_stores = len(px)
    stores = [o for o in tt_ops if o["kind"] == "store"]
    rep.other_stores = len(stores)
    if spec.flag_arg:
        flag = [o for o in stores if o["pointer"] == f"%{spec.flag_arg}"]
        rep.flag_stores = len(flag)
        rep.flag_stores_in_loops = sum(1 for o in flag if {"scf.for", "scf.while"} & set(o["regions"]))
        rep.other_stores -= len(flag)
    if spec.tensor_flag_arg:
        # nonfinite[slot]: an addptr off the argument. Its place is the loop over tensors
        # (scf.while); the tile loops are the scf.for ones.
        per_tensor = [o for o in stores if o["root"] == f"%{spec.tensor_flag_arg}"]
        rep.tensor_flag_stores = len(per_tensor)
        rep.tensor_flag_stores_in_tile_loops = sum(1 for o in per_tensor if "scf.for" in o["regions"])
        rep.other_stores -= len(per_tensor)
    return rep


def inspect_kernels(targets=TARGETS, kernels=KERNELS) -> list[KernelReport]:
    """Compile every kernel for every target (compute capabilities) and analyze it."""
    reports = []
    for spec in kernels:
        for cc in targets:
            c = compile_kernel(spec, cc)
            log = _run_ptxas(c["ptx"], cc)
            reports.append(analyze(spec, c["ttir"], c["ptx"], c["num_warps"], c["target"], log))
    return reports


def inspect_in_subprocess(targets=TARGETS, timeout: float = 300) -> list[KernelReport]:
    """:func:`inspect_kernels` in a fresh interpreter without ``TRITON_INTERPRET``.

    Example::

        >>> reports = inspect_in_subprocess(targets=(90,))  # doctest: +SKIP
        >>> reports[0].vector_share("load")                 # doctest: +SKIP
        1.0
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 is its default
    cmd = [sys.executable, os.path.abspath(__file__), "--json", "--targets", *map(str, targets)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return [KernelReport.from_dict(d) for d in json.loads(res.stdout.strip().splitlines()[-1])]


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def markdown(reports: list[KernelReport]) -> str:
    head = ["kernel", "target", "warps", "registers", "spill st/ld (B)", "stack (B)", "full-tile loads",
            "full-tile stores", "16-byte share ld/st", "ragged-tile loads", "found_inf stores", "nonfinite stores"]
    rows = []
    for r in reports:
        rows.append([
            r.kernel, r.target, str(r.num_warps), str(r.registers), f"{r.spill_stores}/{r.spill_loads}",
            str(r.stack_frame), r.full_loads.describe(), r.full_stores.describe(),
            f"{_pct(r.full_loads.vector_share)}/{_pct(r.full_stores.vector_share)}", r.ragged_loads.describe(),
            "-" if r.flag_stores is None else f"{r.flag_stores} ({r.flag_stores_in_loops} in loops)",
            "-" if r.tensor_flag_stores is None
            else f"{r.tensor_flag_stores} ({r.tensor_flag_stores_in_tile_loops} in tile loops)",
        ])
    from dispatch_amp import _markdown  # the package is installed wherever the kernels are inspected

    return _markdown.table(head, rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", type=int, nargs="+", default=list(TARGETS), help="compute capabilities, e.g. 80 90")
    ap.add_argument("--json", action="store_true", help="print the reports as one JSON line")
    args = ap.parse_args(argv)
    reports = inspect_kernels(tuple(args.targets))
    if args.json:
        print(json.dumps([r.to_dict() for r in reports]))
    else:
        print(markdown(reports))


if __name__ == "__main__":
    main()

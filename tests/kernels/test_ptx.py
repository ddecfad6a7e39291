"""GPU-less checks of the Triton kernels as compiled for sm_80 and sm_90.

Triton compiles for a GPU target without a GPU; ``tools/inspect_ptx.py``
compiles the real kernels from kernels/*.py, runs the ptxas that ships with triton, and
classifies the PTX global accesses (see its module note). These tests pin down what makes
the unscale/check kernels bandwidth-bound on a real GPU (docs/design.md, "Kernels"): 16-byte
loads and stores on full tiles for fp32 and 16-bit gradients, no local-memory spills, one
found_inf store per program; with per-tensor flags (the ``+nonfinite`` builds, PER_TENSOR=True)
the same, plus one nonfinite store per tensor segment outside the tile loops, and none at
all without them. Nothing is launched.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia.compiler")

def _load_tool(name):
    # tools/ is a developer folder, outside the installed package: load it by path.
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "tools" / "loader.py"
    spec = importlib.util.spec_from_file_location("dispatch_amp_tools_loader", path)
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    return loader.load(name)


inspect_ptx = _load_tool("inspect_ptx")
TARGETS, inspect_in_subprocess = inspect_ptx.TARGETS, inspect_ptx.inspect_in_subprocess

TILE_KERNELS = ("unscale_check_", "check_finite_", "unscale_check_+nonfinite", "check_finite_+nonfinite")
STORE_KERNELS = ("unscale_check_", "unscale_check_+nonfinite")
READ_ONLY_KERNELS = ("check_finite_", "check_finite_+nonfinite")
ALL_KERNELS = tuple(spec.name for spec in inspect_ptx.KERNELS)
CASES = [(k, cc) for k in ALL_KERNELS for cc in TARGETS]
TILE_CASES = [(k, cc) for k in TILE_KERNELS for cc in TARGETS]
STORE_CASES = [(k, cc) for k in STORE_KERNELS for cc in TARGETS]
READ_ONLY_CASES = [(k, cc) for k in READ_ONLY_KERNELS for cc in TARGETS]


def _id(case):
    return f"{case[0]}-sm_{case[1]}"


@pytest.fixture(scope="module")
def reports():
    # A subprocess: under TRITON_INTERPRET=1 (conftest) the kernels are interpreter
    # wrappers that triton.compile does not accept; the child compiles the same files.
    got = inspect_in_subprocess(targets=TARGETS)
    return {(r.kernel, int(r.target[3:5])): r for r in got}


VECTORIZE_HINT = (
    "Full tiles must use 16-byte global accesses (ld/st.global.v4.b32; 8 values per access for "
    "16-bit gradients) to be bandwidth-bound. The kernel reaches each gradient through an "
    "address loaded from the int64 table, whose alignment the compiler cannot know: state it "
    "with tl.multiple_of(addr.to(tl.pointer_type(...)), 16) where the typed pointer is made "
    "(a hint on a helper's argument is lost), and send only 16-byte-aligned gradients to the "
    "kernel (others to the torch path)."
)


@pytest.mark.parametrize("case", TILE_CASES, ids=_id)
def test_full_tiles_use_16_byte_loads(reports, case):
    r = reports[case]
    acc = r.full_loads
    # All three dtype paths are in the kernel: fp32, fp16, and bf16 read as raw 16-bit words.
    assert sorted(acc.elem_types) == ["f16", "f32", "i16"], acc.elem_types
    assert acc.bytes == acc.expected_bytes, (
        f"{r.kernel} {r.target}: PTX full-tile loads move {acc.bytes} B/thread ({acc.describe()}), "
        f"the Triton IR {acc.expected_bytes}: the classification no longer matches this kernel."
    )
    assert acc.vector_share == 1.0, f"{r.kernel} {r.target}: full-tile loads are {acc.describe()}. {VECTORIZE_HINT}"


@pytest.mark.parametrize("case", STORE_CASES, ids=_id)
def test_full_tiles_use_16_byte_stores(reports, case):
    r = reports[case]
    acc = r.full_stores
    assert sorted(acc.elem_types) == ["f16", "f32", "i16"], acc.elem_types
    assert acc.bytes == acc.expected_bytes, (acc.describe(), acc.expected_bytes)
    assert acc.vector_share == 1.0, f"{r.kernel} {r.target}: full-tile stores are {acc.describe()}. {VECTORIZE_HINT}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_no_local_memory_spills(reports, case):
    r = reports[case]
    assert r.registers is not None, r.ptxas_log
    assert (r.spill_stores, r.spill_loads) == (0, 0), f"{r.kernel} {r.target} spills to local memory:\n{r.ptxas_log}"
    assert not r.local_in_ptx, f"{r.kernel} {r.target}: the PTX declares .local memory"


@pytest.mark.parametrize("case", TILE_CASES, ids=_id)
def test_found_inf_stored_once_per_program(reports, case):
    r = reports[case]
    assert r.flag_stores == 1, f"{r.kernel} {r.target}: {r.flag_stores} stores to found_inf in the Triton IR"
    assert r.flag_stores_in_loops == 0, f"{r.kernel} {r.target}: the found_inf store sits in a loop (once per tile?)"


@pytest.mark.parametrize("case", TILE_CASES, ids=_id)
def test_nonfinite_stored_per_tensor_segment_only_when_asked(reports, case):
    r = reports[case]
    if r.kernel.endswith("+nonfinite"):
        assert r.tensor_flag_stores == 1, f"{r.kernel} {r.target}: {r.tensor_flag_stores} stores to nonfinite in the Triton IR"
        assert r.tensor_flag_stores_in_tile_loops == 0, (
            f"{r.kernel} {r.target}: the nonfinite store sits in a tile loop; it belongs after a tensor's tiles (once per segment)"
        )
    else:
        # PER_TENSOR=False must compile to the kernel without flags: nothing touches nonfinite_ptr.
        assert r.tensor_flag_stores == 0, f"{r.kernel} {r.target}: stores to nonfinite although PER_TENSOR is False"


@pytest.mark.parametrize("case", READ_ONLY_CASES, ids=_id)
def test_check_finite_stores_only_the_flags(reports, case):
    r = reports[case]
    flags = 1 + r.tensor_flag_stores  # found_inf, and nonfinite in the +nonfinite build
    assert r.other_stores == 0 and r.ptx_stores == flags, (r.other_stores, r.ptx_stores, r.full_stores.describe())


# -- the text parsers, on small hand-written inputs ----------------------------------------------


def test_parse_ptxas():
    log = """ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 111 registers, used 1 barriers"""
    assert inspect_ptx.parse_ptxas(log) == {"registers": 111, "spill_stores": 4, "spill_loads": 12, "stack_frame": 8}


def test_ptx_memory_ops_widths_and_predicates():
    ptx = """
	ld.global.b64 { %rd1 }, [ %rd2 + 0 ];
	ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd3 + 0 ];
	@%p1 ld.global.b16 { %rs1 }, [ %rd4 + 0 ];
	@!%p2 st.global.v2.b32 [ %rd5 + 0 ], { %r5, %r6 };
	ld.param.b64 %rd6, [k_param_0];
"""
    ops = inspect_ptx.ptx_memory_ops(ptx)
    assert [(o["instr"], o["bytes"], o["predicated"]) for o in ops] == [
        ("ld.global.b64", 8, False),
        ("ld.global.v4.b32", 16, False),
        ("ld.global.b16", 2, True),
        ("st.global.v2.b32", 8, True),
    ]


def test_ttir_memory_ops_regions_masks_and_locations():
    ttir = """#loc = loc("/k.py":1:0)
module {
  tt.func public @k(%p: !tt.ptr<f32> loc("p"(#loc)), %flag: !tt.ptr<f32> loc("flag"(#loc))) {
    %x = scf.for %j = %c0 to %n step %c1 iter_args(%a = %z) -> (tensor<4096xi32>)  : i64 {
      %v = tt.load %ptrs : tensor<4096x!tt.ptr<f32>> loc(#loc3)
      %w = tt.load %ptrs, %mask, %other : tensor<4096x!tt.ptr<f16>> loc(#loc4)
      scf.yield %a : tensor<4096xi32> loc(#loc)
    } loc(#loc)
    scf.if %c {
      tt.store %flag, %one : !tt.ptr<f32> loc(#loc5)
    } loc(#loc)
    tt.return loc(#loc)
  } loc(#loc)
} loc(#loc)
#loc2 = loc("/k.py":7:19)
#loc3 = loc(callsite(#loc2 at #loc6))
#loc4 = loc("raw"(#loc7))
#loc5 = loc("/k.py":9:13)
#loc6 = loc("/k.py":3:5)
#loc7 = loc("/k.py":8:19)
"""
    ops = inspect_ptx.ttir_memory_ops(ttir)
    assert [(o["kind"], o["elem"], o["numel"], o["masked"], o["loc"]) for o in ops] == [
        ("load", "f32", 4096, False, ("/k.py", 7)),
        ("load", "f16", 4096, True, ("/k.py", 8)),
        ("store", "f32", 1, False, ("/k.py", 9)),
    ]
    assert "scf.for" in ops[0]["regions"] and "scf.for" not in ops[2]["regions"]
    assert ops[2]["regions"][-1] == "scf.if" and ops[2]["pointer"] == "%flag"


def test_ttir_memory_ops_follow_addptr_to_the_argument():
    ttir = """module {
  tt.func public @k(%flags: !tt.ptr<i32> loc("flags"(#loc)), %slot: i64 loc("slot"(#loc))) {
    %0 = tt.addptr %flags, %slot : !tt.ptr<i32>, i64 loc(#loc)
    %1 = tt.addptr %0, %slot : !tt.ptr<i32>, i64 loc(#loc)
    tt.store %1, %c1_i32, %m : !tt.ptr<i32> loc(#loc)
    tt.store %other, %c1_i32 : !tt.ptr<i32> loc(#loc)
    tt.return loc(#loc)
  } loc(#loc)
} loc(#loc)
"""
    ops = inspect_ptx.ttir_memory_ops(ttir)
    assert [(o["pointer"], o["root"], o["masked"]) for o in ops] == [("%1", "%flags", True), ("%other", "%other", False)]

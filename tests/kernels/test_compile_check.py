"""Every Triton kernel the wrappers launch, compiled for sm_90 and sm_80 with no GPU
(kernels/compile_check.py): it compiles, nothing spills, shared memory fits, and the
attention kernels overlap their K/V loads with the math. The catch for a broken
kernel before a user with a GPU finds it."""
import pytest

from kernels import decode_programs_per_sm
from kernels.compile_check import SHARED_LIMIT, problems, run_in_subprocesses

KERNELS = {"_decode_kernel", "_decode_scores_kernel", "_paged_attention_kernel",
           "_accumulate_key_scores_kernel", "_rms_norm_kernel", "_rope_kernel", "_silu_and_mul_kernel",
           "_store_kv_kernel", "_move_slots_kernel", "_repage_kernel", "_hole_count_kernel", "_hole_pack_kernel",
           "_eviction_order_kernel", "_choose_pages_kernel", "_head_slots_kernel"}
SHARED_PER_SM = {90: 228 * 1024, 80: 164 * 1024}   # an SM's shared memory; 1 KB of it per program is reserved
REGISTERS_PER_SM = 64 * 1024


def registers_per_program(record) -> int:
    """A program's registers: each warp's, allocated 256 at a time."""
    return record.num_warps * -(-record.registers * 32 // 256) * 256


@pytest.fixture(scope="module")
def compiled():
    return run_in_subprocesses([90, 80])


@pytest.mark.parametrize("arch", [90, 80])
def test_every_kernel_compiles_without_problems(compiled, arch):
    records = [r for r in compiled if r.arch == arch]
    assert {r.kernel for r in records} == KERNELS
    assert [p for r in records for p in problems(r)] == []


def test_decode_programs_per_sm_holds(compiled):
    """kernels.decode_programs_per_sm sizes the decode grid's waves: that many decode programs at
    head_dim 128 fit in one SM, by shared memory and by registers, for a 16-bit and an 8-bit cache."""
    checked = set()
    for r in compiled:
        if r.kernel == "_decode_kernel" and "fp32" not in r.case and ("128" in r.case or "8b" in r.case):
            quantized = "int8" in r.case
            resident = decode_programs_per_sm(r.arch // 10, quantized)
            assert resident * (r.shared_bytes + 1024) <= SHARED_PER_SM[r.arch], r
            assert resident * registers_per_program(r) <= REGISTERS_PER_SM, r
            assert r.shared_bytes <= SHARED_LIMIT[r.arch]
            checked.add((r.arch, quantized))
    assert checked == {(arch, quantized) for arch in (90, 80) for quantized in (False, True)}


def test_problems_are_reported():
    """The checks themselves: a spill, too much shared memory, a single K/V buffer, 32-bit rows."""
    from kernels.compile_check import CompiledKernel, _narrow_rows
    fine = CompiledKernel("decode, bf16", "_decode_kernel", 90, 96, 0, 72 * 1024, 4, 3, 2, [])
    assert problems(fine) == []
    bad = CompiledKernel("decode, bf16", "_decode_kernel", 80, 255, 8, 200 * 1024, 4, 3, 1, ["k"])
    assert len(problems(bad)) == 4
    ttir = ("%q_67 = tt.addptr %q_66, %q_65 : tensor<64x1x!tt.ptr<bf16>>, tensor<64x1xi32>\n"
            "%k_36 = tt.addptr %k_35, %k_34 : tensor<64x1x!tt.ptr<bf16>>, tensor<64x1xi64>")
    assert _narrow_rows("_accumulate_key_scores_kernel", ttir) == ["q"]
    assert _narrow_rows("_accumulate_key_scores_kernel", ttir + "\n%q_chunk_49 = tt.addptr %q_ptr, %q_chunk_48 : "
                        "!tt.ptr<bf16>, i64 loc(#loc173)") == []

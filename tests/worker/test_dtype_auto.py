"""`--dtype auto`: bfloat16 on a CPU that computes it natively (AVX512-BF16 or AMX), float32 on any other CPU, the
checkpoint's dtype on a GPU; each choice with the reason the worker logs; the CPU's flags read from /proc/cpuinfo."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from worker_svc.cpu_features import cpu_flags, cpu_signature, native_bf16_flags
from worker_svc.models import auto_cpu_dtype, load_model, resolve_dtype

F32 = {"torch_dtype": "float32"}
# /proc/cpuinfo flags of real CPUs, cut to what matters here
AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c"}  # Haswell .. Alder Lake, Zen 1-3
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"}  # Skylake-SP, Ice Lake
COOPER_LAKE = AVX512 | {"avx512_bf16"}  # also Zen 4 and 5
SAPPHIRE_RAPIDS = COOPER_LAKE | {"amx_tile", "amx_int8", "amx_bf16", "avx512_fp16"}


@pytest.mark.parametrize(("flags", "dtype", "reason"), [
    ({"avx512_bf16"}, "bfloat16", "auto: the CPU has avx512_bf16"),
    ({"amx_bf16"}, "bfloat16", "auto: the CPU has amx_bf16"),
    (COOPER_LAKE, "bfloat16", "auto: the CPU has avx512_bf16"),
    (SAPPHIRE_RAPIDS, "bfloat16", "auto: the CPU has amx_bf16 and avx512_bf16"),
    ({"avx512f"}, "float32", "auto: the CPU has no amx_bf16 or avx512_bf16, so 16-bit floats would be emulated"),
    (AVX512, "float32", "auto: the CPU has no amx_bf16 or avx512_bf16, so 16-bit floats would be emulated"),
    (AVX2, "float32", "auto: the CPU has no amx_bf16 or avx512_bf16, so 16-bit floats would be emulated"),
    (set(), "float32", "auto: the CPU has no amx_bf16 or avx512_bf16, so 16-bit floats would be emulated"),
])
def test_auto_on_the_cpu_is_bfloat16_only_where_the_cpu_computes_it(flags, dtype, reason):
    assert auto_cpu_dtype(flags, "float32") == (dtype, reason)
    choice = resolve_dtype("auto", "cpu", F32, flags)
    assert (choice.dtype, choice.name, choice.reason) == (getattr(torch, dtype), dtype, reason)


@pytest.mark.parametrize("checkpoint", ["float16", "bfloat16"])
def test_a_16_bit_checkpoint_on_a_cpu_without_native_bfloat16_runs_in_float32_and_says_why(checkpoint):
    for flags in (AVX2, AVX512, set()):
        choice = resolve_dtype("auto", "cpu", {"torch_dtype": checkpoint}, flags)
        assert choice.dtype == torch.float32
        assert choice.reason == (f"auto: the checkpoint is {checkpoint}, but the CPU has no amx_bf16 or avx512_bf16, "
                                 f"so 16-bit floats would be emulated")


def test_with_native_bfloat16_any_checkpoint_runs_in_bfloat16_and_a_float16_one_says_it_is_cast():
    assert resolve_dtype("auto", "cpu", {"dtype": "bfloat16"}, COOPER_LAKE).reason == "auto: the CPU has avx512_bf16"
    assert resolve_dtype("auto", "cpu", {}, COOPER_LAKE).dtype == torch.bfloat16  # config.json says nothing
    half = resolve_dtype("auto", "cpu", {"torch_dtype": "float16"}, COOPER_LAKE)
    assert (half.dtype, half.reason) == (torch.bfloat16,
                                         "auto: the CPU has avx512_bf16 (the float16 checkpoint cast to bfloat16)")


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_on_a_gpu_auto_is_still_the_checkpoints_dtype_whatever_the_host_cpu(device):
    for flags in (SAPPHIRE_RAPIDS, AVX2):
        for checkpoint, want in (("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                 ("float16", torch.float16)):
            choice = resolve_dtype("auto", device, {"torch_dtype": checkpoint}, flags)
            assert (choice.dtype, choice.reason) == (want, "auto: the checkpoint's dtype on a GPU")
        assert resolve_dtype("auto", device, {}, flags).dtype == torch.float16  # config.json says nothing


def test_a_given_dtype_is_used_as_given_everywhere():
    for device in ("cpu", "cuda:0"):
        for flags in (SAPPHIRE_RAPIDS, AVX2):
            for dtype in ("float32", "bfloat16", "float16"):
                choice = resolve_dtype(dtype, device, F32, flags)
                assert (choice.name, choice.reason) == (dtype, f"--dtype {dtype}")
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        resolve_dtype("float64", "cpu", F32, AVX2)


def test_the_flags_come_from_the_first_cpus_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                    "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\nbugs\t\t: spectre_v1\n\n"
                    "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu sse2\n")
    assert cpu_flags(info) == {"fpu", "sse2", "avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    assert native_bf16_flags(cpu_flags(info)) == ("amx_bf16", "avx512_bf16")
    assert cpu_signature(info) == (f"{platform.machine()}\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                                   "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile")


def test_an_arm_cpuinfo_or_none_at_all_gives_no_flags_and_float32(tmp_path):
    arm = tmp_path / "cpuinfo"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\n")
    missing = tmp_path / "nothing-here"
    for path in (arm, missing):
        assert cpu_flags(path) == frozenset()
        assert resolve_dtype("auto", "cpu", F32, cpu_flags(path)).dtype == torch.float32
    assert cpu_signature(missing) == f"{platform.machine()}\n"


def test_this_machines_auto_matches_its_proc_cpuinfo():
    """Read here without cpu_features: bfloat16 exactly where the kernel's own flags list one of the two."""
    try:
        words = set(Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split())
    except (OSError, IndexError):
        words = set()
    native = sorted(f for f in ("avx512_bf16", "amx_bf16") if f in words)
    choice = resolve_dtype("auto", "cpu", F32)
    assert choice.dtype == (torch.bfloat16 if native else torch.float32)
    assert all(f in choice.reason for f in native), choice.reason


def test_the_loaded_model_carries_the_choice_and_the_cache_follows_it(tiny_llama_dir):
    """Weights, LoadedModel.dtype, dtype_reason and the `--kv-cache-dtype auto` pool all in the dtype auto picked."""
    want = resolve_dtype("auto", "cpu", F32)
    loaded = load_model(tiny_llama_dir)  # dtype auto, on the CPU
    assert (loaded.dtype, loaded.dtype_reason) == (want.dtype, want.reason)
    assert {p.dtype for p in loaded.model.parameters()} == {want.dtype}
    assert loaded.kv_geometry(16).dtype == want.name
    exact = load_model(tiny_llama_dir, dtype="float32")
    assert (exact.dtype, exact.dtype_reason, exact.kv_geometry(16).dtype) == (torch.float32, "--dtype float32",
                                                                               "float32")

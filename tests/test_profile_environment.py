"""The processor a report records (issue 19): CPU features from /proc/cpuinfo and ISA caps."""

from __future__ import annotations

import pytest

from ficoco.profiling.environment import CPU_FEATURES, cpu_features, isa_overrides

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu vme sse sse2 avx avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
flags\t\t: fpu sse
"""


def test_cpu_features_reads_the_first_flags_line(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert cpu_features(path) == dict.fromkeys(CPU_FEATURES, True)


def test_cpu_features_names_missing_features_false(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("model name\t: Ryzen\nflags\t\t: sse avx avx2 avx512f avx512bw\n")
    assert cpu_features(path) == {"amx_bf16": False, "amx_tile": False, "avx512_bf16": False,
                                  "avx512f": True, "avx2": True}


def test_cpu_features_is_empty_when_unknown(tmp_path):
    assert cpu_features(tmp_path / "missing") == {}
    (tmp_path / "noflags").write_text("model name\t: Apple M2\n")
    assert cpu_features(tmp_path / "noflags") == {}


def test_isa_overrides_name_only_what_is_set(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert isa_overrides() == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "")
    assert isa_overrides() == {"ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.skipif(not __import__("os").path.isfile("/proc/cpuinfo"), reason="no /proc/cpuinfo here")
def test_this_cpu_has_its_features_recorded():
    assert set(cpu_features()) == set(CPU_FEATURES)

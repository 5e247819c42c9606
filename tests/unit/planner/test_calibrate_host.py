"""What a calibrated profile records about its machine: /proc/cpuinfo and sysfs parsing."""

from __future__ import annotations

import pytest

from moeserve.planner.calibrate.host import cache_sizes, cpuinfo, last_level_cache_mb

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu avx2 fma avx512f amx_tile

processor\t: 1
model name\t: another
"""


def test_cpuinfo_first_processor():
    info = cpuinfo(CPUINFO)
    assert info["model name"] == "Intel(R) Xeon(R) Processor"
    assert info["model"] == "207"
    assert "avx512f" in info["flags"].split()
    assert cpuinfo("") == {}


def _cache(root, index, level, kind, size, shared):
    d = root / f"index{index}"
    d.mkdir()
    for name, text in (("level", level), ("type", kind), ("size", size)):
        (d / name).write_text(f"{text}\n")
    (d / "shared_cpu_list").write_text(f"{shared}\n")


def test_cache_sizes_and_last_level(tmp_path):
    _cache(tmp_path, 0, 1, "Data", "48K", "0")
    _cache(tmp_path, 1, 1, "Instruction", "32K", "0")
    _cache(tmp_path, 2, 2, "Unified", "2048K", "0")
    _cache(tmp_path, 3, 3, "Unified", "307200K", "0-1")
    got = cache_sizes(str(tmp_path))
    assert got == {
        "L1d": "48K (shared by CPUs 0)",
        "L1i": "32K (shared by CPUs 0)",
        "L2": "2048K (shared by CPUs 0)",
        "L3": "307200K (shared by CPUs 0-1)",
    }
    assert last_level_cache_mb(got) == pytest.approx(307200 * 1024 / 1e6)
    assert last_level_cache_mb(cache_sizes(str(tmp_path / "missing"))) == 0.0


def test_refit_reads_back_what_write_profile_wrote(tmp_path):
    from moeserve.planner.calibrate import read_measurements, write_profile

    meas = {"bandwidth": {"read_gbs": 20.0, "gemv_gbs": 23.5}, "gemms": []}
    raw = {"name": "x", "kind": "cpu", "measured_on": {"date": "2026-12-01"}, "measurements": meas}
    path = write_profile(raw, tmp_path / "p.yaml")
    got = read_measurements(path)
    assert got == {"measured_on": {"date": "2026-12-01"}, "measurements": meas}
    (tmp_path / "bare.yaml").write_text("name: x\n")
    with pytest.raises(ValueError, match="no raw measurements"):
        read_measurements(tmp_path / "bare.yaml")

"""Profiles load from YAML with every figure's source, and bad ones fail naming the field."""

from __future__ import annotations

import pytest
import yaml

from moeserve.planner.hardware import (
    ProfileError,
    builtin_profiles,
    load_profile,
    profile_from_dict,
)

REQUIRED = {"this-machine", "cpu-hbm", "kunpeng-920", "h800", "h20", "h100", "ascend-910b"}


def test_builtin_profiles_load_with_sources():
    assert REQUIRED <= set(builtin_profiles())
    for name in builtin_profiles():
        p = load_profile(name)
        assert p.name == name
        assert p.sources and all(s.strip() for s in p.sources.values())
        assert p.device.flops_per_s(p.software.compute_dtype) > 0


def test_profile_from_file(tmp_path, raw_profile):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(raw_profile))
    p = load_profile(path)
    assert p.devices == 2 and p.device.bytes_per_s == 1e9
    assert p.sources["network.inter_node.latency_us"] == "assumption: test"


def test_missing_field_is_named(raw_profile):
    del raw_profile["device"]["memory_gb"]
    with pytest.raises(ProfileError, match=r"unit: missing field device\.memory_gb"):
        profile_from_dict(raw_profile, "unit")


def test_missing_source_is_refused(raw_profile):
    raw_profile["network"]["intra_node"]["latency_us"] = {"value": 3}
    with pytest.raises(ProfileError, match=r"network\.intra_node\.latency_us has no source"):
        profile_from_dict(raw_profile, "unit")


def test_bare_number_is_refused(raw_profile):
    raw_profile["software"]["op_overhead_us"] = 3
    with pytest.raises(ProfileError, match=r"software\.op_overhead_us must be \{value"):
        profile_from_dict(raw_profile, "unit")


def test_wrong_types_and_ranges(raw_profile):
    raw_profile["device"]["memory_bandwidth_gbs"]["value"] = "fast"
    with pytest.raises(ProfileError, match="memory_bandwidth_gbs must be a number"):
        profile_from_dict(raw_profile, "unit")
    raw_profile["device"]["memory_bandwidth_gbs"]["value"] = 10
    raw_profile["device"]["memory_efficiency"]["value"] = 1.5
    with pytest.raises(ProfileError, match=r"memory_efficiency must be in \(0, 1\]"):
        profile_from_dict(raw_profile, "unit")
    raw_profile["device"]["memory_efficiency"]["value"] = 1
    raw_profile["software"]["weight_dtype"]["value"] = "fp7"
    with pytest.raises(ProfileError, match="unknown dtype 'fp7'"):
        profile_from_dict(raw_profile, "unit")


def test_missing_section_and_kind(raw_profile):
    bad = dict(raw_profile, kind="tpu")
    with pytest.raises(ProfileError, match="kind must be one of"):
        profile_from_dict(bad, "unit")
    del raw_profile["network"]
    with pytest.raises(ProfileError, match="missing section 'network'"):
        profile_from_dict(raw_profile, "unit")


def test_invalid_yaml_and_unknown_names(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ProfileError, match=r"bad\.yaml: invalid YAML"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="not one of the built-in profiles.*h800"):
        load_profile("no-such-machine")
    with pytest.raises(ProfileError, match="not found"):
        load_profile(tmp_path / "missing.yaml")
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n")
    with pytest.raises(ProfileError, match="top level must be a mapping"):
        load_profile(top)


def test_optional_few_row_and_expert_curve_figures(raw_profile):
    dev = raw_profile["device"]
    p = profile_from_dict(raw_profile)
    assert p.device.small_gemm_max_rows == 0 and p.device.expert_m_half is None
    assert p.device.gemm_rate("fp32", 1) == (p.device.flops_per_s("fp32"), 0)
    dev["small_gemm_max_rows"] = {"value": 128, "source": "assumption: test"}
    dev["small_gemm_tflops"] = {"value": 0.2, "source": "assumption: test"}
    dev["small_gemm_m_half"] = {"value": 19, "source": "assumption: test"}
    dev["expert_m_half"] = {"value": 8, "source": "assumption: test"}
    p = profile_from_dict(raw_profile)
    assert p.device.gemm_rate("fp32", 128) == (0.2e12, 19)
    assert p.device.gemm_rate("fp32", 129) == (p.device.flops_per_s("fp32"), 0)
    assert p.device.expert_m_half == 8
    dev["small_gemm_tflops"]["value"] = 0
    with pytest.raises(ProfileError, match="small_gemm_tflops"):
        profile_from_dict(raw_profile)
    dev["small_gemm_tflops"] = {"value": 0.2}
    with pytest.raises(ProfileError, match="no source"):
        profile_from_dict(raw_profile)

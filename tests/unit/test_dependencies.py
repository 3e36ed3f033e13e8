"""Declared dependency ranges: no release with a known vulnerability; pre-release series bounded."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
REQUIREMENTS = {
    req.name: req
    for req in map(Requirement, tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"])
}

# (package, last vulnerable release, advisory)
VULNERABLE = [
    ("orjson", "3.9.14", "CVE-2024-27454: orjson.loads recursion"),
    ("orjson", "3.11.5", "CVE-2025-67221: orjson.dumps recursion"),
    ("pydantic", "2.3.0", "CVE-2024-3772: email validation ReDoS"),
    ("confluent-kafka", "2.15.99", "bundled OpenSSL/libcurl CVEs before 2.16.0"),
]


@pytest.mark.parametrize(("name", "vulnerable", "advisory"), VULNERABLE)
def test_floor_excludes_known_vulnerable_releases(
    name: str, vulnerable: str, advisory: str
) -> None:
    assert not REQUIREMENTS[name].specifier.contains(Version(vulnerable), prereleases=True), (
        advisory
    )


def test_pre_release_series_have_an_upper_bound() -> None:
    for name, req in REQUIREMENTS.items():
        floors = [Version(s.version) for s in req.specifier if s.operator in (">=", ">", "==")]
        if any(v.is_prerelease for v in floors):
            assert any(s.operator in ("<", "<=", "~=", "==") for s in req.specifier), name
    prometheus = REQUIREMENTS["opentelemetry-exporter-prometheus"].specifier
    assert prometheus.contains("0.66b2", prereleases=True)  # the tested release
    assert not prometheus.contains("0.67b0", prereleases=True)
    assert not prometheus.contains("1.0.0", prereleases=True)

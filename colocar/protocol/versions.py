"""Version facts exchanged at connect, to detect controller/sidecar skew early and clearly."""

from __future__ import annotations

import importlib.metadata
import sys


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def local_versions() -> dict[str, str]:
    """The versions that must agree for pickled code to run on the other side."""
    return {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "cloudpickle": _dist_version("cloudpickle"),
        "jax": _dist_version("jax"),
    }


def skew(controller: dict[str, str], sidecar: dict[str, str]) -> list[str]:
    """Human-readable mismatches; an empty version on either side (not installed) is ignored."""
    problems = []
    for key in ("python", "cloudpickle", "jax"):
        a, b = controller.get(key, ""), sidecar.get(key, "")
        if a and b and a != b:
            problems.append(f"{key} {a} on the controller but {b} on the sidecar")
    return problems


def colocar_version() -> str:
    return _dist_version("colocar") or "0+unknown"

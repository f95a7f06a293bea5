"""Where the sample operator of this checkout lives: its handlers and its CRD.

The demo and the chaos harness both run ``operator/examples/devices.py`` with
``crds/devices.yaml``; they find them here, from the working directory or from
this package's checkout.
"""

from __future__ import annotations

from pathlib import Path

from kopf_reconcile.api import ConfigError

__all__ = ["find_crd", "find_handlers"]


def find_handlers(explicit: Path | None) -> Path:
    if explicit is not None:
        if not explicit.is_file():
            raise ConfigError(f"--handlers: no such file {str(explicit)!r}")
        return explicit
    for base in (Path.cwd(), *Path(__file__).resolve().parents):
        candidate = base / "operator" / "examples" / "devices.py"
        if candidate.is_file():
            return candidate
    raise ConfigError(
        "--handlers: operator/examples/devices.py not found; run from the project's checkout "
        "or pass --handlers PATH"
    )


def find_crd(handlers: Path) -> Path:
    for base in (Path.cwd(), *handlers.resolve().parents):
        candidate = base / "crds" / "devices.yaml"
        if candidate.is_file():
            return candidate
    raise ConfigError("crds/devices.yaml not found next to the handlers' checkout")

"""Kubeconfig files pointing kubectl and client libraries at an embedded cluster."""

from __future__ import annotations

from pathlib import Path

import yaml

CONTEXT = "embedded"


def write_kubeconfig(path: Path, url: str, namespace: str = "default") -> Path:
    """Write a kubeconfig with one cluster, user and (current) context; no credentials needed."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": CONTEXT, "cluster": {"server": url}}],
        "users": [{"name": CONTEXT, "user": {}}],
        "contexts": [
            {
                "name": CONTEXT,
                "context": {"cluster": CONTEXT, "user": CONTEXT, "namespace": namespace},
            }
        ],
        "current-context": CONTEXT,
        "preferences": {},
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path

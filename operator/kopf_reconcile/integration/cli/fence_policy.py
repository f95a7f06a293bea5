"""``kopf-reconcile fence-policy``: the API server's fence, for clusters without the chart.

Prints, as YAML documents for ``kubectl apply -f -``, what the chart installs with
``fence.enabled``: the ValidatingAdmissionPolicy that refuses a reconciler's API write made
under a Lease that changed hands, its binding to the kopf-reconcile Leases of the operator's
namespace, and the RBAC that lets the operator's ServiceAccount impersonate itself with the
lease as user extras (see :mod:`kopf_reconcile.integration.fence_policy`).
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

import yaml

from kopf_reconcile.api import ConfigError
from kopf_reconcile.integration.fence_policy import manifests

__all__ = ["add_parser"]

_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def add_parser(commands: Any) -> None:
    """``fence-policy``, on the CLI's subcommands."""
    parser = commands.add_parser(
        "fence-policy",
        help="print the API server's fence (policy, binding, RBAC) for kubectl apply",
        description=(
            "Print the ValidatingAdmissionPolicy, its binding and the RBAC with which the API "
            "server refuses a deposed leader's writes, for an operator whose Leases live in "
            "NAMESPACE and which runs as SERVICE_ACCOUNT (the chart installs the same with "
            "fence.enabled)."
        ),
    )
    parser.add_argument("--namespace", required=True, help="where the operator's Leases live")
    parser.add_argument(
        "--service-account", required=True, help="the operator's ServiceAccount (in NAMESPACE)"
    )
    parser.add_argument(
        "--name", default="kopf-reconcile", help="base of the objects' names (default: %(default)s)"
    )
    parser.set_defaults(command=_fence_policy)


def _fence_policy(args: argparse.Namespace) -> int:
    for option, value in (
        ("--namespace", args.namespace),
        ("--service-account", args.service_account),
        ("--name", args.name),
    ):
        if len(value) > 63 or not _NAME.fullmatch(value):
            raise ConfigError(
                f"{option} must be a Kubernetes name (lowercase letters, digits and '-', "
                f"at most 63), got {value!r}"
            )
    documents = manifests(args.name, args.namespace, args.service_account)
    sys.stdout.write(yaml.safe_dump_all(documents, sort_keys=False))
    return 0

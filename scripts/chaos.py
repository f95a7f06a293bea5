"""Process chaos for ``make chaos``: replicas of the example operator under a seeded nemesis.

Runs :mod:`kopf_reconcile.testing.chaos` (``--seed``, ``--duration``,
``--replicas``, ``--elector``, ``--devices``, ``--rate``, ``--shards``, ``--by-namespace``,
``--keep``; see
``--help``) and exits non-zero if any invariant broke.
"""

from __future__ import annotations

import sys

from kopf_reconcile.testing.chaos.__main__ import main

if __name__ == "__main__":
    sys.exit(main())

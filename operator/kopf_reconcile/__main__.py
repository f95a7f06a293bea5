"""``python -m kopf_reconcile``: the ``kopf-reconcile`` command."""

import sys

from kopf_reconcile.integration.cli import main

if __name__ == "__main__":
    sys.exit(main())

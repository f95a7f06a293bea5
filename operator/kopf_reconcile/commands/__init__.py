"""Commands of ``kopf-reconcile`` kept in modules of their own, one per command, named after it
(``init``, ``dev``, ``fence-policy``); :mod:`kopf_reconcile.integration.cli` adds each one's
parser."""

"""A kopf operator with one ``on.event`` handler.

The resource comes from TEST_GROUP/TEST_VERSION/TEST_PLURAL; each event is appended to the
file TEST_LOG as ``<type> <name>``.
"""

import os
from typing import Any

import kopf

SELECTOR: dict[str, Any] = {
    "version": os.environ["TEST_VERSION"],
    "plural": os.environ["TEST_PLURAL"],
}
if os.environ["TEST_GROUP"]:
    SELECTOR["group"] = os.environ["TEST_GROUP"]


@kopf.on.event(**SELECTOR)
def seen(type: str | None, name: str, **_: Any) -> None:
    with open(os.environ["TEST_LOG"], "a") as log:
        log.write(f"{type} {name}\n")

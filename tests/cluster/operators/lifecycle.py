"""A kopf operator with create/update/delete handlers (finalizers included).

The resource comes from TEST_GROUP/TEST_VERSION/TEST_PLURAL; each handler call is appended
to the file TEST_LOG as ``<cause> <name>``.
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


def record(cause: str, name: str) -> None:
    with open(os.environ["TEST_LOG"], "a") as log:
        log.write(f"{cause} {name}\n")


@kopf.on.create(**SELECTOR)
def created(name: str, **_: Any) -> None:
    record("create", name)


@kopf.on.update(**SELECTOR)
def updated(name: str, **_: Any) -> None:
    record("update", name)


@kopf.on.delete(**SELECTOR)
def deleted(name: str, **_: Any) -> None:
    record("delete", name)

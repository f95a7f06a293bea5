"""The embedded cluster's protobuf decoding of the bodies ``kubectl create`` sends."""

from __future__ import annotations

import pytest

from kopf_reconcile.testing.emulated_apiserver import protobuf
from kopf_reconcile.testing.emulated_apiserver.errors import ApiError

# kubectl 1.35's body of `kubectl create configmap c1 --from-literal=a=b`, as sent.
KUBECTL_CONFIGMAP = bytes.fromhex(
    "6b3873000a0f0a0276311209436f6e6669674d6170121c0a120a0263311200"
    "1a0022002a0032003800420012060a01611201621a002200"
)


def test_a_configmap_as_kubectl_sends_it() -> None:
    assert protobuf.decode(KUBECTL_CONFIGMAP) == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "c1"},  # empty optional strings are absent, as in JSON
        "data": {"a": "b"},
    }


def test_other_kinds_and_fields_are_refused_by_name() -> None:
    lease = b"k8s\x00" + bytes([0x0A, 0x07, 0x0A, 0x02]) + b"v1" + bytes([0x12, 0x01]) + b"X"
    with pytest.raises(ApiError) as raised:
        protobuf.decode(lease)
    assert raised.value.code == 415
    assert "(not kind X of v1)" in raised.value.message
    with pytest.raises(ApiError) as raised:
        protobuf.decode(b"k8s\x00\x0a\x0f\x0a")  # truncated
    assert raised.value.code == 400

"""The files a pod-tier node runs from: its certificates and its components' configuration.

Everything is written into the node's own directory: a CA and the API server's
serving certificate (for every address it is reached at: the node, the
``kubernetes`` Service, the host's loopback forwarder), the service-account key,
static tokens, the audit policy, kubeconfigs, the CNI network, containerd's
configuration (root, state, socket, runc root and CNI configuration all inside
the directory; plugins that would write elsewhere disabled) and the kubelet's.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

NODE_NAME = "pod-tier-node"
#: The node's address, inside its network namespace only; the API server listens there.
NODE_IP = "10.88.0.1"
APISERVER_PORT = 6443
POD_SUBNET = "10.244.0.0/24"
SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
SERVICE_IP = "10.0.0.1"  # the `kubernetes` Service's address: in the certificate, never routed
PAUSE_IMAGE = "docker.io/kopf-reconcile/pause:1"
CNI_PLUGINS = Path("/usr/lib/cni")


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def issue_certificates(pki: Path) -> None:
    """A CA, and the API server's serving certificate for every address it is reached at."""
    pki.mkdir()
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", pki / "ca.key")
    _openssl("req", "-x509", "-new", "-key", pki / "ca.key", "-subj", "/CN=pod-tier-ca",
             "-days", "2", "-out", pki / "ca.crt")  # fmt: skip
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", pki / "apiserver.key")
    _openssl("req", "-new", "-key", pki / "apiserver.key", "-subj", "/CN=kube-apiserver",
             "-out", pki / "apiserver.csr")  # fmt: skip
    names = [
        f"IP:{NODE_IP}",
        f"IP:{SERVICE_IP}",
        "IP:127.0.0.1",
        "DNS:localhost",
        "DNS:kubernetes",
        "DNS:kubernetes.default",
        "DNS:kubernetes.default.svc",
        "DNS:kubernetes.default.svc.cluster.local",
    ]
    (pki / "apiserver.ext").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
        f"extendedKeyUsage=serverAuth\nsubjectAltName={','.join(names)}\n"
    )
    _openssl("x509", "-req", "-in", pki / "apiserver.csr", "-CA", pki / "ca.crt",
             "-CAkey", pki / "ca.key", "-CAcreateserial", "-days", "2",
             "-extfile", pki / "apiserver.ext", "-out", pki / "apiserver.crt")  # fmt: skip
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", pki / "sa.key")


def write_configuration(d: Path, admin_token: str, kubelet_token: str) -> None:
    """Every file the node's components read, into the node's directory ``d``."""
    (d / "tokens.csv").write_text(
        f'{admin_token},admin,admin,"system:masters"\n'
        f'{kubelet_token},system:node:{NODE_NAME},kubelet,"system:nodes"\n'
    )
    # Lease writes with their result (the terms stale API writes are judged by), the rest
    # as metadata (who, what, the impersonated extras, the answer).
    lease_writes = {
        "level": "RequestResponse",
        "verbs": ["create", "update", "patch"],
        "resources": [{"group": "coordination.k8s.io", "resources": ["leases"]}],
    }
    (d / "audit-policy.yaml").write_text(yaml.safe_dump({
        "apiVersion": "audit.k8s.io/v1", "kind": "Policy",
        "omitStages": ["RequestReceived"], "rules": [lease_writes, {"level": "Metadata"}],
    }))  # fmt: skip
    inside = f"https://{NODE_IP}:{APISERVER_PORT}"
    write_kubeconfig(d, str(d / "kubeconfig-inside"), inside, "admin", admin_token)
    write_kubeconfig(
        d, str(d / "kubeconfig-kubelet"), inside, f"system:node:{NODE_NAME}", kubelet_token
    )
    (d / "cni").mkdir()
    (d / "cni" / "10-pod-tier.conflist").write_text(json.dumps({
        "cniVersion": "0.4.0",
        "name": "pod-tier",
        "plugins": [{
            "type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False,
            "hairpinMode": True,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]],
                     "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(d / "cni-ipam")},
        }],
    }))  # fmt: skip
    (d / "containerd.toml").write_text(f"""\
version = 2
root = "{d / "containerd" / "root"}"
state = "{d / "containerd" / "state"}"
# Plugins that would write outside the node's directory, or are of no use here.
disabled_plugins = [
  "io.containerd.internal.v1.opt",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp",
]

[grpc]
  address = "{d / "containerd.sock"}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # runc cannot set the sandbox's OOM score without CAP_SYS_RESOURCE, which a VM may lack.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
snapshotter = "overlayfs"
default_runtime_name = "runc"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
    SystemdCgroup = false
    Root = "{d / "runc"}"
  [plugins."io.containerd.grpc.v1.cri".cni]
bin_dir = "{CNI_PLUGINS}"
conf_dir = "{d / "cni"}"
""")
    (d / "kubelet.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # containerd 1.x does not report its cgroup driver (the RuntimeConfig call): say it.
        "cgroupDriver": "cgroupfs",
        # This kind of machine has cgroup v1, which a kubelet from 1.35 on refuses unless told.
        "failCgroupV1": False,
        "containerRuntimeEndpoint": f"unix://{d / 'containerd.sock'}",
        "failSwapOn": False,
        "address": NODE_IP,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "volumePluginDir": str(d / "kubelet-volume-plugins"),
        "makeIPTablesUtilChains": False,
        "serializeImagePulls": False,
        # The machine's disk is not the node's concern: never evict for it.
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%",
                         "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "podPidsLimit": -1,
    }))  # fmt: skip


def write_kubeconfig(d: Path, path: str, server: str, user: str, token: str) -> None:
    """A kubeconfig for ``user`` (a static token), trusting the node's CA."""
    cluster = {"server": server, "certificate-authority": str(d / "pki" / "ca.crt")}
    context = {"cluster": "pods", "user": user, "namespace": "default"}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "pods", "cluster": cluster}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "pods", "context": context}],
        "current-context": "pods",
    }
    Path(path).write_text(yaml.safe_dump(config, sort_keys=False))

"""The host state a kubelet and containerd change, remembered and put back.

The kubelet tunes host sysctls when it starts (``setupKernelTunables``: they are
not per network namespace), writes under fixed paths whatever its flags say
(``/var/lib/kubelet/device-plugins``, ``/var/log/pods``), and leaves its
``kubepods`` cgroups behind; containerd keeps its shims' sockets under
``/run/containerd``, CNI caches results under ``/var/lib/cni``, the CRI plugin
makes the pods' network namespaces under ``/run/netns``, and the shims outlive
containerd. :class:`HostState` remembers what was there before the node started
and puts it back; paths that existed before are left alone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

#: Host sysctls the kubelet sets when it starts: restored at teardown.
KUBELET_SYSCTLS = (
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
)
#: Fixed host paths the node's components create; removed at teardown if they were not there.
HOST_PATHS = (
    Path("/var/lib/kubelet"),
    Path("/var/log/pods"),
    Path("/var/log/containers"),
    Path("/run/containerd"),
    Path("/var/lib/cni"),
    Path("/run/netns"),
)
NETNS_DIR = Path("/run/netns")
CGROUP_ROOT = Path("/sys/fs/cgroup")


class HostState:
    """What the host looked like before the node started, and how to get back to it."""

    def __init__(self) -> None:
        self._sysctls: dict[str, str] = {}
        self._created_paths: list[Path] = []
        self._namespaces_before: set[str] = set()

    def remember(self) -> None:
        for name in KUBELET_SYSCTLS:
            value = read_sysctl(name)
            if value is not None:
                self._sysctls[name] = value
        self._created_paths = [path for path in HOST_PATHS if not path.exists()]
        if NETNS_DIR.is_dir():
            self._namespaces_before = set(os.listdir(NETNS_DIR))

    def restore_sysctls(self) -> None:
        for name, value in self._sysctls.items():
            if read_sysctl(name) != value:
                subprocess.run(["sysctl", "-q", "-w", f"{name}={value}"], check=False)
        self._sysctls.clear()

    def remove_pod_namespaces(self) -> None:
        """The pods' network namespaces containerd made (``cni-*``) and left."""
        if not NETNS_DIR.is_dir():
            return
        for name in set(os.listdir(NETNS_DIR)) - self._namespaces_before:
            if name.startswith("cni-"):
                unmount_under([NETNS_DIR / name])
                with contextlib.suppress(OSError):
                    (NETNS_DIR / name).unlink()

    def remove_created_paths(self) -> None:
        for path in reversed(self._created_paths):
            if path == NETNS_DIR:  # `ip netns` made it a mount point; only while empty
                if path.is_dir() and not os.listdir(path):
                    unmount_under([path])
                    with contextlib.suppress(OSError):
                        path.rmdir()
            else:
                unmount_under([path])
                shutil.rmtree(path, ignore_errors=True)
        self._created_paths.clear()


def read_sysctl(name: str) -> str | None:
    path = Path("/proc/sys") / name.replace(".", "/")
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _mounts_under(roots: list[Path]) -> list[str]:
    """Mount points at or below any of ``roots``, deepest first."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if any(point == str(root) or point.startswith(f"{root}/") for root in roots):
            found.append(point)
    return sorted(found, key=lambda p: p.count("/"), reverse=True)


def unmount_under(roots: list[Path]) -> None:
    for point in _mounts_under(roots):
        subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)


def _kubepods_cgroups() -> Iterator[Path]:
    """Every ``kubepods`` cgroup the kubelet made, in each hierarchy, deepest first."""
    for hierarchy in sorted(CGROUP_ROOT.iterdir()) if CGROUP_ROOT.is_dir() else []:
        top = hierarchy / "kubepods"
        if top.is_dir() and not top.is_symlink():
            below = [Path(d) for d, _, _ in os.walk(top)]
            yield from sorted(below, key=lambda p: len(p.parts), reverse=True)


def kill_kubepods() -> None:
    """SIGKILL every process still in a pod's cgroup, then remove the cgroups."""
    for _ in range(50):
        pids = set()
        for group in _kubepods_cgroups():
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in (group / "cgroup.procs").read_text().split())
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    for group in _kubepods_cgroups():
        with contextlib.suppress(OSError):
            group.rmdir()


def kill_shims(containerd_socket: Path) -> None:
    """containerd's shims outlive it: kill the ones serving this node's containerd."""
    marker = str(containerd_socket).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"containerd-shim-runc-v2") and marker in argv:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)

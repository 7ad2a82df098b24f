"""Hosts for the deploy tests: each "pod" or "node" in its own network namespace, or all on loopback.

``NetLab`` puts every host in a network namespace of its own, wired with veth pairs to a bridge that lives in
one more namespace (the switch), so nothing touches the machine's own network: the root namespace's
interfaces, routes, iptables and sysctls are never changed, and deleting the namespaces removes every link.
Names resolve as in a cluster: ``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts`` over ``/etc/hosts``,
so each host sees the others' names (``spotrun-etcd-0.spotrun-etcd``) and its own hostname as its own address
and each host has its own hostname (own UTS namespace) that resolves to its own address, as in a pod
(``socket.getfqdn()`` gives the agent's address; gloo picks its interface from the hostname).

When network namespaces are not available (not root, no ``ip``), ``loopback_reason()`` says why and the tests
run every host on 127.0.0.1 instead (names then cannot resolve: the tests substitute addresses).
Every process is started in its own process group and stopped by that group id; every namespace and hosts
directory created here is removed by ``close()``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

FORCE_LOOPBACK_ENV = "SPOTRUN_TEST_LOOPBACK"
"""Set to run the deploy tests on 127.0.0.1 even where network namespaces work (to exercise the fallback)."""

SUBNET = "10.231.7"
"""Private /24 of the lab; it exists only inside the lab's namespaces, so it cannot clash with the host's."""


def loopback_reason() -> str | None:
    """Why network namespaces cannot be used here, or None when they can."""
    if os.environ.get(FORCE_LOOPBACK_ENV):
        return f"{FORCE_LOOPBACK_ENV} is set"
    if os.geteuid() != 0:
        return "not root: network namespaces need CAP_SYS_ADMIN"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"spotrun-probe-{os.getpid()}"
    result = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True, timeout=10)
    if result.returncode != 0:
        return f"`ip netns add` failed: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True, timeout=10)
    return None


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=10)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


@dataclass
class Host:
    name: str
    """The host's DNS name as the others see it (the first alias), e.g. ``spotrun-etcd-0.spotrun-etcd``."""
    hostname: str
    """Its own hostname (the first alias without a dot, as a pod's is), which resolves to ``addr``."""
    addr: str
    netns: str | None
    """Network namespace, None on loopback."""


@dataclass
class NetLab:
    """A set of hosts; ``add`` them, then ``start``, then ``popen`` processes on them; always ``close``."""

    isolated: bool
    tag: str = field(default_factory=lambda: f"spotrun-t{os.getpid()}-{time.monotonic_ns() % 100000}")
    hosts: dict[str, Host] = field(default_factory=dict)
    _aliases: dict[str, list[str]] = field(default_factory=dict)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _namespaces: list[str] = field(default_factory=list)

    def add(self, key: str, *names: str) -> Host:
        index = len(self.hosts) + 10
        netns = f"{self.tag}-{index}" if self.isolated else None
        hostname = next((n for n in names if "." not in n), key)
        host = Host(names[0] if names else key, hostname, f"{SUBNET}.{index}" if self.isolated else "127.0.0.1", netns)
        self.hosts[key] = host
        self._aliases[key] = list(names)
        return host

    def start(self) -> NetLab:
        if not self.isolated:
            return self
        switch = f"{self.tag}-sw"
        self._create_netns(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts.values()):
            assert host.netns is not None
            self._create_netns(host.netns)
            # Both ends are created directly inside the namespaces: no interface ever appears on the host.
            _ip("-n", switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            _ip("-n", switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        for key, host in self.hosts.items():
            self._write_hosts_file(key, host)
        return self

    def cut(self, key: str) -> None:
        """Cut host ``key``'s link the way a partition does: every packet dropped both ways (a blackhole qdisc on
        its interface and on its switch port), no RST, no FIN, the interfaces stay up. ``restore`` undoes it."""
        netns, port = self._link(key)
        _ip("netns", "exec", netns, "tc", "qdisc", "add", "dev", "eth0", "root", "blackhole")
        _ip("netns", "exec", f"{self.tag}-sw", "tc", "qdisc", "add", "dev", port, "root", "blackhole")

    def restore(self, key: str) -> None:
        netns, port = self._link(key)
        _ip("netns", "exec", netns, "tc", "qdisc", "del", "dev", "eth0", "root")
        _ip("netns", "exec", f"{self.tag}-sw", "tc", "qdisc", "del", "dev", port, "root")

    def _link(self, key: str) -> tuple[str, str]:
        host = self.hosts[key]
        if host.netns is None:
            raise RuntimeError("a link can only be cut between network namespaces (the lab runs on loopback)")
        return host.netns, f"p{list(self.hosts).index(key)}"

    def _create_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)

    def _write_hosts_file(self, key: str, host: Host) -> None:
        assert host.netns is not None
        lines = ["127.0.0.1 localhost"]
        lines += [f"{other.addr} {' '.join(self._aliases[k])}" for k, other in self.hosts.items() if self._aliases[k]]
        directory = Path("/etc/netns") / host.netns
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "hosts").write_text("\n".join(lines) + "\n")
        # No nameserver line: glibc then asks 127.0.0.1:53, which refuses at once inside the namespace. The
        # host's resolv.conf would point at a server the namespace cannot reach, and every lookup of a name
        # not in the hosts file (gloo's and c10d's reverse lookups) would wait for its timeout.
        (directory / "resolv.conf").write_text("# spotrun test lab: names come from /etc/hosts only\noptions timeout:1 attempts:1\n")

    def _on(self, key: str | None) -> list[str]:
        """Command prefix that runs a program on host ``key``: its network namespace and, as on a real node or
        pod, its own hostname (own UTS namespace), so ``socket.getfqdn()`` and gloo find the host's address.
        Every step execs, so the PID the caller gets is the program's."""
        if key is None or self.hosts[key].netns is None:
            return []
        host = self.hosts[key]
        return ["ip", "netns", "exec", host.netns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                host.hostname]

    def popen(self, key: str | None, argv: Sequence[str], *, env: Mapping[str, str], cwd: str | Path,
              log: IO[bytes]) -> subprocess.Popen[bytes]:
        """Start ``argv`` on host ``key`` (None: in the test's own namespace, e.g. a Slurm batch shell)."""
        prefix = self._on(key)
        # `ip netns exec` execs the command: the PID is the process itself. Its own session, so that the
        # whole tree (an agent and its workers) is stopped through its process group id.
        proc = subprocess.Popen([*prefix, *argv], env=dict(env), cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self._procs.append(proc)
        return proc

    def run(self, key: str, argv: Sequence[str], *, env: Mapping[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
        prefix = self._on(key)
        return subprocess.run([*prefix, *argv], check=False, env=dict(env), capture_output=True, text=True, timeout=timeout)

    def stop(self, proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
        """SIGTERM the process group we created, SIGKILL it after ``grace``; reap the leader."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            if proc.poll() is not None:
                break
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        # Members of the group that outlived their leader (workers of a killed agent, tasks of a script).
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        for proc in reversed(self._procs):
            self.stop(proc, grace=2.0)
        for netns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", netns], check=False, capture_output=True, timeout=10)
            shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)
        self._namespaces.clear()

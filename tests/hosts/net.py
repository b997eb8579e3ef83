"""Hosts on one machine: network namespaces joined to the root namespace by veth pairs.

Each host is a namespace with two links to the root namespace, each a veth pair on a /30 of
its own inside ``10.213.0.0/16``:

- ``db``: the host reaches the database at the root side's address of this link;
- ``prov``: the host reaches the "provider" (the chaos sink) at the root side's address of
  this link.

:meth:`Hosts.cut` sets the root side of the ``db`` link down: the host keeps its address and
its routes, and what it sends to the database is dropped, as in a partition it is not told of.
Its provider link stays up (the hard case: a host that cannot reach the database may still
reach the provider). :meth:`Hosts.heal` sets it up again; TCP connections that survived the
cut go on.

Names carry a per-run random suffix (namespaces ``oh<sfx>h<i>``, root-side links
``oh<sfx><i>d`` / ``oh<sfx><i>p``) and a third octet chosen free in the root namespace, so two
runs never collide. :meth:`Hosts.close` deletes every namespace (which deletes its veth pairs)
even when a test failed; addresses exist only on links the run made.

A host's clock can be skewed from outside (:func:`clock_skew_env`): libfaketime offsets the
process's wall clock and can make its clocks, monotonic included, run slower or faster; the
package's engine needs no switch for it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.chaos.cluster import PrivateCluster, find_bindir

NETWORK = ipaddress.ip_network("10.213.0.0/16")
FAKETIME_LIBS = ("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
                 "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                          check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why this machine cannot make hosts (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"ohprobe{secrets.token_hex(3)}"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"cannot create a network namespace: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    if find_bindir() is None:
        return "no PostgreSQL binaries for a private cluster"
    return None


def faketime_lib() -> str | None:
    return next((lib for lib in FAKETIME_LIBS if Path(lib).exists()), None)


def clock_skew_env(offset: float = 0.0, rate: float = 1.0) -> dict[str, str]:
    """The environment that starts a process with its clocks skewed: wall clock ``offset``
    seconds ahead (negative: behind), and every clock running at ``rate`` times real time
    (sleeps and timeouts scaled with it, as on a host whose oscillator is off)."""
    lib = faketime_lib()
    if lib is None:
        raise RuntimeError("libfaketime is not installed (Debian package faketime)")
    spec = f"{offset:+.3f}" + (f" x{rate:g}" if rate != 1.0 else "")
    return {"LD_PRELOAD": lib, "FAKETIME": spec, "FAKETIME_NO_CACHE": "1"}


@dataclass(frozen=True)
class Host:
    index: int
    netns: str
    db_link: str  # root side of the database link
    prov_link: str  # root side of the provider link
    db_server: str  # the database's address as this host sees it
    prov_server: str  # the provider's address as this host sees it
    address: str  # the host's own address on its database link

    def prefix(self) -> list[str]:
        """The command prefix that runs a program on this host."""
        return ["ip", "netns", "exec", self.netns]


class Hosts:
    """``count`` hosts; a context manager that removes them on exit."""

    def __init__(self, count: int) -> None:
        self.suffix = secrets.token_hex(2)
        self.hosts: list[Host] = []
        self.octet = self._free_octet()
        for i in range(count):
            base = self.octet * 256 + 8 * i
            addr = [str(NETWORK[base + k]) for k in range(8)]
            self.hosts.append(Host(
                index=i, netns=f"oh{self.suffix}h{i}", db_link=f"oh{self.suffix}{i}d",
                prov_link=f"oh{self.suffix}{i}p", db_server=addr[1], prov_server=addr[5],
                address=addr[2]))
        self._made: list[str] = []

    @staticmethod
    def _free_octet() -> int:
        taken = _ip("-4", "-o", "addr", "show").stdout
        for _ in range(100):
            octet = secrets.randbelow(256)
            if f" 10.213.{octet}." not in taken:
                return octet
        raise RuntimeError("no free 10.213.x.0/24 in the root namespace")

    def __enter__(self) -> Hosts:
        try:
            for host in self.hosts:
                self._make(host)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self, host: Host) -> None:
        _ip("netns", "add", host.netns)
        self._made.append(host.netns)
        _ip("-n", host.netns, "link", "set", "lo", "up")
        for root_side, inner, server, mine in (
                (host.db_link, "db", host.db_server, host.address),
                (host.prov_link, "prov", host.prov_server,
                 str(ipaddress.ip_address(host.prov_server) + 1))):
            _ip("link", "add", root_side, "type", "veth", "peer", "name", inner,
                "netns", host.netns)
            _ip("addr", "add", f"{server}/30", "dev", root_side)
            _ip("link", "set", root_side, "up")
            _ip("-n", host.netns, "addr", "add", f"{mine}/30", "dev", inner)
            _ip("-n", host.netns, "link", "set", inner, "up")

    def close(self) -> None:
        for host in self.hosts:
            for link in (host.db_link, host.prov_link):
                _ip("link", "del", link, check=False)  # the pair goes with it
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()

    def cut(self, host: Host) -> None:
        """The host's database link goes down (the provider link stays up)."""
        _ip("link", "set", host.db_link, "down")

    def heal(self, host: Host) -> None:
        _ip("link", "set", host.db_link, "up")

    def server_addresses(self) -> list[str]:
        return [a for h in self.hosts for a in (h.db_server, h.prov_server)]


def host_url(url: str, address: str) -> str:
    """``url`` (a cluster URL on 127.0.0.1) with the server reached at ``address``."""
    return url.replace("@127.0.0.1:", f"@{address}:", 1)


@contextlib.contextmanager
def cluster_for(hosts: Hosts, *, idle_transaction_timeout: str = "2s"
                ) -> Iterator[PrivateCluster]:
    """A private cluster listening on 127.0.0.1 and on the root side of every host link,
    accepting the hosts' connections; destroyed on exit. ``idle_transaction_timeout``: the
    server's ``idle_in_transaction_session_timeout`` ("0": none)."""
    bindir = find_bindir()
    if bindir is None:
        raise RuntimeError("no PostgreSQL binaries")
    cluster = PrivateCluster(bindir)
    try:
        cluster.init()
        addresses = ",".join(["127.0.0.1", *hosts.server_addresses()])
        with open(cluster.data / "postgresql.conf", "a") as conf:
            conf.write(f"listen_addresses = '{addresses}'\n")
            # A connection to a cut host is given up within 2 s, below the tests' 3 s lease,
            # instead of the kernel's 15 minutes of retransmissions: a backend waiting to read
            # by keepalives, one blocked sending results to the lost host by
            # tcp_user_timeout (the idle-in-transaction timeout does not reach that one: it
            # is not idle). Either holds its transaction's row locks until it ends.
            conf.write("tcp_keepalives_idle = 1\ntcp_keepalives_interval = 1\n"
                       "tcp_keepalives_count = 1\ntcp_user_timeout = 2000\n")
            # A cut host's open transaction holds its row locks until the server ends it; the
            # sweep that releases expired leases skips locked rows, so that transaction must
            # end before a lease has run out (docs/operations.md).
            conf.write(f"idle_in_transaction_session_timeout = '{idle_transaction_timeout}'\n")
        with open(cluster.data / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {NETWORK} trust\n")
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()


def reachable(url: str, host: Host, timeout: float = 5) -> bool:
    """Whether ``host`` reaches the database at ``url`` (a probe run inside the host)."""
    code = ("import psycopg, sys\n"
            f"psycopg.connect(sys.argv[1], connect_timeout={int(timeout)}).close()\n")
    done = subprocess.run([*host.prefix(), _python(), "-c", code, url], capture_output=True,
                          timeout=timeout + 10, check=False)
    return done.returncode == 0


def _python() -> str:
    import sys

    return sys.executable

"""Two "hosts" on one machine: network namespaces joined by a veth pair, each with its own address.

Used by the multi-host tests and benchmarks. Needs root (``ip netns``); the namespaces and links
are removed on exit. Addresses are taken from 10.213.0.0/24 and exist only inside the namespaces
created here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Host:
    ns: str
    addr: str
    ifname: str
    hostname: str

    def prefix(self) -> list[str]:
        """Run a command inside this host: own network namespace and own hostname."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "sh", "-c",
                f'hostname {self.hostname} && exec "$@"', "sh"]


def can_create() -> str | None:
    """None when namespaces can be made here, else the reason why not."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs the {tool} command (iproute2 / util-linux)"
    probe = f"rp-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_hosts(delay_ms: float = 0.0, rate: str | None = None) -> Iterator[tuple[Host, Host]]:
    """Yield two hosts joined by a veth link, optionally shaped (``tc netem`` delay, ``tc tbf`` rate)."""
    tag = f"{os.getpid() % 100000}"
    hosts = (
        Host(f"rp-a-{tag}", "10.213.0.1", f"rpa{tag}", "rp-host-a"),
        Host(f"rp-b-{tag}", "10.213.0.2", f"rpb{tag}", "rp-host-b"),
    )
    try:
        for h in hosts:
            _ip("netns", "add", h.ns)
        _ip("link", "add", hosts[0].ifname, "type", "veth", "peer", "name", hosts[1].ifname)
        for h in hosts:
            _ip("link", "set", h.ifname, "netns", h.ns)
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            _ip("-n", h.ns, "link", "set", h.ifname, "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
            if delay_ms:
                netem = ["tc", "qdisc", "add", "dev", h.ifname, "root", "netem", "delay", f"{delay_ms}ms"]
                if rate:
                    netem += ["rate", rate]
                subprocess.run(["ip", "netns", "exec", h.ns, *netem], check=True, capture_output=True)
            elif rate:
                # A token bucket: needs only sch_tbf, which more kernels ship than sch_netem.
                tbf = ["tc", "qdisc", "add", "dev", h.ifname, "root", "tbf", "rate", rate,
                       "burst", "64kb", "latency", "500ms"]
                subprocess.run(["ip", "netns", "exec", h.ns, *tbf], check=True, capture_output=True)
        yield hosts
    finally:
        for h in hosts:
            subprocess.run(["ip", "netns", "del", h.ns], capture_output=True)


AGENT = str(Path(__file__).with_name("netns_agent.sh"))


def mpirun_across(hosts: tuple[Host, ...], argv: list[str], hostfile: Path, slots: int = 1) -> tuple[list[str], dict[str, str]]:
    """An Open MPI ``mpirun`` line, started inside the first host, with ``slots`` ranks on each host.

    Open MPI reaches the other hosts through an rsh agent (``netns_agent.sh``) that enters the
    host's namespace instead of logging in with ssh; TCP only, over the namespaces' subnet.
    Returns the command and the environment variables it needs.
    """
    hostfile.write_text("".join(f"{h.addr} slots={slots}\n" for h in hosts))
    subnet = "10.213.0.0/24"
    cmd = [*hosts[0].prefix(), "mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(slots * len(hosts)),
           "--hostfile", str(hostfile), "--mca", "plm_rsh_agent", AGENT, "--mca", "btl", "self,tcp",
           "--mca", "btl_tcp_if_include", subnet, "--mca", "oob_tcp_if_include", subnet,
           "--bind-to", "none", "--tag-output", *argv]
    env = {"RP_NETNS_MAP": " ".join(f"{h.addr}={h.ns}:{h.hostname}" for h in hosts)}
    return cmd, env

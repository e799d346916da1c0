"""Hosts on one machine: network namespaces, each with its own address and hostname.

:func:`two_hosts` joins two namespaces by a veth pair; :func:`bridged_hosts` joins any number
through a bridge that lives in a namespace of its own (a switch), so that one host's link can
be shaped (``tc tbf``) without touching the others'. Used by the multi-host tests and
benchmarks. Needs root (``ip netns``); the namespaces and links are removed on exit, also on
failure. Addresses are taken from 10.213.0.0/24 and exist only inside the namespaces created
here.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Host:
    ns: str
    addr: str
    ifname: str
    hostname: str
    cpus: str | None = None

    def prefix(self) -> list[str]:
        """Run a command inside this host: own network namespace, own hostname, its CPUs (``cpus``) only."""
        pin = ["taskset", "-c", self.cpus] if self.cpus else []
        return ["ip", "netns", "exec", self.ns, *pin, "unshare", "--uts", "sh", "-c",
                f'hostname {self.hostname} && exec "$@"', "sh"]


def can_create() -> str | None:
    """None when namespaces can be made here, else the reason why not."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs the {tool} command (iproute2 / util-linux)"
    probe = f"rpd-probe-{os.getpid()}"
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
        Host(f"rpd-a-{tag}", "10.213.0.1", f"rpda{tag}", "rp-host-a"),
        Host(f"rpd-b-{tag}", "10.213.0.2", f"rpdb{tag}", "rp-host-b"),
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


def _tbf(ns: str, dev: str, rate: str) -> list[str]:
    """A token bucket on ``dev``'s egress inside ``ns`` (needs only sch_tbf)."""
    return ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
            "burst", "64kb", "latency", "500ms"]


def _pair_tbf(ns: str, dev: str, dst: str, rate: str) -> list[list[str]]:
    """A token bucket on ``dev``'s egress inside ``ns`` for the packets to address ``dst`` only: an HTB root
    (unclassified packets go out unshaped) whose one class, chosen by a u32 match on the destination,
    holds the ``tbf``."""
    tc = ["ip", "netns", "exec", ns, "tc"]
    return [[*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb"],
            [*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", "40gbit"],
            [*tc, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "tbf", "rate", rate,
             "burst", "64kb", "latency", "500ms"],
            [*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
             "match", "ip", "dst", f"{dst}/32", "flowid", "1:1"]]


@contextlib.contextmanager
def bridged_hosts(count: int = 3, rates: dict[int, str] | None = None,
                  cpus: dict[int, str] | None = None,
                  pair_rates: dict[tuple[int, int], str] | None = None) -> Iterator[tuple[Host, ...]]:
    """Yield ``count`` hosts (``rp-host-a``, ``rp-host-b``, ...) joined by a bridge in a switch namespace.

    ``rates`` shapes host ``i``'s link in both directions (``{2: "50mbit"}``: host c's egress and
    the switch's egress towards it), as a slow NIC, cable or switch port would. ``pair_rates``
    shapes only the path between hosts ``i`` and ``j`` (``{(1, 2): "50mbit"}``: what b sends to c
    and c to b; their traffic with other hosts is not shaped), as a slow route between two hosts
    would. ``cpus`` confines what runs on host ``i`` to some CPUs (``{2: "1"}``), as a smaller
    host would.
    """
    tag = f"{os.getpid() % 100000}"
    switch = f"rpd-sw-{tag}"
    letters = "abcdefghij"[:count]
    hosts = tuple(Host(f"rpd-{x}3-{tag}", f"10.213.0.{i + 1}", "eth0", f"rp-host-{x}", (cpus or {}).get(i))
                  for i, x in enumerate(letters))
    made: list[str] = []
    try:
        for ns in (switch, *(h.ns for h in hosts)):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, h in enumerate(hosts):
            port = f"p{letters[i]}"
            _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", h.ifname, "netns", h.ns)
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            _ip("-n", h.ns, "link", "set", h.ifname, "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
            rate = (rates or {}).get(i)
            if rate:
                subprocess.run(_tbf(h.ns, h.ifname, rate), check=True, capture_output=True)
                subprocess.run(_tbf(switch, port, rate), check=True, capture_output=True)
        for (i, j), rate in (pair_rates or {}).items():
            for a, b in ((hosts[i], hosts[j]), (hosts[j], hosts[i])):
                for cmd in _pair_tbf(a.ns, a.ifname, b.addr, rate):
                    subprocess.run(cmd, check=True, capture_output=True)
        yield hosts
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def mpirun_across(hosts: tuple[Host, ...], argv: list[str], hostfile: Path,
                  slots: int | Sequence[int] = 1) -> tuple[list[str], dict[str, str]]:
    """An Open MPI ``mpirun`` line, started inside the first host, with ``slots`` ranks on each host.

    ``slots``: one count for every host, or one per host (``(4, 2, 2)``); ranks are placed in
    host order.

    Open MPI reaches the other hosts through an rsh agent (``netns_agent.sh``) that enters the
    host's namespace instead of logging in with ssh; TCP only, over the namespaces' subnet.
    Returns the command and the environment variables it needs.
    """
    per_host = [slots] * len(hosts) if isinstance(slots, int) else list(slots)
    hostfile.write_text("".join(f"{h.addr} slots={n}\n" for h, n in zip(hosts, per_host, strict=True)))
    subnet = "10.213.0.0/24"
    cmd = [*hosts[0].prefix(), "mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(sum(per_host)),
           "--hostfile", str(hostfile), "--mca", "plm_rsh_agent", AGENT, "--mca", "btl", "self,tcp",
           "--mca", "btl_tcp_if_include", subnet, "--mca", "oob_tcp_if_include", subnet,
           "--bind-to", "none", "--tag-output", *argv]
    env = {"RP_NETNS_MAP": " ".join(f"{h.addr}={h.ns}:{h.hostname}:{h.cpus or ''}" for h in hosts)}
    return cmd, env


def untagged(text: str) -> str:
    """``mpirun --tag-output``'s output without its tags.

    mpirun tags what each read of a rank's output returns, so one line written at once can come
    back cut in two with a tag in the middle (``...}[1,0]<stdout>:``); without the tags the
    line of the one rank that prints is whole again.
    """
    return re.sub(r"\[\d+,\d+\]<std(?:out|err)>:", "", text)


def job_env(**extra: str) -> dict[str, str]:
    """This process's environment for a job launched across the hosts: without the variables of a world
    this process may be part of (a launcher sets its own), one intra-op thread per rank, and ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RINGPIPE_BACKEND", "WORLD_SIZE", "RANK")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def launch_across(hosts: Sequence[Host], per_host: Sequence[int], argv: list[str], port: int,
                  env: dict[str, str], timeout: float = 300) -> list[subprocess.CompletedProcess[str]]:
    """``ringpipe launch --nnodes N`` inside every host, ``per_host[i]`` ranks on host ``i``; waits for all.

    ``argv``: what each launcher runs (a script and its arguments, or ``-m module ...``). Ranks
    are numbered host by host (host a's first). Returns each host's completed launcher; a
    launcher still running at ``timeout`` is killed with its ranks.
    """
    import sys

    procs = []
    for node, (host, n) in enumerate(zip(hosts, per_host, strict=True)):
        cmd = [*host.prefix(), sys.executable, "-m", "ringpipe.cli", "launch", "-n", str(n), "--nnodes",
               str(len(hosts)), "--node-rank", str(node), "--rdzv-endpoint", f"{hosts[0].addr}:{port}", *argv]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                      start_new_session=True))
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    return done


def rank_lines(text: str, rank: int = 0) -> str:
    """The stdout lines that ``mpirun --tag-output`` tagged as rank ``rank``'s, with the tag taken off the front.

    What a user gets with ``sed -n 's/^\\[1,0\\]<stdout>://p'``: unlike :func:`untagged`, a tag in
    the middle of a line (a line cut between two reads) is left there.
    """
    tag = re.compile(rf"^\[\d+,{rank}\]<stdout>:")
    return "".join(tag.sub("", line, count=1) for line in text.splitlines(keepends=True) if tag.match(line))

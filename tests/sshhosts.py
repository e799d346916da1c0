"""Hosts reachable over ssh on one machine: network namespaces on a bridge, each running its own ``sshd``.

:func:`ssh_hosts` yields ``count`` hosts (hostnames ``rpl-host-a``, ``rpl-host-b``, ...) and a
``client`` namespace on the same bridge (a login node with no sshd), plus the ssh settings that
reach them: a throwaway client key, a client configuration that neither checks nor records host
keys, and the port every ``sshd`` listens on. Everything (namespaces, daemons, keys) is made for
the test and removed on exit, also on failure. Needs root, ``ip``, ``unshare`` and OpenSSH's
``sshd`` (Debian: ``apt-get install openssh-server``). Addresses come from a 10.219.N.0/24 subnet
that exists only inside the namespaces created here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import netns

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
PORT = 2222


@dataclass
class Host:
    ns: str
    addr: str
    hostname: str

    def prefix(self) -> list[str]:
        """Run a command inside this host: its network namespace and its own hostname."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "sh", "-c",
                f'hostname {self.hostname} && exec "$@"', "sh"]


@dataclass
class SshHosts:
    hosts: tuple[Host, ...]
    client: Host
    key: str  # private key that every sshd accepts
    config: str  # ssh client configuration (no host key checks, nothing written to ~/.ssh)
    port: int
    subnet: str

    def ssh_options(self) -> list[str]:
        """The ``ringpipe launch`` options that reach these hosts."""
        return ["--ssh-command", f"ssh -F {self.config}", "--ssh-port", str(self.port),
                "--ssh-identity-file", self.key]


def can_run() -> str | None:
    """None when ssh hosts can be made here, else the reason why not."""
    reason = netns.can_create()
    if reason is not None:
        return reason
    for tool in ("ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"needs the {tool} command"
    if not os.path.exists(SSHD):
        return "needs OpenSSH's sshd (apt-get install openssh-server)"
    return None


_ip = netns._ip


def _sshd_config(work: Path, host: Host, port: int) -> Path:
    path = work / f"sshd-{host.hostname}.conf"
    path.write_text(
        f"Port {port}\nListenAddress {host.addr}\nHostKey {work}/host_key\n"
        f"AuthorizedKeysFile {work}/authorized_keys\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        f"PidFile {work}/sshd-{host.hostname}.pid\nPrintMotd no\nLogLevel ERROR\nMaxStartups 100\n"
        "MaxSessions 100\n"
    )
    return path


def _wait_listening(host: Host, port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        probe = subprocess.run(["ip", "netns", "exec", host.ns, "bash", "-c", f"exec 3<>/dev/tcp/{host.addr}/{port}"],
                               capture_output=True)
        if probe.returncode == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"sshd on {host.hostname} ({host.addr}:{port}) did not start")


@contextlib.contextmanager
def ssh_hosts(count: int = 3, port: int = PORT) -> Iterator[SshHosts]:
    """Yield ``count`` ssh hosts and a client namespace on one bridge; remove everything afterwards."""
    tag = os.getpid() % 100000
    net = 10 + tag % 240
    subnet = f"10.219.{net}.0/24"
    switch = f"rpl-sw-{tag}"
    letters = "abcdefgh"[:count]
    hosts = tuple(Host(f"rpl-{x}-{tag}", f"10.219.{net}.{i + 1}", f"rpl-host-{x}") for i, x in enumerate(letters))
    client = Host(f"rpl-cl-{tag}", f"10.219.{net}.100", "rpl-client")
    made: list[str] = []
    daemons: list[subprocess.Popen[bytes]] = []
    work = Path(tempfile.mkdtemp(prefix="rpl-ssh-"))
    try:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(work / "host_key")], check=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(work / "id_ed25519")], check=True)
        (work / "authorized_keys").write_text((work / "id_ed25519.pub").read_text())
        config = work / "ssh_config"
        config.write_text("Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
                          "  IdentitiesOnly yes\n")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        for ns in (switch, *(h.ns for h in (*hosts, client))):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, h in enumerate((*hosts, client)):
            peer = f"p{i}"
            _ip("-n", switch, "link", "add", peer, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
            _ip("-n", switch, "link", "set", peer, "master", "br0")
            _ip("-n", switch, "link", "set", peer, "up")
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
            _ip("-n", h.ns, "link", "set", "eth0", "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
        for h in hosts:
            conf = _sshd_config(work, h, port)
            daemons.append(subprocess.Popen([*h.prefix(), SSHD, "-D", "-e", "-f", str(conf)],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            start_new_session=True))
        for h in hosts:
            _wait_listening(h, port)
        yield SshHosts(hosts, client, str(work / "id_ed25519"), str(config), port, subnet)
    finally:
        for d in daemons:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(d.pid, signal.SIGTERM)
            try:
                d.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(d.pid, signal.SIGKILL)
                d.wait()
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def processes_with(marker: str) -> list[str]:
    """``pid cmdline`` of every process (any namespace) whose command line contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append(f"{entry} {cmdline.strip()}")
    return found

"""``ringpipe launch --backend mpi -H a:4,b:2`` (or ``--hostfile``): one ``mpirun`` across the hosts.

The hosts are checked as for the default mode (:func:`ringpipe.launch.remote.check_hosts`), then
``mpirun`` gets them as its own ``-H host:count,...`` in ringpipe's placement, reaches them with
ssh or ``--ssh-command`` (Open MPI's ``plm_rsh_agent``; ``--ssh-port`` and
``--ssh-identity-file`` become ``plm_rsh_args``), exports the forwarded variables with ``-x`` and
keeps its traffic on ``--network-interface`` (``btl_tcp_if_include`` / ``oob_tcp_if_include``).

A remote rank cannot write into the launcher's pipes, so its lines come through mpirun's
``--tag-output``; the launcher joins the pieces mpirun tags separately (a line split from its
newline) back into whole lines and prefixes each once, ``[rank]:``, as in every other mode.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys

from ringpipe.launch import runners
from ringpipe.launch.bootstrap import PLACEMENT
from ringpipe.launch.hosts import is_local
from ringpipe.launch.options import LaunchOptions
from ringpipe.launch.relay import Failure, last_error, lost_peer, report_failures
from ringpipe.launch.remote import HostProblem, _node0_address, check_hosts, forwarded_env
from ringpipe.launch.speaker import label
from ringpipe.ports import free_port

__all__ = ["run_mpi_hosts", "TagJoiner", "mpirun_hosts_command"]

_TAG = re.compile(rb"\[\d+,(\d+)\]<(stdout|stderr)>:")


class TagJoiner:
    """Turn ``mpirun --tag-output``'s stream into whole lines prefixed ``[rank]:``, one stream per rank."""

    def __init__(self, tail_lines: int = 60) -> None:
        self._buf = b""
        self._key: tuple[int, int] | None = None  # (rank, fd) of the text being read
        self._partial: dict[tuple[int, int] | None, bytes] = collections.defaultdict(bytes)
        self.tails: dict[int, collections.deque[str]] = collections.defaultdict(lambda: collections.deque(maxlen=tail_lines))
        self.untagged: list[str] = []  # mpirun's own messages

    def feed(self, data: bytes, final: bool = False) -> list[tuple[int, bytes]]:
        """Return ``(fd, line)`` pairs ready to write."""
        self._buf += data
        out: list[tuple[int, bytes]] = []
        while True:
            m = _TAG.search(self._buf)
            if m is None:
                cut = self._buf.rfind(b"[")
                keep = not final and cut != -1 and len(self._buf) - cut < 32  # maybe the start of a tag
                text, self._buf = (self._buf[:cut], self._buf[cut:]) if keep else (self._buf, b"")
                out += self._text(text)
                break
            out += self._text(self._buf[:m.start()])
            self._key = (int(m[1]), 1 if m[2] == b"stdout" else 2)
            self._buf = self._buf[m.end():]
        if final:
            for key in list(self._partial):
                if self._partial[key]:
                    out += self._line(key, self._partial.pop(key))
        return out

    def _text(self, text: bytes) -> list[tuple[int, bytes]]:
        """Text after the current tag: its first line is the tagged rank's, later lines are mpirun's own."""
        out: list[tuple[int, bytes]] = []
        while text:
            nl = text.find(b"\n")
            if nl == -1:
                self._partial[self._key] += text
                break
            out += self._line(self._key, self._partial.pop(self._key, b"") + text[:nl])
            text = text[nl + 1:]
            self._key = None  # mpirun tags every line it forwards: an untagged line is its own
        return out

    def _line(self, key: tuple[int, int] | None, line: bytes) -> list[tuple[int, bytes]]:
        if key is None:
            if not line.strip():
                return []
            self.untagged.append(line.decode(errors="replace"))
            return [(2, line + b"\n")]
        rank, fd = key
        if fd == 2:
            self.tails[rank].append(line.decode(errors="replace"))
        return [(fd, f"[{rank}]:".encode() + line + b"\n")]


def mpirun_hosts_command(opts: LaunchOptions, env: dict[str, str]) -> list[str]:
    """The ``mpirun`` line for ``opts.placement`` with ``env``'s variables exported."""
    assert opts.placement is not None
    extra = ["-H", ",".join(f"{h}:{n}" for h, n in opts.placement.hosts)]
    if opts.ssh_command:
        extra += ["--mca", "plm_rsh_agent", opts.ssh_command]
    rsh_args = ["-o", "BatchMode=yes"]
    if opts.ssh_port:
        rsh_args += ["-p", str(opts.ssh_port)]
    if opts.ssh_identity_file:
        rsh_args += ["-i", opts.ssh_identity_file]
    extra += ["--mca", "plm_rsh_args", " ".join(rsh_args)]
    if opts.network_interface:
        extra += ["--mca", "btl_tcp_if_include", opts.network_interface,
                  "--mca", "oob_tcp_if_include", opts.network_interface]
    for name in sorted(env):
        extra += ["-x", name]
    cmd = runners.mpirun_command(opts.placement.size, runners._rank_command(opts), extra=extra, tag_output=True)
    return [c for c in cmd if c != "--oversubscribe"]  # the hosts' slots decide, not this machine's cores


def run_mpi_hosts(opts: LaunchOptions) -> int:
    placement = opts.placement
    assert placement is not None
    remote = [h for h, _ in placement.hosts if not is_local(h)]
    found = check_hosts(remote, opts, float(opts.start_timeout or 30))
    problems = [p for p in found.values() if isinstance(p, HostProblem)]
    if problems:
        for p in problems:
            print(f"{label()}: cannot start ranks on host {p.host}: {p.reason}", file=sys.stderr)
        print(f"{label()}: nothing was started", file=sys.stderr)
        return 1
    first = placement.hosts[0][0]
    port = opts.master_port or (found[first] if isinstance(found.get(first), int) else free_port(""))
    env = forwarded_env(opts)
    env.update({"RINGPIPE_BACKEND": "mpi", "MASTER_ADDR": _node0_address(placement), "MASTER_PORT": str(port),
                "PYTHONUNBUFFERED": "1", PLACEMENT: ",".join(str(n) for _, n in placement.hosts)})
    cmd = mpirun_hosts_command(opts, env)
    print(f"{label()}: {placement.size} MPI ranks on {len(placement.hosts)} hosts ({placement.describe()})",
          file=sys.stderr, flush=True)
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("RINGPIPE_LAUNCH_")}
    child_env.update(env)
    proc = subprocess.Popen(cmd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=runners._die_with_launcher(os.getpid()))
    assert proc.stdout is not None
    joiner = TagJoiner()
    try:
        while True:
            data = os.read(proc.stdout.fileno(), 65536)
            for fd, line in joiner.feed(data, final=not data):
                os.write(fd, line)
            if not data:
                break
        code = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        print(f"{label()}: interrupted by SIGINT; every rank on every host was stopped", file=sys.stderr)
        return 130
    if code == 0:
        return 0
    text = "\n".join(joiner.untagged)
    codes: dict[int, int] = {}
    for rank, sig in runners._MPI_SIGNAL.findall(text):
        codes[int(rank)] = -int(sig)
    for rank, status in runners._MPI_EXIT.findall(text) + runners._MPI_ABORT.findall(text):
        codes.setdefault(int(rank), int(status))
    failures = []
    for rank, status in sorted(codes.items()):
        tail = list(joiner.tails.get(rank, []))
        error = last_error(tail)
        failures.append(Failure(rank, status, error, float(rank), lost_peer(tail)))
    if not failures:
        print(f"{label()}: mpirun exited with code {code}", file=sys.stderr)
        return code
    return report_failures(failures)

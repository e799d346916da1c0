"""Several hosts from one command: ``ringpipe launch -np 8 -H a:4,b:2,c:2`` starts every host's ranks over ssh.

As horovodrun does, the launcher first checks every host with one ssh command, all at once and
within ``--start-timeout`` (default 30 s, or ``HOROVOD_START_TIMEOUT``): the host must answer,
hold this interpreter and this working directory, and find ringpipe. A host that fails is named
with ssh's own reason before any rank starts. Then it starts ``ringpipe launch --nnodes N
--node-rank I`` on each host (``cd`` to this directory, the forwarded environment, this
interpreter), host 0's agent serving the rendezvous, and relays their output whole lines at a time.

Every host's launcher ends when its standard input closes: the launcher holds that pipe (through
ssh for a remote host), so when one host's ranks fail, when the launcher is interrupted, and even
when it is killed, every other host's launcher stops its ranks. The first host to fail is named
with its exit status; the launcher exits with it (130 after Ctrl-C).

Remote hosts are reached with ``ssh`` (``--ssh-port``, ``--ssh-identity-file``), or with the
command given by ``--ssh-command``, called as ``CMD [ssh options] HOST COMMAND`` like Open MPI's
``plm_rsh_agent``. The same interpreter path and working directory must exist on every host
(a shared file system or the same installation), as with horovodrun and mpirun.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ringpipe.launch.bootstrap import PLACEMENT
from ringpipe.launch.hosts import Placement, is_local
from ringpipe.launch.options import LaunchOptions
from ringpipe.launch.speaker import LAUNCH, label

__all__ = ["run_hosts", "check_hosts", "forwarded_env", "end_on_stdin_eof", "ssh_prefix", "HostProblem"]

#: Set for each host's launcher: its ranks' first global rank (for their output prefix).
FIRST_RANK = "RINGPIPE_LAUNCH_FIRST_RANK"
#: Set for each host's launcher: end (stopping the ranks) when standard input closes.
STDIN_EOF = "RINGPIPE_LAUNCH_END_ON_EOF"

#: Variables every host's ranks get from the launcher's environment, besides those named by -x.
FORWARDED_PREFIXES = ("RINGPIPE_", "HOROVOD_", "NCCL_", "GLOO_", "TORCH_", "OMP_", "MKL_")
FORWARDED_NAMES = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONHASHSEED", "CUDA_VISIBLE_DEVICES")
_NOT_FORWARDED = ("RINGPIPE_LAUNCH_", "TORCHELASTIC_")

_GRACE_S = 20.0


def forwarded_env(opts: LaunchOptions, env: dict[str, str] | None = None) -> dict[str, str]:
    """The variables every host's ranks receive: ringpipe's, Horovod's, the libraries' and ``-x``'s."""
    env = dict(os.environ if env is None else env)
    out = {k: v for k, v in env.items()
           if (k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES) and not k.startswith(_NOT_FORWARDED)}
    for item in opts.exports:
        name, eq, value = item.partition("=")
        if eq:
            out[name] = value
        elif name in env:
            out[name] = env[name]
    out.setdefault("OMP_NUM_THREADS", "1")
    if opts.network_interface:
        out["GLOO_SOCKET_IFNAME"] = opts.network_interface
        out["NCCL_SOCKET_IFNAME"] = opts.network_interface
    return out


def ssh_prefix(opts: LaunchOptions, connect_timeout: float | None = None) -> list[str]:
    """``ssh [options]`` (or ``--ssh-command``'s words) to put before ``HOST COMMAND``."""
    cmd = shlex.split(opts.ssh_command) if opts.ssh_command else ["ssh"]
    cmd += ["-o", "BatchMode=yes"]
    if connect_timeout:
        cmd += ["-o", f"ConnectTimeout={max(1, int(connect_timeout))}"]
    if opts.ssh_port:
        cmd += ["-p", str(opts.ssh_port)]
    if opts.ssh_identity_file:
        cmd += ["-i", opts.ssh_identity_file]
    return cmd


@dataclass
class HostProblem:
    host: str
    reason: str


_PROBE = ("import importlib.util as u, socket; s = socket.socket(); s.bind(('', 0)); "
          "print('ringpipe-probe', s.getsockname()[1] if u.find_spec('ringpipe') else 'missing')")


def _probe(host: str, opts: LaunchOptions, timeout: float) -> tuple[str, int | HostProblem]:
    remote = f"cd {shlex.quote(os.getcwd())} && {shlex.quote(sys.executable)} -c {shlex.quote(_PROBE)}"
    cmd = [*ssh_prefix(opts, timeout), host, remote]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return host, HostProblem(host, f"no answer within --start-timeout {timeout:g} s")
    except FileNotFoundError:
        return host, HostProblem(host, f"cannot run {cmd[0]!r} (install ssh, or give --ssh-command)")
    words = out.stdout.split()
    if out.returncode == 0 and words[:1] == ["ringpipe-probe"] and len(words) > 1:
        if words[1] == "missing":
            return host, HostProblem(host, f"{sys.executable} there cannot import ringpipe; install it on that host")
        return host, int(words[1])
    err = " ".join(line.strip() for line in (out.stderr or out.stdout).strip().splitlines()[-2:])
    if out.returncode == 255:
        why = f"ssh failed: {err}" if err else "ssh failed (exit status 255)"
    elif "No such file or directory" in err and "cd" in err:
        why = f"the working directory {os.getcwd()} does not exist there: {err}"
    elif out.returncode == 127 or "not found" in err or "No such file" in err:
        why = f"{sys.executable} is not there ({err}); install the same environment at the same path"
    else:
        why = f"the check command failed with exit status {out.returncode}: {err}"
    return host, HostProblem(host, why)


def check_hosts(hosts: Sequence[str], opts: LaunchOptions, timeout: float) -> dict[str, int | HostProblem]:
    """Probe every remote host at once; host -> a free TCP port there, or the problem found."""
    if not hosts:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return dict(pool.map(lambda h: _probe(h, opts, timeout), hosts))


def end_on_stdin_eof() -> None:
    """In a host's launcher: stop (SIGTERM to itself, which stops its ranks) when standard input closes."""
    def watch() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="ringpipe-launch-stdin", daemon=True).start()


def _die_with_launcher() -> None:  # in each child before exec
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)


def _host_command(opts: LaunchOptions, placement: Placement, index: int, endpoint: str) -> list[str]:
    _, count = placement.hosts[index]
    cmd = [sys.executable, "-m", "ringpipe.cli", "launch", "-n", str(count), "--nnodes", str(len(placement.hosts)),
           "--node-rank", str(index), "--rdzv-endpoint", endpoint, "--backend", opts.backend]
    if opts.python:
        cmd += ["python", *opts.python]
    return [*cmd, *opts.program]


class _Lines:
    """Relay one child stream to ours, whole lines at a time; tag the host launcher's own lines with the host."""

    def __init__(self, stream: object, out: int, host: str, lock: threading.Lock) -> None:
        self.thread = threading.Thread(target=self._run, args=(stream, out, host, lock), daemon=True)
        self.thread.start()

    @staticmethod
    def _run(stream: object, out: int, host: str, lock: threading.Lock) -> None:
        own = f"{LAUNCH}: ".encode()  # a host's own launcher is ringpipe launch
        for line in iter(stream.readline, b""):  # type: ignore[attr-defined]
            if line.startswith(own):
                line = f"{label()}: [{host}] ".encode() + line[len(own):]
            if not line.endswith(b"\n"):
                line += b"\n"
            with lock:
                view = memoryview(line)
                while view:
                    try:
                        view = view[os.write(out, view):]
                    except BlockingIOError:
                        continue
                    except OSError:
                        return


def _node0_address(placement: Placement) -> str:
    """Host 0 as the other hosts reach it: its name, or this machine's address towards them."""
    first = placement.hosts[0][0]
    if first not in ("localhost", "localhost.localdomain", "::1", "ip6-localhost") and not first.startswith("127."):
        return first
    from ringpipe.launch.runners import source_address

    others = [h for h, _ in placement.hosts[1:]]
    return (source_address(others[0]) if others else None) or first


def run_hosts(opts: LaunchOptions) -> int:
    """Start every host's ranks (see the module's docstring); return the launcher's exit status."""
    placement = opts.placement
    assert placement is not None
    hosts = [h for h, _ in placement.hosts]
    remote = [h for h in hosts if not is_local(h)]
    timeout = float(opts.start_timeout or 30)
    found = check_hosts(remote, opts, timeout)
    problems = [p for p in found.values() if isinstance(p, HostProblem)]
    if problems:
        for p in problems:
            print(f"{label()}: cannot start ranks on host {p.host}: {p.reason}", file=sys.stderr)
        print(f"{label()}: nothing was started", file=sys.stderr)
        return 1
    if opts.master_port:
        port = opts.master_port
    elif hosts[0] in found:
        port = int(found[hosts[0]])  # type: ignore[arg-type]
    else:
        from ringpipe.ports import free_port

        port = free_port("")
    endpoint = f"{_node0_address(placement)}:{port}"
    env = forwarded_env(opts)
    print(f"{label()}: {placement.size} ranks on {len(hosts)} hosts ({placement.describe()}); "
          f"rendezvous at {endpoint}", file=sys.stderr, flush=True)

    procs: list[subprocess.Popen[bytes]] = []
    relays: list[_Lines] = []
    lock = threading.Lock()
    sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        for i, host in enumerate(hosts):
            host_env = {**env, FIRST_RANK: str(placement.first_rank(i)), STDIN_EOF: "1",
                        PLACEMENT: ",".join(str(n) for _, n in placement.hosts)}
            command = _host_command(opts, placement, i, endpoint)
            if host in remote:
                exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(host_env.items()))
                line = f"cd {shlex.quote(os.getcwd())} && exec env {exports} {shlex.join(command)}"
                argv, child_env = [*ssh_prefix(opts, timeout), host, line], None
            else:
                argv = command
                child_env = {k: v for k, v in os.environ.items()
                             if k not in ("MASTER_ADDR", "MASTER_PORT") and not k.startswith(_NOT_FORWARDED)}
                child_env.update(host_env)
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=child_env, start_new_session=True, preexec_fn=_die_with_launcher)
            procs.append(proc)
            relays += [_Lines(proc.stdout, 1, host, lock), _Lines(proc.stderr, 2, host, lock)]
        failed = _wait_first_failure(procs)
    except KeyboardInterrupt as exc:
        _stop(procs)
        for r in relays:
            r.thread.join(timeout=5)
        sig = int(exc.args[0]) if exc.args and isinstance(exc.args[0], int) else int(signal.SIGINT)
        print(f"{label()}: interrupted by {signal.Signals(sig).name}; every rank on every host was stopped",
              file=sys.stderr)
        return 128 + sig
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    if failed is not None:
        _stop(procs)
    for r in relays:
        r.thread.join(timeout=10)
    if failed is None:
        return 0
    index, code = failed
    host, count = placement.hosts[index]
    first = placement.first_rank(index)
    what = ("the ssh connection was lost (ssh exit status 255)" if code == 255 and hosts[index] in remote
            else f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}")
    print(f"{label()}: host {host} (ranks {first}-{first + count - 1}) failed first with {what}; "
          "the ranks on every host were stopped", file=sys.stderr)
    return code if code > 0 else 128 - code if code < 0 else 1


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signum)


def _wait_first_failure(procs: list[subprocess.Popen[bytes]]) -> tuple[int, int] | None:
    """Wait until every host's launcher ended (None) or one failed: (its index, its status)."""
    while True:
        running = False
        for i, p in enumerate(procs):
            code = p.poll()
            if code is None:
                running = True
            elif code != 0:
                return i, code
        if not running:
            return None
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Close every host launcher's standard input (it stops its ranks), then wait; kill what is left."""
    for p in procs:
        if p.stdin is not None:
            with contextlib.suppress(OSError):
                p.stdin.close()
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()

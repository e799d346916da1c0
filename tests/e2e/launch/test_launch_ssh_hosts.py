"""One command, three hosts: ``ringpipe launch -H`` / ``--hostfile`` and ``horovodrun`` over real ssh.

Each host is a network namespace running its own ``sshd`` with a key made for the test
(:mod:`sshhosts`). The expected placement, local ranks and Horovod's cross ranks are written
plainly here from horovodrun's rule (fill the slots host after host; a rank's cross rank counts
the earlier hosts holding the same local rank); the allreduce's expected sum is 1 + 2 + ... + n.
A failing rank on a remote host, Ctrl-C and an unreachable host must each end the job quickly,
with the cause named and nothing left running on any host.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import sshhosts

REASON = sshhosts.can_run()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

LAUNCH = [sys.executable, "-m", "ringpipe.cli", "launch"]
HOROVODRUN = [sys.executable, "-m", "ringpipe.launch.horovodrun"]

PROBE = textwrap.dedent("""
    import os, socket, torch
    import ringpipe as rp
    comm = rp.init_world(os.environ.get("RINGPIPE_BACKEND", "gloo"))
    t = torch.tensor([float(comm.rank + 1)])
    comm.allreduce(t)
    e = os.environ
    print(f"probe rank={comm.rank} size={comm.size} host={socket.gethostname()} "
          f"local={e['LOCAL_RANK']}/{e['LOCAL_WORLD_SIZE']} hvd={e['HOROVOD_RANK']}/{e['HOROVOD_SIZE']} "
          f"cross={e['HOROVOD_CROSS_RANK']}/{e['HOROVOD_CROSS_SIZE']} mark={e.get('RPL_MARK')} sum={t.item():g}",
          flush=True)
    rp.shutdown_world()
""")

WAIT = textwrap.dedent("""
    import os, signal, socket, sys, time, torch
    import ringpipe as rp
    comm = rp.init_world(os.environ.get("RINGPIPE_BACKEND", "gloo"))
    comm.allreduce(torch.ones(1))
    print(f"ready rank={comm.rank} pid={os.getpid()} host={socket.gethostname()}", flush=True)
    if comm.rank == int(sys.argv[1]):
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
""")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "RINGPIPE_BACKEND")
           and not k.startswith(("HOROVOD_", "RINGPIPE_LAUNCH_"))}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def expected_lines(hosts: list[tuple[str, int]], mark: str) -> set[str]:
    """horovodrun's placement, written plainly: ranks fill each host's slots in order."""
    size = sum(n for _, n in hosts)
    lines, rank = set(), 0
    for h, (name, n) in enumerate(hosts):
        for local in range(n):
            cross_rank = sum(1 for _, m in hosts[:h] if m > local)
            cross_size = sum(1 for _, m in hosts if m > local)
            lines.add(f"[{rank}]:probe rank={rank} size={size} host={name} local={local}/{n} hvd={rank}/{size} "
                      f"cross={cross_rank}/{cross_size} mark={mark} sum={size * (size + 1) // 2}")
            rank += 1
    return lines


def _check_probe(out: subprocess.CompletedProcess[str], hosts: list[tuple[str, int]], mark: str) -> None:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    got = {line for line in out.stdout.splitlines() if ":probe " in line}
    assert got == expected_lines(hosts, mark), out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.timeout(400)
def test_4_2_2_from_a_login_node_over_ssh(tmp_path):
    """``-np 8 -H a:4,b:2,c:2`` from a fourth machine: every host's ranks start over ssh."""
    (tmp_path / "probe.py").write_text(PROBE)
    with sshhosts.ssh_hosts(3) as sh:
        a, b, c = sh.hosts
        cmd = [*sh.client.prefix(), *LAUNCH, "-np", "8", "-H", f"{a.addr}:4,{b.addr}:2,{c.addr}:2",
               *sh.ssh_options(), "-x", "RPL_MARK", "python", "-u", "probe.py"]
        out = subprocess.run(cmd, cwd=tmp_path, env=_env(RPL_MARK="sent"), capture_output=True, text=True,
                             timeout=360)
    _check_probe(out, [(a.hostname, 4), (b.hostname, 2), (c.hostname, 2)], "sent")
    assert "8 ranks on 3 hosts" in out.stderr


@pytest.mark.timeout(400)
def test_4_3_1_from_a_hostfile_on_one_of_the_hosts(tmp_path):
    """Open MPI's hostfile, the launcher on host a: a's ranks start locally, b's and c's over ssh."""
    (tmp_path / "probe.py").write_text(PROBE)
    with sshhosts.ssh_hosts(3) as sh:
        a, b, c = sh.hosts
        hostfile = tmp_path / "hosts"
        hostfile.write_text(f"# seed 000's 4-3-1\n{a.addr} slots=4\n{b.addr} slots=3 max_slots=3\n{c.addr}:1\n")
        cmd = [*a.prefix(), *LAUNCH, "--hostfile", str(hostfile), *sh.ssh_options(), "probe.py"]
        out = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=360)
    _check_probe(out, [(a.hostname, 4), (b.hostname, 3), (c.hostname, 1)], "None")


@pytest.mark.mpi
@pytest.mark.timeout(400)
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun")
def test_horovodrun_across_hosts_runs_on_mpi_as_horovod_would(tmp_path):
    """``horovodrun -np 8 -H a:4,b:2,c:2 python probe.py`` with MPI installed: mpirun across the hosts."""
    pytest.importorskip("mpi4py")
    (tmp_path / "probe.py").write_text(PROBE)
    with sshhosts.ssh_hosts(3) as sh:
        a, b, c = sh.hosts
        cmd = [*sh.client.prefix(), *HOROVODRUN, "-np", "8", "-H", f"{a.addr}:4,{b.addr}:2,{c.addr}:2",
               "-p", str(sh.port), "-i", sh.key, "--network-interface", "eth0", "--start-timeout", "60",
               "python", "probe.py"]
        env = _env(RPL_MARK="whole-env", RINGPIPE_SSH_COMMAND=f"ssh -F {sh.config}")
        out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=360)
    _check_probe(out, [(a.hostname, 4), (b.hostname, 2), (c.hostname, 2)], "whole-env")
    assert "8 MPI ranks on 3 hosts" in out.stderr
    # a run that ended well ends quietly: no rank's store client meets a server already gone
    assert "TCPStore" not in out.stderr + out.stdout, out.stderr[-3000:]


class _Reader:
    """Collect a process's output lines while it runs."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.threads = [threading.Thread(target=self._read, args=(s,), daemon=True) for s in (proc.stdout, proc.stderr)]
        for t in self.threads:
            t.start()

    def _read(self, stream) -> None:  # noqa: ANN001
        for line in iter(stream.readline, ""):
            self.lines.append(line)

    def wait_for(self, pattern: str, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(1 for line in list(self.lines) if re.search(pattern, line)) >= count:
                return
            time.sleep(0.2)
        raise AssertionError(f"{count} lines matching {pattern!r} did not come: {''.join(self.lines)[-3000:]}")

    def text(self) -> str:
        for t in self.threads:
            t.join(timeout=10)
        return "".join(self.lines)


def _nothing_left(marker: str, timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := sshhosts.processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["gloo", pytest.param("mpi", marks=pytest.mark.mpi)])
def test_a_rank_killed_on_a_remote_host_stops_every_host(tmp_path, backend):
    if backend == "mpi" and (shutil.which("mpirun") is None or __import__("importlib").util.find_spec("mpi4py") is None):
        pytest.skip("needs Open MPI's mpirun and mpi4py")
    (tmp_path / "wait.py").write_text(WAIT)
    with sshhosts.ssh_hosts(3) as sh:
        a, b, c = sh.hosts
        cmd = [*sh.client.prefix(), *LAUNCH, "-np", "8", "-H", f"{a.addr}:4,{b.addr}:2,{c.addr}:2", "--backend",
               backend, "--network-interface", "eth0", *sh.ssh_options(), str(tmp_path / "wait.py"), "5"]
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        reader = _Reader(proc)
        try:
            reader.wait_for(r"\]:ready rank=", 8, timeout=300)
            code = proc.wait(timeout=120)  # rank 5 kills itself a second after every rank is ready
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        text = reader.text()
        left = _nothing_left(str(tmp_path))
    assert code != 0, text[-3000:]
    assert "rank 5 failed with signal SIGKILL" in text, text[-3000:]
    if backend == "gloo":  # mpirun stops the job itself and names the rank only
        assert re.search(rf"host {re.escape(b.addr)} \(ranks 4-5\) failed first", text), text[-3000:]
    assert left == [], left


@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_ctrl_c_or_a_killed_launcher_stops_every_host(tmp_path, sig):
    """Ctrl-C: one line, status 130. SIGKILL to the launcher and its group: no word, and still no orphan."""
    (tmp_path / "wait.py").write_text(WAIT)
    with sshhosts.ssh_hosts(3) as sh:
        a, b, c = sh.hosts
        cmd = [*sh.client.prefix(), *LAUNCH, "-np", "4", "-H", f"{a.addr}:2,{b.addr}:1,{c.addr}:1",
               *sh.ssh_options(), str(tmp_path / "wait.py"), "-1"]
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal's job
        reader = _Reader(proc)
        try:
            reader.wait_for(r"\]:ready rank=", 4, timeout=300)
            os.killpg(proc.pid, sig)  # as a terminal's Ctrl-C reaches the foreground group
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        text = reader.text()
        left = _nothing_left(str(tmp_path))
    assert left == [], left
    if sig == signal.SIGKILL:
        return
    assert code == 130, text[-3000:]
    assert text.count("interrupted by SIGINT; every rank on every host was stopped") == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


@pytest.mark.timeout(200)
def test_an_unreachable_host_is_named_within_the_start_timeout(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    with sshhosts.ssh_hosts(1) as sh:
        (a,) = sh.hosts
        absent = a.addr.rsplit(".", 1)[0] + ".77"  # in the subnet, no host there
        cmd = [*sh.client.prefix(), *LAUNCH, "-np", "2", "-H", f"{a.addr}:1,{absent}:1", *sh.ssh_options(),
               "--start-timeout", "5", "probe.py"]
        start = time.monotonic()
        out = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=150)
        took = time.monotonic() - start
        left = _nothing_left(str(tmp_path), timeout=5)
    assert out.returncode == 1, out.stderr
    assert f"cannot start ranks on host {absent}" in out.stderr and "nothing was started" in out.stderr, out.stderr
    assert f"host {a.addr}" not in out.stderr  # the reachable host is not blamed
    assert took < 60 and left == []

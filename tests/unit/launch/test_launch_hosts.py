"""Host lists and hostfiles as horovodrun and Open MPI read them, the placement of ranks, and bad input refused by name.

The placement rule is horovodrun's (horovod/runner/common/util/hosts.py, get_host_assignments)
and ``mpirun --map-by slot``'s: fill each host's slots in the order given. The bad-input cases
run the real command line and must end with a message naming what is wrong, quickly, with
nothing started.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib

from ringpipe.launch.horovodrun import translate
from ringpipe.launch.hosts import (
    HostsError,
    HostSlots,
    is_local,
    parse_host_list,
    place,
    read_hostfile,
)
from ringpipe.launch.mpi_hosts import TagJoiner, mpirun_hosts_command
from ringpipe.launch.options import LaunchUsageError, parse_launch_args, validate
from ringpipe.launch.remote import forwarded_env, ssh_prefix

SCRIPT = os.path.abspath(__file__)
ROOT = Path(__file__).resolve().parents[3]


def test_host_list_as_horovodrun_writes_it():
    assert parse_host_list("server1:4,server2:4, 10.0.0.3:2,server4") == [
        HostSlots("server1", 4), HostSlots("server2", 4), HostSlots("10.0.0.3", 2), HostSlots("server4", 1)]


def test_hostfile_in_open_mpi_and_horovodrun_spellings(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# the cluster\nnodeA slots=4 max_slots=6\n\nnodeB slots=3   # fast\nnodeC\nnodeD:2\nnodeB slots=1\n")
    assert read_hostfile(str(f)) == [HostSlots("nodeA", 4, 6), HostSlots("nodeB", 4), HostSlots("nodeC", 1),
                                     HostSlots("nodeD", 2)]


@pytest.mark.parametrize("slots, np_, expected", [
    ((4, 2, 2), 8, (4, 2, 2)),  # seed 000's placements
    ((4, 3, 1), 8, (4, 3, 1)),
    ((4, 4, 4, 4), 16, (4, 4, 4, 4)),  # seed 004: horovodrun -np 16 -H server1:4,...,server4:4
    ((4, 4), 5, (4, 1)),  # fewer ranks than slots: host after host
    ((4, 4), 3, (3,)),  # a host with no rank is left out
    ((4, 2, 2), None, (4, 2, 2)),  # no -np: every slot
])
def test_ranks_fill_the_slots_host_after_host(slots, np_, expected):
    hosts = [HostSlots(f"h{i}", n) for i, n in enumerate(slots)]
    placement = place(hosts, np_, "-H")
    assert [n for _, n in placement.hosts] == list(expected)
    assert [placement.first_rank(i) for i in range(len(expected))] == [sum(expected[:i]) for i in range(len(expected))]


def test_max_slots_lets_a_host_take_more_only_when_every_slot_is_full():
    hosts = [HostSlots("a", 2, 4), HostSlots("b", 2)]
    assert place(hosts, 4, "f").hosts == (("a", 2), ("b", 2))
    assert place(hosts, 6, "f").hosts == (("a", 4), ("b", 2))
    with pytest.raises(HostsError, match=r"-n 7 is more than the 4 slots \(6 with max_slots\)"):
        place(hosts, 7, "f")


@pytest.mark.parametrize("text, message", [
    ("nodeA slot=4\n", "line 1 ('nodeA slot=4'): unknown key 'slot'"),
    ("nodeA slots=four\n", "line 1 ('nodeA slots=four'): slots must be a whole number, got 'four'"),
    ("nodeA 4\n", "expected KEY=VALUE after the host, got '4'"),
    ("nodeA slots=0\n", "slots is 0; give at least 1"),
    ("nodeA:x\n", "the slot count must be a whole number, got 'x'"),
    ("nodeA slots=4 max_slots=2\n", "max_slots=2 is less than slots=4"),
    ("bad/host slots=2\n", "'bad/host' is not a host name or address"),
    ("# only a comment\n", "no hosts in it"),
])
def test_malformed_hostfile_is_named_by_line(tmp_path, text, message):
    f = tmp_path / "hosts"
    f.write_text(text)
    with pytest.raises(HostsError) as info:
        read_hostfile(str(f))
    assert message in str(info.value) and str(f) in str(info.value)


@pytest.mark.parametrize("argv, message", [
    (["-np", "9", "-H", "a:4,b:2,c:2"], "-n 9 is more than the 8 slots of -H a:4,b:2,c:2"),
    (["-H", "a:4,b:0"], "slots of 'b' is 0"),
    (["-H", "a:4,:2"], "an empty host name"),
    (["-H", "a:4", "--hostfile", "f"], "give the hosts once"),
    (["--hostfile", "/nonexistent/hosts"], "--hostfile /nonexistent/hosts: cannot read it"),
    (["-H", "a:2,b:2", "--mode", "mp"], "--mode mp runs on one machine"),
    (["-H", "a:2,b:2", "--max-restarts", "1"], "--max-restarts is not supported across hosts"),
    (["-H", "a:2", "--ssh-identity-file", "/nonexistent/key"], "--ssh-identity-file /nonexistent/key: no such file"),
    (["-H", "a:2", "-x", "1BAD"], "-x '1BAD': give a variable name"),
    (["-H", "a:2", "--start-timeout", "0"], "--start-timeout must be >= 1"),
])
def test_bad_host_options_are_refused_by_name(argv, message):
    with pytest.raises(LaunchUsageError) as info:
        validate(parse_launch_args([*argv, SCRIPT]))
    assert message in str(info.value)


def test_this_machine_alone_stays_a_local_launch():
    opts = parse_launch_args(["-H", "localhost:1,127.0.0.1:2", SCRIPT])
    validate(opts)
    assert opts.placement is None and opts.nprocs == 3
    assert is_local("localhost") and is_local("127.0.0.2") and not is_local("192.0.2.1")


@pytest.mark.e2e  # asks mpirun its version
def test_other_hosts_get_a_placement_and_the_options_they_need(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1024")
    monkeypatch.setenv("RPL_ASKED", "yes")
    monkeypatch.setenv("RPL_NOT_ASKED", "no")
    opts = parse_launch_args(["-np", "8", "-H", "a:4,b:2,c:2", "-x", "RPL_ASKED", "-x", "RPL_SET=1", "--ssh-port",
                              "2222", "-i", SCRIPT, "--ssh-command", "ssh -F cfg", "--network-interface", "eth1",
                              "--start-timeout", "7", SCRIPT])
    validate(opts)
    assert opts.placement is not None and opts.placement.hosts == (("a", 4), ("b", 2), ("c", 2))
    env = forwarded_env(opts)
    assert env["RPL_ASKED"] == "yes" and env["RPL_SET"] == "1" and "RPL_NOT_ASKED" not in env
    assert env["HOROVOD_FUSION_THRESHOLD"] == "1024" and env["GLOO_SOCKET_IFNAME"] == "eth1"
    assert ssh_prefix(opts, 7) == ["ssh", "-F", "cfg", "-o", "BatchMode=yes", "-o", "ConnectTimeout=7", "-p", "2222",
                                   "-i", SCRIPT]
    opts.backend = "mpi"
    cmd = mpirun_hosts_command(opts, {"RPL_SET": "1"})
    text = " ".join(cmd)
    assert "-n 8" in text and "-H a:4,b:2,c:2" in text and "-x RPL_SET" in text
    assert cmd[cmd.index("plm_rsh_agent") + 1] == "ssh -F cfg"
    assert cmd[cmd.index("plm_rsh_args") + 1] == f"-o BatchMode=yes -p 2222 -i {SCRIPT}"
    assert cmd[cmd.index("btl_tcp_if_include") + 1] == "eth1" and cmd[cmd.index("oob_tcp_if_include") + 1] == "eth1"


def test_start_timeout_default_follows_horovod(monkeypatch):
    monkeypatch.setenv("HOROVOD_START_TIMEOUT", "12")
    opts = parse_launch_args(["-H", "a:1", SCRIPT])
    validate(opts)
    assert opts.start_timeout == 12
    monkeypatch.delenv("HOROVOD_START_TIMEOUT")
    opts = parse_launch_args(["-H", "a:1", SCRIPT])
    validate(opts)
    assert opts.start_timeout == 30  # horovodrun's default


def test_mpirun_tags_become_whole_prefixed_lines():
    """A line split from its newline by mpirun (item seen as `80.13%[1,0]<stdout>:`) is one line again."""
    joiner = TagJoiner()
    chunks = [b"[1,0]<stdout>:Training set: 80.13%", b"[1,0]<stdout>:\n[1,1]<stdout>:hel", b"[1,1]<stdout>:lo\n[1,1]<std",
              b"err>:Traceback (most recent call last)\n[1,1]<stderr>:ValueError: x\nmpirun noticed that process rank 1"
              b" with PID 5 on node a exited on signal 9 (Killed).\n"]
    out = [pair for chunk in chunks for pair in joiner.feed(chunk)] + joiner.feed(b"", final=True)
    assert out == [(1, b"[0]:Training set: 80.13%\n"), (1, b"[1]:hello\n"), (2, b"[1]:Traceback (most recent call last)\n"),
                   (2, b"[1]:ValueError: x\n"),
                   (2, b"mpirun noticed that process rank 1 with PID 5 on node a exited on signal 9 (Killed).\n")]
    assert list(joiner.tails[1]) == ["Traceback (most recent call last)", "ValueError: x"]


def test_horovodrun_host_options_map_onto_the_launch(tmp_path, monkeypatch):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    args, _ = translate(["-np", "2", "--hostfile", str(hostfile), "-p", "2222", "-i", "key", "--start-timeout", "9",
                         "--network-interface", "eth0", "--gloo", "--disable-cache", "python", "train.py"])
    assert args == ["-np", "2", "--hostfile", str(hostfile), "--ssh-port", "2222", "--ssh-identity-file", "key",
                    "--start-timeout", "9", "--network-interface", "eth0", "--backend", "gloo", "python", "train.py"]
    monkeypatch.setenv("RPL_USER_VAR", "1")
    args, _ = translate(["-np", "2", "-H", "otherhost:2", "--mpi", "python", "train.py"])
    exported = {args[i + 1] for i, a in enumerate(args) if a == "-x"}
    assert "RPL_USER_VAR" in exported and "HOSTNAME" not in exported and "SSH_CONNECTION" not in exported


def test_horovodrun_picks_mpi_when_usable_as_horovod_does(monkeypatch):
    """Horovod: --gloo or --mpi as asked; else MPI when it is built and installed, else gloo."""
    import ringpipe.launch.horovodrun as hr

    monkeypatch.setattr(hr, "mpi_usable", lambda: True)
    assert translate(["-np", "2", "python", "t.py"])[0][:4] == ["-np", "2", "--backend", "mpi"]
    assert translate(["--gloo", "-np", "2", "python", "t.py"])[0][:4] == ["-np", "2", "--backend", "gloo"]
    monkeypatch.setattr(hr, "mpi_usable", lambda: False)
    assert translate(["-np", "2", "python", "t.py"])[0][:4] == ["-np", "2", "--backend", "gloo"]


@pytest.mark.e2e
def test_horovodrun_is_installed_under_its_own_name_and_horovodrun_itself_is_opt_in(tmp_path):
    """``horovodrun`` never shadows a real Horovod's: ringpipe writes it only when asked, never over another's."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["ringpipe-horovodrun"] == "ringpipe.launch.horovodrun:main" and "horovodrun" not in scripts
    cli = [sys.executable, "-m", "ringpipe.launch.horovodrun"]

    def run(*args):
        return subprocess.run([*cli, *args, "--bin-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)

    other = tmp_path / "horovodrun"
    other.write_text("#!/bin/sh\n# Horovod's own\n")
    refused = run("--install-alias")
    assert refused.returncode == 1 and "not written by ringpipe" in refused.stderr and "--force" in refused.stderr
    assert "Horovod's own" in other.read_text()
    assert run("--remove-alias").returncode == 1 and other.exists()  # never removes another's either
    other.unlink()
    made = run("--install-alias")
    assert made.returncode == 0, made.stderr
    usage = subprocess.run([str(other), "--no-such-option"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "horovodrun (ringpipe)" in usage.stderr  # it is ringpipe's horovodrun
    assert run("--install-alias").returncode == 0  # rewriting its own is fine
    assert run("--remove-alias").returncode == 0 and not other.exists()
    assert run("--install-alias", "--bogus").returncode == 2


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_unknown_host_is_named_before_anything_starts(tmp_path):
    marker = tmp_path / "started"
    script = tmp_path / "prog.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "ringpipe.cli", "launch", "-np", "2", "-H",
                          "localhost:1,no-such-host.invalid:1", "--start-timeout", "10", str(script)],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 1, out.stderr
    # With an ssh client the host's probe fails; without one, the launcher says so instead.
    cause = "ssh failed" if shutil.which("ssh") else "cannot run 'ssh' (install ssh, or give --ssh-command)"
    assert f"cannot start ranks on host no-such-host.invalid: {cause}" in out.stderr, out.stderr
    assert "nothing was started" in out.stderr and not marker.exists()
    assert time.monotonic() - start < 60

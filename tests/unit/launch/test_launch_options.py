"""ringpipe launch's command line, read without starting anything: launcher options, then the program, exactly."""

import os
import sys

import pytest

from ringpipe.comm.base import CommError
from ringpipe.comm.rendezvous import resolve_backend
from ringpipe.launch.bootstrap import rank_environment
from ringpipe.launch.options import LaunchUsageError, parse_launch_args, validate

SCRIPT = os.path.abspath(__file__)


@pytest.mark.parametrize("argv, nprocs", [
    (["-n", "3"], 3), (["-n3"], 3), (["-np", "3"], 3), (["--nprocs", "3"], 3), (["--nprocs=3"], 3),
    (["--nproc-per-node", "3"], 3), (["--nproc_per_node=3"], 3), (["--nproc-per-node=3"], 3),
    (["-H", "localhost:3"], 3), (["-H", "localhost:1,127.0.0.1:2"], 3), ([], 2),
])
def test_process_count_spellings(argv, nprocs):
    opts = parse_launch_args([*argv, SCRIPT, "--x"])
    validate(opts)
    assert opts.nprocs == nprocs and opts.program == [SCRIPT, "--x"]


def test_torchrun_spellings():
    opts = parse_launch_args(["--nnodes", "2", "--node_rank=1", "--master-addr", "10.0.0.1", "--master_port", "29500",
                              "--max_restarts", "3", SCRIPT])
    validate(opts)
    assert (opts.nnodes, opts.node_rank, opts.rdzv_endpoint, opts.max_restarts) == (2, 1, "10.0.0.1:29500", 3)
    opts = parse_launch_args(["--nnodes=2", "--node-rank=0", "--rdzv_endpoint=h:1234", SCRIPT])
    validate(opts)
    assert opts.rdzv_endpoint == "h:1234"


@pytest.mark.parametrize("argv, program, python", [
    # Everything after the script or the module is the program's, in order, options included.
    ([SCRIPT, "-n", "5", "--backend", "x"], [SCRIPT, "-n", "5", "--backend", "x"], []),
    (["-m", "pytest", "-q", "-p", "no:cacheprovider", "t.py"], ["-m", "pytest", "-q", "-p", "no:cacheprovider", "t.py"], []),
    (["-mpytest", "-x"], ["-m", "pytest", "-x"], []),
    (["python", SCRIPT, "-u"], [SCRIPT, "-u"], []),
    (["python3", "-u", "-X", "dev", "-W", "error", SCRIPT], [SCRIPT], ["-u", "-X", "dev", "-W", "error"]),
    (["python", "-Xdev", "-m", "mod", "a"], ["-m", "mod", "a"], ["-Xdev"]),
    (["--", SCRIPT, "--", "z"], [SCRIPT, "--", "z"], []),
])
def test_program_reaches_the_program_exactly(argv, program, python):
    opts = parse_launch_args(["-n", "2", *argv])
    assert opts.program == program and opts.python == python and opts.nprocs == 2


@pytest.mark.parametrize("argv, message", [
    (["--nproc_per_nod=3", SCRIPT], "unknown launcher option '--nproc_per_nod'; did you mean --nproc_per_node?"),
    (["--flag-for-script", SCRIPT], "unknown launcher option '--flag-for-script'"),
    (["-np", "p", SCRIPT], "-n takes a whole number, got 'p'"),
    (["-n"], "-n needs a value"),
    (["-n", "2"], "give a script (or -m module)"),
    (["-m"], "-m needs a module name"),
    (["python", "-c", "print(1)"], "python -c is not supported"),
    (["python", "--weird", SCRIPT], "unknown python option '--weird'"),
    (["/usr/bin/python3", SCRIPT], "not the path '/usr/bin/python3'"),
])
def test_refused_before_anything_starts(argv, message):
    with pytest.raises(LaunchUsageError) as info:
        parse_launch_args(argv)
    assert message in str(info.value)


@pytest.mark.parametrize("argv, message", [
    (["--backend", "tcp", SCRIPT], "unknown backend 'tcp'; valid: gloo, nccl, mpi"),
    (["--mode", "threads", SCRIPT], "unknown --mode 'threads'"),
    (["-n", "0", SCRIPT], "-n must be >= 1"),
    (["-H", "localhost:2", "-n", "3", SCRIPT], "-n 3 is more than the 2 slots"),
    (["-H", "elsewhere.example:2", "--nnodes", "2", SCRIPT], "starts every host from this one command"),
    (["-H", "localhost:x", SCRIPT], "slots of 'localhost' must be a whole number"),
    (["--nnodes", "2", SCRIPT], "--nnodes > 1 needs --rdzv-endpoint"),
    (["--max-restarts", "1", "--mode", "mp", SCRIPT], "--max-restarts needs torch's elastic agent"),
    (["no_such_script.py"], "no such script: no_such_script.py"),
])
def test_inconsistent_options_are_refused(argv, message):
    opts = parse_launch_args(argv)
    with pytest.raises(LaunchUsageError) as info:
        validate(opts)
    assert message in str(info.value)


def test_help_lists_the_spellings(capsys):
    with pytest.raises(SystemExit) as info:
        parse_launch_args(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for name in ("-np", "--nproc-per-node", "--nproc_per_node", "--max-restarts", "-H", "HOROVOD_CROSS_SIZE"):
        assert name in text


def test_rank_environment_from_mpirun():
    """mpirun's own variables become the torch and horovodrun contract (what is set stays)."""
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1", "MASTER_PORT": "1"}
    assert rank_environment(env) == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2",
    }


def test_rank_environment_from_torchrun_on_three_nodes():
    env = {"RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "2"}
    assert rank_environment(env) == {
        "HOROVOD_RANK": "5", "HOROVOD_SIZE": "6", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "2", "HOROVOD_CROSS_SIZE": "3",
    }
    assert rank_environment({}) == {}


def test_backend_rule(monkeypatch):
    """The argument, else RINGPIPE_BACKEND, else the machine's default: one rule for every entry point."""
    monkeypatch.setenv("RINGPIPE_BACKEND", "mpi")
    assert resolve_backend() == "mpi" and resolve_backend("gloo") == "gloo"
    monkeypatch.setenv("RINGPIPE_BACKEND", "tcp")
    with pytest.raises(CommError, match="unknown backend 'tcp' \\(from RINGPIPE_BACKEND\\)"):
        resolve_backend()
    monkeypatch.delenv("RINGPIPE_BACKEND")
    assert resolve_backend() == ("nccl" if "torch" in sys.modules and __import__("torch").cuda.is_available() else "gloo")


def test_elastic_options_with_horovods_meanings(tmp_path, monkeypatch):
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:2\n")
    discover.chmod(0o755)
    opts = parse_launch_args(["-np", "2", "--min-num-proc", "1", "--max-np", "4", "--host-discovery-script",
                              str(discover), "--slots-per-host", "2", "--reset-limit", "3",
                              "--blacklist-cooldown-range", "5", "60", SCRIPT])
    monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", "42")
    validate(opts)
    assert opts.elastic and (opts.nprocs, opts.min_np, opts.max_np, opts.slots_per_host) == (2, 1, 4, 2)
    assert (opts.reset_limit, opts.blacklist_cooldown_range, opts.elastic_timeout) == (3, (5, 60), 42)
    assert opts.placement is None and opts.program == [SCRIPT]
    # --min-np defaults to -np; a fixed host set (two hosts at least) is elastic too under --min-np
    opts = parse_launch_args(["-np", "2", "--min-np", "2", "--elastic-timeout", "7", "-H", "a:1,b:1", SCRIPT])
    validate(opts)
    assert opts.elastic and opts.min_np == 2 and opts.elastic_timeout == 7 and opts.placement is None


@pytest.mark.parametrize("argv, message", [
    (["--min-np", "1", "-H", "a:2"], "at least 2 hosts"),
    (["--min-np", "1"], "needs its hosts"),
    (["--min-np", "1", "-H", "a:1,b:1", "--backend", "mpi"], "Gloo only"),
    (["-np", "1", "--min-np", "2", "-H", "a:1,b:1"], "must lie between"),
    (["--blacklist-cooldown-range", "5", "x", SCRIPT], "two whole numbers"),
    (["--host-discovery-script", "/nonexistent/discover.sh"], "not an executable"),
])
def test_elastic_options_refused_before_anything_starts(argv, message):
    with pytest.raises(LaunchUsageError, match=message):
        validate(parse_launch_args([*argv, SCRIPT]))

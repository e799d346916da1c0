"""``horovodrun`` on ringpipe, and the ``HOROVOD_*`` settings every rank honours.

The mapping follows horovodrun's own (horovod/runner/common/util/config_parser.py:
``--fusion-threshold-mb`` becomes ``HOROVOD_FUSION_THRESHOLD`` in bytes, ``--timeline-filename``
``HOROVOD_TIMELINE``, ...); the settings' effects are checked in real processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ringpipe.launch.horovodrun import HorovodrunUsageError, translate

HOROVODRUN = [sys.executable, "-m", "ringpipe.launch.horovodrun"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_") and k != "RINGPIPE_TIMELINE"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def test_horovodrun_options_become_launch_options_and_horovod_variables():
    args, env = translate(["-np", "4", "-H", "localhost:4", "--mpi", "--timeline-filename", "t.json",
                           "--timeline-mark-cycles", "--fusion-threshold-mb", "32", "--cycle-time-ms", "5",
                           "--hierarchical-allreduce", "--stall-check-warning-time-seconds", "30",
                           "--log-level", "DEBUG", "python", "-u", "train.py", "--epochs", "3"])
    assert args == ["-np", "4", "-H", "localhost:4", "--backend", "mpi", "python", "-u", "train.py", "--epochs", "3"]
    assert env == {"HOROVOD_TIMELINE": "t.json", "HOROVOD_TIMELINE_MARK_CYCLES": "1",
                   "HOROVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024), "HOROVOD_CYCLE_TIME": "5",
                   "HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
                   "HOROVOD_LOG_LEVEL": "debug"}


@pytest.mark.parametrize("option", ["--autotune", "--elastic", "--jsrun", "--bogus"])
def test_options_without_an_equivalent_are_refused_by_name(option):
    with pytest.raises(HorovodrunUsageError, match=option):
        translate([option, "x", "-np", "2", "python", "train.py"])


def test_horovodrun_refuses_before_starting_anything():
    out = subprocess.run([*HOROVODRUN, "-np", "2", "--autotune", "python", "nothere.py"], env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--autotune is not supported by ringpipe" in out.stderr


PROGRAM = textwrap.dedent("""
    import json, os, torch, logging
    import ringpipe as hvd
    from ringpipe.comm.rendezvous import stall_inspector
    hvd.init()
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.allreduce(torch.ones(2), name="loss")
    insp = stall_inspector()
    print("SETTINGS " + json.dumps({"rank": hvd.rank(), "bucket_bytes": opt.bucket_bytes,
        "algorithm": opt.algorithm, "stall_s": insp.seconds if insp else None,
        "level": logging.getLogger("ringpipe").level}), flush=True)
""")


@pytest.mark.timeout(300)
def test_horovodrun_runs_a_program_with_the_settings_in_effect(tmp_path):
    (tmp_path / "prog.py").write_text(PROGRAM)
    timeline = tmp_path / "t.json"
    out = subprocess.run([*HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", "--fusion-threshold-mb", "2",
                          "--stall-check-warning-time-seconds", "45", "--log-level", "warning",
                          "--timeline-filename", str(timeline), "python", "prog.py"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    seen = [json.loads(line.split("SETTINGS ", 1)[1]) for line in out.stdout.splitlines() if "SETTINGS " in line]
    assert sorted(s["rank"] for s in seen) == [0, 1]
    for s in seen:
        assert s["bucket_bytes"] == 2 * 1024 * 1024 and s["algorithm"] == "native"
        assert s["stall_s"] == 45.0 and s["level"] == 30  # logging.WARNING
    rows = {e["args"]["name"] for e in json.loads(timeline.read_text())["traceEvents"] if e["name"] == "thread_name"}
    assert "allreduce.loss" in rows


STALL = textwrap.dedent("""
    import time, torch
    import ringpipe as hvd
    hvd.init()
    if hvd.rank() == 0:
        hvd.allreduce(torch.ones(2), name="never_matched")  # rank 1 never calls it
    else:
        time.sleep(600)
""")


@pytest.mark.timeout(300)
def test_stall_shutdown_ends_a_stalled_job_instead_of_waiting_for_the_timeout(tmp_path):
    (tmp_path / "prog.py").write_text(STALL)
    env = _env(HOROVOD_STALL_CHECK_TIME_SECONDS="2", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="4",
               HOROVOD_HIERARCHICAL_ALLREDUCE="1", HOROVOD_CYCLE_TIME="5", HOROVOD_CACHE_CAPACITY="0")
    out = subprocess.run([sys.executable, "-m", "ringpipe.cli", "launch", "-np", "2", "prog.py"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=280)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    assert "past the stall shutdown time of 4 s" in text, text[-3000:]


def test_bad_horovod_values_name_the_variable(tmp_path):
    code = "import ringpipe as hvd\nhvd.init()\n"
    for var, value in (("HOROVOD_LOG_LEVEL", "loud"), ("HOROVOD_STALL_CHECK_TIME_SECONDS", "soon")):
        out = subprocess.run([sys.executable, "-c", code], env=_env(**{var: value}), capture_output=True,
                             text=True, timeout=120)
        assert out.returncode != 0 and f"{var}={value!r}" in out.stderr, out.stderr[-2000:]


def test_check_build_prints_horovods_table_of_what_is_available(capsys):
    import importlib.util

    import torch.distributed as dist

    from ringpipe.launch.horovodrun import main, mpi_usable

    with pytest.raises(SystemExit) as done:
        main(["--check-build"])
    assert done.value.code == 0
    out = capsys.readouterr().out

    def row(section, name):
        lines = out.split(section + ":")[1].split("\n\n")[0].splitlines()
        marks = {ln.strip()[4:]: ln.strip()[1] == "X" for ln in lines if ln.strip().startswith("[")}
        return marks[name]

    assert row("Available Frameworks", "PyTorch") is True and row("Available Frameworks", "MXNet") is False
    assert row("Available Frameworks", "TensorFlow") is (importlib.util.find_spec("tensorflow") is not None)
    assert row("Available Controllers", "Gloo") is dist.is_gloo_available()
    assert row("Available Controllers", "MPI") is mpi_usable()
    assert row("Available Tensor Operations", "NCCL") is dist.is_nccl_available()
    assert row("Available Tensor Operations", "DDL") is False and row("Available Tensor Operations", "CCL") is False


def test_output_filename_goes_to_the_launcher():
    args, _ = translate(["--output-filename", "logs", "-np", "2", "python", "train.py"])
    assert args[args.index("--output-filename") + 1] == "logs"


def test_elastic_options_go_to_the_elastic_driver_on_gloo(tmp_path):
    args, _ = translate(["-np", "2", "--min-np", "1", "--max-np=3", "--host-discovery-script", "d.sh",
                         "--slots-per-host", "2", "--elastic-timeout", "5", "--reset-limit", "2",
                         "--blacklist-cooldown-range", "10", "20", "python", "train.py"])
    for flag, value in (("--min-np", "1"), ("--max-np", "3"), ("--host-discovery-script", "d.sh"),
                        ("--slots-per-host", "2"), ("--elastic-timeout", "5"), ("--reset-limit", "2"),
                        ("--blacklist-cooldown-range", "10,20"), ("--backend", "gloo")):
        assert args[args.index(flag) + 1] == value, args
    assert args[-2:] == ["python", "train.py"]
    with pytest.raises(HorovodrunUsageError, match="Gloo only"):  # Horovod's elastic mode is Gloo-only
        translate(["-np", "2", "--mpi", "--host-discovery-script", "d.sh", "python", "train.py"])
    with pytest.raises(HorovodrunUsageError, match="two values"):
        translate(["-np", "2", "--blacklist-cooldown-range", "10", "python", "train.py"])

"""`ringpipe bench`, `ringpipe doctor`, `ringpipe trace` on the command line: size sweeps, one-line errors."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from clibatch import run_cli_batch
from ringpipe.comm.events import Event
from ringpipe.observe.bench import _sizes
from ringpipe.observe.collect import JobEvents, RankEvents, save_events

HAVE_MPI = shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None
RINGPIPE = [sys.executable, "-m", "ringpipe.cli"]
_LAUNCH_VARS = ("RINGPIPE_BACKEND", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK", "SLURM_NTASKS")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _run(*args: str, timeout: float = 60, cwd: object = None, env: dict[str, str] | None = None,
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RINGPIPE, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=env or _env())


def _events(path: object) -> None:
    ms = 1_000_000
    ranks = [RankEvents(r, "h0", [Event("allreduce", 4096, -1, (10 * k + r) * ms, (10 * k + 3) * ms, 0, "world", {})
                                  for k in range(5)], {}) for r in range(2)]
    save_events(path, JobEvents(ranks, {"backend": "gloo"}))


# ----------------------------------------------------------------------------- size sweep


@pytest.mark.timeout(10)
def test_size_sweep_from_zero_goes_on_from_one_element():
    assert _sizes(0, 4096, 2.0, 4) == [0, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


@pytest.mark.timeout(10)
def test_size_sweep_advances_by_at_least_one_element():
    sizes = _sizes(4, 64, 1.2, 4)
    assert sizes[0] == 4 and sizes[-1] <= 64 < max(int(sizes[-1] * 1.2), sizes[-1] + 4)
    assert all(b - a >= 4 for a, b in zip(sizes, sizes[1:], strict=False))
    assert _sizes(1, 10, 1.5) == [1, 2, 3, 4, 6, 9]


@pytest.mark.timeout(10)
def test_size_sweep_refuses_what_cannot_advance():
    assert _sizes(4096, 4096, 1.0) == [4096]
    with pytest.raises(ValueError, match="-f must be > 1"):
        _sizes(4, 64, 1.0)
    with pytest.raises(ValueError, match="larger than -e"):
        _sizes(8192, 4096, 2.0)


SWEEPS = [
    (["-b", "0", "-e", "64"], [4, 8, 16, 32, 64]),  # 0 bytes is measured as one element
    (["-b", "4", "-e", "32", "-f", "1.2"], [4, 8, 12, 16, 20, 24, 28]),
]


def _sweep_command(sweep: list[str]) -> list[str]:
    return ["bench", "allreduce", *sweep, "-a", "ring", "--iters", "2", "-w", "0", "--json"]


@pytest.mark.timeout(600)  # the first test to ask runs every command line of cli_runs
@pytest.mark.parametrize("sweep, expected", SWEEPS)
def test_bench_sweeps_that_hung_finish_on_one_rank_with_a_note(cli_runs, sweep, expected):
    out = cli_runs[tuple(_sweep_command(sweep))]
    assert out.returncode == 0, out.stderr
    assert [json.loads(line)["bytes"] for line in out.stdout.splitlines()] == expected
    assert "running on 1 rank" in out.stderr and "add -n N" in out.stderr


# ----------------------------------------------------------------------------- one-line errors


BAD_ARGUMENTS = [
    (["bench", "allreduce", "-b", "abc"], "ringpipe bench: size 'abc' is not understood"),
    (["bench", "allreduce", "-f", "1"], "ringpipe bench: -f must be > 1"),
    (["bench", "allreduce", "-b", "8K", "-e", "4K"], "ringpipe bench: -b 8192 is larger than -e 4096"),
    (["bench", "allreduce", "--iters", "0"], "ringpipe bench: --iters (timed iterations per block) must be >= 1"),
    (["bench", "allreduce", "-r", "0"], "ringpipe bench: -r (interleaved rounds per size) must be >= 1"),
    (["bench", "allreduce", "-n", "0"], "ringpipe bench: -n (processes to start) must be >= 1"),
    (["bench", "allreduce", "-b", "0", "-e", "0"], "ringpipe bench: -e 0 is smaller than one float32 element (4 bytes)"),
    (["bench", "allreduce", "-a", "nosuch"], "ringpipe bench: allreduce has no algorithm 'nosuch'"),
    (["bench", "allreduce", "-d", "nosuch"], "ringpipe bench: unknown dtype 'nosuch'"),
    (["bench", "allreduce", "--backend", "foo"], "ringpipe bench: unknown backend 'foo'"),
    (["doctor", "--size", "abc"], "ringpipe doctor: size 'abc' is not understood"),
    (["doctor", "--reps", "0"], "ringpipe doctor: --reps must be >= 1"),
    (["doctor", "--backend", "foo"], "ringpipe doctor: unknown backend 'foo'"),
    (["doctor", "nosuch.json"], "ringpipe doctor: nosuch.json: no such events file"),
    (["trace", "nosuch.json"], "ringpipe trace: nosuch.json: no such events file"),
]


P2P_ON_ONE_RANK = ["bench", "p2p"]


@pytest.fixture(scope="module")
def cli_runs():
    """Each command line of the bench sweeps, BAD_ARGUMENTS and p2p on one rank: ``ringpipe ARGS``
    in a fork of one interpreter (tests/clibatch.py), by argument tuple."""
    argvs = [_sweep_command(sweep) for sweep, _ in SWEEPS] + [args for args, _ in BAD_ARGUMENTS] + [P2P_ON_ONE_RANK]
    return dict(zip(map(tuple, argvs), run_cli_batch(argvs, env=_env(), timeout=50 * len(argvs)), strict=True))


@pytest.mark.timeout(600)  # the first test to ask runs every command line of cli_runs
@pytest.mark.parametrize("args, message", BAD_ARGUMENTS)
def test_bad_arguments_give_one_line_and_exit_2(cli_runs, args, message):
    out = cli_runs[tuple(args)]
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert out.stderr.startswith(message), out.stderr
    if "no such events file" in message:
        assert "`ringpipe train` of several processes" in out.stderr  # how to get one


@pytest.mark.timeout(600)  # the first test to ask runs every command line of cli_runs
def test_bench_p2p_on_one_rank_says_it_needs_two(cli_runs):
    out = cli_runs[tuple(P2P_ON_ONE_RANK)]
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == "ringpipe bench: p2p needs at least 2 ranks"


@pytest.mark.timeout(60)
def test_not_an_events_file_and_a_directory_without_one(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"loss": 0.1}))
    out = _run("trace", "summary.json", cwd=tmp_path, timeout=50)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("ringpipe trace: summary.json: not a ringpipe events file")
    out = _run("doctor", str(tmp_path), timeout=50)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith(f"ringpipe doctor: {tmp_path} is a directory without events.json")


@pytest.mark.timeout(60)
def test_doctor_and_trace_take_a_run_directory(tmp_path):
    _events(tmp_path / "events.json")
    out = _run("doctor", str(tmp_path), timeout=50)
    assert out.returncode == 0, out.stderr
    assert "2 ranks" in out.stdout
    out = _run("trace", str(tmp_path), "-o", str(tmp_path / "timeline.json"), timeout=50)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "timeline.json").is_file()


@pytest.mark.timeout(60)
def test_help_names_the_train_key_that_writes_events():
    for command in ("doctor", "trace"):
        out = _run(command, "--help", timeout=50)
        assert out.returncode == 0
        assert "observe.profile, on by default" in out.stdout and "observe.events" not in out.stdout


# ----------------------------------------------------------------------------- doctor under mpirun


@pytest.mark.timeout(120)
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
def test_doctor_with_mpi_backend_starts_its_ranks_under_mpirun():
    out = _run("doctor", "-n", "2", "--backend", "mpi", "--size", "4K", "--reps", "1", "--json", timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    # [1,0]<stdout>:{"ranks"...: under mpirun the report is indented, each line tagged; decode without the tags
    from netns import untagged

    text = untagged(out.stdout)
    report = json.JSONDecoder().raw_decode(text, text.index('{"ranks"'))[0]
    assert report["ranks"] == 2


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_a_long_report_reaches_mpirun_tag_output_in_whole_lines():
    """mpirun --tag-output tags each read of a rank's output: 21 KB written at once came back cut every 2-4 KB."""
    from pathlib import Path

    from ringpipe.launch import mpirun_command

    script = Path(__file__).resolve().parents[2] / "scripts" / "doctor_long_report.py"
    out = subprocess.run(mpirun_command(1, [sys.executable, str(script), "300"]), capture_output=True, text=True,
                         env=_env(), timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines == [f"[1,0]<stdout>:line {i:04d} {'x' * 60}" for i in range(300)], [
        x for x in lines if not x.endswith("x" * 60) or x.count("<stdout>") != 1][:3]


@pytest.mark.timeout(60)
def test_doctor_with_mpi_backend_without_mpirun_says_what_to_do(tmp_path):
    out = _run("doctor", "-n", "2", "--backend", "mpi", env=_env(PATH=str(tmp_path)), timeout=50)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert out.stderr.startswith("ringpipe doctor: ") and "--backend gloo" in out.stderr


# ----------------------------------------------------------------------------- bench: processes, streaming, plot


@pytest.mark.timeout(120)
def test_bench_n_starts_that_many_processes_and_says_where_the_plot_went(tmp_path):
    out = _run("bench", "allreduce", "-n", "2", "-b", "4K", "-e", "8K", "-a", "ring", "-i", "2", "-w", "0",
               "--plot", "busbw.png", cwd=tmp_path, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("# ringpipe bench allreduce: 2 ranks, backend gloo, 5 interleaved rounds of 2 calls"), \
        out.stdout
    assert [line.split()[0] for line in out.stdout.splitlines()[2:]] == ["4096", "8192"]
    assert f"busbw plot written to {tmp_path / 'busbw.png'}" in out.stderr
    assert (tmp_path / "busbw.png").stat().st_size > 0


@pytest.mark.timeout(120)
def test_bench_prints_each_row_as_soon_as_it_is_measured():
    """The first row arrives while the sweep is still running (no waiting for the whole table)."""
    proc = subprocess.Popen([*RINGPIPE, "bench", "allreduce", "-b", "4", "-e", "64M", "-f", "2", "-a", "ring",
                             "-i", "20", "--json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=_env())
    try:
        first = json.loads(proc.stdout.readline())
        assert first["bytes"] == 4
        assert proc.poll() is None  # still measuring the larger sizes
    finally:
        proc.kill()
        proc.communicate()


def _row(algo: str, lo: float, med: float, hi: float, chosen: str | None = None, times=None) -> dict:
    return {"algorithm": algo, "chosen": chosen or algo, "bytes": 4096, "backend": "gloo", "ranks": 2,
            "time_min_us": lo, "time_us": med, "time_max_us": hi, **({"times_us": times} if times else {})}


def test_bench_claims_a_win_or_loss_against_native_only_when_the_rounds_agree():
    """The probe's statistic and rule: per round the variant's time over native's; a verdict needs 2/3 of
    the rounds and the margin (here native's rounds 100, 120, 90)."""
    from ringpipe.observe.bench_report import compare, format_comparison

    c = compare([_row("native", 90, 100, 120, times=[100, 120, 90]), _row("ring", 40, 50, 60, times=[50, 60, 40]),
                 _row("recursive_doubling", 70, 80, 95, times=[80, 95, 70]),
                 _row("auto", 95, 101, 130, chosen="native", times=[101, 130, 95])])
    assert c is not None
    # ring: 50/100, 60/120, 40/90 -> median 0.5, faster in 3 of 3
    assert c["best"] == "ring" and c["best_ratio"] == pytest.approx(0.5) and c["best_verdict"] == "faster"
    assert (c["best_wins"], c["best_rounds"]) == (3, 3)
    # auto ran native: 101/100, 130/120, 95/90 -> median 1.056; native against itself says nothing
    assert c["auto_chose"] == "native" and c["auto_ratio"] == pytest.approx(95 / 90, abs=1e-3)
    assert c["auto_verdict"] == "native itself"
    assert format_comparison(c) == ("# 4 KiB: best own (ring) 0.50x native's time, faster in 3/3 rounds [faster]; "
                                    "auto (native) 1.06x native's time, faster in 0/3 rounds [native itself]")
    slower = compare([_row("native", 90, 100, 120, times=[100, 120, 90]),
                      _row("ring", 121, 130, 140, times=[130, 140, 121])])
    assert slower is not None and slower["best_verdict"] == "slower" and "auto_chose" not in slower
    assert compare([_row("ring", 1, 2, 3)]) is None  # nothing to compare with
    # 0.95x in every round: faster, but by less than the probe's margin: inconclusive
    close = compare([_row("native", 90, 100, 120, times=[100, 120, 90]),
                     _row("ring", 85, 95, 114, times=[95, 114, 85.5])])
    assert close is not None and close["best_wins"] == 3 and close["best_verdict"] == "inconclusive"
    # without rounds to pair: the medians, and no verdict
    bare = compare([_row("native", 90, 100, 120), _row("ring", 40, 50, 60)])
    assert bare is not None and bare["best_ratio"] == pytest.approx(0.5) and bare["best_verdict"] == "inconclusive"
    assert format_comparison(bare) == ("# 4 KiB: best own (ring) 0.50x native's time (medians: no rounds to pair) "
                                       "[inconclusive]")


@pytest.mark.timeout(180)
def test_bench_interleaves_the_variants_and_says_what_auto_chose_per_size():
    out = _run("bench", "allreduce", "-n", "2", "-b", "4K", "-e", "64K", "-f", "16", "-a", "native,ring,auto",
               "-i", "2", "-r", "3", "-w", "1", "--no-probe", timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "3 interleaved rounds of 2 calls" in out.stdout.splitlines()[0]
    lines = out.stdout.splitlines()
    # the recorded rules over gloo without a probe: recursive doubling up to 64 KiB
    assert any(line.split()[:4] == ["4096", "1024", "float32", "auto>recursive_doubling"] for line in lines), lines
    assert sum(line.startswith("# 4 KiB: best own (ring) ") for line in lines) == 1, lines
    assert sum(line.startswith("# 64 KiB: best own (ring) ") for line in lines) == 1, lines
    assert any("auto (recursive_doubling) " in line and "x native's time" in line for line in lines), lines
    summary = lines[lines.index(next(x for x in lines if x.startswith("# against native"))) + 2:]
    assert [line.split()[1:3] for line in summary] == [["4", "KiB"], ["64", "KiB"]], summary


@pytest.mark.mpi
@pytest.mark.timeout(240)
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
def test_bench_with_mpi_backend_runs_under_mpirun_and_auto_runs_mpis_own_allreduce():
    out = _run("bench", "allreduce", "-n", "2", "--backend", "mpi", "-b", "4K", "-e", "4K", "-a", "native,ring,auto",
               "-i", "2", "-r", "2", "-w", "1", "--no-probe", "--json", timeout=220)
    assert out.returncode == 0, out.stderr[-3000:]
    objs = [json.loads(line) for line in out.stdout.splitlines()]  # whole lines: no mpirun tags in them
    rows = [o for o in objs if not o.get("summary")]
    assert [(r["algorithm"], r["chosen"]) for r in rows] == [("native", "native"), ("ring", "ring"),
                                                           ("auto", "native")]  # MPI's rules below 64 MiB
    assert all(r["backend"] == "mpi" and r["ranks"] == 2 and r["wrong"] == 0 for r in rows)
    assert [o["auto_chose"] for o in objs if o.get("summary")] == ["native"]


def test_busbw_plot_has_logarithmic_axes_with_readable_sizes():
    from ringpipe.observe.bench import plot_figure

    rows = [{"collective": "allreduce", "backend": "gloo", "ranks": 2, "algorithm": "ring", "bytes": 4 << k,
             "busbw_gbps": 0.01 * (k + 1)} for k in range(0, 20, 2)]
    fig = plot_figure(rows)
    ax = fig.axes[0]
    fig.canvas.draw()
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    labels = {t.get_text() for t in ax.get_xticklabels()}
    assert {"256", "4K", "1M"} <= labels, labels  # sizes as people write them, not 2^12


def test_links_heat_map_colours_on_a_log_scale_that_keeps_healthy_links_alike():
    from matplotlib.colors import LogNorm

    from ringpipe.observe.plots import links_figure

    ranks = [RankEvents(r, h, [], {}) for r, h in enumerate(["a", "a", "b"])]
    links = [{"src": 0, "dst": 1, "gbps": 1.0}, {"src": 0, "dst": 2, "gbps": 0.9}, {"src": 1, "dst": 2, "gbps": 1.1}]
    norm = links_figure(JobEvents(ranks), links).axes[0].images[0].norm
    assert isinstance(norm, LogNorm) and norm.vmax == pytest.approx(1.1) and norm.vmin <= 1.1 / 100
    # 0.9 and 1.1 GB/s land within a few per cent of the scale of each other; 0.01 GB/s far below.
    assert norm(1.1) - norm(0.9) < 0.05 and norm(0.9) - norm(0.011) > 0.9


# ----------------------------------------------------------------------------- what doctor and trace are given


@pytest.mark.timeout(60)
def test_doctor_on_a_png_a_binary_file_an_empty_file_and_an_empty_run(tmp_path):
    (tmp_path / "links.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "empty.json").write_text("")
    save_events(tmp_path / "none.json", JobEvents([], {"backend": "gloo"}))
    for name, message in (("links.png", "links.png is a PNG image, not an events file"),
                          ("blob.bin", "blob.bin is a binary file, not an events file"),
                          ("empty.json", "empty.json is empty: the run wrote no events"),
                          ("none.json", "none.json holds no events (0 ranks, 0 events)")):
        out = _run("doctor", str(tmp_path / name), timeout=50)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.strip().splitlines() == [out.stderr.strip()]
        assert message in out.stderr, out.stderr


@pytest.mark.timeout(60)
def test_doctor_reads_a_horovod_style_timeline_through_the_events_beside_it(tmp_path):
    from ringpipe.observe.live import create_file

    create_file(tmp_path / "timeline.json")  # the file RINGPIPE_TIMELINE writes (its header comes first)
    out = _run("doctor", str(tmp_path / "timeline.json"), timeout=50)
    assert out.returncode == 2 and "is a Chrome timeline, not an events file" in out.stderr
    assert "timeline.events.json" in out.stderr
    _events(tmp_path / "timeline.events.json")
    out = _run("doctor", str(tmp_path / "timeline.json"), timeout=50)
    assert out.returncode == 0, out.stderr
    assert "ringpipe doctor: 2 ranks" in out.stdout and "reading its events from" in out.stderr


@pytest.mark.timeout(60)
def test_doctor_strict_says_why_it_exits_1(tmp_path):
    ms = 1_000_000
    ranks = [RankEvents(r, "h0", [Event("allreduce", 4096, -1, (100 * k + (30 if r == 1 else 0)) * ms,
                                        (100 * k + 31) * ms, 0, "world", {}) for k in range(8)], {})
             for r in range(2)]
    save_events(tmp_path / "events.json", JobEvents(ranks, {"backend": "gloo"}))
    out = _run("doctor", "--strict", str(tmp_path), timeout=50)
    assert out.returncode == 1 and "rank 1 (host h0) arrives late" in out.stdout
    assert out.stderr.strip() == ("ringpipe doctor --strict: 1 problem(s) found, exit status 1 (the doctor itself "
                                  "ran fine)")


@pytest.mark.timeout(60)
def test_trace_writes_beside_the_events_not_into_the_current_directory(tmp_path):
    run, cwd = tmp_path / "run", tmp_path / "cwd"
    cwd.mkdir()
    _events(run / "events.json")
    _events(tmp_path / "job.json")
    assert _run("trace", str(run), cwd=cwd, timeout=50).returncode == 0
    assert _run("trace", str(tmp_path / "job.json"), cwd=cwd, timeout=50).returncode == 0
    assert list(cwd.iterdir()) == []
    assert json.loads((run / "timeline.json").read_text())["traceEvents"]
    assert json.loads((tmp_path / "job.timeline.json").read_text())["traceEvents"]

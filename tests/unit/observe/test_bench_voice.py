"""``ringpipe bench`` speaks with one voice: the probe that gives ``auto`` its table and the sweep
that measures every algorithm compare against native with one statistic, and the sweep's table
shows the probe's figures beside its own, saying whose rounds each comes from.

The references: the probe's own words (:class:`ringpipe.collectives.autotune.Table`'s line, what
``ringpipe bench`` prints on standard error) and the per-round ratios worked out by hand.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ringpipe.collectives.autotune import Table
from ringpipe.observe.bench_report import compare, format_comparison, format_summary


def _row(algo, times, chosen=None):
    ordered = sorted(times)
    return {"algorithm": algo, "chosen": chosen or algo, "bytes": 4096, "backend": "gloo", "ranks": 2,
            "time_min_us": ordered[0], "time_us": ordered[len(ordered) // 2], "time_max_us": ordered[-1],
            "times_us": list(times)}


def test_the_sweep_states_the_probes_figure_in_the_probes_words():
    # the probe: recursive doubling at 0.36x native's time in each of 9 rounds (seconds per call)
    probe_times = {"native": [1e-3] * 9, "recursive_doubling": [0.36e-3] * 9, "ring": [1.2e-3] * 9}
    table = Table([(4096, "recursive_doubling", probe_times)], ("gloo", 2, None))
    said = re.search(r"4096: recursive_doubling \((.*?)\)", repr(table)).group(1)
    assert said == "0.36x native's time, faster in 9/9 rounds"
    # the sweep, 3 rounds of its own: native 100, 120, 90 us; auto (recursive doubling) 93, 110, 86
    rows = [_row("native", [100, 120, 90]), _row("recursive_doubling", [93, 110, 86]),
            _row("auto", [93, 110, 86], chosen="recursive_doubling")]
    c = compare(rows, (table.rows[0][1], table.rows[0][2]))
    line = format_comparison(c)
    assert f"auto's probe (recursive_doubling) {said.replace(' rounds', ' of its own rounds, before the sweep')}" \
        in line, line
    assert c["probe_verdict"] == "faster"  # what the probe decided by: the same rule
    # the sweep's own rounds: 93/100, 110/120, 86/90 -> median 0.93, faster in 3/3, within the 10 % margin
    assert c["auto_ratio"] == pytest.approx(0.93) and (c["auto_wins"], c["auto_rounds"]) == (3, 3)
    assert c["auto_verdict"] == "inconclusive"
    assert "auto (recursive_doubling) 0.93x native's time, faster in 3/3 rounds [inconclusive]" in line
    # one table, the two sets of rounds side by side, in the same statistic
    row = format_summary([c]).splitlines()[1].split()
    assert row[-6:] == ["0.93", "3/3", "inconclusive", "0.36", "9/9", "faster"], row


def test_the_probes_figure_is_rounded_once_as_the_probe_rounds_it():
    # 0.7849: the probe says 0.78x; rounded to 3 places first (0.785) and then to 2 it would read 0.79x
    probe_times = {"native": [1e-3] * 3, "recursive_doubling": [0.7849e-3] * 3}
    table = Table([(4096, "recursive_doubling", probe_times)], ("gloo", 2, None))
    assert "0.78x native's time, faster in 3/3 rounds" in repr(table)
    rows = [_row("native", [100, 120, 90]), _row("recursive_doubling", [93, 110, 86]),
            _row("auto", [93, 110, 86], chosen="recursive_doubling")]
    line = format_comparison(compare(rows, (table.rows[0][1], table.rows[0][2])))
    assert "auto's probe (recursive_doubling) 0.78x native's time, faster in 3/3 of its own rounds" in line, line


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ringpipe_bench_prints_the_probes_figures_where_it_prints_the_sweeps():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "RINGPIPE_BACKEND")}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, "-m", "ringpipe.cli", "bench", "allreduce", "-n", "2", "-b", "4K", "-e",
                          "64K", "-f", "16", "-r", "3", "-i", "3", "-w", "1"], capture_output=True, text=True,
                         env=env, timeout=580)
    assert out.returncode == 0, out.stderr[-3000:]
    probe = out.stderr[out.stderr.index("Table("):]
    for size, label in ((4096, "4 KiB"), (65536, "64 KiB")):
        said = re.search(rf"{size}: (\w+) \((?:best other (\w+): )?([\d.]+x native's time, faster in \d+/\d+) rounds",
                         probe)
        assert said, probe
        line = next(x for x in out.stdout.splitlines() if x.startswith(f"# {label}:"))
        which = said.group(2) or said.group(1)
        assert f"({which if said.group(1) != 'native' else 'native; best other ' + which}) " \
               f"{said.group(3)} of its own rounds" in line, (probe, line)
    assert "one statistic throughout" in out.stdout
    assert " / native " not in out.stdout  # no second statistic (the old native-over-variant ratio)

"""Every benchmark entry script's ``--quick`` run: it exits 0 and prints the report's header and rows.

A benchmark that no test runs rots (one failed on every rank for a while and nothing noticed), so
each script in ``benchmarks/`` runs here in its ``--quick`` form: tiny sizes, 2 ranks, one
repetition, its whole code path. The scripts are found by listing the folder, so a new one is
tested without being added here. A run must print the header of ``benchmarks/lib/report.py``
(``# bench: NAME``, the command and the machine) and at least one Markdown table with a row.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py"))
#: Scripts whose ranks import TensorFlow: skipped where it is not installed, and given longer.
NEEDS_TF = {"tf_bridge.py", "tf_scaling.py", "tf_tape_vs_mwms.py"}
TIMEOUT_S = {"tf_bridge.py": 300, "tf_scaling.py": 300, "tf_tape_vs_mwms.py": 300, "elastic_recovery.py": 300}
ROW = re.compile(r"^\| .+ \|$", re.MULTILINE)
SEPARATOR = re.compile(r"^\|( -+:? \|)+$", re.MULTILINE)


def test_the_entry_scripts_are_the_expected_ones() -> None:
    """A guard that the glob below sees the scripts (a moved folder would test nothing)."""
    assert {"dp_vs_ddp.py", "pipeline_vs_torch.py", "collectives.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_quick_run_exits_0_with_the_report(script: str) -> None:
    if script in NEEDS_TF:
        pytest.importorskip("tensorflow")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("RINGPIPE_BACKEND", None)
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S.get(script, 180))
    tail = f"\n--- stdout ---\n{done.stdout[-3000:]}\n--- stderr ---\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"{script} --quick exited with {done.returncode}{tail}"
    name = script.removesuffix(".py")
    assert f"# bench: {name}\n" in done.stdout, f"{script}: no report header{tail}"
    assert f"command: python benchmarks/{script} --quick" in done.stdout, f"{script}: no command line{tail}"
    assert "machine: cpu=" in done.stdout and "commit=" in done.stdout, f"{script}: no machine line{tail}"
    assert SEPARATOR.search(done.stdout), f"{script}: no Markdown table{tail}"
    rows = [r for r in ROW.findall(done.stdout) if not SEPARATOR.fullmatch(r)]
    assert len(rows) >= 2, f"{script}: no table row under a header{tail}"

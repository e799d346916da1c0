"""Run an elastic job under ``ringpipe-horovodrun``'s elastic driver for the end-to-end tests, and its oracles.

The programs (``tests/scripts/elastic_train.py`` for PyTorch, ``elastic_train_tf.py`` for
TensorFlow, ``elastic_fit_keras.py`` for Keras ``model.fit``) run full-batch gradient descent with
momentum on 12 rows and commit after every step, so whatever the membership changes, rank 0's
final parameters equal the same descent written plainly here (:func:`oracle`). Hosts are loopback
addresses (127.0.0.1, 127.0.0.2, ...), every one of which is this machine, which the driver treats
as hosts of their own; the discovery script prints ``OUT_DIR/hosts``, which the programs rewrite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

SCRIPTS = Path(__file__).resolve().parent / "scripts"
PROGRAMS = {"torch": SCRIPTS / "elastic_train.py", "tensorflow": SCRIPTS / "elastic_train_tf.py",
            "keras_fit": SCRIPTS / "elastic_fit_keras.py"}
HOROVODRUN = [sys.executable, "-m", "ringpipe.launch.horovodrun"]
STEPS = 20
#: The programs' pause between two steps (seconds): nothing waits for it (a membership change holds
#: the program at its step until the change arrives), it only spreads the steps out.
PAUSE = 0.02
#: The jobs' ringpipe settings (their other RINGPIPE_ variables are dropped): the driver's discovery
#: interval (Horovod's own tests shorten its 1 s the same way: an added host, or one back from the
#: blacklist, is seen within 0.2 s) and the suite's quicker exit (tests/conftest.py).
JOB_ENV = {"RINGPIPE_ELASTIC_DISCOVERY_SECONDS": "0.2",
           "RINGPIPE_QUICK_EXIT": os.environ.get("RINGPIPE_QUICK_EXIT", "")}


def sizes_seen(out: str) -> list[int]:
    """The world sizes rank 0 printed, in order, each once per run of equal sizes."""
    sizes: list[int] = []
    for line in out.splitlines():
        if " rank 0 size " in line and "step " in line:
            size = int(line.split(" size ")[1].split()[0])
            if not sizes or sizes[-1] != size:
                sizes.append(size)
    return sizes


def assert_one_state_per_step(out: str) -> None:
    """Every ``step S ... state D`` line of the job, on any rank in any world, has the same D for each S.

    So the state a survivor restores is bit for bit its last commit (it prints step S again after a
    failure at step S), and the state a new worker receives is bit for bit rank 0's.
    """
    states: dict[int, set[str]] = {}
    for line in out.splitlines():
        if " state " in line and "step " in line and " rank " in line:
            step = int(line.split("step ", 1)[1].split()[0])
            states.setdefault(step, set()).add(line.rsplit(" state ", 1)[1].split()[0])
    assert states, "no step printed a state digest"
    differ = {step: found for step, found in states.items() if len(found) != 1}
    assert not differ, f"the state differs at steps {sorted(differ)}: {differ}\n{out[-4000:]}"


def discovery(tmp_path: Path, hosts: list[str]) -> Path:
    """A discovery script printing ``tmp_path/hosts`` (first written with ``hosts``)."""
    (tmp_path / "hosts").write_text("\n".join(hosts) + "\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n")
    script.chmod(0o755)
    return script


def run_job(tmp_path: Path, program: str, scenario: str | None, hosts: list[str], *flags: str,
            discovered: bool = True, timeout: float = 240, **extra_env: str) -> tuple[int, str, list[int]]:
    """Run ``program`` (a key of PROGRAMS) elastically; (exit status, output, :func:`sizes_seen`).

    No worker may outlive the job.
    """
    where = ["--host-discovery-script", str(discovery(tmp_path, hosts))] if discovered else []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGPIPE_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", ELASTIC_STEPS=str(STEPS), ELASTIC_PAUSE=str(PAUSE), TF_CPP_MIN_LOG_LEVEL="2",
               **JOB_ENV, **extra_env)
    proc = subprocess.run([*HOROVODRUN, *flags, *where, "python", str(PROGRAMS[program]), str(tmp_path),
                           *([scenario] if scenario else [])], capture_output=True, text=True, timeout=timeout,
                          env=env)
    out = proc.stdout + proc.stderr
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not left, f"workers outlived the job: {left}\n{out}"
    return proc.returncode, out, sizes_seen(out)


def rows(program: str) -> np.ndarray:
    """The programs' 12 float32 rows (torch's generator for PyTorch, numpy's for the Keras programs), as float64."""
    if program == "torch":
        import torch

        return torch.randn(12, 4, generator=torch.Generator().manual_seed(1)).numpy().astype(np.float64)
    return np.random.default_rng(1).standard_normal((12, 4)).astype(np.float32).astype(np.float64)


def oracle(program: str, steps: int = STEPS) -> tuple[np.ndarray, np.ndarray]:
    """Full-batch gradient descent with momentum 0.9, lr 0.05 on the programs' 12 rows, in float64.

    ``v <- 0.9 v + g; w <- w - 0.05 v`` (torch's SGD) is ``v' <- 0.9 v' - 0.05 g; w <- w + v'``
    (Keras's) with ``v' = -0.05 v``.
    """
    X = rows(program)
    y = X @ np.array([[1.0], [-2.0], [0.5], [3.0]])
    w0, b0 = initial_state(program)
    w, b = w0.astype(np.float64).reshape(4, 1), b0.astype(np.float64).reshape(1)
    vw, vb = np.zeros_like(w), np.zeros_like(b)
    for _ in range(steps):
        err = X @ w + b - y  # d/dw mean((Xw+b-y)^2) = 2/N X^T err
        gw, gb = 2 * X.T @ err / len(X), 2 * err.sum(0) / len(X)
        vw, vb = 0.9 * vw + gw, 0.9 * vb + gb
        w, b = w - 0.05 * vw, b - 0.05 * vb
    return w, b


def final_state(tmp_path: Path, program: str) -> tuple[np.ndarray, np.ndarray, int]:
    """Rank 0's final weights as a (4, 1) column and a (1,) bias, and its step (or epoch) count."""
    if program == "torch":
        import torch

        final = torch.load(tmp_path / "final.pt", weights_only=True)
        return final["weight"].numpy().reshape(4, 1), final["bias"].numpy(), int(final["step"])
    final = json.loads((tmp_path / "final.json").read_text())
    return (np.array(final["kernel"]).reshape(4, 1), np.array(final["bias"]),
            int(final.get("step", final.get("epoch", -1))))


def initial_state(program: str) -> tuple[np.ndarray, np.ndarray]:
    """The programs' starting weights: torch's ``Linear(4, 1)`` under seed 0, or the Keras programs' fixed ones."""
    if program == "torch":
        import torch

        torch.manual_seed(0)
        layer = torch.nn.Linear(4, 1)
        return layer.weight.detach().numpy().reshape(4, 1), layer.bias.detach().numpy()
    return np.array([[0.1], [-0.2], [0.3], [0.05]]), np.array([0.1])


def assert_oracle(tmp_path: Path, program: str) -> None:
    """Rank 0 ended on the plain descent's weights after STEPS steps (float32 training, a float64 oracle)."""
    w, b, step = final_state(tmp_path, program)
    assert step == STEPS
    w_ref, b_ref = oracle(program)
    tol = {"rtol": 1e-5, "atol": 1e-6} if program == "torch" else {"rtol": 1e-4, "atol": 1e-5}
    np.testing.assert_allclose(w, w_ref, **tol)
    np.testing.assert_allclose(b, b_ref, **tol)

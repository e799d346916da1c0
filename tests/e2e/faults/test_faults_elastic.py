"""Horovod's elastic API with real processes: a worker killed mid-run, the program still ends right.

Under ``ringpipe launch --max-restarts 1`` rank 1 kills itself (SIGKILL) in the middle of epoch
3 of the first attempt. torch's agent replaces both workers; ``@hvd.elastic.run`` starts them
from the last ``state.commit()`` (persisted in ``$RINGPIPE_ELASTIC_DIR``), and the final weights
equal full-batch gradient descent written plainly in this file (the data-parallel oracle).
In-process semantics (commit / restore / sync, attributes, reset callbacks, the retry after a
``HorovodInternalError``) are checked on one rank against Horovod's documented behaviour.
"""

import os
import subprocess
import sys

import pytest
import torch

RINGPIPE = [sys.executable, "-m", "ringpipe.cli"]

PROGRAM = """
import os, signal, sys
import torch
import ringpipe as hvd

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
g = torch.Generator().manual_seed(1)
X = torch.randn(8, 4, generator=g)
y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
mine = slice(hvd.rank(), None, hvd.size())
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
resets = []

@hvd.elastic.run
def train(state):
    print(f"rank {hvd.rank()} attempt {attempt} trains from epoch {state.epoch}", flush=True)
    while state.epoch < 6:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(X[mine]), y[mine])
        if attempt == 0 and state.epoch == 3:
            hvd.barrier()  # rank 0 has persisted the commit of epoch 3 (else the restart may begin at 2)
            if hvd.rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-epoch: rank 0 waits for its gradients
        loss.backward()
        opt.step()
        state.epoch += 1
        state.commit()
    return state.epoch

state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0)
state.register_reset_callbacks([lambda: resets.append(1)])
print(f"rank {hvd.rank()} attempt {attempt} starts at epoch {state.epoch}", flush=True)
epochs = train(state)
if hvd.rank() == 0:
    torch.save({"weight": model.weight.detach(), "bias": model.bias.detach(), "epochs": epochs},
               os.path.join(sys.argv[1], "final.pt"))
print(f"rank {hvd.rank()} attempt {attempt} done", flush=True)
"""


def reference():
    """Full-batch gradient descent on the global data, six steps (what two data-parallel ranks compute)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(8, 4, generator=g)
    y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    w, b = model.weight.detach().clone(), model.bias.detach().clone()
    for _ in range(6):
        err = X @ w.T + b - y  # d/dw mean((Xw+b-y)^2) = 2/N X^T err
        gw = 2 * (err.T @ X) / len(X)
        gb = 2 * err.sum(0) / len(X)
        w, b = w - 0.1 * gw, b - 0.1 * gb
    return w, b


def test_killed_worker_restarts_from_the_last_commit_and_ends_right(tmp_path):
    script = tmp_path / "elastic_prog.py"
    script.write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if k != "RINGPIPE_BACKEND"}
    env.update(OMP_NUM_THREADS="1", RINGPIPE_ELASTIC_DIR=str(tmp_path / "elastic"))
    proc = subprocess.run([*RINGPIPE, "launch", "-n", "2", "--max-restarts", "1", str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env, start_new_session=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "rank 0 attempt 0 trains from epoch 0" in out, out
    # the replaced workers go on from the last commit (epoch 3 never finished)
    assert "rank 0 attempt 1 trains from epoch 3" in out and "rank 1 attempt 1 trains from epoch 3" in out, out
    assert "rank 0 attempt 1 done" in out and "rank 1 attempt 1 done" in out, out
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    w, b = reference()
    assert final["epochs"] == 6
    torch.testing.assert_close(final["weight"], w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(final["bias"], b, rtol=1e-5, atol=1e-6)


@pytest.fixture
def one_rank():
    import ringpipe as hvd

    hvd.init()
    yield hvd
    hvd.shutdown()


def test_commit_restore_and_attributes_follow_horovod(one_rank):
    hvd = one_rank
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0, batch=3)
    assert (state.epoch, state.batch) == (0, 3) and state.model is model and state.optimizer is opt
    before = model.weight.detach().clone()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    state.epoch = 1
    state.restore()  # undo every change since the last commit (here: construction)
    assert state.epoch == 0
    torch.testing.assert_close(model.weight.detach(), before)
    assert opt.state_dict()["state"] == {}
    opt.step()
    state.epoch = 2
    state.commit()
    after = model.weight.detach().clone()
    state.epoch = 5
    state.restore()
    assert state.epoch == 2
    torch.testing.assert_close(model.weight.detach(), after)
    assert opt.state_dict()["state"]  # the momentum buffer was committed


def test_run_retries_after_an_internal_error_restoring_and_calling_reset_callbacks(one_rank):
    hvd = one_rank
    model = torch.nn.Linear(2, 1)
    state = hvd.elastic.TorchState(model=model, epoch=0)
    calls, resets = [], []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state, fail_at):
        calls.append(state.epoch)
        while state.epoch < 4:
            state.epoch += 1
            if state.epoch == fail_at and len(calls) == 1:
                raise hvd.HorovodInternalError("lost a peer")
            if state.epoch % 2 == 0:
                state.commit()
        return "done"

    assert train(state, 3) == "done"
    assert calls == [0, 2]  # the retry starts from the commit at epoch 2, not from epoch 3
    assert resets == [1]
    assert hvd.is_initialized()


# ``ringpipe train`` under the launcher, with a test-only fault: in the first attempt rank 1 kills
# itself (SIGKILL) as soon as the run's first checkpoint exists, i.e. in the middle of the run.
TRAIN_WRAPPER = """
import os, signal, sys, threading, time
from pathlib import Path

run_dir = Path(sys.argv[sys.argv.index("--run-dir") + 1])
if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and os.environ.get("RANK") == "1":
    def kill_after_first_checkpoint():
        while not list((run_dir / "checkpoints").glob("step-*.pt")):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=kill_after_first_checkpoint, daemon=True).start()
from ringpipe.cli import main
sys.exit(main(sys.argv[1:]))
"""

TRAIN_CFG = ["epochs=3", "batch_size=32", "log_every=2", "optimizer.scale_lr=false", "optimizer.lr=0.01",
             "schedule.name=constant", "model.hidden=[32]", "mode=dp", "optimizer.name=sgd"]


@pytest.mark.timeout(600)
def test_train_restarted_by_the_agent_resumes_and_ends_bit_exact(tmp_path):
    """A worker killed mid-run under --max-restarts 2: the run resumes by itself and ends as an undisturbed one."""
    wrapper = tmp_path / "faulty_train.py"
    wrapper.write_text(TRAIN_WRAPPER)
    env = {k: v for k, v in os.environ.items() if k != "RINGPIPE_BACKEND"}
    env.update(OMP_NUM_THREADS="1")
    sets = [a for item in TRAIN_CFG for a in ("--set", item)]
    runs = {}
    for name, program in (("undisturbed", ["-m", "ringpipe.cli"]), ("killed", [str(wrapper)])):
        run_dir = tmp_path / name
        cmd = [*RINGPIPE, "launch", "-n", "2", "--max-restarts", "2", *program,
               "train", "--run-dir", str(run_dir), "--no-progress", *sets]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env=env)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        runs[name] = (run_dir, out)
    out = runs["killed"][1]
    assert "restarting every rank (restart 1 of 2)" in out, out
    assert "resuming from the newest good checkpoint" in out, out
    final = {}
    for name, (run_dir, _) in runs.items():
        newest = sorted((run_dir / "checkpoints").glob("step-*.pt"))[-1]
        from ringpipe.train.checkpoints.files import load_checkpoint

        final[name] = load_checkpoint(newest)
    a, b = final["undisturbed"], final["killed"]
    assert a["step"] == b["step"]
    flat_a, flat_b = _tensors(a["engine"]), _tensors(b["engine"])
    assert flat_a.keys() == flat_b.keys() and flat_a
    for key in flat_a:
        assert torch.equal(flat_a[key], flat_b[key]), key


def _tensors(obj, prefix=""):
    """Every tensor of a nested state, by path."""
    out = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_tensors(v, f"{prefix}/{i}"))
    return out

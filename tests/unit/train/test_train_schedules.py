"""Learning-rate scaling, warmup (Goyal et al.) and schedules over fractional epochs."""

from __future__ import annotations

import math

import pytest
import torch

from ringpipe.train.config import load_config
from ringpipe.train.lr_schedules import build_schedule
from ringpipe.train.optimizers import build_optimizer, scaled_lr


def _lrs(overrides, steps, replicas=1, steps_per_epoch=10.0, epochs=10.0):
    cfg = load_config(overrides=overrides)
    lr, scale = scaled_lr(cfg.optimizer, replicas)
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg.optimizer, lr)
    sched = build_schedule(opt, cfg.schedule, epochs, steps_per_epoch, scale)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out, opt, sched


def test_goyal_warmup_from_single_process_rate():
    # lr 0.1 scaled by 4 replicas -> 0.4, warmup over 2 epochs (20 steps) from 0.1.
    lrs, _, _ = _lrs(["optimizer.name=sgd", "optimizer.lr=0.1", "schedule.name=constant",
                      "schedule.warmup_epochs=2"], 30, replicas=4)
    assert lrs[0] == pytest.approx(0.1)
    assert lrs[10] == pytest.approx(0.25)  # halfway: 0.1 + 0.3 / 2
    assert lrs[5] == pytest.approx(0.1 + 0.3 * 5 / 20)
    assert lrs[20:] == pytest.approx([0.4] * 10)


def test_warmup_start_factor_and_no_scaling():
    lrs, _, _ = _lrs(["optimizer.name=sgd", "optimizer.lr=0.2", "optimizer.scale_lr=false",
                      "schedule.name=constant", "schedule.warmup_epochs=1", "schedule.warmup_start_factor=0.5"],
                     12, replicas=8)
    assert lrs[0] == pytest.approx(0.1) and lrs[5] == pytest.approx(0.15) and lrs[10] == pytest.approx(0.2)
    assert scaled_lr(load_config().optimizer, 3) == (pytest.approx(0.003), 3.0)


def test_step_multistep_cosine():
    lrs, _, _ = _lrs(["optimizer.name=sgd", "optimizer.lr=1", "schedule.name=step", "schedule.step_epochs=3",
                      "schedule.gamma=0.5"], 70)
    assert lrs[29] == 1.0 and lrs[30] == 0.5 and lrs[60] == 0.25
    lrs, _, _ = _lrs(["optimizer.name=sgd", "optimizer.lr=1", "schedule.name=multistep",
                      "schedule.milestones=[2, 2.5]", "schedule.gamma=0.1"], 30)
    assert lrs[19] == 1.0 and lrs[20] == pytest.approx(0.1) and lrs[25] == pytest.approx(0.01)
    lrs, _, _ = _lrs(["optimizer.name=sgd", "optimizer.lr=1", "schedule.name=cosine", "schedule.warmup_epochs=2",
                      "schedule.min_factor=0.1"], 101)
    assert lrs[20] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[100] == pytest.approx(0.1)


def test_fractional_steps_per_epoch():
    # 1438 records, global batch 64: epoch = step * 64 / 1438.
    lrs, _, _ = _lrs(["optimizer.name=sgd", "optimizer.lr=1", "schedule.name=step", "schedule.step_epochs=1"],
                     50, steps_per_epoch=1438 / 64)
    assert lrs[22] == 1.0 and lrs[23] == 0.1  # 22 * 64 = 1408 < 1438 <= 23 * 64


def test_schedule_state_resumes():
    over = ["optimizer.name=sgd", "optimizer.lr=1", "schedule.name=cosine", "schedule.warmup_epochs=1"]
    full, _, _ = _lrs(over, 60)
    _, opt, sched = _lrs(over, 25)
    state = sched.state_dict()
    _, opt2, sched2 = _lrs(over, 0)
    sched2.load_state_dict(state)
    rest = []
    for _ in range(35):
        rest.append(opt2.param_groups[0]["lr"])
        opt2.step()
        sched2.step()
    assert rest == pytest.approx(full[25:])

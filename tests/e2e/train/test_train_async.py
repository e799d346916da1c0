"""``ringpipe train`` in mode async: configuration of the mitigations, per-stage LR schedule, end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from ringpipe.launch import spawn
from ringpipe.pipeline.partition import split_layers
from ringpipe.pipeline.simulator import simulate_async
from ringpipe.pipeline.staleness import GA_STAGE_POLICIES as FACTORY_GA_STAGES
from ringpipe.pipeline.staleness import MITIGATIONS
from ringpipe.train.config import (
    GA_STAGE_POLICIES,
    MITIGATION_DOCS,
    ConfigError,
    PipelineConfig,
    dump_config,
    load_config,
    mitigations_help,
)
from ringpipe.train.datasets import load_dataset
from ringpipe.train.lr_schedules import build_schedule
from ringpipe.train.models import build_model
from ringpipe.train.modes import ModeContext, build_runner
from ringpipe.train.optimizers import build_optimizer
from trainrun import sets, train

TINY = ["epochs=1", "batch_size=32", "log_every=2", "optimizer.scale_lr=false", "optimizer.lr=0.01",
        "model.hidden=[32]"]
#: the documented command line: ringpipe train --set mode=async --set mitigations=wp,ws,ga ...
COMMAND = ["mode=async", "mitigations=wp,ws,ga", "step_every=2", "recompute=false"]
NESTED = ["mode=async", "pipeline.mitigations=[wp, ws, ga]", "pipeline.step_every=2", "pipeline.recompute=false"]
TIMING = {"samples_per_second", "comm_share"}
CONFIGS = Path(__file__).resolve().parents[3] / "configs"




def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    return str(info.value)


# ------------------------------------------------------------------------------ end to end


@pytest.mark.timeout(120)
def test_command_line_runs_end_to_end(tmp_path, capsys):
    run = tmp_path / "run"
    rc, summary, metrics = train(run, *sets([*COMMAND, *TINY]))
    assert rc == 0, capsys.readouterr().err
    for key in ("test_accuracy", "final_loss", "samples_per_second", "epochs", "world_size", "mode"):
        assert key in summary
    assert summary["mode"] == "async" and summary["world_size"] == 2 and summary["epochs"] >= 1.0
    losses = [r["loss"] for r in metrics if r["kind"] == "train"]
    assert len(losses) >= 5 and losses[-1] < 0.5 * losses[0], losses
    saved = yaml.safe_load((run / "config.yaml").read_text())["pipeline"]
    assert saved["mitigations"] == ["wp", "ws", "ga"] and saved["step_every"] == 2
    assert saved["recompute"] is False and saved["ga_stages"] == "all_except_last"
    assert "mitigations" not in yaml.safe_load((run / "config.yaml").read_text())  # stored nested only


def _strip(metrics):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in metrics]


@pytest.mark.timeout(240)
def test_resume_restores_each_stage_schedule(tmp_path):
    """Interrupted at an epoch's end and resumed equals uninterrupted: the stages' own schedules
    are checkpointed, and the pipeline drains at every epoch's end in both runs."""
    cfg = [*TINY, "epochs=2", "batch_size=64", "mode=async", "mitigations=wp,ws", "step_every=2",
           "optimizer.name=sgd", "schedule.name=cosine", "schedule.warmup_epochs=0.5"]
    rc, full, full_metrics = train(tmp_path / "full", *sets(cfg))
    assert rc == 0 and full["steps"] == 45  # 1438 records / 64: epoch 1 ends at step 23
    part = tmp_path / "part"
    rc, cut, _ = train(part, *sets([*cfg, "max_steps=23"]))
    assert rc == 0 and not cut["complete"] and cut["steps"] == 23
    rc, resumed, resumed_metrics = train(part, "--resume", "--set", "max_steps=null")
    assert rc == 0 and resumed["steps"] == full["steps"]
    assert _strip(resumed_metrics) == _strip(full_metrics)
    assert resumed["test_loss"] == full["test_loss"] and resumed["final_lr"] == full["final_lr"]
    # Stopped mid-epoch: the micro-batches in flight are not drained into a checkpoint (the
    # uninterrupted run does not drain there); the run resumes from its last drain, exactly.
    mid = tmp_path / "mid"
    rc, cut, _ = train(mid, *sets([*cfg, "max_steps=17"]))
    assert rc == 0 and not cut["complete"] and cut["steps"] == 17
    assert [p.name for p in (mid / "checkpoints").glob("step-*.pt")] == ["step-00000000.pt"]
    rc, resumed, resumed_metrics = train(mid, "--resume", "--set", "max_steps=null")
    assert rc == 0 and resumed["steps"] == full["steps"] and resumed["complete"]
    assert _strip(resumed_metrics) == _strip(full_metrics)
    assert resumed["test_loss"] == full["test_loss"] and resumed["final_lr"] == full["final_lr"]


# ------------------------------------------------------------------------------ streaming

#: step_every == microbatches: one step per batch, so only streaming across batches makes weights stale
STREAM = ["nprocs=2", "pipeline.microbatches=2", "batch_size=16", "model.hidden=[16]", "optimizer.name=sgd",
          "optimizer.lr=0.1", "optimizer.scale_lr=false", "schedule.name=constant", "schedule.warmup_epochs=0"]


def _stream_worker(comm, batches):
    torch.set_num_threads(1)
    states, in_flight = {}, {}
    for mode, extra in (("async", ["mitigations=stale", "step_every=2"]), ("1f1b", [])):
        cfg = load_config(overrides=[f"mode={mode}", *STREAM, *extra])
        data = load_dataset(cfg.data)

        def make_model(cfg=cfg, data=data):
            torch.manual_seed(cfg.seed)
            return build_model(cfg.model, data)

        runner = build_runner(ModeContext(cfg, comm, data, make_model))
        for b in range(batches):
            runner.train_step(data.train.x[16 * b: 16 * (b + 1)], data.train.y[16 * b: 16 * (b + 1)])
        in_flight[mode] = runner.trainer.in_flight
        runner.state_dict()  # a checkpoint drains the pipeline
        assert runner.trainer.in_flight == 0
        states[mode] = runner.trainer.model_state_dict()
        balance = list(runner.trainer.balance)
        steps = runner.trainer.executor.steps_taken
    out = {"stage": runner.trainer.stage, "in_flight": in_flight, "steps": steps}
    if comm.rank == 0:
        cfg = load_config(overrides=["mode=async", *STREAM, "step_every=2"])
        data = load_dataset(cfg.data)
        torch.manual_seed(cfg.seed)
        stages = split_layers(list(build_model(cfg.model, data)), balance)
        opts = [build_optimizer(s.parameters(), cfg.optimizer, cfg.optimizer.lr) for s in stages]
        micro = [(x, y) for b in range(batches)
                 for x, y in zip(data.train.x[16 * b: 16 * (b + 1)].tensor_split(2),
                                 data.train.y[16 * b: 16 * (b + 1)].tensor_split(2), strict=True)]
        simulate_async(stages, opts, torch.nn.functional.cross_entropy, micro, "stale", step_every=2)
        sim = {k: v.detach() for k, v in torch.nn.Sequential(*[m for s in stages for m in s]).state_dict().items()}
        out["vs_simulator"] = max(float((states["async"][k] - v).abs().max()) for k, v in sim.items())
        out["vs_1f1b"] = max(float((states["async"][k] - v).abs().max()) for k, v in states["1f1b"].items())
    return out


@pytest.mark.timeout(60)
def test_async_mode_streams_across_batches():
    """Mode async keeps micro-batches in flight across batches: stale weights even with one step per batch."""
    batches = 4
    results = spawn(_stream_worker, 2, args=(batches,))
    by_stage = {r["stage"]: r for r in results}
    assert by_stage[0]["in_flight"] == {"async": 1, "1f1b": 0}  # the first stage's last forward waits
    assert by_stage[1]["in_flight"] == {"async": 0, "1f1b": 0}
    assert all(r["steps"] == batches for r in results)
    root = results[0]
    assert root["vs_1f1b"] > 1e-4, "mode async equals 1f1b: no staleness"
    assert root["vs_simulator"] <= 1e-5, root


# ------------------------------------------------------------------------------ per-stage LR


def _lr_worker(comm, overrides):
    torch.set_num_threads(1)
    cfg = load_config(overrides=overrides)
    data = load_dataset(cfg.data)

    def make_model():
        torch.manual_seed(cfg.seed)
        return build_model(cfg.model, data)

    runner = build_runner(ModeContext(cfg, comm, data, make_model))
    trainer = runner.trainer
    used: list[float] = []
    trainer.optimizer.register_step_pre_hook(lambda opt, a, k: used.append(opt.param_groups[0]["lr"]))
    # What the loop does: its per-batch schedule on the runner's optimizer, stepped after each batch.
    loop_schedule = build_schedule(runner.optimizer, cfg.schedule, cfg.epochs,
                                   len(data.train) / cfg.batch_size, runner.lr_scale)
    at_batch_end = []
    for b in range(3):
        x, y = data.train.x[32 * b: 32 * (b + 1)], data.train.y[32 * b: 32 * (b + 1)]
        runner.train_step(x, y)
        loop_schedule.step()
        at_batch_end.append((trainer.optimizer.param_groups[0]["lr"], loop_schedule.get_last_lr()[0],
                             trainer.executor.steps_taken))
    trainer.drain()
    predictor = getattr(trainer.policy, "predictor", None)
    return {
        "stage": trainer.stage,
        "used": used,
        "at_batch_end": at_batch_end,
        "last_epoch": trainer.scheduler.last_epoch,
        "steps": trainer.executor.steps_taken,
        "records": len(data.train),
        "predictor_reads_schedule": predictor is not None and predictor.scheduler is trainer.scheduler,
    }


@pytest.mark.timeout(60)
def test_lr_advances_per_optimizer_step_of_each_stage():
    lr, start, warmup = 0.05, 0.1, 1.0
    overrides = ["mode=async", "nprocs=2", "mitigations=wp", "step_every=2", "pipeline.microbatches=4",
                 "batch_size=32", "model.hidden=[16]", "optimizer.name=sgd", f"optimizer.lr={lr}",
                 "optimizer.scale_lr=false", "schedule.name=constant", f"schedule.warmup_epochs={warmup}",
                 f"schedule.warmup_start_factor={start}"]
    results = spawn(_lr_worker, 2, args=(overrides,))
    assert sorted(r["stage"] for r in results) == [0, 1]
    for r in results:
        steps_per_batch = 4 // 2
        steps_per_epoch = r["records"] / 32 * steps_per_batch
        assert r["steps"] == r["last_epoch"] == 3 * steps_per_batch
        expected = [lr * (start + (1 - start) * (s / steps_per_epoch) / warmup) for s in range(6)]
        assert r["used"] == pytest.approx(expected, rel=1e-12), r["stage"]
        assert all(b > a for a, b in zip(r["used"], r["used"][1:], strict=False))  # changes within a batch
        for b, (stage_lr, loop_lr, steps) in enumerate(r["at_batch_end"]):
            # the last stage's rate is the logged one at batch ends; the first one's lags by the
            # micro-batch it still has in flight (its step comes with the next batch)
            assert steps == steps_per_batch * (b + 1) - (1 if r["stage"] == 0 else 0)
            assert stage_lr == pytest.approx(lr * (start + (1 - start) * (steps / steps_per_epoch) / warmup),
                                             rel=1e-12)
            if r["stage"] == 1:
                assert stage_lr == pytest.approx(loop_lr, rel=1e-12)
        assert r["predictor_reads_schedule"]


# ------------------------------------------------------------------------------ configuration


def test_short_and_nested_forms_agree(tmp_path):
    short = load_config(overrides=COMMAND)
    assert short == load_config(overrides=NESTED)
    assert short.pipeline is not None and short.pipeline.mitigations == ["wp", "ws", "ga"]
    assert load_config(overrides=["mode=async", "mitigations=wp+ws+ga", "step_every=2"]) == short
    f = tmp_path / "c.yaml"
    f.write_text("mode: async\nmitigations: [wp, ws, ga]\nstep_every: 2\npipeline: {recompute: false}\n")
    assert load_config(f) == short
    assert load_config(f, ["step_every=1", "mitigations=ws"]).pipeline.step_every == 1  # --set wins
    assert load_config(overrides=["mode=async", "step_every=2", "pipeline.step_every=1"]).pipeline.step_every == 1
    f.write_text("mode: async\nstep_every: 2\npipeline: {step_every: 1}\n")
    with pytest.raises(ConfigError, match="step_every=2 and pipeline.step_every=1 disagree"):
        load_config(f)
    again = load_config(base=yaml.safe_load(yaml.safe_dump(dump_config(short))))
    assert again == short


def test_async_defaults_are_resolved():
    p = load_config(overrides=["mode=async"]).pipeline
    assert p is not None and (p.step_every, p.mitigations, p.ga_stages, p.nag_with_predictor) == (
        1, ["stale"], None, None)
    p = load_config(overrides=["mode=async", "mitigations=ws,ga", "ga_stages=almost_last_partition",
                               "pipeline.stages=3", "nprocs=3"]).pipeline
    assert p is not None and p.ga_stages == "almost_last_partition"
    dumped = dump_config(load_config(overrides=["mode=gpipe"]))["pipeline"]
    assert not {"step_every", "mitigations", "ga_stages", "nag_with_predictor"} & set(dumped)


@pytest.mark.parametrize("names", ["stale", "ws", "wp", "msnag", "wp,ws", "ws,ga", "wp,ws,ga", "wp,ga_jfl,ws"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_meaningful_combinations_are_accepted(names, optimizer):
    cfg = load_config(overrides=["mode=async", f"mitigations={names}", f"optimizer.name={optimizer}",
                                 f"recompute={'ga_jfl' in names}"])
    assert cfg.pipeline is not None and cfg.pipeline.mitigations == names.split(",")


def test_unknown_mitigation_lists_valid_names(tmp_path, capsys):
    msg = _error("mode=async", "mitigations=wp,ws,gap")
    assert "pipeline.mitigations=wp,ws,gap" in msg and "unknown staleness mitigation 'gap'" in msg
    assert all(name in msg for name in MITIGATIONS)
    rc, _, _ = train(tmp_path / "x", *sets(["mode=async", "mitigations=pw"]))
    assert rc == 2 and "'pw'" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert "mitigations.0=3" in _error("mode=async", "mitigations=[3]")
    assert "ga_stages='last'" in _error("mode=async", "mitigations=ws,ga", "ga_stages=last")


@pytest.mark.parametrize("overrides,expected", [
    (["mitigations=ga,ga_jfl,ws", "recompute=true"], "choose one"),
    (["mitigations=stale,ws"], "cannot be combined"),
    (["mitigations=wp,msnag"], "choose one weight predictor"),
    (["mitigations=ws,ws"], "repeat"),
    (["mitigations=aggmsnag"], "step_every > 1"),
    (["mitigations=ga_jfl", "recompute=true"], "add 'ws'"),
    (["mitigations=ws,ga_jfl"], "needs recomputation"),
    (["mitigations=ga", "optimizer.name=adam"], "Gap Aware for Adam"),
    (["mitigations=wp,ga", "optimizer.name=adamw"], "Gap Aware for AdamW"),
    (["mitigations=ws", "ga_stages=all_except_last"], "read only with mitigation ga"),
    (["mitigations=ws", "nag_with_predictor=true"], "read only with a weight predictor"),
    (["mitigations=ws,ga", "ga_stages=all_except_last_two"], "no stage of a 2-stage pipeline"),
    (["step_every=3"], "must divide pipeline.microbatches=4"),
])
def test_bad_combinations_are_config_errors(overrides, expected):
    msg = _error("mode=async", *overrides)
    assert expected in msg
    assert "pipeline." in msg  # names the field


@pytest.mark.parametrize("mode", ["single", "ddp", "dp", "seq", "gpipe", "1f1b"])
def test_async_keys_refused_for_synchronous_modes(mode):
    msg = _error(f"mode={mode}", "step_every=2")
    assert "pipeline.step_every=2" in msg and "mode 'async'" in msg and f"mode {mode!r}" in msg
    msg = _error(f"mode={mode}", "pipeline.mitigations=ws")
    assert "pipeline.mitigations" in msg and "mode 'async'" in msg
    if mode in ("single", "ddp", "dp"):
        assert "pipeline.recompute" in _error(f"mode={mode}", "recompute=true")
    else:
        assert load_config(overrides=[f"mode={mode}", "recompute=true"]).pipeline.recompute


def test_every_mitigation_is_documented():
    assert set(MITIGATION_DOCS) == set(MITIGATIONS)
    assert tuple(GA_STAGE_POLICIES) == tuple(FACTORY_GA_STAGES)
    description = PipelineConfig.model_fields["mitigations"].description or ""
    text = mitigations_help()
    for name in (*MITIGATIONS, *GA_STAGE_POLICIES, "nag_with_predictor", "step_every"):
        assert name in text
    for name in MITIGATIONS:
        assert f"{name}:" in description


@pytest.mark.parametrize("name", ["async.yaml", "async_wp_ws_ga.yaml"])
def test_example_configs_load(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.mode == "async" and cfg.pipeline is not None and cfg.pipeline.step_every is not None
    if name == "async_wp_ws_ga.yaml":
        assert cfg == load_config(CONFIGS / name, [*COMMAND, "pipeline.microbatches=4"])

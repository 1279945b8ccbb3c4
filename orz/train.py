"""Train from a YAML preset (or a playground recipe) and `key.sub=value` overrides, and the life
of the process around a run: refusals before Ray starts, signals, restarts after a lost worker.

    python -m orz.train --config configs/tiny_grpo.yaml trainer.iterations=50 actor.lr=1e-5
    python playground/orz_7b_ppo.py model.path=/models/Qwen2.5-7B data.train=[/data/orz_math_57k.json]
    run(cfg)    # from Python: the result's iterations, seconds, plot, first and last metrics

Torch, Ray and Megatron's helpers are imported when a run starts (seconds), so that a refused
command line answers at once and Ctrl-C during the imports ends quietly.
"""
import argparse
import contextlib
import json
import re
import signal
import sys
import threading
from pathlib import Path

from orz.config import ConfigError, ExperimentConfig, apply_overrides, load_config
from orz.stopping import Stopped


def main(argv: list[str] | None = None, base: ExperimentConfig | None = None) -> int:
    """The entry point of `python -m orz.train` and of every recipe (`base` = the recipe)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML preset (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides, base=base)
        if not cfg.model.path:
            raise ConfigError("model.path is not set: pass model.path=/path/to/hf_model")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        import orz.ppo.trainer  # noqa: F401  seconds: torch, Ray, Megatron's helpers
    except KeyboardInterrupt:
        print("orz: stopped by Ctrl-C (SIGINT) before the run started", file=sys.stderr)
        return 130
    from orz.data.datasets import DatasetFormatError
    from orz.models.arch import ModelConfigError

    try:
        result = run(cfg)
    except (ConfigError, DatasetFormatError, ModelConfigError) as err:  # refused before anything started
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Stopped as stop:  # SIGINT or SIGTERM, once every role and the run's Ray cluster are shut down
        print(f"orz: {stop}", file=sys.stderr)
        return 128 + stop.signum  # 130 (SIGINT), 143 (SIGTERM): what a shell reports for a signal's end
    print(json.dumps(result, default=str))
    # 75 (EX_TEMPFAIL): stopped by SIGUSR1 with a checkpoint; scripts/slurm requeues the job.
    return 75 if result.get("preempted") else 0


def run(cfg: ExperimentConfig) -> dict:
    """Trains to the end; after a lost Megatron worker, rebuilds the run from its last checkpoint.
    SIGTERM and Ctrl-C raise Stopped once every role is shut down, and the local Ray cluster too if
    this call started it: no agent or worker process of the run is left behind. SIGUSR1, from the
    start on and across restarts, ends the run after the current iteration with a checkpoint."""
    import ray

    from orz.logs import output_to, quiet_driver
    from orz.ppo.trainer import console
    from orz.run import resume
    from orz.stopping import StopSignals

    stop = threading.Event()
    signals = StopSignals() if threading.current_thread() is threading.main_thread() else None
    if signals:
        signal.signal(signal.SIGUSR1, lambda *_: stop.set())
        signals.install()
    progress = {"iterations": None}  # of the trainer in use, for Stopped
    owns_ray = False
    try:
        try:
            cfg, start, data = _checked(cfg)  # before Ray or any worker starts
            resume_from, t = start.checkpoint, cfg.trainer
            if start.says:
                console.print(start.says)
            if not t.resume and (aside := resume.set_aside(Path(t.output_dir), after=-1)) is not None:
                console.print(f"orz: trainer.resume=false: the earlier run in {t.output_dir} (its checkpoints, "
                              f"metrics and samples) moved to {aside}")
            log_dir = Path(t.output_dir) / "logs"
            if not t.verbose:
                console.print(f"orz: output of Ray, vLLM, Megatron and warnings: {log_dir}/ (trainer.verbose=true shows it)")
            owns_ray = not ray.is_initialized()
            if owns_ray:
                # "local": a new cluster even where `ray start` left its address in /tmp/ray. A joined
                # cluster has its own CPUs (run_rules refuses ray_num_cpus with ray_address).
                with contextlib.nullcontext() if t.verbose else output_to(log_dir / "driver.log"):
                    ray.init(address=t.ray_address or "local", num_cpus=t.ray_num_cpus or None, include_dashboard=False,
                             log_to_driver=t.verbose, configure_logging=False)
            elif t.ray_num_cpus and (cpus := ray.cluster_resources().get("CPU")) != t.ray_num_cpus:
                raise ConfigError(f"trainer.ray_num_cpus={t.ray_num_cpus} sizes the local cluster a run starts, but "
                                  f"Ray is already initialised in this process with {cpus} CPUs: leave "
                                  "ray_num_cpus 0, or start Ray with that many")
            if signals:
                signals.install()
            with contextlib.nullcontext() if t.verbose else quiet_driver(log_dir):
                result = _train_with_restarts(cfg, resume_from, data, stop, signals, progress)
        except KeyboardInterrupt:
            if signals:
                signals.caught()
            raise _stopped(cfg, signals, progress) from None
        finally:
            if signals:  # the shutdown below is not interrupted; a signal meanwhile is kept (signals.signum)
                signals.caught()
            if owns_ray and ray.is_initialized():
                ray.shutdown()  # a joined cluster (ray_address) is only disconnected from
    finally:
        if signals:
            signals.restore()
    if signals and signals.signum:  # came while the finished run shut down: it still ends as stopped
        raise _stopped(cfg, signals, progress)
    return result


def _checked(cfg: ExperimentConfig):
    """Every refusal before Ray starts: the fault spec, the config against its model, the checkpoint
    it resumes from; then the run's rows, read once. Returns the config (a Megatron start converted
    for the engines: hf_start), where it starts (resume.start_point) and the rows."""
    from orz.faults import Fault
    from orz.models.checkpoint import HFCheckpoint
    from orz.ppo import checkpoints
    from orz.run import lora_rules, placement, resume, run_rules

    try:
        Fault.parse(cfg.trainer.fault)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    cfg = hf_start(cfg)
    arch = HFCheckpoint(cfg.model.path).arch
    run_rules.check(cfg, arch)
    start = resume.start_point(cfg)
    if start.checkpoint is not None:
        trained = {"actor": arch} | ({"critic": HFCheckpoint(cfg.model.critic_path or cfg.model.path).arch}
                                     if "critic" in placement.roles(cfg) else {})
        problems = run_rules.checkpoint_problems(start.checkpoint, trained)
        problems = problems or lora_rules.base_problems(start.checkpoint, cfg)
        if problems:
            raise ConfigError("\n".join(problems))
        saved = checkpoints.saved_state(start.checkpoint)["config"]
        problems = run_rules.resume_problems(cfg, saved, arch)
        if problems:
            raise ConfigError("\n".join(f"{start.checkpoint}: {p}" for p in problems))
    return cfg, start, run_rules.read_data(cfg)


def _stopped(cfg: ExperimentConfig, signals, progress: dict) -> Stopped:
    """The run's Stopped: its signal (SIGINT without one: Ctrl-C inside a Ray call), its iterations
    and its last checkpoint."""
    latest = Path(cfg.trainer.output_dir) / "checkpoints" / "latest"
    return Stopped(signals.signum if signals and signals.signum else signal.SIGINT, progress["iterations"],
                   str(latest.parent / latest.read_text().strip()) if latest.is_file() else None)




def _train_with_restarts(cfg: ExperimentConfig, resume_from: Path | None, data, stop: threading.Event, signals,
                         progress: dict) -> dict:
    """RayPPOTrainer(...).fit() from `resume_from`, rebuilt from the last checkpoint after a lost
    Megatron worker."""
    from rich.markup import escape

    from orz.ppo.trainer import RayPPOTrainer, console

    restarts = 0
    while True:
        trainer = None
        try:
            trainer = RayPPOTrainer(cfg, resume_from, restarts, data)
            return trainer.fit(stop) | {"restarts": restarts}
        except KeyboardInterrupt:
            if signals:
                signals.caught()  # before the shutdown below, which must not be interrupted
            raise
        except Exception as err:
            if trainer is None:
                raise
            lost = trainer.lost_workers()
            if not lost:  # an exception, not a lost process: starting again would raise it again
                console.print(f"[bold red]orz: iteration {trainer.iteration + 1} failed[/] in its {trainer.phase} "
                              f"phase: {escape(_origin(err))}; the run stops, its traceback follows. The last checkpoint: "
                              f"{trainer.last_checkpoint or 'none'}")
                raise
            if restarts == cfg.trainer.max_restarts:
                raise
            restarts += 1
            resume_from = trainer.last_checkpoint
            console.print(f"[bold red]orz: {', '.join(lost)} died[/] in iteration {trainer.iteration + 1} "
                          f"({type(err).__name__}); restart {restarts} of at most {cfg.trainer.max_restarts}, "
                          f"from {resume_from or 'the start'}")
        finally:
            if trainer is not None:
                progress["iterations"] = trainer.iteration
                trainer.shutdown()


def _origin(err: BaseException) -> str:
    """The error's first line and, when a Ray actor raised it, which actor (its repr: the name of
    its log, `actor-0`, `engine-0`) in which method, from the line Ray puts over its traceback."""
    import ray

    cause = getattr(err, "cause", None) if isinstance(err, ray.exceptions.RayTaskError) else None
    what = f"{type(cause or err).__name__}: {cause or err}".splitlines()[0]
    actor = re.search(r"ray::([\w.]+)\(\).*?repr=([^)]+)\)", str(err)) if cause is not None else None
    return f"{what} (raised in {actor[2]}, {actor[1]})" if actor else what


def hf_start(cfg: ExperimentConfig) -> ExperimentConfig:
    """A model.path that names a Megatron checkpoint (`orz convert hf2mcore`'s) is converted once
    into output_dir/model_hf, which the run then reads: the engines load HF weights."""
    from orz.convert import mcore2hf
    from orz.models.checkpoint import MEGATRON_META
    from orz.ppo.trainer import console

    if not (Path(cfg.model.path) / MEGATRON_META).is_file():
        return cfg
    converted = Path(cfg.trainer.output_dir) / "model_hf"
    if not (converted / "config.json").is_file():
        console.print(f"orz: model.path={cfg.model.path} is a Megatron checkpoint: converting it once into {converted}")
        mcore2hf(cfg.model.path, str(converted))
    return apply_overrides(cfg, [f"model.path={converted}"])


if __name__ == "__main__":
    sys.exit(main())

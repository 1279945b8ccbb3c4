"""Train from a YAML preset (or a playground recipe) and `key.sub=value` overrides.

    python -m orz.train --config configs/tiny_grpo.yaml trainer.iterations=50 actor.lr=1e-5
    python playground/orz_7b_ppo.py model.path=/models/Qwen2.5-7B data.train=[/data/orz_math_57k.json]
"""
import argparse
import json
import sys

from orz.config import ConfigError, ExperimentConfig, load_config
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
        from orz.ppo.trainer import main as train  # seconds: torch, Ray, Megatron's helpers
    except KeyboardInterrupt:
        print("orz: stopped by Ctrl-C (SIGINT) before the run started", file=sys.stderr)
        return 130
    from orz.data.datasets import DatasetFormatError
    from orz.models.arch import ModelConfigError

    try:
        result = train(cfg)
    except (ConfigError, DatasetFormatError, ModelConfigError) as err:  # refused before anything started
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Stopped as stop:  # SIGINT or SIGTERM, once every role and the run's Ray cluster are shut down
        print(f"orz: {stop}", file=sys.stderr)
        return 128 + stop.signum  # 130 (SIGINT), 143 (SIGTERM): what a shell reports for a signal's end
    print(json.dumps(result, default=str))
    # 75 (EX_TEMPFAIL): stopped by SIGUSR1 with a checkpoint; scripts/slurm requeues the job.
    return 75 if result.get("preempted") else 0


if __name__ == "__main__":
    sys.exit(main())

"""Train from a YAML preset and overrides.

    python -m orz.train --config configs/tiny_grpo.yaml trainer.iterations=50 actor.lr=1e-5
"""
import argparse
import json
import sys

from orz.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orz.train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML preset (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from orz.ppo.trainer import main as train

    print(json.dumps(train(cfg), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

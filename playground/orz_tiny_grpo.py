"""GRPO on the CPU demo's tiny model (pre-trained on first use, cached in runs/demo).

    python playground/orz_tiny_grpo.py trainer.iterations=30
"""
import sys
from pathlib import Path

from orz.demo import BaseModelSpec, base_model, rl_config
from orz.train import main

SPEC = BaseModelSpec()


def recipe(root: Path = Path("runs/demo"), name: str = "tiny_grpo"):
    return rl_config(base_model(SPEC, root), SPEC, root, [f"trainer.output_dir={root / name}"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], base=recipe()))

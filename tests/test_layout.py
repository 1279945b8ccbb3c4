"""The dependency rules of ../shared/DESIGN.md, read from every module's imports (lazy ones in
function bodies included): each package imports only what lies below it.

    .venv/bin/python -m pytest -q tests/test_layout.py
"""
import ast
from pathlib import Path

import pytest

ORZ = Path(__file__).resolve().parents[1] / "orz"

# (modules, the imports they must not make, why)
RULES = [
    ("orz.ppo.core_algos", ("orz.config", "orz.run", "orz.ppo", "orz.models", "orz.rollout", "orz.reward", "orz.data",
                            "ray", "megatron", "vllm", "transformers"),
     "the math imports torch alone, and the names it implements (orz/algorithm_names.py)"),
    ("orz.algorithm_names", ("orz.config", "orz.run", "orz.ppo", "orz.models", "torch", "ray"), "names import nothing"),
    ("orz.data", ("orz.reward", "orz.ppo", "orz.rollout", "orz.models", "ray", "megatron", "vllm"),
     "data is read by the verifiers, never the reverse"),
    ("orz.reward", ("orz.ppo", "orz.rollout", "orz.models", "ray", "megatron", "vllm"),
     "verifiers run without Ray, Megatron or vLLM"),
    ("orz.models", ("orz.ppo", "orz.rollout", "orz.reward", "orz.run"), "models know nothing of RL or of a run"),
    # The environments' rules still read orz/rollout/envs.py and python_tool.py (whose agent loop
    # imports Ray): the one way run/ reaches above itself, left for a registry of environments.
    ("orz.run", ("orz.ppo", "ray", "megatron", "vllm", "orz.rollout.engine", "orz.rollout.fleet", "orz.rollout.driver"),
     "what a run is sits below the trainer"),
    ("orz.convert", ("orz.ppo", "orz.rollout", "ray"), "conversions build models from their spec in a local world"),
    ("orz.models.spec", ("torch", "ray", "megatron", "vllm", "orz"), "the planner reads a model's sizes without torch"),
    ("orz.plan.inputs", ("torch", "ray", "megatron", "vllm", "orz.ppo.core_algos"), "the planner's arithmetic"),
    ("orz.plan.memory", ("torch", "ray", "megatron", "vllm", "orz.ppo.core_algos"), "the planner's arithmetic"),
    ("orz.plan.timing", ("torch", "ray", "megatron", "vllm", "orz.ppo.core_algos"), "the planner's arithmetic"),
    ("orz.plan.estimate", ("torch", "ray", "megatron", "vllm", "orz.ppo.core_algos"), "the planner's arithmetic"),
    ("orz.plan.advice", ("torch", "ray", "megatron", "vllm", "orz.ppo.core_algos"), "the planner's arithmetic"),
]


def modules() -> dict[str, Path]:
    out = {}
    for path in ORZ.rglob("*.py"):
        parts = path.relative_to(ORZ.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, name: str) -> set[str]:
    """Every module `path` imports, at any depth of its body, relative imports resolved."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".")[: -node.level if path.name != "__init__.py" else len(name.split("."))]
                base = ".".join(package + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@pytest.mark.parametrize("scope, forbidden, why", RULES, ids=[rule[0] for rule in RULES])
def test_imports_point_downward(scope, forbidden, why):
    checked = {name: path for name, path in modules().items() if _under(name, scope)}
    assert checked, f"no module under {scope}"
    wrong = sorted(f"{name} imports {imp}" for name, path in checked.items() for imp in imports(path, name)
                   if any(_under(imp, f) for f in forbidden) and not _under(imp, scope))
    assert not wrong, f"{why}:\n" + "\n".join(wrong)

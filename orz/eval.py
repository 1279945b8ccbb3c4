"""Benchmark table for a checkpoint: avg@k, pass@k, maj@k, lengths and truncation per benchmark.

    python -m orz.eval --model ckpt/hf --data aime24=data/aime2024.json --data math500=data/math500.json \\
        --n 32 --temperature 0.6 --top-p 0.95 --max-tokens 8192 [--template think_answer|chat] \\
        [--out DIR] [--engines N] [--seed S] [--env python | --env NAME=package.module:Class] [--max-turns T]

--model is an HF directory or a Megatron checkpoint written by orz (it holds orz_checkpoint.json; it
is converted to a temporary HF directory under --out, with the tokenizer hf2mcore kept beside it or --tokenizer's).
Benchmark files are read locally (see orz/evaluation/benchmarks.py for their formats); every
file is checked before any engine starts. Writes DIR/report.json (settings and every figure),
DIR/samples.jsonl (one line per sample) and DIR/table.md, and prints the table. With --env, rows
are evaluated multi-turn, as trained (docs/multiturn.md): with the python tool, or a user
environment by import path, for every row that names none of its own; --max-tokens bounds each turn.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from orz.config import DataConfig, ExperimentConfig, RolloutConfig
from orz.data.datasets import DatasetFormatError
from orz.models.arch import ModelConfigError
from orz.models.checkpoint import MEGATRON_META, is_earlier_format, kept_hf_files, read_megatron_meta


@dataclass(frozen=True)
class CliConfig:
    model: str
    data: dict[str, str]  # benchmark name -> file
    tokenizer: str | None  # None: the model directory's
    template: str
    out: str
    engines: int
    engine_tp: int
    max_model_len: int | None  # None: the model's own
    kv_cache_gib: int  # CPU only: vLLM's KV cache size
    gpu_memory_utilization: float | None  # GPU only; None: vLLM's default
    ray_address: str | None  # None: start a local Ray cluster
    progress: bool
    rollout: RolloutConfig | None = None  # its environments (multi-turn evaluation); None: single turn


def parse_args(argv: list[str] | None = None):
    from orz.evaluation.runner import EvalConfig
    from orz.run import run_rules
    from orz.reward.router import RouterConfig

    defaults = EvalConfig()
    p = argparse.ArgumentParser(prog="python -m orz.eval", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF model directory, or an orz Megatron checkpoint")
    p.add_argument("--data", required=True, action="append", metavar="NAME=PATH",
                   help="a benchmark file (.jsonl/.json/.parquet); repeat for several. PATH alone: NAME is its stem")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model; required for a Megatron checkpoint)")
    p.add_argument("--template", default="think_answer", choices=["think_answer", "chat"])
    p.add_argument("--n", type=int, default=defaults.n, help="samples per problem (the k of avg@k)")
    p.add_argument("--temperature", type=float, default=defaults.temperature)
    p.add_argument("--top-p", type=float, default=defaults.top_p)
    p.add_argument("--top-k", type=int, default=defaults.top_k)
    p.add_argument("--max-tokens", type=int, default=defaults.max_new_tokens, help="new tokens per response")
    p.add_argument("--stop", action="append", help="stop string (repeat); default: the template's")
    p.add_argument("--k", type=int, nargs="+", help="the k of pass@k and maj@k (default: 1, 2, 4, ..., n)")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--custom", action="append", default=[], metavar="NAME=SPEC",
                   help="a custom reward for rows whose verifier is NAME: package.module:function or an http(s) URL")
    p.add_argument("--chunk-samples", type=int, default=defaults.chunk_samples, help="samples per generate call")
    p.add_argument("--out", help="output directory (default: runs/eval/<model>-<time>)")
    p.add_argument("--engines", type=int, default=1, help="vLLM engines")
    p.add_argument("--tp", type=int, default=1, help="GPUs per engine (vLLM tensor parallelism)")
    p.add_argument("--max-model-len", type=int, help="vLLM context length (default: the model's)")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="CPU only: KV cache per engine")
    p.add_argument("--gpu-memory-utilization", type=float, help="GPU only (default: vLLM's)")
    p.add_argument("--ray-address", help="join this Ray cluster instead of starting one")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--env", metavar="python|NAME=package.module:Class",
                   help="evaluate multi-turn with this environment (rows naming their own keep it)")
    p.add_argument("--max-turns", type=int, default=RolloutConfig.max_turns, help="model turns per sample with --env")
    p.add_argument("--tool-format", default=RolloutConfig.tool_format, choices=["code", "chat"],
                   help="the python tool's calls: code blocks, or the chat template's JSON calls (needs --template chat)")
    args = p.parse_args(argv)
    data = {}
    for item in args.data:
        name, _, path = item.partition("=") if "=" in item else (Path(item).stem, "", item)
        if not name or not path or name in data:
            p.error(f"--data {item!r}: expected NAME=PATH with distinct names")
        data[name] = path
    out = args.out or f"runs/eval/{Path(args.model).resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}"
    custom = dict(item.partition("=")[::2] for item in args.custom)
    rollout = None
    if args.tool_format != RolloutConfig.tool_format and not args.env:
        p.error("--tool-format shapes the python tool of --env python: pass --env")
    if args.env:
        name, _, spec = args.env.partition("=")
        rollout = RolloutConfig(env=name, envs={name: spec} if spec else {}, max_turns=args.max_turns,
                                max_new_tokens=args.max_tokens, tool_format=args.tool_format)
        run = ExperimentConfig(rollout=rollout, data=DataConfig(template=args.template))
        problems = run_rules.setting_problems(run) + run_rules.env_problems(run)
        if problems:
            p.error("--env/--max-turns/--tool-format: " + "; ".join(problems))
    cli = CliConfig(args.model, data, args.tokenizer, args.template, out, args.engines, args.tp, args.max_model_len,
                    args.kv_cache_gib, args.gpu_memory_utilization, args.ray_address, not args.no_progress, rollout)
    try:
        cfg = EvalConfig(reward=RouterConfig(custom=custom), n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                         max_new_tokens=args.max_tokens, stop=None if args.stop is None else tuple(args.stop),
                         seed=args.seed, ks=None if args.k is None else tuple(args.k), chunk_samples=args.chunk_samples)
    except ValueError as err:
        p.error(str(err))
    return cli, cfg


def resolve_model(model: str | Path, tokenizer: str | None, workdir: str | Path) -> tuple[str, str]:
    """(HF directory for vLLM, tokenizer directory). An orz Megatron checkpoint is converted into
    `workdir` first, with the tokenizer hf2mcore kept beside it; a trainer's holds none, so
    `tokenizer` must name one."""
    from orz.convert import mcore2hf

    model = Path(model)
    if (model / MEGATRON_META).is_file():
        tokenizer = tokenizer or kept_hf_files(model)
        if tokenizer is None:
            raise ModelConfigError(f"{model} is a Megatron checkpoint that holds no tokenizer (a trainer's): "
                                   f"pass --tokenizer DIR")
        return str(mcore2hf(str(model), str(Path(workdir) / "hf"), like=tokenizer)), tokenizer
    if is_earlier_format(model):
        read_megatron_meta(model)  # refuses it, naming `orz convert upgrade`
    if not (model / "config.json").is_file():
        raise ModelConfigError(f"{model}: neither an HF directory (config.json) nor an orz Megatron checkpoint "
                               f"({MEGATRON_META})")
    return str(model), tokenizer or str(model)


def main(argv: list[str] | None = None) -> int:
    cli, cfg = parse_args(argv)
    try:
        return run(cli, cfg)
    except (DatasetFormatError, ModelConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def run(cli: CliConfig, cfg) -> int:
    """setup (benchmarks first: a bad file fails in seconds) -> evaluate -> save -> cleanup."""
    import ray

    from orz.data.templates import make_template
    from orz.data.tokenizers import load_tokenizer
    from orz.evaluation.benchmarks import load_benchmark
    from orz.evaluation.runner import Evaluator
    from orz.rollout.fleet import EngineFleet, FleetConfig
    from orz.rollout.python_tool import prompt_tools

    start = time.perf_counter()
    benchmarks = [load_benchmark(name, path) for name, path in cli.data.items()]
    Path(cli.out).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".model-", dir=cli.out) as workdir:
        model_dir, tokenizer_dir = resolve_model(cli.model, cli.tokenizer, workdir)
        tokenizer = load_tokenizer(tokenizer_dir)
        template = make_template(cli.template, tokenizer, tools=prompt_tools(cli.rollout) if cli.rollout else ())
        engine_args = {k: v for k, v in (("max_model_len", cli.max_model_len),
                                         ("gpu_memory_utilization", cli.gpu_memory_utilization)) if v is not None}
        started_ray = not ray.is_initialized()
        if started_ray:
            ray.init(address=cli.ray_address or "local", include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        fleet = None
        try:
            fleet_cfg = FleetConfig(num_engines=cli.engines, engine_tp=cli.engine_tp,
                                    engine_args=engine_args, kv_cache_gib=cli.kv_cache_gib)
            fleet = EngineFleet(model_dir, fleet_cfg, seed=cfg.seed)
            turns = None if cli.rollout is None else _multi_turn(cli, fleet, tokenizer, benchmarks, model_dir)
            with Evaluator(fleet, tokenizer, template, benchmarks, cfg, progress=cli.progress, turns=turns,
                           env=cli.rollout.env if cli.rollout else "") as evaluator:
                report = evaluator.run()
        finally:
            if fleet is not None:
                fleet.shutdown()
            if started_ray:
                ray.shutdown()
    report.settings.update(model=str(cli.model), tokenizer=cli.tokenizer or str(cli.model), engines=cli.engines,
                           engine_tp=cli.engine_tp, engine_args=engine_args,
                           total_wall_s=time.perf_counter() - start)  # engine start-up included
    paths = report.save(cli.out)
    print(report.table())
    print(f"\nreport: {paths['report']}\nsamples: {paths['samples']}")
    return 0


def _multi_turn(cli: CliConfig, fleet, tokenizer, benchmarks, model_dir: str):
    """The multi-turn rollout of --env over `fleet`: turns within the engines' context (--max-model-len,
    else the model's), the code reward's sandbox for the python tool."""
    from orz.config import CodeScoringConfig
    from orz.models.arch import read_hf_config
    from orz.rollout.agent_loop import TurnLimits
    from orz.rollout.multiturn import MultiTurnRollout, make_loops

    r = cli.rollout
    context = cli.max_model_len or read_hf_config(model_dir)["max_position_embeddings"]
    used = {r.env, *(row.env for b in benchmarks for row in b.problems)} - {""}
    limits = TurnLimits(r.max_turns, r.max_new_tokens, context, r.max_observation_tokens, r.env_timeout_s)
    return MultiTurnRollout(fleet, tokenizer, make_loops(r, CodeScoringConfig(), used, tokenizer), limits)


if __name__ == "__main__":
    sys.exit(main())

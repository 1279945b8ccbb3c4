"""Evaluator: samples n responses per benchmark problem from a fleet, judges them, and reports
avg@k, pass@k, maj@k, response lengths and truncation per benchmark. It is the one code path
behind `python -m orz.eval` and the trainer's periodic evaluation, so both give the same numbers
for the same weights and settings.

    evaluator = Evaluator(fleet, tokenizer, template, benchmarks, EvalConfig(n=32))
    report = evaluator.run(min_version=fleet.weight_version)   # the trainer: the weights just synced
    print(report.table()); report.save(out_dir); metrics.update(report.metrics())
    evaluator.close()

Generation goes in chunks of whole problems; the next chunk is generated while the last one is
judged. Problem i of a benchmark is sampled with seed `cfg.seed + i`, so results depend neither
on the chunking nor on how many engines share the work (up to the engines' numerics).
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from orz.config import ExperimentConfig
from orz.data.datasets import Row
from orz.data.templates import ANSWER_CLOSE, ThinkAnswerTemplate, encode_prompt
from orz.evaluation import metrics
from orz.evaluation.benchmarks import Benchmark, cluster_math_answers
from orz.reward.pool import KillablePool
from orz.reward.router import RewardRouter, RouterConfig
from orz.rollout.driver import generate
from orz.rollout.engine import Sample, SamplingConfig
from orz.rollout.envs import env_names
from orz.rollout.fleet import EngineFleet
from orz.rollout.agent_loop import Conversation
from orz.rollout.multiturn import MultiTurnRollout


@dataclass(frozen=True)
class EvalConfig:
    n: int = 1  # samples per problem: the k of avg@k
    temperature: float = 0.6  # 0.6 / 0.95: the sampling DeepSeek-R1 and Skywork-OR1 report avg@k with
    top_p: float = 0.95
    top_k: int = -1  # -1: off
    max_new_tokens: int = 8192
    stop: tuple[str, ...] | None = None  # None: the template's own (think_answer: after "</answer>")
    seed: int = 0  # problem i of each benchmark is sampled with seed + i
    ks: tuple[int, ...] | None = None  # the k of pass@k and maj@k besides n; None: 1, 2, 4, ... below n
    # Samples per generate call, rounded to whole problems. The progress bar moves once per chunk;
    # bigger chunks keep more engines busy.
    chunk_samples: int = 1024
    # How each row's verifier judges. A verdict is right or wrong: no format bonus, code passes every test.
    reward: RouterConfig = field(default_factory=RouterConfig)
    # Wall-clock limit for clustering one problem's answers for maj@k (math-verify, pairwise). Past
    # it, that problem's answers are clustered by exact string instead (counted as
    # cluster_fallbacks).
    cluster_timeout_s: float = 30.0

    def __post_init__(self):
        if self.n < 1 or self.chunk_samples < 1:
            raise ValueError(f"need n >= 1 and chunk_samples >= 1; got n={self.n}, "
                             f"chunk_samples={self.chunk_samples}")
        if self.ks is not None and any(not 1 <= k <= self.n for k in self.ks):
            raise ValueError(f"every k must be in 1..n={self.n}; got ks={list(self.ks)}")
        if self.reward.math.format_reward != 0.0 or self.reward.code.scoring != "all_pass" or self.reward.weights:
            raise ValueError(f"a verdict is right or wrong: need math.format_reward=0, code.scoring='all_pass' and "
                             f"no reward weights; got {self.reward.math.format_reward}, "
                             f"{self.reward.code.scoring!r} and {self.reward.weights}")

    @property
    def pass_ks(self) -> tuple[int, ...]:
        """The k of pass@k and maj@k: `ks` and always n (the table's columns)."""
        return tuple(sorted({*self.ks, self.n})) if self.ks is not None else metrics.default_ks(self.n)


def default_stop(template: Any) -> tuple[str, ...]:
    """ORZ's template ends its answer with a tag; a chat template ends with the EOS token."""
    return (ANSWER_CLOSE,) if isinstance(template, ThinkAnswerTemplate) else ()


@dataclass
class Judged:
    """Verdicts on one chunk of samples, problem by problem (n samples each, in order)."""

    extracted: list[str | None]  # the answer, letter or code read from each response
    verdicts: list[bool]
    clusters: list[int | None] | None  # per sample, its answer cluster within its problem; None: no voting (code)
    judge_timeouts: int = 0  # samples whose verification was killed, failed or crashed, and code test cases killed
    cluster_fallbacks: int = 0  # problems clustered by exact string after a clustering timeout


@dataclass
class EvalReport:
    settings: dict[str, Any]
    figures: dict[str, dict[str, float]]  # benchmark -> figure -> value
    records: list[dict[str, Any]]  # one per sample

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        """Flat `eval/<benchmark>/<figure>` metrics for the trainer's logs."""
        return {f"{prefix}/{name}/{key}": value for name, figs in self.figures.items() for key, value in figs.items()}

    def table(self) -> str:
        """The Markdown table: accuracies in percent, lengths in tokens."""
        n = self.settings["n"]
        header = ["benchmark", "kind", "problems", f"avg@{n}", f"pass@{n}", f"maj@{n}",
                  "tokens mean", "tokens p95", "truncated", "wall s"]
        align = ["---"] * 2 + ["--:"] * (len(header) - 2)  # names left, numbers right
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
        for name, f in self.figures.items():
            maj = f.get(f"maj@{n}")
            cells = [name, self.settings["benchmarks"][name]["kind"], str(f["problems"]), _pct(f[f"avg@{n}"]),
                     _pct(f[f"pass@{n}"]), "–" if maj is None else _pct(maj), f"{f['response_tokens_mean']:.0f}",
                     f"{f['response_tokens_p95']:.0f}", _pct(f["truncated_rate"]), f"{f['wall_s']:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def save(self, out_dir: str | Path) -> dict[str, Path]:
        """Writes report.json (settings and every figure), samples.jsonl and table.md."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"report": out / "report.json", "samples": out / "samples.jsonl", "table": out / "table.md"}
        report = {"settings": self.settings, "benchmarks": self.figures}
        paths["report"].write_text(json.dumps(report, indent=2) + "\n")
        with open(paths["samples"], "w", encoding="utf-8") as f:
            for record in self.records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        paths["table"].write_text(self.table() + "\n")
        return paths


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def eval_settings(cfg: ExperimentConfig, seed: int) -> dict[str, EvalConfig]:
    """A training run's evaluations, by metric prefix: greedy (avg@1 at temperature 0) and, with
    trainer.eval_n > 1, sampled avg@k / pass@k / maj@k at the rollout's sampling settings and
    length; each verdict right or wrong (no format bonus, no weights)."""
    r = cfg.rollout
    verdicts = replace(RouterConfig.from_config(cfg.reward, format_reward=0.0, num_workers=1, scoring="all_pass",
                                                envs=env_names(r.envs)),
                       weights={})
    common = dict(max_new_tokens=r.max_new_tokens, stop=tuple(r.stop) or None, seed=seed, reward=verdicts)
    settings = {"eval_greedy": EvalConfig(n=1, temperature=0.0, **common)}
    if cfg.trainer.eval_n > 1:
        settings["eval"] = EvalConfig(n=cfg.trainer.eval_n, temperature=r.temperature, top_p=r.top_p, **common)
    return settings


def _never(a: str, b: str) -> bool:
    """Equivalence by identity alone (cluster_answers already merges identical strings)."""
    return False


class Evaluator:
    """Evaluates whatever weights `fleet` holds on `benchmarks`; holds the verifier pools between
    runs (call `close()`)."""

    def __init__(self, fleet: EngineFleet, tokenizer: Any, template: Any, benchmarks: Sequence[Benchmark],
                 cfg: EvalConfig = EvalConfig(), progress: bool = True, turns: MultiTurnRollout | None = None,
                 env: str = ""):
        """turns: a multi-turn rollout over the same fleet, for rows with an environment (a row's
        own, else `env`), evaluated the way they were trained; None: single turn."""
        names = [b.name for b in benchmarks]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"need at least one benchmark and distinct names; got {names}")
        self.fleet, self.template, self.benchmarks, self.cfg = fleet, template, list(benchmarks), cfg
        self.turns, self.env = turns, env
        self.progress = progress
        self.prompts = {b.name: [template.prompt(p.prompt) for p in b.problems] for b in benchmarks}
        self.prompt_ids = {
            b.name: [encode_prompt(tokenizer, template, p.prompt) for p in b.problems] for b in benchmarks
        }
        stop = default_stop(template) if cfg.stop is None else cfg.stop
        self.sampling = SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                       max_new_tokens=cfg.max_new_tokens, stop=list(stop), n=cfg.n, seed=cfg.seed)
        self.router = RewardRouter(cfg.reward, [row for b in benchmarks for row in b.problems])
        self.cluster_pool = None
        if any(b.kind == "math" for b in benchmarks):
            math = cfg.reward.math
            self.cluster_pool = KillablePool(cluster_math_answers, math.num_workers, cfg.cluster_timeout_s,
                                             chunk_size=1, memory_limit_mb=math.memory_limit_mb)

    def settings(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "benchmarks": {
                b.name: {"path": b.path, "kind": b.kind, "problems": len(b.problems)} for b in self.benchmarks
            },
            "template": type(self.template).__name__,
            "n": cfg.n, "ks": list(cfg.pass_ks), "seed": cfg.seed,
            "sampling": asdict(self.sampling),
            "math_extraction": list(cfg.reward.math.extraction),
            "cluster_timeout_s": cfg.cluster_timeout_s,
            **({"code_sandbox": self.router.sandbox_isolation} if self.router.sandbox_isolation else {}),
        }

    def run(self, min_version: int | None = None) -> EvalReport:
        """Generates and judges every benchmark; `min_version` is passed to the rollout driver (the
        trainer's guarantee that the engines hold the weights it means to evaluate)."""
        figures, records, versions = {}, [], set()
        total = sum(len(b.problems) for b in self.benchmarks) * self.cfg.n
        with tqdm(total=total, unit="sample", desc="eval", disable=not self.progress, dynamic_ncols=True) as bar:
            for bench in self.benchmarks:
                figures[bench.name], bench_records = self._run_one(bench, min_version, bar)
                records += bench_records
                versions |= {r["weight_version"] for r in bench_records}
        settings = {**self.settings(), "min_version": min_version, "weight_versions": sorted(versions)}
        return EvalReport(settings, figures, records)

    def _run_one(self, bench: Benchmark, min_version: int | None, bar: tqdm) -> tuple[dict[str, float], list[dict]]:
        n, start = self.cfg.n, time.perf_counter()
        per_chunk = max(1, self.cfg.chunk_samples // n)
        starts = list(range(0, len(bench.problems), per_chunk))
        verdicts, clusters, records = [], [], []
        judge_timeouts = cluster_fallbacks = 0
        with ThreadPoolExecutor(1, thread_name_prefix="orz-eval-generate") as generator:
            pending = generator.submit(self._generate, bench, starts[0], per_chunk, min_version)
            for i, first in enumerate(starts):
                samples = pending.result()
                if i + 1 < len(starts):  # the engines work on the next chunk while this one is judged
                    pending = generator.submit(self._generate, bench, starts[i + 1], per_chunk, min_version)
                problems = [bench.problems[first + s.index] for s in samples]
                judged = self._judge(bench.kind, problems, samples)
                judge_timeouts += judged.judge_timeouts
                cluster_fallbacks += judged.cluster_fallbacks
                for j in range(0, len(samples), n):
                    verdicts.append(judged.verdicts[j : j + n])
                    clusters.append(None if judged.clusters is None else judged.clusters[j : j + n])
                records += [self._record(bench, first, k, s, judged) for k, s in enumerate(samples)]
                bar.set_postfix_str(f"{bench.name} avg@{n} {metrics.avg_at_k(verdicts):.3f}")
                bar.update(len(samples))
        figures = metrics.benchmark_figures(
            verdicts, None if None in clusters else clusters, self.cfg.pass_ks,
            [r["response_tokens"] for r in records], [r["finish_reason"] == "length" for r in records],
        )
        figures.update(
            no_answer_rate=metrics.mean([float(r["extracted"] is None) for r in records]),
            judge_timeouts=judge_timeouts,
            cluster_fallbacks=cluster_fallbacks,
            wall_s=time.perf_counter() - start,
        )
        return figures, records

    def _generate(self, bench: Benchmark, first: int, count: int, min_version: int | None) -> list[Sample]:
        prompts = self.prompt_ids[bench.name][first : first + count]
        sampling = replace(self.sampling, seed=self.cfg.seed + first)  # problem i: seed + i
        if self.turns is None:
            samples = generate(self.fleet, prompts, sampling, min_version=min_version)
        else:
            rows = bench.problems[first : first + count]
            groups = self.turns.stream([(ids, row.record(), row.env or self.env) for ids, row in zip(prompts, rows)],
                                       sampling, min_version)
            samples = [sample for group in sorted(groups, key=lambda group: group[0].index) for sample in group]
        got = [s.index for s in samples]
        if got != [i for i in range(len(prompts)) for _ in range(self.cfg.n)]:
            raise RuntimeError(f"{bench.name}: the fleet returned samples for prompts {got[:12]}..., expected "
                               f"{self.cfg.n} per prompt for {len(prompts)} prompts, in order")
        return samples

    def _record(self, bench: Benchmark, first: int, k: int, sample: Sample, judged: Judged) -> dict[str, Any]:
        """The JSONL line of sample `k` of a chunk that starts at problem `first`."""
        problem_index = first + sample.index
        return {
            "benchmark": bench.name, "problem": problem_index, "row": bench.problems[problem_index].number,
            "sample": k % self.cfg.n, "prompt": self.prompts[bench.name][problem_index], "response": sample.text,
            "extracted": judged.extracted[k], "answer": bench.problems[problem_index].answer or None,
            "correct": judged.verdicts[k], "cluster": None if judged.clusters is None else judged.clusters[k],
            "finish_reason": sample.finish_reason, "response_tokens": len(sample.response_ids),
            "weight_version": sample.weight_version,
            **({"turns": [vars(turn) for turn in sample.turns]} if isinstance(sample, Conversation) else {}),
        }

    # ---- judges: one per kind, over one chunk (whole problems, n samples each) ---------------
    def _votes(self, samples: Sequence[Sample], extracted: Sequence[str | None]) -> list[tuple[str | None, ...]]:
        """Per problem, the answers that vote in maj@k: a truncated response does not (it is wrong
        by definition, as in the reward)."""
        votes = [a if s.finish_reason == "stop" else None for s, a in zip(samples, extracted)]
        return [tuple(votes[j : j + self.cfg.n]) for j in range(0, len(votes), self.cfg.n)]

    def _judge(self, kind: str, problems: Sequence[Row], samples: Sequence[Sample]) -> Judged:
        """Verdicts by each row's verifier (the trainer's router); answers vote in maj@k for math
        (clustered by equivalence) and multiple choice (by letter), not for code or custom rewards."""
        verdicts = self.router.score([s.text for s in samples], problems, [s.finish_reason for s in samples])
        extracted = [v.extracted for v in verdicts]
        failures = sum(v.status in ("timeout", "crash", "error") for v in verdicts) + sum(v.test_timeouts for v in verdicts)
        judged = Judged(extracted, [v.correct for v in verdicts], None, failures)
        if kind not in ("math", "multiple_choice"):
            return judged
        votes = self._votes(samples, extracted)
        if kind == "multiple_choice":  # letters are equal only when identical
            judged.clusters = [c for answers in votes for c in metrics.cluster_answers(answers, _never)]
            return judged
        judged.clusters = []
        for answers, outcome in zip(votes, self.cluster_pool.map(votes)):
            if outcome.status == "ok":
                judged.clusters += outcome.value
            else:  # identical strings still agree; nothing else is compared
                judged.clusters += metrics.cluster_answers(answers, _never)
                judged.cluster_fallbacks += 1
        return judged

    def close(self) -> None:
        for closeable in (self.router, self.cluster_pool):
            if closeable is not None:
                closeable.close()

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

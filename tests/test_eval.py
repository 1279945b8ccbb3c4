"""The Evaluator (on a scripted fleet: hand-computed figures for math, multiple choice and code)
and `python -m orz.eval` on the tiny model, whose numbers must equal the Evaluator's called
directly, as the trainer calls it."""
import json
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from orz.data.templates import make_template
from orz.data.tokenizers import char_tokenizer, load_tokenizer
from orz.eval import main, resolve_model
from orz.evaluation.benchmarks import load_benchmark
from orz.evaluation.runner import EvalConfig, Evaluator
from orz.reward.router import RouterConfig
from orz.models.arch import ModelConfigError
from orz.rollout.engine import Sample
from jsonl_files import write_jsonl

TAG = " a </think> <answer>{}</answer>"
ADD = "```python\na, b = map(int, input().split())\nprint(a {} b)\n```"
SCRIPT = {  # a marker in the question -> the n=4 responses, in sample order, with finish reasons
    "half": [(TAG.format("0.5"), "stop"), (TAG.format("\\frac{1}{2}"), "stop"), (TAG.format("3"), "stop"), (TAG.format("3"), "stop")],
    "seven": [(TAG.format("8"), "stop"), (TAG.format("7"), "stop"), (TAG.format("8"), "stop"), (TAG.format("7"), "length")],
    "lepton": [(TAG.format("B"), "stop"), (TAG.format("(A)"), "stop"), (TAG.format("\\text{B}"), "stop"), (" no idea", "stop")],
    "sum": [(ADD.format("+"), "stop"), (ADD.format("-"), "stop"), (" no code", "stop"), (ADD.format("+"), "length")],
}
EXPECTED = {  # by hand, see test_eval_metrics for the pass@k and maj@k arithmetic
    # 1/2: right, right, wrong, wrong; clusters {0.5, 1/2} and {3, 3} tie 2-2, the first wins.
    # 7: 8, 7, 8 and a truncated 7 (wrong, no vote): 8 leads, and wins the k=2 tie by coming first.
    "math": {"avg@4": 0.375, "pass@1": 0.375, "pass@2": (5 / 6 + 1 / 2) / 2, "pass@4": 1.0,
             "maj@1": 0.5, "maj@2": 0.5, "maj@4": 0.5, "truncated_rate": 1 / 8, "no_answer_rate": 0.0},
    # B, A, B, nothing; the answer is B.
    "gpqa": {"avg@4": 0.5, "pass@1": 0.5, "pass@2": 5 / 6, "pass@4": 1.0, "maj@1": 1.0, "maj@2": 1.0, "maj@4": 1.0,
             "truncated_rate": 0.0, "no_answer_rate": 0.25},
    # right, wrong, no code, right but truncated.
    "code": {"avg@4": 0.25, "pass@1": 0.25, "pass@2": 0.5, "pass@4": 1.0, "truncated_rate": 0.25, "no_answer_rate": 0.25},
}


class ScriptedFleet:
    """Answers each prompt with SCRIPT's responses for the marker its question holds."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def generate(self, prompts, sampling, min_version=None):
        self.calls.append({"prompts": len(prompts), "seed": sampling.seed, "min_version": min_version, "stop": sampling.stop})
        samples = []
        for index, ids in enumerate(prompts):
            text = self.tokenizer.decode(ids)
            responses = next(SCRIPT[marker] for marker in SCRIPT if marker in text)
            for response, reason in responses[: sampling.n]:
                response_ids = self.tokenizer(response, add_special_tokens=False)["input_ids"]
                samples.append(Sample(index, list(ids), response_ids, [0.0] * len(response_ids), reason, response, 7))
        return samples


def _write_benchmarks(tmp_path):
    files = {
        "math": [{"prompt": "What is one half?", "answer": "1/2"}, {"prompt": "What is seven?", "answer": "7"}],
        "gpqa": [{"question": "Which particle is a lepton?", "choices": ["proton", "electron", "pion"], "answer": "B"}],
        "code": [{"question": "Print the sum of two integers.", "tests": {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3", "12"]}}],
    }
    paths = {}
    for name, rows in files.items():
        paths[name] = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    return paths


def _scripted_run(evaluator):
    """evaluator.run(min_version=7), its scripted fleet answering in place of the rollout driver."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("orz.evaluation.runner.generate", lambda fleet, *args, **kwargs: fleet.generate(*args, **kwargs))
        return evaluator.run(min_version=7)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bench")
    paths = _write_benchmarks(tmp_path)
    benchmarks = [load_benchmark(name, path) for name, path in paths.items()]
    template = make_template("think_answer")
    texts = [template.prompt(p.prompt) for b in benchmarks for p in b.problems]
    tokenizer = char_tokenizer(texts + [r for responses in SCRIPT.values() for r, _ in responses])
    fleet = ScriptedFleet(tokenizer)
    evaluator = Evaluator(fleet, tokenizer, template, benchmarks, EvalConfig(n=4, seed=10), progress=False)
    report = _scripted_run(evaluator)
    yield fleet, evaluator, report, benchmarks, tokenizer
    evaluator.close()


def test_figures_equal_the_hand_computed_ones(scripted):
    _, _, report, _, tokenizer = scripted
    for name, expected in EXPECTED.items():
        figures = report.figures[name]
        assert {k: figures[k] for k in expected} == pytest.approx(expected), name
        lengths = [len(tokenizer(r, add_special_tokens=False)["input_ids"]) for key in SCRIPT for r, _ in SCRIPT[key]]
        assert figures["response_tokens_mean"] > 0 and figures["response_tokens_p95"] <= max(lengths)
        assert figures["judge_timeouts"] == 0 and figures["wall_s"] > 0
    assert "maj@4" not in report.figures["code"]  # code answers are not voted on
    assert report.figures["math"]["cluster_fallbacks"] == 0


def test_avg_at_k_is_the_mean_of_the_records_verdicts(scripted):
    _, _, report, _, _ = scripted
    for name in EXPECTED:
        verdicts = [r["correct"] for r in report.records if r["benchmark"] == name]
        assert report.figures[name]["avg@4"] == pytest.approx(sum(verdicts) / len(verdicts))


def test_records_hold_prompt_response_answer_and_verdict(scripted):
    _, _, report, _, _ = scripted
    assert len(report.records) == 4 * 4
    half = [r for r in report.records if r["benchmark"] == "math" and r["problem"] == 0]
    assert [r["extracted"] for r in half] == ["0.5", "\\frac{1}{2}", "3", "3"]
    assert [r["correct"] for r in half] == [True, True, False, False]
    assert [r["cluster"] for r in half] == [0, 0, 2, 2]
    assert [r["sample"] for r in half] == [0, 1, 2, 3]
    assert half[0]["prompt"].endswith("User: What is one half?\nAssistant: <think>")
    assert half[0]["answer"] == "1/2" and half[0]["row"] == 1 and half[0]["weight_version"] == 7
    seven = [r for r in report.records if r["benchmark"] == "math" and r["problem"] == 1]
    assert [r["cluster"] for r in seven] == [0, 1, 0, None]  # the truncated response does not vote
    gpqa = [r for r in report.records if r["benchmark"] == "gpqa"]
    assert [r["extracted"] for r in gpqa] == ["B", "A", "B", None]
    code = [r for r in report.records if r["benchmark"] == "code"]
    assert [r["correct"] for r in code] == [True, False, False, False]
    assert code[0]["extracted"].startswith("a, b = map") and code[0]["answer"] is None and code[0]["cluster"] is None


def test_min_version_stop_and_seeds_reach_the_fleet(scripted):
    fleet, _, report, _, _ = scripted
    assert [c["min_version"] for c in fleet.calls] == [7, 7, 7]
    assert {tuple(c["stop"]) for c in fleet.calls} == {("</answer>",)}  # the think_answer template's own
    assert [c["seed"] for c in fleet.calls] == [10, 10, 10]  # each benchmark's problem i gets seed + i
    assert report.settings["min_version"] == 7 and report.settings["weight_versions"] == [7]
    assert report.settings["sampling"]["temperature"] == 0.6 and report.settings["ks"] == [1, 2, 4]


def test_chunking_changes_nothing_but_the_calls(scripted):
    fleet, evaluator, report, _, _ = scripted
    whole = evaluator.cfg
    evaluator.cfg = replace(whole, chunk_samples=4)  # one problem per generate call; the same pools
    fleet.calls.clear()
    try:
        again = _scripted_run(evaluator)
    finally:
        evaluator.cfg = whole
    assert [(c["prompts"], c["seed"]) for c in fleet.calls] == [(1, 10), (1, 11), (1, 10), (1, 10)]
    assert again.records == report.records
    assert {n: _without_time(f) for n, f in again.figures.items()} == {n: _without_time(f) for n, f in report.figures.items()}


def test_report_files_table_and_flat_metrics(scripted, tmp_path):
    _, _, report, _, _ = scripted
    paths = report.save(tmp_path / "out")
    saved = json.loads(paths["report"].read_text())
    assert saved["benchmarks"] == report.figures and saved["settings"]["benchmarks"]["gpqa"]["kind"] == "multiple_choice"
    assert [json.loads(line) for line in paths["samples"].read_text().splitlines()] == report.records
    table = report.table().splitlines()
    assert table[0] == ("| benchmark | kind | problems | avg@4 | pass@4 | maj@4 | tokens mean | tokens p95 "
                        "| truncated | wall s |")
    assert table[2].startswith("| math | math | 2 | 37.5 | 100.0 | 50.0 | ")
    assert table[3].startswith("| gpqa | multiple_choice | 1 | 50.0 | 100.0 | 100.0 | ")
    assert table[4].startswith("| code | code | 1 | 25.0 | 100.0 | – | ")
    assert paths["table"].read_text() == report.table() + "\n"
    assert report.metrics()["eval/math/maj@4"] == 0.5


def test_prompts_carry_one_bos_with_either_template():
    from tokenizers import processors

    from orz.data.templates import encode_prompt

    tokenizer = char_tokenizer(["What is 1 + 2?\nPut the final answer in \\boxed{}. UserAssistant:"])
    bos = tokenizer.bos_token_id
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for name in ("think_answer", "chat"):  # the tokenizer adds it; the chat template writes it
        ids = encode_prompt(tokenizer, make_template(name, tokenizer), "What is 1 + 2?")
        assert ids[0] == bos and ids[1] != bos, name


def test_config_checks_name_the_offending_values():
    with pytest.raises(ValueError, match=r"k must be in 1..n=4; got ks=\[8\]"):
        EvalConfig(n=4, ks=(8,))
    assert EvalConfig(n=4, ks=(2,)).pass_ks == (2, 4)  # n always: the table shows pass@n and maj@n
    from orz.reward.math import MathRewardConfig

    with pytest.raises(ValueError, match="format_reward=0"):
        EvalConfig(reward=RouterConfig(math=MathRewardConfig(format_reward=0.1)))


def _without_time(figures):
    return {k: v for k, v in figures.items() if k != "wall_s"}


# ---- the CLI on the tiny model -------------------------------------------------------------


def test_bad_benchmark_file_stops_before_any_engine_starts(tiny_model, tmp_path, capsys):
    bad = tmp_path / "aime.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n" + json.dumps({"prompt": "2+2?"}) + "\n")
    assert main(["--model", tiny_model, "--data", f"aime={bad}", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"error: {bad}, row 2: no answer" in err


def test_bad_settings_are_usage_errors(tiny_model, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", tiny_model, "--data", f"a={tmp_path / 'a.jsonl'}", "--n", "4", "--k", "8"])
    assert exit_.value.code == 2 and "every k must be in 1..n=4; got ks=[8]" in capsys.readouterr().err


def test_a_megatron_checkpoint_is_converted_for_the_engines(tiny_model, tmp_path):
    from orz.convert import hf2mcore
    from orz.models.checkpoint import HFCheckpoint

    mcore = hf2mcore(tiny_model, tmp_path / "mcore", tp=1, pp=1)
    hf_dir, tokenizer_dir = resolve_model(mcore, None, tmp_path / "work")  # the tokenizer hf2mcore kept
    assert tokenizer_dir == str(mcore / "hf_files")
    assert load_tokenizer(hf_dir).get_vocab() == load_tokenizer(tiny_model).get_vocab()
    shutil.rmtree(mcore / "hf_files")  # as a trainer's checkpoint: no tokenizer beside it
    with pytest.raises(ModelConfigError, match="pass --tokenizer"):
        resolve_model(mcore, None, tmp_path / "work2")
    hf_dir, tokenizer_dir = resolve_model(mcore, tiny_model, tmp_path / "work3")
    assert tokenizer_dir == tiny_model and load_tokenizer(hf_dir).get_vocab() == load_tokenizer(tiny_model).get_vocab()
    original, converted = HFCheckpoint(tiny_model), HFCheckpoint(hf_dir)
    assert sorted(original.keys()) == sorted(converted.keys())
    assert all(torch.equal(original.get(k), converted.get(k)) for k in original.keys())
    assert resolve_model(tiny_model, None, tmp_path) == (tiny_model, tiny_model)
    with pytest.raises(ModelConfigError, match="neither an HF directory"):
        resolve_model(tmp_path, None, tmp_path)


@pytest.mark.slow
def test_cli_writes_table_json_jsonl_equal_to_the_evaluator_called_directly(ray_cluster, tiny_model, tmp_path):
    from orz.rollout.fleet import EngineFleet, FleetConfig

    arith = write_jsonl(tmp_path / "arith.jsonl", [{"prompt": f"{a} + {b} = ?", "answer": str(a + b)}
                                                    for a, b in ((1, 2), (30, 12), (7, 7))])
    choice = tmp_path / "choice.json"
    choice.write_text(json.dumps([{"question": "2 + 2 = ?", "choices": ["3", "4", "5"], "answer": "B"},
                                  {"question": "1 + 0 = ?", "choices": ["1", "0"], "answer": 0}]))
    out = tmp_path / "out"
    sampling = ["--n", "3", "--temperature", "1.0", "--top-p", "0.9", "--max-tokens", "12", "--seed", "5"]
    command = [sys.executable, "-m", "orz.eval", "--model", tiny_model, "--data", f"arith={arith}",
               "--data", f"choice={choice}", *sampling, "--out", str(out), "--engines", "1",
               "--max-model-len", "512", "--kv-cache-gib", "1", "--no-progress",
               "--ray-address", ray_cluster.get_runtime_context().gcs_address]
    # The CLI and the direct run start their engines side by side: the test waits for one start, not two.
    cli = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    fleet = EngineFleet(tiny_model, FleetConfig(num_engines=1, engine_args={"max_model_len": 512}, kv_cache_gib=1), seed=5)
    try:
        benchmarks = [load_benchmark("arith", arith), load_benchmark("choice", choice)]
        cfg = EvalConfig(n=3, temperature=1.0, top_p=0.9, max_new_tokens=12, seed=5)
        with Evaluator(fleet, load_tokenizer(tiny_model), make_template("think_answer"), benchmarks, cfg, progress=False) as ev:
            direct = ev.run()
    finally:
        fleet.shutdown()
        try:
            stdout, stderr = cli.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            cli.kill()
            raise
    assert cli.returncode == 0, stderr[-4000:]
    table = stdout.splitlines()
    assert table[0].startswith("| benchmark | kind | problems | avg@3 | pass@3 | maj@3 |")
    assert table[2].startswith("| arith | math | 3 | ") and table[3].startswith("| choice | multiple_choice | 2 | ")
    saved = json.loads((out / "report.json").read_text())
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(records) == (3 + 2) * 3 and (out / "table.md").is_file()
    assert saved["settings"]["model"] == tiny_model and saved["settings"]["engines"] == 1
    assert not [p for p in out.iterdir() if p.name.startswith(".model-")]  # the work directory is gone

    assert records == direct.records
    assert {n: _without_time(f) for n, f in saved["benchmarks"].items()} == {n: _without_time(f) for n, f in direct.figures.items()}
    assert {k: saved["settings"][k] for k in direct.settings} == json.loads(json.dumps(direct.settings))
    assert any(r["response_tokens"] > 0 for r in records)

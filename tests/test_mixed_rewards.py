"""End to end: Skywork-OR1's math + code mixture, in its own parquet format, trains through the
command line without conversion; each source's rewards are logged, code responses really run in
the sandbox, and a code evaluation set reports pass@k beside the math one."""
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from orz.train import main as cli
from run_history import history

pytestmark = pytest.mark.slow


def _skywork_rows():
    """Skywork-OR1's published row format: chat prompt, `reward_model.ground_truth` as the string of a
    Python list (math) or as JSON text of stdin/stdout tests (code)."""
    rows = []
    for a in range(4):
        for b in range(2):
            rows.append({"data_source": "train-math-tiny", "ability": "math", "extra_info": {"index": len(rows)},
                         "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                         "reward_model": {"style": "rule", "ground_truth": str([str(a + b)])}})
            rows.append({"data_source": "train-code-tiny", "ability": "code", "extra_info": {"index": len(rows)},
                         "prompt": [{"role": "user", "content": f"Print {a} + {b}."}],
                         "reward_model": {"style": "rule", "ground_truth": json.dumps(
                             {"inputs": [""], "outputs": [str(a + b)]})}})
    return rows


def test_skywork_math_and_code_mixture_trains_through_the_cli(ray_cluster, tiny_run, tmp_path):
    data = tmp_path / "skywork_or1_tiny.parquet"
    pq.write_table(pa.Table.from_pylist(_skywork_rows()), data)
    out = tmp_path / "run"
    overrides = [*tiny_run(out, "grpo", iterations=2), f"data.train=[{data}]",
                 "data.eval={arith: 'synthetic:arithmetic', code: 'synthetic:code'}",
                 # The random model never writes a fenced block: its whole answer is the program.
                 "reward.code.extraction=response", "trainer.save_every=0",
                 "data.prompt_max_tokens=512"]  # the code prompts are longer than the arithmetic ones
    assert cli(overrides) == 0
    rows = history(out)
    for row in rows[1:]:  # a verifier absent from a batch logs nothing
        math, code = row.get("reward/math/count", 0), row.get("reward/code/count", 0)
        assert math + code == 16  # 4 prompts × 4 samples
        assert row.get("reward/source/train-math-tiny/count", 0) == math
        assert row.get("reward/source/train-code-tiny/count", 0) == code
    assert all(sum(row.get(f"reward/{kind}/count", 0) for row in rows) > 0 for kind in ("math", "code"))
    code = [row for row in rows[1:] if row.get("reward/code/count")]
    assert code and sum(row["reward/code/executed"] for row in code) > 0  # programs ran in the sandbox
    assert sum(row["reward/code/cpu_s"] for row in code) > 0
    assert "eval_greedy/code/pass@1" in rows[0] and "eval_greedy/arith/pass@1" in rows[-1]
    samples = [json.loads(line) for line in (out / "eval/eval_greedy_iter_000000/samples.jsonl").read_text().splitlines()]
    code_samples = [s for s in samples if s["benchmark"] == "code"]
    assert code_samples and all(s["extracted"] is not None or s["finish_reason"] != "stop" for s in code_samples)


@pytest.mark.parametrize("row, problem", [
    ({"prompt": "q", "verifier": "poetry"}, r"row 2: unknown verifier 'poetry'"),
    ({"prompt": "q", "verifier": "code"}, r"row 2: a code row needs tests"),
    ({"prompt": [{"role": "user", "content": "q"}], "ability": "code",
      "reward_model": {"ground_truth": json.dumps({"inputs": ["1"]})}}, r"row 2: code tests need 'inputs' and 'outputs'"),
])
def test_a_bad_row_stops_the_run_before_anything_starts(tiny_run, tmp_path, capsys, row, problem):
    data = tmp_path / "mixed.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n" + json.dumps(row) + "\n")
    out = tmp_path / "run"
    assert cli([*tiny_run(out, "grpo"), f"data.train=[{data}]"]) == 2
    assert re.search(f"error: {re.escape(str(data))}, {problem}", capsys.readouterr().err)
    assert not out.exists()  # no output directory, no worker, no Ray

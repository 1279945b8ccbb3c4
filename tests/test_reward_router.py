"""The reward router: responses known to be right and wrong for every verifier score as they should
through the path the trainer takes (rows from the loader, real math-verify pool and sandbox), custom
functions and HTTP endpoints with their timeouts and errors, weights, and the refusals."""
import http.server
import json
import sys
import textwrap
import threading
import time

import pytest

from orz.config import load_config
from orz.data.datasets import DatasetFormatError, parse_rows
from orz.reward.router import RewardRouter, RouterConfig, reward_metrics

FENCE = "```"


def _rows(*raw):
    return parse_rows("test.jsonl", enumerate(raw, start=1))


def _code(body):
    return f"<think> easy </think> {FENCE}python\n{body}\n{FENCE}"


ROWS = _rows(
    {"prompt": "1/2 + 1/2?", "answer": "['1', '\\\\frac{2}{2}']", "data_source": "m"},
    {"prompt": "Pick.", "choices": ["a", "b", "c"], "answer": "B", "data_source": "mc"},
    {"prompt": "Add.", "verifier": "code", "tests": {"inputs": ["1 2\n"], "outputs": ["3\n"]}, "data_source": "stdio"},
    {"prompt": "f", "verifier": "code", "tests": {"inputs": [[[1, 2]]], "outputs": [[3]], "fn_name": "total"},
     "data_source": "call"},
    {"prompt": "g", "data_source": "humaneval", "reward_model": {"ground_truth": json.dumps(
        {"import_prefix": "", "entry_point": "add", "test_code": "def check(f):\n    assert f(1, 2) == 3\n    assert f(2, 2) == 4"})}},
    {"prompt": "h", "data_source": "mbpp", "reward_model": {"ground_truth": {"assert_case": ["assert add(1, 2) == 3"]}}},
    {"prompt": "Using 3, 4 make 12.", "verifier": "countdown", "extra_info": {"numbers": [3, 4], "target": 12}},
)
RIGHT = ["<answer>1</answer>", "<answer>B</answer>", _code("a, b = map(int, input().split())\nprint(a + b)"),
         _code("def total(xs):\n    return sum(xs)"), _code("def add(a, b):\n    return a + b"),
         _code("def add(a, b):\n    return a + b"), "<answer>3*4</answer>"]
WRONG = ["<answer>2</answer>", "<answer>C</answer>", _code("print(4)"), _code("def total(xs):\n    return 0"),
         _code("def add(a, b):\n    return a * b"), _code("def add(a, b):\n    return a - b"), "<answer>3+4</answer>"]


@pytest.fixture(scope="module")
def router():
    with RewardRouter(RouterConfig(), ROWS) as r:
        yield r


def test_known_responses_score_right_and_wrong_for_every_verifier(router):
    right = router.score(RIGHT, ROWS)
    wrong = router.score(WRONG, ROWS)
    assert [v.score for v in right] == [1.0] * len(ROWS), [(v.verifier, v.statuses) for v in right]
    assert [v.score for v in wrong] == [0.0] * len(ROWS)
    assert [v.verifier for v in right] == ["math", "multiple_choice", "code", "code", "code", "code", "countdown"]
    assert right[0].extracted == "1" and right[1].extracted == "B" and right[2].extracted.startswith("a, b")
    assert (right[4].tests_run, right[4].tests_passed) == (2, 2)  # one process per check line
    assert (wrong[4].tests_run, wrong[4].tests_passed) == (1, 0)  # all_pass stops at the first failure
    metrics = reward_metrics(right + wrong)
    assert metrics["reward/accuracy"] == 0.5 and metrics["reward/code/accuracy"] == 0.5
    assert metrics["reward/code/executed"] == 8.0 and metrics["reward/code/count"] == 8.0
    assert metrics["reward/source/humaneval/accuracy"] == 0.5 and metrics["reward/source/m/count"] == 2.0
    assert metrics["reward/code/cpu_s"] > 0 and metrics["reward/math/errors"] == 0.0


def test_a_solution_that_exits_early_does_not_pass_check_tests(router):
    """Check-mode tests pass when the check code runs to its end, not when the process exits 0."""
    rows = [ROWS[4], ROWS[5]]  # a check(fn) harness, assert lines
    for cheat in ("import os\nos._exit(0)", "import sys\nsys.exit(0)", "raise SystemExit"):
        assert [v.score for v in router.score([_code(cheat)] * 2, rows)] == [0.0, 0.0], cheat


def test_truncated_responses_score_zero_without_running(router):
    verdicts = router.score(RIGHT, ROWS, ["length"] * len(ROWS))
    assert [v.score for v in verdicts] == [0.0] * len(ROWS)
    assert {v.status for v in verdicts} == {"truncated"} and verdicts[0].extracted == "1"  # recorded, not judged
    assert reward_metrics(verdicts)["reward/code/executed"] == 0.0


def test_submits_overlap_and_keep_their_order(router):
    pending = [router.submit(RIGHT, ROWS), router.submit(WRONG, ROWS)]
    assert [v.score for v in pending[1].result()] == [0.0] * len(ROWS)
    assert [v.score for v in pending[0].result()] == [1.0] * len(ROWS)


@pytest.fixture(scope="module")
def user_rewards(tmp_path_factory):
    """A user's reward module on sys.path, as a user would bring one."""
    root = tmp_path_factory.mktemp("user_rewards")
    (root / "my_rewards.py").write_text(textwrap.dedent("""
        import time

        def brevity(response, row):
            return {"score": float(len(response) <= 20), "chars": len(response)}

        def numpy_score(response, row):
            import numpy
            return {"score": numpy.float32(1.0), "passed": True}

        def crashes(response, row):
            raise RuntimeError("a bug in the user's reward")

        def sleeps(response, row):
            time.sleep(30)
            return 1.0

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            # verl's signature, unchanged
            return float(str(ground_truth) in solution_str) if data_source == "verl" else 0.0
    """))
    (root / "broken_rewards.py").write_text("import not_a_module_anywhere\n")
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))


def test_custom_functions_weights_errors_and_timeouts(user_rewards):
    rows = _rows({"prompt": "q", "verifier": "verl", "answer": "42", "data_source": "verl"},
                 {"prompt": "q", "verifier": "crashes"}, {"prompt": "q", "verifier": "sleeps"},
                 {"prompt": "1+1?", "answer": "2"}, {"prompt": "q", "verifier": "numpy"})
    # The run's own keys (reward.custom_workers and custom_timeout_s off their defaults, 2 and 10 s)
    reward = load_config(None, [
        "reward.custom={verl: 'my_rewards:compute_score', crashes: 'my_rewards:crashes', sleeps: 'my_rewards:sleeps', "
        "brevity: 'my_rewards:brevity', numpy: 'my_rewards:numpy_score'}", "reward.weights={brevity: 0.5, math: 2.0}",
        "reward.custom_timeout_s=3", "reward.custom_workers=3"]).reward
    responses = ["it is 42", "x", "y", "<answer>2</answer> and a long tail of words", "a long response, not brief"]
    start = time.monotonic()
    with RewardRouter.from_config(reward, rows) as router:
        assert (router.functions.pool.num_workers, router.functions.pool.item_timeout_s) == (3, 3.0)
        verdicts = router.score(responses, rows)
    assert time.monotonic() - start < 20  # the sleeper was killed at its timeout
    # verl: 1 + 0.5 brevity; crash: 0 + 0.5; timeout: 0 + 0.5; math: 2·1 + 0 (long response); numpy: 1 + 0
    assert [v.score for v in verdicts] == [1.5, 0.5, 0.5, 2.0, 1.0]
    assert [v.status for v in verdicts] == ["ok", "error", "timeout", "ok", "ok"]
    metrics = reward_metrics(verdicts)
    assert metrics["reward/crashes/errors"] == 1.0 and metrics["reward/sleeps/timeouts"] == 1.0
    assert metrics["reward/brevity/mean"] == 0.6 and metrics["reward/brevity/chars/mean"] == pytest.approx(
        sum(map(len, responses)) / 5)
    assert metrics["reward/brevity/timeouts"] == 0.0 and metrics["reward/numpy/passed/mean"] == 1.0


def test_custom_reward_refusals_name_the_key_and_module(user_rewards):
    with pytest.raises(ValueError, match=r"reward.custom.judge: cannot import module 'broken_rewards' "
                                         r"\(from 'broken_rewards:score'\): ModuleNotFoundError"):
        RouterConfig(custom={"judge": "broken_rewards:score"})
    with pytest.raises(ValueError, match=r"reward.custom.judge: module 'my_rewards' .* has no function 'nope'"):
        RouterConfig(custom={"judge": "my_rewards:nope"})
    with pytest.raises(ValueError, match="is not 'package.module:function' nor an http"):
        RouterConfig(custom={"judge": "my_rewards"})
    with pytest.raises(ValueError, match=r"reward.custom.math: 'math' is a built-in verifier"):
        RouterConfig(custom={"math": "my_rewards:brevity"})
    with pytest.raises(ValueError, match=r"reward.weights names \['length'\]"):
        RouterConfig(weights={"length": -0.1})


def test_a_row_with_an_unknown_verifier_names_its_file_and_row():
    rows = _rows({"prompt": "q", "answer": "1"}, {"prompt": "q", "verifier": "poetry"})
    with pytest.raises(DatasetFormatError, match=r"test.jsonl, row 2: unknown verifier 'poetry'.*reward.custom"):
        RewardRouter(RouterConfig(), rows)


class _Scores(http.server.BaseHTTPRequestHandler):
    """Scores 1 for responses that mention the row's answer; sleeps when asked to."""

    batches = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Scores.batches.append(len(body["responses"]))
        if any("slow" in r for r in body["responses"]):
            time.sleep(3)
        scores = [float(row["answers"][0] in text) for text, row in zip(body["responses"], body["rows"])]
        reply = json.dumps({"rewards": scores}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def test_an_http_endpoint_on_loopback_is_batched_and_timed_out():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scores)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    rows = _rows(*[{"prompt": f"q{i}", "verifier": "remote", "answer": str(i)} for i in range(5)])
    cfg = RouterConfig(custom={"remote": url}, custom_timeout_s=1.5, endpoint_batch_size=2)
    try:
        with RewardRouter(cfg, rows) as router:
            verdicts = router.score(["0", "no", "2", "3", "4"], rows)
            assert [v.score for v in verdicts] == [1.0, 0.0, 1.0, 1.0, 1.0]
            assert sorted(_Scores.batches) == [1, 2, 2]
            slow = router.score(["0", "1", "slow", "3", "4"], rows)
            assert [v.status for v in slow][2:4] == ["timeout", "timeout"]  # that batch, not the others
            assert [v.score for v in slow] == [1.0, 1.0, 0.0, 0.0, 1.0]
        with RewardRouter(RouterConfig(custom={"remote": "http://127.0.0.1:9/none"}), rows) as router:
            down = router.score(["0"] * 5, rows)
            assert {v.status for v in down} == {"error"} and reward_metrics(down)["reward/remote/errors"] == 5.0
    finally:
        server.shutdown()


def test_a_custom_result_without_score_is_an_error_not_a_crash(user_rewards):
    from orz.reward.custom import call

    (user_rewards / "bad_dict.py").write_text("def f(response, row):\n    return {'value': 1}\n")
    with pytest.raises(ValueError, match="needs 'score'"):
        call(("bad_dict:f", "x", {}))

"""Multi-turn rollout: the environment protocol, the python tool in the real sandbox, observation
tokens out of the actor's loss, refusals before start, and one tiny `orz train` run (python tool
and a user environment by import path, side by side) whose dumps are checked token by token."""
import ast
import functools
import json
import os
import queue
import signal
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orz.config import ConfigError, RolloutConfig, load_config
from orz.ppo.core_algos import actor_loss
from orz.ppo.experience import experience_from_rollouts
from orz.rollout.agent_loop import TurnLimits
from orz.rollout.envs import StepResult, as_step_result
from orz.rollout.python_tool import PYTHON_FUNCTION, PythonTool, ToolFormat, closed_block, prompt_tools, tool_format

TESTS = os.path.dirname(__file__)
sys.path.insert(0, TESTS)  # turn_envs, shaped_reward: by import path, as a user's module
from jsonl_files import write_jsonl  # noqa: E402
from turn_envs import digit_share  # noqa: E402

# A tokenizer of few characters (the prompts' other characters read as <unk>), so that a random
# model opens and closes code blocks by chance; "</code>\n<output>" merges the end of a model turn
# with the start of the python tool's observation when the joined text is re-tokenised.
TAGS = ("<think>", "<code>", "</code>", "<output>", "</output>", "</code>\n<output>")
MERGED = "</code>\n<output>"
# A chat template in Qwen3's layout: the tools' schemas in a system turn, a tool message as a user
# turn in <tool_response>; what it writes around a tool message's content, read off it by hand:
CHAT_TAGS = ("<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\n' }}</tools><|im_end|>{{ '\n' }}{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>{{ '\n' }}{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{{ '\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}{% endif %}")
BEFORE_OUTPUT = "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
AFTER_OUTPUT = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_step_results_from_plain_dicts():
    assert as_step_result({"observation": "hi", "reward": 1, "done": False}) == StepResult("hi", 1.0, False)
    assert as_step_result({"done": True}) == StepResult(None, None, True)
    for bad in ({"observation": "x"}, {"done": True, "score": 1}, {"done": False, "observation": 3}, ("x", 1, True)):
        with pytest.raises(TypeError):
            as_step_result(bad)


def test_python_tool_runs_the_closed_block_in_the_sandbox():
    import time

    from orz.reward.sandbox import Sandbox, SandboxLimits

    assert closed_block("a<code>print(1)</code>", "<code>", "</code>") == "print(1)"
    assert closed_block("a<code>print(1)", "<code>", "</code>") is None  # never closed: the turn ran out
    assert closed_block("no block</code>", "<code>", "</code>") is None
    tool = PythonTool(Sandbox(SandboxLimits()), timeout_s=1.0, max_chars=40)
    ok = tool.step("so <code>print(6 * 7)</code>")
    assert ok.observation == "\n<output>\n42\n\n</output>\n" and not ok.done
    assert ok.counts == {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0, "tool_format_errors": 0}
    error = tool.step("<code>1/0</code>")
    assert error.counts["tool_errors"] == 1 and "[output cut]" in error.observation  # the traceback, cut to 40
    assert len(error.observation) == 40
    started = time.monotonic()
    hung = tool.step("<code>while True: pass</code>")
    # ended by tool_timeout_s (1 s wall clock), not by the sandbox's 5 s CPU limit: a timeout and an error
    assert 1.0 <= time.monotonic() - started < 5.0 and "timed out after 1 s" in hung.observation
    assert hung.counts == {"tool_calls": 1, "tool_errors": 1, "tool_timeouts": 1, "tool_format_errors": 0}
    assert not hung.done
    assert tool.step("the answer is 42").done  # no code: the sample ends


def test_chat_format_calls_python_in_json_and_answers_in_the_templates_tool_message():
    """rollout.tool_format=chat: the prompt shows the python function's schema; a JSON call runs,
    its output comes back inside the chat template's tool message; a malformed call is answered
    with what is wrong, counted, and takes the format reward back."""
    from orz.data.templates import make_template
    from orz.data.tokenizers import char_tokenizer
    from orz.reward.sandbox import Sandbox, SandboxLimits

    tokenizer = char_tokenizer([string.printable], extra_tokens=CHAT_TAGS)
    tokenizer.chat_template = CHAT_TEMPLATE
    chat = RolloutConfig(tool_format="chat", tool_format_reward=0.5)
    assert f"<tools>\n{json.dumps(PYTHON_FUNCTION)}\n</tools>" in make_template("chat", tokenizer,
                                                                              tools=prompt_tools(chat)).prompt("2+2?")
    assert "<tools>" not in make_template("chat", tokenizer, tools=prompt_tools(RolloutConfig())).prompt("2+2?")
    tool = PythonTool(Sandbox(SandboxLimits()), 1.0, 200, tool_format(chat, tokenizer), chat.tool_format_reward)
    ok = tool.step('I compute <tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>')
    assert ok.observation == BEFORE_OUTPUT + "42\n" + AFTER_OUTPUT and not ok.done
    assert ok.counts == {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0, "tool_format_errors": 0}
    assert ok.reward == 0.5  # one call, well formed
    as_text = tool.step('<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    assert as_text.observation == BEFORE_OUTPUT + "1\n" + AFTER_OUTPUT and as_text.reward is None  # still 0.5 in all
    for call, error in (('{"name": "python", "arguments": {"program": "1"}}', 'arguments must hold "code"'),
                        ('{"name": "bash", "arguments": {"code": "ls"}}', 'must be {"name": "python"'),
                        ('{"name": "python", "arguments": {"code": "print(1)"}', "not JSON")):
        bad = tool.step(f"<tool_call>{call}</tool_call>")
        assert bad.observation.startswith(BEFORE_OUTPUT + "error: ") and error in bad.observation
        assert bad.counts == {"tool_calls": 1, "tool_errors": 1, "tool_timeouts": 0, "tool_format_errors": 1}
    assert tool.rewarded == 0.0  # the first malformed call took the 0.5 back (its step's reward: -0.5)
    assert tool.step("<code>print(1)</code>").done  # a code block is no call in the chat format
    # The code format: a block that does not compile still runs (the model reads Python's message),
    # and counts as malformed.
    code = PythonTool(Sandbox(SandboxLimits()), 1.0, 400, ToolFormat(), format_reward=1.0)
    assert code.step("<code>print(2)</code>").reward == 1.0
    broken = code.step("<code>print(1</code>")
    assert "SyntaxError" in broken.observation and broken.counts["tool_format_errors"] == 1 and broken.reward == -1.0


def test_observation_tokens_carry_no_loss_and_no_gradient():
    """Through the real actor loss: logits at an observation position change neither the loss nor
    any gradient; the mask is 0 exactly there."""
    experience = experience_from_rollouts([[5, 6]], [[7, 8, 9, 10, 11]], [[-1.0, -1.1, 0.0, 0.0, -0.9]],
                                          loss_masks=[[1, 1, 0, 0, 1]])
    assert experience.response_mask.tolist() == [[1, 1, 0, 0, 1]]
    response = experience.sequences[:, 2:7]  # (1, T)
    old = experience.rollout_logprobs
    advantages = torch.tensor([[1.0, -2.0, 3.0, 4.0, 0.5]])

    def loss_and_grad(logits):
        logits = logits.clone().requires_grad_()
        logprob = torch.log_softmax(logits, -1).gather(-1, response[..., None])[..., 0]  # (1, T)
        loss, _ = actor_loss(logprob, old, advantages, experience.response_mask, rollout_logprob=old,
                             is_level="token", is_cap=2.0, entropy=torch.ones_like(logprob), entropy_coef=0.1,
                             ref_logprob=old - 0.2, kl_coef=0.5, kl_kind="k3")
        loss.backward()
        return loss.detach(), logits.grad

    logits = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(0))
    changed = logits.clone()
    changed[0, 2:4] = torch.randn(2, 16, generator=torch.Generator().manual_seed(1)) * 5  # observation positions
    (loss, grad), (loss2, grad2) = loss_and_grad(logits), loss_and_grad(changed)
    assert loss == loss2 and torch.equal(grad, grad2)
    assert grad[0, 2:4].abs().max() == 0 and grad[0, [0, 1, 4]].abs().min() > 0


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    from orz.data.tokenizers import char_tokenizer
    from orz.models.tiny import make_tiny_hf

    path = tmp_path_factory.mktemp("tool_llama")
    tokenizer = char_tokenizer(["0123456789+= \n"], extra_tokens=TAGS + CHAT_TAGS)
    assert tokenizer.encode(MERGED, add_special_tokens=False) == [tokenizer.convert_tokens_to_ids(MERGED)]
    tokenizer.chat_template = CHAT_TEMPLATE  # for the chat tool format (orz eval --template chat)
    tokenizer.save_pretrained(path)
    make_tiny_hf(path, vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2,
                 num_layers=2, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id)
    return str(path)


def _rows(path: Path, envs: list[str]) -> str:
    return str(write_jsonl(path, [{"prompt": f"{i}+{i}", "answer": str(2 * i), "env": env}
                                  for i, env in enumerate(envs, start=1)]))


def test_a_row_naming_an_unknown_environment_is_refused_naming_file_and_row(tool_model, tmp_path):
    from orz.data.datasets import DatasetFormatError
    from orz.run.run_rules import read_data

    rows = _rows(tmp_path / "rows.jsonl", ["python", "chess"])
    cfg = load_config(None, [f"model.path={tool_model}", f"data.train=[{rows}]"])
    with pytest.raises(DatasetFormatError, match=rf"{rows}, row 2: unknown environment 'chess'"):
        read_data(cfg)
    rows = _rows(tmp_path / "rows.jsonl", ["", ""])  # the python tool's settings where no row calls it
    cfg = load_config(None, [f"model.path={tool_model}", f"data.train=[{rows}]", "rollout.tool_format_reward=1"])
    with pytest.raises(ConfigError, match="rollout.tool_format_reward=1.0 shapes the python tool, which no row uses"):
        read_data(cfg)


# ---- end to end: one tiny run, three python rows, one user environment (Echo, never done: the
# turn limit ends it) and one that raises (Broken), with dynamic sampling and streaming rewards.
@pytest.fixture(scope="module")
def tool_run(ray_cluster, tool_model, tiny_run, tmp_path_factory):
    from orz.train import run as train
    from run_history import history

    out = tmp_path_factory.mktemp("tools")
    rows = _rows(out / "rows.jsonl", ["python", "python", "python", "echo", "broken"])
    heldout = _rows(out / "heldout.jsonl", ["echo", "echo"])
    train(load_config(None, [
        *tiny_run(out, "grpo", iterations=2, model=tool_model), f"data.train=[{rows}]", f"data.eval={{echo: {heldout}}}",
        "trainer.prompts_per_iteration=5", "rollout.stop=[]", "rollout.max_new_tokens=24", "rollout.max_turns=3",
        "rollout.max_observation_tokens=48", "rollout.envs={echo: 'turn_envs:Echo', broken: 'turn_envs:Broken'}",
        "reward.custom={digits: 'shaped_reward:digit_share'}", "reward.weights={digits: 1.0, math: 0.0, echo: 0.5}",
        "algorithm.dynamic_sampling=true", "algorithm.max_prompt_draws=2", "algorithm.entropy_coef=0",
        "trainer.dump_per_token=true", "trainer.save_every=0", "trainer.export_hf=false",
        "rollout.tool_format_reward=0.25"]))
    samples = out / "samples"
    draws = [[json.loads(line) for line in (samples / f"iter_{i:06d}_draws.jsonl").read_text().splitlines()]
             for i in (1, 2)]
    trained = [[json.loads(line) for line in (samples / f"iter_{i:06d}.jsonl").read_text().splitlines()] for i in (1, 2)]
    evaluations = [[json.loads(line) for line in path.read_text().splitlines()]
                   for path in sorted(out.glob("eval/eval_greedy_iter_*/samples.jsonl"))]
    return history(out)[1:], draws, trained, evaluations


@pytest.mark.slow
def test_the_trainers_evaluation_runs_the_rows_environment(tool_run, tool_model):
    """The held-out rows name Echo, which is never done: evaluated the way the run trains, each
    sample alternates model turns and Echo's " ok:" up to rollout.max_turns (3), before and after."""
    from orz.data.tokenizers import load_tokenizer

    ok = load_tokenizer(tool_model).encode(" ok:", add_special_tokens=False)
    evaluations = tool_run[3]
    assert len(evaluations) == 2  # before training and after
    for records in evaluations:
        assert len(records) == 2
        for record in records:
            assert [turn["origin"] for turn in record["turns"]] == ["model", "env", "model", "env", "model"]
            assert all(turn["ids"] == ok for turn in record["turns"] if turn["origin"] == "env")


def _model_text(sample) -> str:
    return "".join(turn["text"] for turn in sample["turns"] if turn["origin"] == "model")


def _calls_code(turn, opens: str = "<code>", closes: str = "</code>") -> bool:
    """A model turn that closes a block opened in it (rechecked here with string operations)."""
    return turn["origin"] == "model" and turn["text"].endswith(closes) and opens in turn["text"][: -len(closes)]


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except SyntaxError:
        return False
    return True


@pytest.mark.slow
def test_turns_tools_errors_and_scores_as_the_dumps_say(tool_run):
    rows, draws, _, _ = tool_run
    format_rewards = {True: 0, False: 0}  # python samples with and without the format reward
    for row, drawn in zip(rows, draws):
        turns = [sum(turn["origin"] == "model" for turn in sample["turns"]) for sample in drawn]
        assert row["rollout/turns_mean"] == pytest.approx(sum(turns) / len(turns))
        assert row["rollout/turns_max"] == max(turns) == 3  # Echo is never done: rollout.max_turns ends it
        assert all(n == 3 for n, sample in zip(turns, drawn) if sample["env"] == "echo")
        python = [sample for sample in drawn if sample["env"] == "python"]
        assert row["rollout/tool_calls"] == sum(_calls_code(turn) for sample in python for turn in sample["turns"])
        for sample in python:  # an observation follows a call, unless the call was the last turn
            for turn, after in zip(sample["turns"], sample["turns"][1:]):
                assert (after["origin"] == "env") == _calls_code(turn)
                assert after["origin"] == "model" or after["text"].startswith("\n<output>\n")
        broken = [sample for sample in drawn if sample["env"] == "broken"]
        assert row["rollout/env_errors"] == len(broken) > 0
        assert all(s["env_error"] == "step: RuntimeError: broken on purpose" and s["score"] == 0 for s in broken)
        # The verifier reads the model's own text (digit share, weight 1); Echo adds 0.5 × Σ its
        # per-turn rewards (each model turn's digit share); the python tool adds its format reward
        # (0.25, weight 1) when the sample's calls, one or more, all parse; tool outputs count for nothing.
        echo_rewards, malformed = [], 0
        for sample in drawn:
            assert sample["response"] == _model_text(sample)
            model_turns = [turn["text"] for turn in sample["turns"] if turn["origin"] == "model"]
            env_reward = sum(map(digit_share, model_turns)) if sample["env"] == "echo" else 0.0
            echo_rewards += [env_reward] if sample["env"] == "echo" else []
            if sample["env"] == "python":
                parsed = [_parses(closed_block(turn["text"], "<code>", "</code>"))
                          for turn in sample["turns"] if _calls_code(turn)]
                malformed += parsed.count(False)
                format_rewards[bool(parsed) and all(parsed)] += 1
                env_reward = 0.25 * (bool(parsed) and all(parsed))
            weight = 0.5 if sample["env"] == "echo" else 1.0
            expected = 0.0 if sample["env"] == "broken" else digit_share(_model_text(sample)) + weight * env_reward
            assert sample["score"] == pytest.approx(expected, abs=1e-6)
        assert row["rollout/tool_format_errors"] == malformed
        assert row["reward/env/echo/mean"] == pytest.approx(sum(echo_rewards) / len(echo_rewards), abs=1e-6)
        env_tokens = sum(len(turn["ids"]) for sample in drawn for turn in sample["turns"] if turn["origin"] == "env")
        assert row["rollout/env_token_frac"] == pytest.approx(env_tokens / sum(s["length"] for s in drawn))
    assert sum(row["rollout/tool_calls"] for row in rows) > 0  # the premise: the python tool ran
    assert format_rewards[True] > 0 and format_rewards[False] > 0  # ... and some samples earned the format reward
    assert all(row["rollout/draws"] == 2 for row in rows)  # Broken's groups (all 0) were dropped, more drawn


@pytest.mark.slow
def test_trained_tokens_are_the_engines_own_across_turns(tool_run, tool_model):
    """The trained ids are each turn's ids joined, the loss mask 0 exactly on the environments'
    tokens, and the trainer's log-probs of the model's tokens equal the engine's (1e-3, fp32).
    Re-tokenising the joined text would merge a turn's "</code>" with its observation's
    "\n<output>" into one token: it differs."""
    from orz.data.tokenizers import load_tokenizer

    rows, draws, trained, _ = tool_run
    tokenizer, boundaries = load_tokenizer(tool_model), 0
    close = tokenizer.convert_tokens_to_ids("</code>")
    for row, drawn, batch in zip(rows, draws, trained):
        kept = [sample for sample in drawn if sample["kept"]]
        assert len(kept) == len(batch) == 20
        for sample, record in zip(kept, batch):
            ids = [i for turn in sample["turns"] for i in turn["ids"]]
            mask = [float(turn["origin"] == "model") for turn in sample["turns"] for _ in turn["ids"]]
            assert record["response_ids"] == ids and record["response_mask"] == mask
            engine, trainer = torch.tensor(record["rollout_logprobs"]), torch.tensor(record["old_logprobs"])
            assert len(engine) == sum(mask) and (engine - trainer).abs().max() < 1e-3
            turns = sample["turns"]
            if any(turn["ids"][-1] == close and after["origin"] == "env" for turn, after in zip(turns, turns[1:])):
                boundaries += 1  # (a turn may also end with the merged token itself: its text is cut at "</code>")
                assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) != ids
        assert row["mismatch/logp_abs_diff_max"] < 1e-3 and row["actor/grad_norm"] > 0
    assert boundaries > 0  # the premise: a model turn closed a block and its output followed it


PROMPT_MAX, TURN, OBSERVATION, TURNS, BUFFER = 64, 16, 8, 3, 64  # the longest buffer allowed: 128 − 64


@pytest.fixture(scope="module")
def tool_teacher(tool_model, tmp_path_factory):
    """Another model with the tool model's tokenizer (one layer, other weights): a teacher."""
    from orz.models.tiny import make_tiny_hf
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tool_teacher")
    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    tokenizer.save_pretrained(path)
    make_tiny_hf(path, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=2,
                 num_layers=1, seed=1, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id)
    return str(path)


def _async_partial(tiny_run, tool_model, rows, teacher):
    """Overrides of a multi-turn run, asynchronous and partial, with the overlong penalty: Echo's
    rows and a user's agent loop's (Reviser), three turns, two sequences decoded at a time (so that
    the update interrupts the batch ahead mid-turn), a checkpoint every iteration; a teacher's
    reverse-KL term added to the task reward's advantages (docs/distillation.md); the actor trained
    through rank-8 LoRA adapters, which the engines serve (docs/lora.md): the tests below that
    compare the engine's log-probs with π_old on the actor's own tokens, continued conversations
    included, and resume the run, check that the adapter of every version arrived and came back."""
    def overrides(out):
        return [*tiny_run(out, "grpo", iterations=3, model=tool_model), f"data.train=[{rows}]", "data.eval={}",
                f"data.prompt_max_tokens={PROMPT_MAX}", "rollout.stop=[]", f"rollout.max_new_tokens={TURN}",
                f"rollout.max_turns={TURNS}", f"rollout.max_observation_tokens={OBSERVATION}",
                "rollout.envs={echo: 'turn_envs:Echo', revise: 'turn_envs:Reviser'}", "rollout.max_num_seqs=2",
                "reward.custom={digits: 'shaped_reward:digit_share'}",
                "reward.weights={digits: 1.0, math: 0.0, echo: 0.5, revise: 0.25}", "trainer.max_staleness=1", "rollout.partial=true",
                f"algorithm.overlong_buffer={BUFFER}", "trainer.dump_per_token=true", "trainer.export_hf=false",
                "trainer.keep_checkpoints=1", "trainer.keep_every=2", f"teachers.other.path={teacher}",
                "distill.task_reward=true", "distill.student_logprobs=engine", "distill.coef=0.5",
                "actor.lora.rank=8", "actor.lora.alpha=16", "actor.lr=5e-3", "actor.lora.targets=[linear_qkv, linear_fc2]"]

    return overrides


@pytest.fixture(scope="module")
def async_tool_run(ray_cluster, tool_model, tool_teacher, tiny_run, tmp_path_factory):
    from orz.train import run as train

    out = tmp_path_factory.mktemp("async_tools")
    overrides = _async_partial(tiny_run, tool_model, _rows(out / "rows.jsonl", ["echo"] * 6 + ["revise"] * 2),
                               tool_teacher)
    train(load_config(None, overrides(out / "whole")))
    return out / "whole", overrides


@pytest.mark.slow
def test_conversations_continued_across_the_update_train_with_the_overlong_penalty(async_tool_run):
    """Multi-turn, asynchronous (trainer.max_staleness=1) and partial: the update interrupts the
    batch ahead mid-turn, and each conversation keeps its finished turns and the tokens of its
    current turn, then goes on with the new weights, within the staleness bound. The per-token dump shows both versions inside
    one model turn, old tokens first; the tokens of the actor's own version have the engine's
    log-probs to 1e-3 (a continuation conditioned on anything but the ids so far would not), and
    the overlong penalty is each sample's model tokens against the context less its prompt
    (derived here from the settings)."""
    from run_history import history

    out, _ = async_tool_run
    metrics = history(out)[1:]
    assert all(row["actor/grad_norm"] > 0 for row in metrics)  # the premise: a signal to train on
    # The staleness bound holds with partial rollout: a sample's version is its oldest token's.
    assert [row["rollout/sample_weight_version"] for row in metrics] == [0, 0, 1]
    assert [row["rollout/staleness_max"] for row in metrics] == [0, 1, 1]
    assert metrics[0]["rollout/partial_samples"] == 0  # generated before any update
    # saved every iteration: the last one stays, and every second (trainer.keep_every=2)
    assert sorted(p.name for p in (out / "checkpoints").glob("iter_*")) == ["iter_000002", "iter_000003"]
    context = PROMPT_MAX + TURNS * TURN + (TURNS - 1) * OBSERVATION  # run_rules.context_length
    mixed, penalised = 0, 0
    for iteration in (1, 2, 3):
        samples = out / "samples"
        draws = [json.loads(line) for line in (samples / f"iter_{iteration:06d}_draws.jsonl").read_text().splitlines()]
        trained = [json.loads(line) for line in (samples / f"iter_{iteration:06d}.jsonl").read_text().splitlines()]
        kept = [d for d in draws if d["kept"]]
        assert len(kept) == len(trained) == 16
        assert metrics[iteration - 1]["rollout/partial_samples"] == sum(len(d["weight_versions"]) > 1 for d in kept)
        for draw, record in zip(kept, trained):
            ids = [i for t in draw["turns"] for i in t["ids"]]
            assert record["response_ids"] == ids  # every turn's ids, appended
            versions = record["info/token_version"]  # on the model's tokens
            assert versions == sorted(versions) and set(versions) <= {iteration - 2, iteration - 1} - {-1}
            at = 0
            for t in (t for t in draw["turns"] if t["origin"] == "model"):
                mixed += len(set(versions[at:at + len(t["ids"])])) == 2
                at += len(t["ids"])
            own = [k for k, v in enumerate(versions) if v == iteration - 1]  # the actor's weights at its forward
            engine, trainer = torch.tensor(record["rollout_logprobs"]), torch.tensor(record["old_logprobs"])
            assert ((engine[own] - trainer[own]).abs() < 1e-3).all()
            model_tokens, budget = sum(record["response_mask"]), context - len(record["prompt_ids"])
            penalty = max(-1.0, min(0.0, -(model_tokens - (budget - BUFFER)) / BUFFER))
            assert record["scores"] == pytest.approx(draw["score"] + penalty, abs=1e-5)
            penalised += penalty < 0
    assert mixed > 0, "no model turn was continued across the update"  # the premise
    assert 0 < penalised < 48  # the premise: the penalty bound, and not on every sample
    # The actor trained adapters on linear_qkv and linear_fc2 only (actor.lora.targets), as its checkpoint holds.
    from megatron.core.dist_checkpointing import load_tensors_metadata

    adapted = {key.split(".")[-2] for key in load_tensors_metadata(str(out / "checkpoints/iter_000003/actor"))
               if key.endswith(("lora_A", "lora_B"))}
    assert adapted == {"linear_qkv", "linear_fc2"}, adapted


@pytest.mark.slow
def test_a_users_agent_loop_trains_asynchronously_with_its_own_observation_ids(async_tool_run, tool_model):
    """The Reviser rows (rollout.envs names an agent loop: `async def run(sample)`) run the user's
    loop in the same run: a turn, its token count as the loop's own observation ids, a second
    turn, scored as the verifier says plus 0.25 × the loop's reward, and trained on exactly those
    ids with the observation out of the loss."""
    from orz.data.tokenizers import load_tokenizer

    out, _ = async_tool_run
    tokenizer, revised = load_tokenizer(tool_model), 0
    for iteration in (1, 2, 3):
        samples = out / "samples"
        draws = [json.loads(line) for line in (samples / f"iter_{iteration:06d}_draws.jsonl").read_text().splitlines()]
        trained = [json.loads(line) for line in (samples / f"iter_{iteration:06d}.jsonl").read_text().splitlines()]
        for draw, record in zip([d for d in draws if d["kept"]], trained):
            if draw["env"] != "revise":
                continue
            revised += 1
            first, note, second = draw["turns"]
            assert [t["origin"] for t in draw["turns"]] == ["model", "env", "model"]
            assert note["ids"] == tokenizer.encode(f" {len(first['ids'])}:", add_special_tokens=False)
            assert record["response_mask"] == [1.0] * len(first["ids"]) + [0.0] * len(note["ids"]) + [1.0] * len(second["ids"])
            expected = digit_share(first["text"] + second["text"]) + 0.25 * digit_share(second["text"])
            assert draw["score"] == pytest.approx(expected, abs=1e-6)
    assert revised > 0  # the premise: the loop's rows were drawn and kept


@pytest.mark.slow
def test_a_teacher_scores_the_models_tokens_of_each_conversation_and_adds_to_the_task_advantage(
        async_tool_run, tool_teacher):
    """The run above has a teacher (another model), distill.task_reward=true, coef 0.5 and the
    engine's log-probs as the student's: on every model token of every conversation (its
    observations in between) the teacher's log-prob is what transformers' forward of the teacher
    over the whole conversation gives there, and the advantage is the row's GRPO advantage (one
    value per row) plus 0.5·(log π_teacher − log π_engine)."""
    from transformers import AutoModelForCausalLM

    from run_history import history

    out, _ = async_tool_run
    assert all(f"distill/other/reverse_kl" in row for row in history(out)[1:])
    teacher = AutoModelForCausalLM.from_pretrained(tool_teacher, dtype=torch.float32)
    with_observations = 0
    for iteration in (1, 3):
        records = [json.loads(line) for line in (out / "samples" / f"iter_{iteration:06d}.jsonl").read_text().splitlines()]
        for record in records:
            prompt, response, mask = record["prompt_ids"], record["response_ids"], record["response_mask"]
            with_observations += 0.0 in mask
            with torch.no_grad():
                logp = torch.log_softmax(teacher(torch.tensor([prompt + response])).logits[0].double(), -1)
            at = [len(prompt) + t for t, m in enumerate(mask) if m]  # the model's tokens only
            reference = logp[[a - 1 for a in at], [(prompt + response)[a] for a in at]]
            got, engine = torch.tensor(record["teacher_logprobs"]), torch.tensor(record["rollout_logprobs"])
            torch.testing.assert_close(got.double(), reference, atol=1e-4, rtol=0)
            task = torch.tensor(record["advantages"]) - 0.5 * (got - engine)
            assert (task - task[0]).abs().max() < 1e-5 and (got - engine).abs().mean() > 0.1
    assert with_observations > 0  # the premise: conversations with an environment's tokens in them


@pytest.mark.slow
def test_the_async_multiturn_runs_timeline_holds_every_party_and_adds_up_to_its_metrics(async_tool_run, tool_model):
    """The run above (asynchronous, partial rollout, a teacher): timeline.json passes check_timeline,
    and has a lane for each party: the trainer's phases and the batch generated ahead, the actor's
    and the teacher's passes, the engine (busy, weight sync, turns in flight), the actor's send, the
    reward's verifiers and the two environments; goodput/* and mfu/* are in every row, mfu/generation
    the FLOPs of each batch's tokens worked by hand over the engine's busy time and peak. Its
    plan_vs_run.json holds the timeline's medians, and `orz plan --against` writes it again alike."""
    from run_history import history
    from timeline_checks import check_generation_mfu, check_plan_vs_run, check_timeline, lane_names, read_trace

    out, _ = async_tool_run
    rows = history(out)
    by_iteration = check_timeline(out, rows)
    events = read_trace(out / "timeline.json")
    lanes = set(lane_names(events).values())
    assert {"trainer/phases", "trainer/pipeline", "trainer/rollout", "trainer/checkpoint", "actor/rank 0",
            "teachers.other/rank 0", "engines/engine 0", "sync/actor", "environments/echo",
            "environments/revise"} <= lanes, lanes
    names = {(lane, e["name"]) for spans in by_iteration.values() for lane, e in spans}
    assert {("actor/rank 0", "update"), ("actor/rank 0", "optimizer step"), ("actor/rank 0", "backward"),
            ("teachers.other/rank 0", "teacher log-probs"), ("engines/engine 0", "busy"),
            ("engines/engine 0", "weight sync")} <= names
    assert any(e["ph"] == "C" and e["name"] == "engine 0: turns in flight" and e["args"]["value"] > 0 for e in events)
    assert any(lane.startswith("reward/") for lane in lanes)
    for row in rows[1:]:
        assert 0 <= row["goodput/engine_0"] <= 1 and 0 < row["goodput/actor"] <= 1 and 0 < row["goodput/machine"] <= 1
        assert row["mfu/update"] > 0 and row["perf/peak_flops_per_thread"] > 0
    assert max(row["goodput/engine_0"] for row in rows[1:]) > 0  # the last iteration generates nothing ahead
    assert check_generation_mfu(out, rows, by_iteration, tool_model) >= 2
    # The plan against the run: written at its end, and again by `orz plan --against` from its files alone.
    written = check_plan_vs_run(out, by_iteration, staleness=1)
    again = subprocess.run([sys.executable, "-m", "orz.cli", "plan", "--against", str(out)], capture_output=True,
                           text=True)
    assert again.returncode == 0, again.stderr
    assert "the plan against the run" in again.stdout and json.loads((out / "plan_vs_run.json").read_text()) == written


@pytest.mark.slow
def test_an_async_multiturn_run_killed_then_stopped_inside_iterations_resumes_every_prompt_once(
        async_tool_run, ray_cluster, tmp_path, capsys, monkeypatch):
    """The run above, killed (SIGKILL of its process group) inside iteration 2, resumed (`orz
    train`'s main, in this process) and stopped by SIGTERM inside iteration 2 again, in its update
    while batch 3's conversations are in flight: it exits 143 with
    its one line naming its last checkpoint. The same command resumes once more. After each
    resume the metrics rows up to its checkpoint are kept byte for byte and the later ones written
    again, and every iteration draws the uninterrupted run's prompts: none skipped, none trained
    twice (the conversations in flight at the kill or the signal went with their batch, drawn again)."""
    import subprocess
    import time

    from orz.ppo.trainer import RayPPOTrainer
    from orz.train import main, run as train
    from run_history import joined, kill_run, prompts_by_iteration, resume_problems

    whole, overrides = async_tool_run
    out = tmp_path / "stopped"
    latest = out / "checkpoints" / "latest"

    def written(checkpoint: str) -> bool:
        return latest.exists() and latest.read_text() == checkpoint

    console = tmp_path / "console.txt"
    proc = subprocess.Popen([sys.executable, "-m", "orz.train", *overrides(out), joined(ray_cluster)],
                            stdout=console.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])})
    deadline = time.time() + 600
    while not written("iter_000001"):
        assert proc.poll() is None and time.time() < deadline, console.read_text()
        time.sleep(0.05)
    kill_run(proc)  # inside iteration 2: its batch ahead generating
    assert written("iter_000001")
    before = (out / "metrics.jsonl").read_bytes()

    update = RayPPOTrainer._update

    def signalled_in_iteration_2(self, experience):  # inside it: batch 3's conversations in flight
        if self.iteration == 1:
            assert self.pipeline.generating  # the premise
            os.kill(os.getpid(), signal.SIGTERM)
        return update(self, experience)

    monkeypatch.setattr(RayPPOTrainer, "_update", signalled_in_iteration_2)
    assert main(overrides(out)) == 143
    monkeypatch.setattr(RayPPOTrainer, "_update", update)
    assert written("iter_000001")  # stopped before iteration 2's checkpoint
    out_console, err = capsys.readouterr()
    assert not resume_problems(out, before, out_console, 1)
    stopped = [line for line in err.splitlines() if line.startswith("orz: stopped")]
    assert stopped == [f"orz: stopped by SIGTERM after 1 iteration; the last checkpoint is "
                       f"{out / 'checkpoints' / 'iter_000001'} (the same command resumes from it)"]
    before = (out / "metrics.jsonl").read_bytes()
    train(load_config(None, overrides(out)))
    assert not resume_problems(out, before, capsys.readouterr().out, 1)
    assert prompts_by_iteration(out) == prompts_by_iteration(whole)
    assert len({p for prompts in prompts_by_iteration(whole) for p in prompts}) == 8  # the premise: 8 rows


# ---- the driver alone, on a fleet of one engine (what a benchmark drives): no barrier across
# the batch, an environment past env_timeout_s, an engine hung mid-conversation.
class _Timed:
    """Three turns, an observation after each; each step of a "slow" row takes 3 s, of a "hang"
    row 6 s (past env_timeout_s=4); the first step of a "stop" row stops the engine (SIGSTOP)."""

    log: list = []  # (row prompt, turn, time), when a step ends
    began: list = []  # (row prompt, turn), when a step begins
    stopped, pid = False, 0  # pid: the engine's, read before (a call would queue behind serve)

    def reset(self, row):
        self.prompt, self.turns = row["prompt"], 0

    def step(self, turn_text):
        import time

        self.turns += 1
        _Timed.began.append((self.prompt, self.turns))
        if self.prompt == "slow":
            time.sleep(3.0)
        if self.prompt == "hang":
            time.sleep(6.0)
        if self.prompt == "nap":
            time.sleep(NAP_S)
        if self.prompt == "stop" and not _Timed.stopped:  # hangs the engine (alive, silent)
            _Timed.stopped = True
            os.kill(_Timed.pid, signal.SIGSTOP)
        _Timed.log.append((self.prompt, self.turns, time.monotonic()))
        return {"observation": " 12", "done": self.turns == 3}


NAP_S = 0.5  # each step of a "nap" row


def _check_goodput_drops_by_what_the_environment_sleeps(rollout, tokenizer):
    """One conversation whose environment sleeps NAP_S at each of its 3 steps: the engine waits
    meanwhile, so its goodput (orz.timeline.figures, from the driver's busy spans) over the rollout
    drops by the sleeps' share. Tolerance from the run's own spans: the seconds that are neither
    the engine's nor the environment's (the driver's own)."""
    from orz.rollout.engine import SamplingConfig
    from orz.timeline.figures import Resource, goodput, union_seconds
    from orz.timeline.record import RECORDER

    RECORDER.on = True
    RECORDER.drain()
    start = RECORDER.now()
    list(rollout.stream([(tokenizer.encode("1+1="), {"prompt": "nap"}, "timed")], SamplingConfig(n=1, max_new_tokens=8)))
    window = start, RECORDER.now()
    events, wall = RECORDER.drain(), window[1] - window[0]
    spans = {lane: [(s, s + d) for kind, l, name, s, d, _ in events if l == lane and kind == "X"
                    and name in ("busy", "call")] for lane in ("engines/engine 0", "environments/timed")}
    busy, naps = (union_seconds(spans[lane], window) for lane in ("engines/engine 0", "environments/timed"))
    assert sum(b - a >= NAP_S for a, b in spans["environments/timed"]) == 3  # the steps (and a quick reset)
    either = union_seconds(spans["engines/engine 0"] + spans["environments/timed"], window)
    assert busy + naps == pytest.approx(either, abs=1e-3)  # never both: the engine waited for the environment
    driver = wall - either
    assert driver < 0.25 * wall  # the premise: the sleeps, not the driver, left the engine idle
    figure = goodput(events, window, [Resource("engine_0", ("engines/engine 0",), 1, useful=("busy",))])
    assert figure["goodput/engine_0"] == pytest.approx(busy / wall)
    assert 1 - naps / wall - driver / wall - 1e-3 <= figure["goodput/engine_0"] <= 1 - 3 * NAP_S / wall + 1e-3


class _AnswersAfter:
    """An environment whose step answers after row["seconds"]: done, nothing to observe."""

    def reset(self, row):
        self.seconds = row["seconds"]

    def step(self, turn_text):
        import time

        time.sleep(self.seconds)
        return {"observation": None, "done": True}


def test_an_environment_past_env_timeout_s_scores_its_sample_0_and_holds_up_no_other():
    """rollout.env_timeout_s = 0.2: of two samples whose environment answers after 0 s and after
    1 s, the first ends as it said, the second with a timeout (scored 0) once 0.2 s have passed,
    without waiting for the answer (the sample's loop awaits it; no thread waits), and while a
    third sample's turn is held by the driver (as an interrupt holds it until the new weights)."""
    import time

    from orz.rollout.envs import EnvLoop
    from orz.rollout.multiturn import env_scores

    limits = TurnLimits(max_turns=3, max_new_tokens=8, max_model_len=256, max_observation_tokens=8, env_timeout_s=0.2)
    run, driver = _stub_run(limits, [[1, 2], [3, 4], [5]], [{"seconds": 0.0}, {"seconds": 1.0}, {"seconds": 0.0}],
                            functools.partial(EnvLoop, _AnswersAfter, []))
    asked = sorted(driver.asked.get(timeout=5)[0] for _ in range(3))
    assert asked == [0, 1, 2]
    for key in (0, 1):
        _model_says(run, key, [5, 6])
    asked_at = time.monotonic()
    _until(lambda: not run.left[0] and not run.left[1])
    assert 0.2 <= time.monotonic() - asked_at < 0.9  # the premise: the timeout bound, not the answer
    assert run.left[2] == 1  # still waiting for its turn
    _model_says(run, 2, [7])
    _until(run.finished)
    run.close()
    in_time, late = run.conversations[0], run.conversations[1]
    assert in_time.env_error == "" and in_time.model_turns == 1
    assert late.env_error == "timeout: no answer within rollout.env_timeout_s=0.2"
    # a sample whose environment timed out scores 0, whatever its verifier said
    assert env_scores([in_time, late], torch.tensor([1.0, 1.0]), {}).tolist() == [1.0, 0.0]
    assert sorted(c.index for group in run.ready() for c in group) == [0, 1, 2]


@pytest.mark.slow
def test_samples_advance_on_their_own_time_out_and_survive_an_engine_restart(ray_cluster, tool_model):
    """No barrier across the batch; an environment past env_timeout_s scores 0; an environment that
    sleeps lowers the engine's goodput by its share; an engine that hangs mid-conversation is
    restarted and its conversations go on. (An engine that dies: the same driver's restart,
    tests/test_rollout.py.)"""
    import time

    import ray

    from orz.data.tokenizers import load_tokenizer
    from orz.rollout.engine import SamplingConfig
    from orz.rollout.fleet import EngineFleet, FleetConfig
    from orz.rollout.envs import EnvLoop
    from orz.rollout.multiturn import MultiTurnRollout, multiturn_metrics

    fleet = EngineFleet(tool_model, FleetConfig(num_engines=1, engine_args={"max_model_len": 256}, kv_cache_gib=1,
                                                request_timeout_s=10.0))  # an 8-token turn: < 1 s alone
    try:
        tokenizer = load_tokenizer(tool_model)
        limits = TurnLimits(max_turns=3, max_new_tokens=8, max_model_len=256, max_observation_tokens=8, env_timeout_s=4.0)
        rollout = MultiTurnRollout(fleet, tokenizer, {"timed": functools.partial(EnvLoop, _Timed, [])}, limits)
        sampling = SamplingConfig(n=2, max_new_tokens=8, seed=3)

        def run(names):
            prompts = [(tokenizer.encode(f"{i}+{i}="), {"prompt": name}, "timed") for i, name in enumerate(names)]
            return {names[group[0].index]: (time.monotonic(), group) for group in rollout.stream(prompts, sampling)}

        ended = run(["fast", "slow", "hang"])
        slow_first_step = min(t for prompt, turn, t in _Timed.log if prompt == "slow")
        assert ended["fast"][0] < slow_first_step  # the fast samples' 3 turns ended while a slow step was running
        assert all(c.model_turns == 3 and not c.env_error for name in ("fast", "slow") for c in ended[name][1])
        assert all(c.env_error.startswith("timeout") and c.model_turns == 1 for c in ended["hang"][1])
        metrics = multiturn_metrics([c for _, group in ended.values() for c in group])
        assert metrics["rollout/env_errors"] == metrics["rollout/env_timeouts"] == 2
        _check_goodput_drops_by_what_the_environment_sleeps(rollout, tokenizer)
        _Timed.pid = ray.get(fleet.engines[0].pid.remote())
        ended |= run(["stop"])  # the engine hangs: after request_timeout_s without a turn, restarted
        assert fleet.metrics["rollout/engine_restarts"] == 1
        survived = [(c.model_turns, c.env_error, c.finish_reason) for c in ended["stop"][1]]
        assert all(turns == 3 and not error for turns, error, _ in survived), survived
        for _, group in ended.values():
            for c in group:
                assert len(c.response_ids) == len(c.logprobs) == len(c.loss_mask)
                assert [i for turn in c.turns for i in turn.ids] == c.response_ids
        _check_an_environment_times_out_while_an_update_holds_the_turns(fleet, rollout, tokenizer, sampling, tool_model)
    finally:
        fleet.shutdown()


def _check_an_environment_times_out_while_an_update_holds_the_turns(fleet, rollout, tokenizer, sampling, model):
    """Partial rollout, a real interrupt: while the engines wait for new weights (the update), a
    sample whose environment is past env_timeout_s (4 s of its 6) still ends then, scored as a
    timeout, without waiting for the sync; the samples whose turns the interrupt held go on with
    the new weights once they are in."""
    import threading
    import time

    from orz.models.checkpoint import HFCheckpoint
    from orz.rollout.weight_sync import TensorSource

    prompts = [(tokenizer.encode(f"{i}+{i}="), {"prompt": name}, "timed") for i, name in enumerate(["slow", "hang"])]
    ended, _Timed.began[:] = {}, []

    def stream():
        for group in rollout.stream(prompts, sampling, interruptible=True):
            ended[group[0].index] = (time.monotonic(), group)

    streaming = threading.Thread(target=stream, daemon=True)
    streaming.start()
    deadline = time.monotonic() + 60
    while len(_Timed.began) < 2 * sampling.n:  # every sample's first environment step in flight
        assert time.monotonic() < deadline, _Timed.began
        time.sleep(0.01)
    start = time.monotonic()
    version = fleet.weight_version + 1
    fleet.interrupt()
    interrupted = time.monotonic()
    deadline = interrupted + 30
    while 1 not in ended and time.monotonic() < deadline:
        time.sleep(0.05)
    hang_ended, hang = ended[1]
    assert 0 not in ended  # the premise: the slow samples' next turns wait for the new weights
    assert hang_ended - start < 4.0 + 1.5  # its timeout, not its answer (6 s) nor a sync
    assert all(c.env_error.startswith("timeout") and c.model_turns == 1 for c in hang)
    ckpt = HFCheckpoint(model)
    synced = time.monotonic()
    fleet.sync(TensorSource({k: ckpt.get(k) for k in ckpt.keys()}), version=version)
    streaming.join(timeout=60)
    slow_ended, slow = ended[0]
    assert slow_ended > synced and all(c.model_turns == 3 and not c.env_error for c in slow)
    assert all(version in c.token_versions for c in slow)  # their later turns came from the new weights


@pytest.mark.slow
def test_orz_eval_runs_rows_with_their_environment(ray_cluster, tool_model, tmp_path):
    """`orz eval --env echo=turn_envs:Echo`: the row without an environment of its own takes Echo
    (three turns: it is never done), the python rows keep the python tool, here in the chat format
    (--template chat --tool-format chat): the prompt shows the python function, a turn ends where
    a <tool_call> closes, and the call (never well formed from a random model) is answered inside
    the chat template's tool message. The verdict and the response are the model's own turns."""
    from orz.data.tokenizers import load_tokenizer
    from orz.eval import main

    rows = _rows(tmp_path / "bench.jsonl", ["python", "", "python", "python", "python"])
    out = tmp_path / "eval"
    assert main(["--model", tool_model, "--data", f"bench={rows}", "--env", "echo=turn_envs:Echo", "--n", "16",
                 "--max-tokens", "24", "--max-turns", "3", "--max-model-len", "1024", "--kv-cache-gib", "1",
                 "--template", "chat", "--tool-format", "chat", "--out", str(out), "--no-progress"]) == 0
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 80
    before = load_tokenizer(tool_model).encode(BEFORE_OUTPUT, add_special_tokens=False)
    calls = 0
    for record in records:
        turns = record["turns"]
        assert record["response"] == _model_text(record) and json.dumps(PYTHON_FUNCTION) in record["prompt"]
        if record["row"] == 2:
            assert [turn["origin"] for turn in turns] == ["model", "env", "model", "env", "model"]
            assert all(turn["text"] == " <unk><unk><unk>" for turn in turns if turn["origin"] == "env")  # " ok:"
            continue
        for turn, after in zip(turns, turns[1:]):
            assert (after["origin"] == "env") == _calls_code(turn, "<tool_call>", "</tool_call>")
            if after["origin"] == "env":
                calls += 1
                assert after["ids"][:len(before)] == before  # "error: the call is not JSON" follows, as <unk>s
    assert calls > 0  # the premise: the python tool was called


class _Scripted:
    """An environment that answers row["observations"] in turn, then is done."""

    def reset(self, row):
        self.observations = list(row["observations"])

    def step(self, turn_text):
        return {"observation": self.observations.pop(0) if self.observations else None, "done": False}


class _StubDriver:
    """Records the turns asked (key, context, seed, max_tokens, stop) and runs what the loops post
    at once: no Ray and no engine; the test plays the model's turns itself (_model_says)."""

    min_version = 0

    def __init__(self):
        self.asked = queue.Queue()

    def call_soon(self, function):
        function()

    def ask(self, key, group, *request):
        self.asked.put((key, *request))


def _stub_run(limits, prompts, rows, loop):
    """The multi-turn client (AgentLoops) of samples with one loop, on a stub driver."""
    from types import SimpleNamespace

    from orz.data.tokenizers import char_tokenizer
    from orz.rollout.engine import SamplingConfig
    from orz.rollout.multiturn import AgentLoops

    rollout = SimpleNamespace(env_threads=2, limits=limits, tokenizer=char_tokenizer([string.digits + " ok:"]),
                              loops={"e": loop})
    run = AgentLoops(rollout, [(p, row, "e") for p, row in zip(prompts, rows)], SamplingConfig(n=1))
    driver = _StubDriver()
    run.begin(driver)
    return run, driver


def _model_says(run, key, ids, finish_reason="stop"):
    from orz.rollout.engine import Sample

    run.turn_ended(key, Sample(index=key, prompt_ids=[], response_ids=ids, logprobs=[-1.0] * len(ids),
                               finish_reason=finish_reason, text="x" * len(ids), weight_version=0,
                               token_versions=[0] * len(ids)))


def _until(condition, timeout=5.0):
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_max_model_len_bounds_each_turn_and_ends_the_sample_that_reaches_it():
    """rollout.max_model_len = 12 with a 3-token prompt and turns of up to 4 tokens: a turn is asked
    for no more tokens than fit (12 − context), an observation that leaves no room ends the sample
    with "length" (≥: 3 + 4 + 5 = 12 ends it, 3 + 4 + 4 = 11 leaves one token), and a prompt that
    fills the context is never sent to the engine."""
    from orz.rollout.envs import EnvLoop

    limits = TurnLimits(max_turns=5, max_new_tokens=4, max_model_len=12, max_observation_tokens=8, env_timeout_s=60)
    rows = [{"observations": ["12", " 1"]}, {"observations": [" 123"]}, {"observations": [" 1234"]},
            {"observations": []}]
    run, driver = _stub_run(limits, [[1, 2, 3]] * 3 + [[1] * 12], rows, functools.partial(EnvLoop, _Scripted, []))
    asked = sorted(driver.asked.get(timeout=5) for _ in range(3))
    assert [request[0] for request in asked] == [0, 1, 2] and [request[3] for request in asked] == [4, 4, 4]
    _until(lambda: run.left[3] == 0)  # 12 tokens: nothing asked
    assert run.conversations[3].finish_reason == "length" and not run.conversations[3].turns
    tokenizer = run.r.tokenizer
    # sample 0: observation of 2 → context 9: the next turn is asked for 12 − 9 = 3 < max_new_tokens
    _model_says(run, 0, [5, 6, 7, 8])
    key, context, _, max_tokens, _ = driver.asked.get(timeout=5)
    assert key == 0 and len(context) == 9 and max_tokens == 3
    _model_says(run, 0, [5, 6, 7], "length")  # context 12: nothing left
    _until(lambda: run.left[0] == 0)
    c = run.conversations[0]
    assert c.finish_reason == "length" and c.turns[-1].origin == "model" and len(c.prompt_ids + c.response_ids) == 12
    # samples 1 and 2 after a 4-token turn (context 7): an observation of 4 fits, one of 5 ends the sample
    for key in (1, 2):
        _model_says(run, key, [5, 6, 7, 8])
    key, context, _, max_tokens, _ = driver.asked.get(timeout=5)
    assert key == 1 and max_tokens == 1 and len(context) == 11
    _until(lambda: run.left[2] == 0)
    two = run.conversations[2]
    assert two.finish_reason == "length" and two.turns[-1].origin == "model"
    assert len(tokenizer.encode(" 1234", add_special_tokens=False)) == 5  # the premise: 3 + 4 + 5 = 12
    assert driver.asked.empty()  # sample 0 was not asked again
    run.close()


def test_an_observation_longer_than_max_observation_tokens_is_cut_to_it():
    """rollout.max_observation_tokens = 5: an environment's 11-token observation enters the
    conversation as its first 5 tokens, none of them in the loss, and the next turn's context
    holds exactly those."""
    from orz.rollout.envs import EnvLoop

    limits = TurnLimits(max_turns=3, max_new_tokens=4, max_model_len=64, max_observation_tokens=5, env_timeout_s=60)
    run, driver = _stub_run(limits, [[1, 2, 3]], [{"observations": [" 1234567890"]}],
                            functools.partial(EnvLoop, _Scripted, []))
    driver.asked.get(timeout=5)
    _model_says(run, 0, [5, 6, 7, 8])
    ids = run.r.tokenizer.encode(" 1234567890", add_special_tokens=False)
    assert len(ids) == 11 > 5  # the premise: the cut binds
    assert driver.asked.get(timeout=5)[1] == [1, 2, 3, 5, 6, 7, 8, *ids[:5]]
    c = run.conversations[0]
    assert c.turns[-1].ids == ids[:5] and c.turns[-1].text == run.r.tokenizer.decode(ids[:5])
    assert c.loss_mask == [1] * 4 + [0] * 5 and c.logprobs[-5:] == [0.0] * 5
    run.close()


class _Reviser:
    """A user's agent loop: a turn, a hint computed in a thread as observation ids, a second turn
    with a stop string of its own, a reward; a row asking for it fails on purpose."""

    async def run(self, sample):
        first = await sample.generate()
        if sample.row.get("fail"):
            sample.fail("no hint for this one")
        hint = await sample.call(lambda: f" {len(first.response_ids)}:")
        sample.observe(sample.tokenizer.encode(hint, add_special_tokens=False))
        await sample.generate(stop=["!"])
        sample.reward += 0.5
        sample.counts["hints"] = 1


class _Raises:
    async def run(self, sample):
        raise ValueError("a bug in the loop")


def test_a_users_agent_loop_asks_turns_as_ids_and_appends_its_own():
    """An agent loop's turns are asked on the ids so far, from the sample's seed + t·2^20, with
    its stop strings; its observation ids enter out of the loss; its reward and counts are the
    sample's. sample.fail and an exception out of the loop score the sample 0 with what happened."""
    from orz.rollout.agent_loop import TURN_SEED_STRIDE
    from orz.rollout.multiturn import env_scores, multiturn_metrics

    limits = TurnLimits(max_turns=3, max_new_tokens=4, max_model_len=64, max_observation_tokens=8, env_timeout_s=60)
    run, driver = _stub_run(limits, [[1, 2, 3], [4, 5]], [{}, {"fail": True}], _Reviser)
    first = sorted(driver.asked.get(timeout=5) for _ in range(2))
    assert [(key, context, seed) for key, context, seed, _, _ in first] == [(0, [1, 2, 3], 0), (1, [4, 5], 1)]
    _model_says(run, 1, [7])
    _model_says(run, 0, [7, 8, 9])
    hint = run.r.tokenizer.encode(" 3:", add_special_tokens=False)
    key, context, seed, max_tokens, stop = driver.asked.get(timeout=5)
    assert (key, context, seed, stop) == (0, [1, 2, 3, 7, 8, 9, *hint], TURN_SEED_STRIDE, ["!"])
    _model_says(run, 0, [6])
    _until(run.finished)
    run.close()
    done, failed = run.conversations[0], run.conversations[1]
    assert done.response_ids == [7, 8, 9, *hint, 6] and done.loss_mask == [1, 1, 1, 0, 0, 0, 1]
    assert done.logprobs == [-1.0] * 3 + [0.0] * 3 + [-1.0] and done.text == "xxxx"
    assert (done.env_reward, done.counts, done.env_error) == (0.5, {"hints": 1}, "")
    assert failed.env_error == "no hint for this one" and failed.model_turns == 1
    assert env_scores([done, failed], torch.tensor([1.0, 1.0]), {"e": 2.0}).tolist() == [2.0, 0.0]
    assert multiturn_metrics([done, failed])["rollout/env_errors"] == 1
    run, driver = _stub_run(limits, [[1]], [{}], _Raises)
    _until(run.finished)
    run.close()
    assert run.conversations[0].env_error == "ValueError: a bug in the loop" and driver.asked.empty()


def test_turn_limits_and_the_python_tool_take_the_rollouts_settings():
    """The run's settings reach the driver's limits (TurnLimits.of, positional) and the python tool
    (make_loops): a swap of two of them would pass every test that uses the defaults."""
    from orz.config import CodeScoringConfig
    from orz.data.tokenizers import char_tokenizer
    from orz.rollout.multiturn import make_loops
    from orz.rollout.python_tool import OUTPUT_CLOSE, OUTPUT_OPEN

    rollout = RolloutConfig(env="python", max_turns=2, max_new_tokens=3, max_observation_tokens=40, env_timeout_s=7.0,
                            tool_timeout_s=0.5, tool_open="<py>", tool_close="</py>")
    assert TurnLimits.of(rollout, 11) == TurnLimits(2, 3, 11, 40, 7.0)
    loop = make_loops(rollout, CodeScoringConfig(allow_weak_sandbox=True), {"python"}, char_tokenizer(["abc"]))["python"]()
    assert loop.stop == ["</py>"]  # a turn ends where a block closes (rollout.tool_close)
    tool = loop.make()
    assert (tool.form.open, tool.form.close) == ("<py>", "</py>")
    assert tool.limits.wall_s == 0.5
    assert tool.max_chars == 40 - len(OUTPUT_OPEN) - len(OUTPUT_CLOSE)

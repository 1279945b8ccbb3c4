"""On-policy distillation through `orz train`: a random tiny student, two trained teachers of another
size routed by data source, at TP 1 and 2; the dumps read back token by token against transformers."""
import json

import pytest
import torch

from conftest import _arith_model


def _trained_teacher(path, seed: int, ops: str) -> str:
    """A smaller Llama (1 layer, hidden 64) than the student, with the student's tokenizer, trained
    with transformers on the task's worked solutions of `ops` (150 Adam steps, ~6 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orz.data.synthetic import arithmetic_rows
    from orz.data.templates import ThinkAnswerTemplate

    path = _arith_model(path, hidden_size=64, head_dim=32, num_heads=2, num_kv_heads=2, num_layers=1,
                        intermediate_size=128, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = [ThinkAnswerTemplate("Compute.").prompt(r["prompt"]) + r["solution"] + tokenizer.eos_token
             for r in arithmetic_rows(256, seed=seed, digits=(1, 1), ops=ops)]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        rows = torch.randint(0, len(texts), (32,))
        loss = model(input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows], labels=labels[rows]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert loss.item() < 0.5  # the premise: a trained teacher (a random one starts near log V ≈ 3.7)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def teachers(tmp_path_factory) -> dict[str, str]:
    """Two trained teachers, each of other weights: one on additions and subtractions, one on subtractions."""
    return {"adder": _trained_teacher(tmp_path_factory.mktemp("adder"), seed=1, ops="+-"),
            "subtractor": _trained_teacher(tmp_path_factory.mktemp("subtractor"), seed=2, ops="-")}


def _hf_logprobs(path: str, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """transformers' log-probs of each response token after its prompt: the independent reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(prompt_ids) - 1:-1].double(), -1)
    return logp.gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


def _two_sources(path):
    """Additions (data_source "add") and subtractions ("sub"), alternating."""
    from orz.data.synthetic import arithmetic_rows

    add, sub = (arithmetic_rows(32, seed=2, digits=(1, 1), ops=op) for op in "+-")
    with open(path, "w") as out:
        for a, s in zip(add, sub):
            out.write(json.dumps({"prompt": a["prompt"], "answer": a["answer"], "data_source": "add"}) + "\n")
            out.write(json.dumps({"prompt": s["prompt"], "answer": s["answer"], "data_source": "sub"}) + "\n")
    return path


@pytest.mark.slow
def test_two_teachers_routed_by_source_score_their_own_rows_and_the_student_moves_toward_them(
        ray_cluster, tiny_run, arith_model, teachers, tmp_path):
    """Reverse KL alone (no task reward), GRPO's estimator, a random student. Additions go to the
    adder (TP 1), subtractions to the subtractor (TP 2, over a vocabulary of odd size). Each row's
    teacher log-probs are its own teacher's, token by token, as transformers computes them, and its
    advantage is log π_teacher − log π_old; the student's reverse KL to both falls."""
    from orz.config import load_config
    from orz.train import run as train
    from run_history import history

    out = tmp_path / "run"
    overrides = [*tiny_run(out, "grpo", iterations=20), f"data.train=[{_two_sources(tmp_path / 'rows.jsonl')}]",
                 "data.eval={}", "rollout.stop=[]", "trainer.save_every=0", "trainer.dump_per_token=true",
                 "trainer.prompts_per_iteration=8", "actor.lr=3e-3",
                 *(f"teachers.{name}.path={path}" for name, path in teachers.items()), "teachers.subtractor.tp=2",
                 "distill.routes={add: adder, sub: subtractor}"]
    train(load_config(None, overrides))
    rows = history(out)[1:]
    assert all(row["actor/grad_norm"] > 0 for row in rows)
    # From a random student towards its teachers: the reverse KL to them (both, per token) falls, and
    # the share of its tokens that are their most likely ones rises (means of the first and last 4).
    kl = [sum(row[f"distill/{name}/reverse_kl"] for name in teachers) / 2 for row in rows]
    top1 = [sum(row[f"distill/{name}/top1_agreement"] for name in teachers) / 2 for row in rows]
    assert kl[0] > 1.0 and sum(kl[-4:]) / 4 < sum(kl[:4]) / 4 - 0.1, kl  # measured 4.35 -> 4.09
    assert sum(top1[-4:]) / 4 > sum(top1[:4]) / 4 + 0.02, top1  # measured 0.014 -> 0.066
    samples = [json.loads(line) for line in (out / "samples" / "iter_000001.jsonl").read_text().splitlines()]
    assert {s["info/teacher"] for s in samples} == {0, 1}
    for s in samples[::4]:  # a sample of each prompt
        teacher, old, advantages = (torch.tensor(s[k]) for k in ("teacher_logprobs", "old_logprobs", "advantages"))
        index = 0 if "+" in s["prompt"] else 1  # its source's teacher
        assert s["info/teacher"] == index
        reference = _hf_logprobs(teachers[("adder", "subtractor")[index]], s["prompt_ids"], s["response_ids"])
        torch.testing.assert_close(teacher.double(), reference, atol=1e-4, rtol=0)
        torch.testing.assert_close(advantages, teacher - old, atol=1e-6, rtol=0)

"""On-policy distillation through `orz train`: a random tiny student, two trained teachers of another
size routed by data source, at TP 1 and 2; the dumps read back token by token against transformers."""
import json
import os

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
    advantage is log π_teacher − log π_old; the student's reverse KL to both falls. A resume from
    its checkpoint repeats its figures exactly."""
    from orz.config import load_config
    from orz.train import run as train
    from run_history import deterministic, history

    out = tmp_path / "run"
    overrides = [*tiny_run(out, "grpo", iterations=20), f"data.train=[{_two_sources(tmp_path / 'rows.jsonl')}]",
                 "data.eval={}", "rollout.stop=[]", "trainer.dump_per_token=true",
                 "trainer.prompts_per_iteration=8", "actor.lr=3e-3",
                 *(f"teachers.{name}.path={path}" for name, path in teachers.items()), "teachers.subtractor.tp=2",
                 "distill.routes={add: adder, sub: subtractor}"]
    train(load_config(None, [*overrides, "trainer.save_every=18"]))
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
        assert (teacher - old).abs().mean() > 0.1  # another model than the student: the term moves it
    # Resumed from its checkpoint at iteration 18 (into another directory), the run repeats its last
    # two iterations' figures exactly, the teachers' included.
    branch = tmp_path / "branch"
    train(load_config(None, [*overrides, f"trainer.output_dir={branch}",
                             f"trainer.resume_from={out / 'checkpoints' / 'iter_000018'}"]))
    resumed, whole = history(branch), {row["step"]: row for row in history(out)}
    assert [row["step"] for row in resumed] == [19, 20] and "distill/adder/reverse_kl" in resumed[0]
    assert all(deterministic(row) == deterministic(whole[row["step"]]) for row in resumed)


@pytest.mark.slow
def test_the_top_k_forward_kl_through_orz_train_is_transformers_figure_on_the_first_batch(
        ray_cluster, tiny_run, arith_model, teachers, tmp_path):
    """distill.objective=topk_forward_kl, top_k=4: the first update's actor/distill_loss (before
    the weights move) is the token mean, over the batch's model tokens, of Σⱼ p̃ⱼ (log p̃ⱼ − log π(j))
    over the teacher's renormalised top 4, computed here with transformers from the dumped samples;
    the term alone (no task reward) moves the weights, and it falls."""
    from transformers import AutoModelForCausalLM

    from orz.config import load_config
    from orz.train import run as train
    from run_history import history

    out = tmp_path / "run"
    train(load_config(None, [*tiny_run(out, "grpo", iterations=3), "data.eval={}", "rollout.stop=[]",
                             "trainer.save_every=0", "trainer.dump_per_token=true", "actor.lr=3e-3",
                             f"teachers.t.path={teachers['adder']}", "distill.objective=topk_forward_kl",
                             "distill.top_k=4"]))
    rows = history(out)[1:]
    assert all(row["actor/grad_norm"] > 0 for row in rows) and rows[-1]["actor/distill_loss"] < rows[0]["actor/distill_loss"]
    student, teacher = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32) for p in (arith_model, teachers["adder"]))
    total, tokens = 0.0, 0
    for record in map(json.loads, (out / "samples" / "iter_000001.jsonl").read_text().splitlines()):
        ids = torch.tensor([record["prompt_ids"] + record["response_ids"]])
        start, n = len(record["prompt_ids"]), int(sum(record["response_mask"]))
        with torch.no_grad():
            s, t = (torch.log_softmax(m(ids).logits[0, start - 1:start - 1 + n].double(), -1) for m in (student, teacher))
        top, at = t.topk(4, dim=-1)
        p = top - top.logsumexp(-1, keepdim=True)
        total += float((p.exp() * (p - s.gather(-1, at))).sum())
        tokens += n
    assert rows[0]["actor/distill_loss"] == pytest.approx(total / tokens, rel=1e-4)


def _rollouts(vocab: int):
    """8 rows of random prompts (3–6 tokens) and responses (2–9), every row's teacher 0 but the
    last's (none), random task advantages."""
    from orz.ppo.experience import experience_from_rollouts

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, vocab, (int(n),), generator=g).tolist() for n in torch.randint(3, 7, (8,), generator=g)]
    responses = [torch.randint(4, vocab, (int(n),), generator=g).tolist() for n in torch.randint(2, 10, (8,), generator=g)]
    exp = experience_from_rollouts(prompts, responses, [[-3.0] * len(r) for r in responses], pad_id=0)
    teacher = torch.tensor([0] * 7 + [-1])
    return exp, teacher, torch.randn(exp.response_mask.shape, generator=g) * exp.response_mask


def _teacher_as_student(rank, world, model: str, with_term: bool, top_k: int):
    """One worker holding the student's weights: its π_old, its teacher pass, then one update, with
    the reverse-KL term added to the task's advantages or not; with top_k, a second worker process
    trains on the forward KL over its own top-k alone. Returns what the test compares."""
    from dataclasses import replace

    from orz.config import AlgorithmConfig, RoleConfig
    from orz.models.checkpoint import HFCheckpoint
    from orz.ppo.distillation import reverse_kl_advantages, with_teacher_term
    from orz.ppo.experience import MiniBatch
    from orz.ppo.workers import ActorSettings, MegatronWorker
    from worker_specs import worker_spec

    worker = MegatronWorker(worker_spec(model, RoleConfig(micro_batch_size=4), total_steps=1, seed=3), rank, world)
    worker.setup((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
    vocab = HFCheckpoint(model).arch.vocab_size
    exp, teacher_index, task = _rollouts(vocab)
    exp = replace(exp, info={"teacher": teacher_index})
    _, old = worker.logprobs(exp, 1.0)
    _, figures = worker.teacher_logprobs(exp, 1.0, max(top_k, 1), vocab)
    k = max(top_k, 1)
    teacher = figures[..., 0]
    term = reverse_kl_advantages(old, teacher, exp.response_mask)
    if top_k:  # the forward KL over the top-k alone: no advantage
        exp = replace(exp, teacher_logprobs=teacher, teacher_topk_logprobs=figures[..., 1:1 + k],
                      teacher_topk_ids=figures[..., 1 + k:].long(), old_logprobs=old, advantages=torch.zeros_like(old))
        update = worker.train_actor([MiniBatch.of(exp)], ActorSettings(AlgorithmConfig(), 1.0, 0.0, 0.0, 1.0))
        return update.metrics, exp
    advantages = with_teacher_term(task, term, teacher_index, 1.0, True) if with_term else task
    update = worker.train_actor([MiniBatch.of(replace(exp, old_logprobs=old, advantages=advantages))],
                                ActorSettings(AlgorithmConfig(), 1.0, 0.0, 0.0))
    return teacher, old, term, update.metrics, dict(worker.model.hf_tensors())


def test_a_teacher_with_the_students_weights_gives_its_log_probs_and_leaves_the_update_unchanged(arith_model):
    """The premise: the teacher pass equals the actor's log-prob pass exactly (same weights, layout,
    dtype, threads), so the reverse-KL term is 0 on every token and the update with it is the
    update without it, weight for weight, bit for bit at fp32."""
    from orz.models.local_world import run_world

    (teacher, old, term, metrics, with_term), = run_world(_teacher_as_student, 1, arith_model, True, 0)
    (*_, without_metrics, without), = run_world(_teacher_as_student, 1, arith_model, False, 0)
    assert torch.equal(teacher, old) and old.any() and not term.any()
    assert metrics["actor/grad_norm"] > 0  # the premise: the update moved the weights
    assert with_term.keys() == without.keys() and all(torch.equal(with_term[n], without[n]) for n in with_term)


def test_the_forward_kl_over_a_teachers_top_k_trains_the_actor_by_transformers_numbers(arith_model):
    """With the student's own top-4 as the teacher's, Lₜ = Σⱼ p̃ⱼ (log p̃ⱼ − log π(j)) = −log Σ_top-4 π:
    actor/distill_loss equals its token mean from transformers' logits, the row with no teacher
    contributing nothing; the term alone (zero advantages) moves the weights."""
    from transformers import AutoModelForCausalLM

    from orz.models.local_world import run_world

    (metrics, exp), = run_world(_teacher_as_student, 1, arith_model, False, 4)
    model = AutoModelForCausalLM.from_pretrained(arith_model, dtype=torch.float32)
    total = 0.0
    for row in range(exp.batch_size - 1):  # the last row has no teacher
        start, n = int(exp.prompt_lengths[row]), int(exp.response_mask[row].sum())
        with torch.no_grad():
            logp = torch.log_softmax(model(exp.sequences[row:row + 1, :start + n]).logits[0].double(), -1)
        top = logp[start - 1:start - 1 + n].topk(4, dim=-1).values
        total += float(-top.logsumexp(-1).sum())
    assert metrics["actor/distill_loss"] == pytest.approx(total / float(exp.response_mask.sum()), rel=1e-5)
    assert metrics["actor/grad_norm"] > 0


def test_teacher_settings_that_cannot_work_are_refused_before_any_worker(arith_model, tiny_model, tmp_path):
    """Each refusal names the key or the file: a teacher with another tokenizer (both paths, the
    first token whose id differs), a missing path, top-k beyond the vocabulary, a route to an
    undefined teacher, a teacher no route uses, several teachers with no routes, settings the
    objective ignores, distill settings without a teacher."""
    from orz.config import ConfigError, load_config
    from orz.models.checkpoint import HFCheckpoint
    from orz.run import run_rules

    def refusal(*overrides) -> str:
        cfg = load_config(None, [f"model.path={arith_model}", "data.train=[synthetic:arithmetic]", *overrides])
        with pytest.raises(ConfigError) as refused:
            run_rules.check(cfg, HFCheckpoint(arith_model).arch)
        return str(refused.value)

    other = refusal(f"teachers.t.path={tiny_model}")
    assert other.startswith(f"teachers.t.path={tiny_model}: its tokenizer gives other ids than the student's "
                            f"({arith_model}): token ") and "for the student" in other, other
    assert refusal(f"teachers.t.path={tmp_path / 'absent'}") == f"teachers.t.path={tmp_path / 'absent'}: " \
                                                                  f"{tmp_path / 'absent'}: not a directory"
    assert refusal("teachers.t.dp=2") == "teachers.t.path is not set: give the teacher's HF model directory"
    vocab = HFCheckpoint(arith_model).arch.vocab_size
    assert refusal(f"teachers.t.path={arith_model}", "distill.objective=topk_forward_kl",
                   f"distill.top_k={vocab + 1}") == f"distill.top_k={vocab + 1} is beyond the student's vocabulary " \
                                                    f"of {vocab} tokens"
    assert "distill.routes.math='ghost' routes to a teacher that is not defined" in refusal(
        f"teachers.t.path={arith_model}", "distill.routes={math: ghost, '*': t}")
    assert refusal(f"teachers.a.path={arith_model}", f"teachers.b.path={arith_model}", "distill.routes={math: a}") \
        == "teachers.b is defined, and no distill.routes entry routes rows to it: route a data_source to it, or remove it"
    assert refusal(f"teachers.a.path={arith_model}", f"teachers.b.path={arith_model}").startswith(
        "teachers a, b: with several teachers, distill.routes must say")
    assert refusal(f"teachers.t.path={arith_model}", "distill.top_k=8").startswith(
        "distill.top_k=8 applies to distill.objective=topk_forward_kl only")
    assert refusal("distill.coef=0.5").startswith("distill.coef set, and the run has no teachers")

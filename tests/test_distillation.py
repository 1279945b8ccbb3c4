"""On-policy distillation's math against hand computations with log_softmax on two tiny models'
logits (a student's and a teacher's): the reverse-KL advantage, the top-k forward KL and its
gradient, how the term meets the task's advantages, the routes and the figures per teacher."""
import torch

from orz.config import load_config
from orz.ppo.core_algos import actor_loss
from orz.ppo.distillation import (
    NO_TEACHER, TeacherRoutes, reverse_kl_advantages, teacher_metrics, topk_forward_kl, with_teacher_term,
)

B, T, V, H = 3, 5, 11, 8


def _two_models():
    """A student's and a teacher's logits (B, T, V) from two random linear heads over shared hidden
    states, the sampled tokens and a response mask whose last row ends early (padding)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    student, teacher = (hidden @ torch.randn(H, V, generator=g, dtype=torch.float64) for _ in range(2))
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[2, 3:] = 0
    return student, teacher, tokens, mask


def test_the_reverse_kl_advantage_is_the_teachers_log_prob_less_the_students_on_each_token():
    student, teacher, tokens, mask = _two_models()
    s = torch.log_softmax(student, -1).gather(-1, tokens[..., None])[..., 0]
    t = torch.log_softmax(teacher, -1).gather(-1, tokens[..., None])[..., 0]
    got = reverse_kl_advantages(s.float(), t.float(), mask)
    for b in range(B):
        for i in range(T):  # by hand, token by token; 0 off the mask (padding, an environment's tokens)
            want = (t[b, i] - s[b, i]).item() if mask[b, i] else 0.0
            assert abs(got[b, i].item() - want) <= 1e-6
    assert (got[2, 3:] == 0).all() and got[2, :3].abs().min() > 0


def test_the_top_k_forward_kl_and_its_gradient_equal_a_hand_computation():
    """Lₜ = Σⱼ p̃ⱼ (log p̃ⱼ − log π_s(j)) over the teacher's top-k, p̃ renormalised over them, and
    its gradient in the student's logits by hand: ∂Lₜ/∂zᵢ = π_s(i) − p̃ᵢ (p̃ is 0 off the top-k)."""
    student, teacher, _, _ = _two_models()
    k = 4
    top, ids = torch.log_softmax(teacher, -1).topk(k, dim=-1)
    z = student.clone().requires_grad_(True)
    student_topk = torch.log_softmax(z, -1).gather(-1, ids)
    loss = topk_forward_kl(student_topk, top)
    loss.sum().backward()
    p = top.exp() / top.exp().sum(-1, keepdim=True)  # renormalised over the k
    want = (p * (p.log() - torch.log_softmax(student, -1).gather(-1, ids))).sum(-1)
    torch.testing.assert_close(loss.detach(), want, atol=1e-6, rtol=0)
    grad = torch.softmax(student, -1) - torch.zeros_like(student).scatter(-1, ids, p)
    torch.testing.assert_close(z.grad, grad, atol=1e-6, rtol=0)
    # Not renormalised (the teacher's raw top-k probabilities as weights), the loss is another number.
    raw = (top.exp() * (top - student_topk.detach())).sum(-1)
    assert (raw - want).abs().max() > 1e-3


def test_the_forward_kl_enters_the_actor_loss_with_its_weight_and_the_aggregation():
    _, _, _, mask = _two_models()
    g = torch.Generator().manual_seed(1)
    logprob = -torch.rand(B, T, generator=g)
    kl = torch.rand(B, T, generator=g)
    base, _ = actor_loss(logprob, logprob, torch.zeros(B, T), mask)
    with_term, metrics = actor_loss(logprob, logprob, torch.zeros(B, T), mask, teacher_kl=kl, distill_coef=0.5)
    want = (kl * mask).sum() / mask.sum()  # token-mean
    torch.testing.assert_close(with_term - base, 0.5 * want)
    torch.testing.assert_close(metrics["actor/distill_loss"], want)


def test_the_teacher_term_replaces_or_adds_to_the_task_advantage_on_rows_with_a_teacher():
    task = torch.full((3, 2), 0.5)
    term = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    index = torch.tensor([0, NO_TEACHER, 1])
    alone = with_teacher_term(task, term, index, coef=2.0, task_reward=False)
    assert alone.tolist() == [[2.0, 4.0], [0.5, 0.5], [10.0, 12.0]]
    summed = with_teacher_term(task, term, index, coef=2.0, task_reward=True)
    assert summed.tolist() == [[2.5, 4.5], [0.5, 0.5], [10.5, 12.5]]


def test_rows_go_to_the_teacher_of_their_data_source():
    cfg = load_config(None, ["teachers.math.path=/m", "teachers.code.path=/c", "distill.routes.gsm8k=math",
                             "distill.routes.lcb=code"])
    routes = TeacherRoutes.from_config(cfg)
    assert [routes.index(s) for s in ("gsm8k", "lcb", "other")] == [0, 1, NO_TEACHER]
    routes = TeacherRoutes.from_config(load_config(None, ["teachers.math.path=/m", "teachers.code.path=/c",
                                                          "distill.routes.lcb=code", "distill.routes.*=math"]))
    assert [routes.index(s) for s in ("gsm8k", "lcb", "")] == [0, 1, 0]
    one = TeacherRoutes.from_config(load_config(None, ["teachers.only.path=/m"]))
    assert one.index("anything") == 0 and not TeacherRoutes.from_config(load_config(None, []))


def test_each_teachers_figures_are_over_its_own_rows_tokens():
    student = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])
    teacher = torch.tensor([[-0.5, -1.0], [-3.0, -9.0]])
    tokens, top1 = torch.tensor([[4, 5], [6, 7]]), torch.tensor([[4, 9], [6, 7]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    got = teacher_metrics(("a", "b"), torch.tensor([0, 1]), student, teacher, top1, tokens, mask)
    assert got == {"distill/a/reverse_kl": (-0.5 - 1.0) / 2, "distill/a/teacher_logprob": -0.75,
                   "distill/a/top1_agreement": 0.5,
                   "distill/b/reverse_kl": 2.5, "distill/b/teacher_logprob": -3.0, "distill/b/top1_agreement": 1.0}

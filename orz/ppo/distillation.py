"""On-policy distillation's math (docs/distillation.md): which teacher scores a row, the
reverse-KL advantage, the top-k forward KL, and each teacher's figures. Pure torch.

For response token t of a row whose teacher is T, with s = log π_student(yₜ) and τ = log π_T(yₜ):

    reverse KL, policy-gradient form:  dₜ = −(s − τ)     (the k1 estimate of KL(π_student ‖ π_T), negated)
    the row's advantage:               Aₜ = coef·dₜ + [task_reward]·A_taskₜ
                                       (a row with no teacher keeps A_taskₜ)

and over the teacher's k most likely tokens j at t, renormalised, p̃ⱼ = exp(τⱼ) / Σᵢ exp(τᵢ):

    forward KL over the top-k:         Lₜ = Σⱼ p̃ⱼ (log p̃ⱼ − log π_student(j)),   ∂Lₜ/∂zⱼ = π_student(j) − p̃ⱼ
                                       on the top-k ids (and π_student(j) elsewhere: it pushes them down)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from orz.config import ANY_SOURCE

NO_TEACHER = -1  # a row's teacher index when no teacher scores it


@dataclass(frozen=True)
class TeacherRoutes:
    """Which teacher scores a row, by its data_source: distill.routes, or the one teacher for all."""

    names: tuple[str, ...] = ()  # the teachers in config order; a row's index points here
    routes: dict[str, str] = field(default_factory=dict)  # data_source -> teacher name

    @classmethod
    def from_config(cls, cfg) -> TeacherRoutes:
        return cls(tuple(cfg.teachers), dict(cfg.distill.routes))

    def __bool__(self) -> bool:
        return bool(self.names)

    def index(self, data_source: str) -> int:
        if not self.routes:
            return 0 if len(self.names) == 1 else NO_TEACHER
        name = self.routes.get(data_source, self.routes.get(ANY_SOURCE))
        return self.names.index(name) if name is not None else NO_TEACHER


def reverse_kl_advantages(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """(B, T) dₜ = −(s − τ) on the mask's tokens (the model's own: never an observation's), 0 elsewhere."""
    return (teacher_logprobs - student_logprobs) * mask


def with_teacher_term(task_advantages: Tensor, term: Tensor, teacher_index: Tensor, coef: float,
                      task_reward: bool) -> Tensor:
    """(B, T) coef·term (+ the task's advantages when task_reward) on rows with a teacher; the
    task's advantages on the others."""
    distilled = coef * term + (task_advantages if task_reward else 0.0)
    return torch.where((teacher_index != NO_TEACHER)[:, None], distilled, task_advantages)


def topk_forward_kl(student_topk: Tensor, teacher_topk: Tensor) -> Tensor:
    """(...) Lₜ from (..., K) log-probs of the teacher's top-k tokens under the student and the teacher."""
    log_p = teacher_topk - teacher_topk.logsumexp(-1, keepdim=True)
    return (log_p.exp() * (log_p - student_topk)).sum(-1)


def teacher_metrics(names: tuple[str, ...], teacher_index: Tensor, student_logprobs: Tensor,
                    teacher_logprobs: Tensor, teacher_top1: Tensor, tokens: Tensor, mask: Tensor) -> dict[str, float]:
    """Per teacher, over its rows' tokens: distill/<name>/reverse_kl (mean of s − τ),
    /teacher_logprob (mean τ), /top1_agreement (share of tokens that are the teacher's most likely)."""
    metrics = {}
    for index, name in enumerate(names):
        real = mask * (teacher_index == index)[:, None]
        count = real.sum()
        if not count:
            continue
        metrics |= {f"distill/{name}/reverse_kl": float(((student_logprobs - teacher_logprobs) * real).sum() / count),
                    f"distill/{name}/teacher_logprob": float((teacher_logprobs * real).sum() / count),
                    f"distill/{name}/top1_agreement": float(((teacher_top1 == tokens) * real).sum() / count)}
    return metrics

"""The run's teachers as the trainer uses them (docs/distillation.md): each teacher's pass over the
rows routed to it, the Experience fields of their results, the advantages with the reverse-KL term
and each teacher's figures, and the forward KL's weight in the actor's loss.

    teachers = Teachers(groups, cfg.distill, vocab_size)      # {role: WorkerGroup}, in config order
    passes = teachers.launch(experience, temperature)          # beside the actor's and the reference's
    experience = replace(experience, **teachers.fields(experience, passes))
    advantages, metrics = teachers.advantages(experience, advantages)
"""
from __future__ import annotations

import ray
import torch

from orz.config import DistillConfig
from orz.ppo.distillation import reverse_kl_advantages, teacher_metrics, with_teacher_term
from orz.ppo.experience import Experience
from orz.ppo.workers import PendingRows, WorkerGroup
from orz.run.placement import TEACHER


class Teachers:
    def __init__(self, groups: dict[str, WorkerGroup], distill: DistillConfig, vocab_size: int):
        """groups: {"teachers.NAME": its WorkerGroup} in config order (a row's info["teacher"] indexes
        it); vocab_size: the student's, what a teacher's π spans."""
        self.groups, self.distill, self.vocab_size = groups, distill, vocab_size
        self.names = tuple(role.removeprefix(TEACHER) for role in groups)
        # Each pass's top-k: distill.top_k for the forward KL, else 1 (the top-1 agreement figure).
        self.k = distill.top_k if distill.objective == "topk_forward_kl" else 1

    def __bool__(self) -> bool:
        return bool(self.groups)

    @property
    def loss_coef(self) -> float:
        """The top-k forward KL's weight in the actor's loss; 0 without it."""
        return self.distill.coef if self and self.distill.objective == "topk_forward_kl" else 0.0

    def launch(self, experience: Experience, temperature: float) -> list[tuple[torch.Tensor, PendingRows]]:
        """Each teacher's pass over its own rows (info["teacher"]), launched: (rows, pending)."""
        if not self:
            return []
        index, passes = experience.info["teacher"], []
        for i, group in enumerate(self.groups.values()):
            rows = (index == i).nonzero()[:, 0]
            if len(rows):
                rows_only = ray.put(experience.select(rows))
                passes.append((rows, group.teacher_logprobs_async(rows_only, temperature, self.k, self.vocab_size)))
        return passes

    def fields(self, experience: Experience, passes: list[tuple[torch.Tensor, PendingRows]]) -> dict:
        """The Experience fields of the passes: every row's own teacher's figures, 0 on rows with none."""
        if not self:
            return {}
        k = self.k
        figures = torch.zeros(*experience.response_mask.shape, 1 + 2 * k)
        for rows, pending in passes:
            got = pending.get()
            figures[rows, :got.shape[1]] = got
        return dict(teacher_logprobs=figures[..., 0], teacher_topk_logprobs=figures[..., 1:1 + k],
                    teacher_topk_ids=figures[..., 1 + k:].long())

    def advantages(self, experience: Experience, advantages: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The advantages with the reverse-KL term (none with the forward KL, which is the loss's),
        and each teacher's figures."""
        d, mask, index = self.distill, experience.response_mask, experience.info["teacher"]
        student = experience.old_logprobs if d.student_logprobs == "old" else experience.rollout_logprobs
        teacher = experience.teacher_logprobs
        term = reverse_kl_advantages(student, teacher, mask) if d.objective == "reverse_kl" else torch.zeros_like(mask)
        metrics = teacher_metrics(self.names, index, student, teacher, experience.teacher_topk_ids[..., 0],
                                  experience.gather_response(experience.sequences), mask)
        return with_teacher_term(advantages, term, index, d.coef, d.task_reward), metrics

"""trainer.fault: an exception raised on purpose inside one role in the middle of a run, so that
what a real bug there does can be seen (and is tested): its traceback reaches the terminal,
naming the role, and the run stops with a non-zero exit status. Off ("") by default.

    python -m orz.train ... trainer.fault=actor@2    # the actor's workers raise in iteration 2's update
    python -m orz.train ... trainer.fault=engine@2   # every vLLM engine raises in iteration 2's rollout
    python -m orz.train ... trainer.fault=reward@2   # the reward router raises scoring iteration 2's samples

An exception is not a lost worker: the run does not restart from its checkpoint for it (only a
worker whose process is gone is rebuilt; orz.ppo.trainer). Imports nothing heavy, so that the
roles (reward/ included) can carry the hook.
"""
from __future__ import annotations

from dataclasses import dataclass

ROLES = ("actor", "engine", "reward")


class InjectedFault(RuntimeError):
    """Raised by trainer.fault, never by anything else."""


@dataclass(frozen=True)
class Fault:
    role: str  # one of ROLES
    iteration: int  # 1-based: the iteration whose rollout (engine, reward) or update (actor) raises

    @classmethod
    def parse(cls, text: str) -> Fault | None:
        """ "role@iteration" -> Fault; "" -> None. A ValueError names what is wrong."""
        if not text:
            return None
        role, _, iteration = text.partition("@")
        if role not in ROLES or not iteration.isdigit() or int(iteration) < 1:
            raise ValueError(f"trainer.fault={text!r} must be ROLE@ITERATION with ROLE one of {', '.join(ROLES)} "
                             "and ITERATION >= 1 (e.g. actor@2), or '' (off)")
        return cls(role, int(iteration))

    def message(self, where: str) -> str:
        return f"trainer.fault={self.role}@{self.iteration}: injected into {where} in iteration {self.iteration}"


class FaultSite:
    """Mixin of a role's class: `arm_fault(message)` makes its next `_raise_armed_fault()` raise
    InjectedFault (once). Arming is a separate call, so the role's own methods keep their signatures."""

    _armed_fault: str | None = None

    def arm_fault(self, message: str) -> None:
        self._armed_fault = message

    def _raise_armed_fault(self) -> None:
        if self._armed_fault is not None:
            message, self._armed_fault = self._armed_fault, None
            raise InjectedFault(message)

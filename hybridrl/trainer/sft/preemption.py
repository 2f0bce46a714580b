"""Save on preemption for ``main_sft``: SIGTERM / SIGUSR1 end the run after the current step, saved.

An SFT step changes the model only at its end (one optimizer step), so a signal that arrives while
a step runs lets that step finish; the step is then saved (unless the step's own ``save_freq``
save already wrote it) and the run exits with 128 + the signal number within
``trainer.preemption_grace_s`` (``hybridrl.utils.shutdown``; the alarm ends the run anyway when the
grace period is over, leaving the previous checkpoint as the newest). The same command resumes from
the saved step exactly (``trainer.resume_mode=auto``). Under ``torchrun`` every rank receives the
scheduler's signal, but not necessarily at the same step: the ranks agree with one all-reduce (MAX)
per step, so all of them save the same step together. A run that writes no checkpoints
(``trainer.save_freq`` <= 0) exits at once, as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hybridrl.utils import checkpointing as ck
from hybridrl.utils.shutdown import PREEMPTION

__all__ = ["SFTStepGuard"]


class SFTStepGuard:
    """The preemption point of one SFTTrainer's loop (``trainer``: its ``save_checkpoint()``, ranks)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.saves = trainer.config.trainer.save_freq > 0

    def arm(self) -> None:
        if self.saves:
            PREEMPTION.arm(self._last_good)

    def disarm(self) -> None:
        PREEMPTION.disarm()

    def _last_good(self) -> str | None:
        root = self.trainer.checkpoint_root
        step = ck.latest_pointer(root)
        return ck.step_dir(root, step) if step else None

    def requested(self) -> bool:
        """Whether any rank got a signal (one all-reduce per step on more than one rank)."""
        if not self.saves:
            return False
        if self.trainer.world == 1:
            return PREEMPTION.requested
        flag = torch.tensor([1.0 if PREEMPTION.requested else 0.0], device=self.trainer.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def after_step(self, saved: str | None) -> None:
        """The step is finished (``saved``: where its regular save wrote it, if it did): on a signal,
        save it and leave."""
        if not self.requested():
            return
        path = saved or self.trainer.save_checkpoint()
        if PREEMPTION.signum is None:  # another rank got the signal: leave as it does
            PREEMPTION.signum = 15
        PREEMPTION.exit(path)

"""The fit loop's answer to a preemption notice, and veRL's save ahead of an instance's expiry.

Preemption (SIGTERM, SIGUSR1; ``hybridrl.utils.shutdown``): a step is either finished or abandoned,
never half kept. The driver state at the start of each step (step count, data-loader position, RNG
states, KL controller) is kept; the workers' state changes only in the updates (critic, actor).

* A signal that arrives before the updates abandons the step at the next stage boundary: the
  checkpoint written is that of the previous step, made of the workers' unchanged state and the
  driver state kept at the step's start (nothing is written if that step is already saved), so the
  resumed run trains the abandoned step exactly as an uninterrupted run does.
* A signal that arrives during the updates lets the step finish (validation is skipped) and saves it.

Either way the run then exits with 128 + the signal number, within ``trainer.preemption_grace_s``
(see ``Preemption``). A run that writes no checkpoints (``save_freq`` and ``save_freq_secs`` off)
exits at once, as before.

``trainer.esi_redundant_time`` (veRL): on Volcengine ML Platform and SageMaker capacity blocks the
instance's expiry time is in ``MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP`` /
``SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP`` (Unix seconds). As in veRL, once the time
left is at most (checkpoint save time + longest step + esi_redundant_time) every step is saved; veRL
assumes 60 s for a save, here the longest save of this run is used once there has been one.
"""

from __future__ import annotations

import os
import time
from typing import Any

from hybridrl.utils import checkpointing as ck
from hybridrl.utils.shutdown import PREEMPTION

__all__ = ["ESI_ENV_VARS", "StepGuard", "esi_seconds_left"]

ESI_ENV_VARS = (
    "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP",  # Volcengine ML Platform
    "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP",  # AWS SageMaker
)
DEFAULT_SAVE_S = 60.0  # veRL's assumed save time before one was measured


def esi_seconds_left(now: float | None = None) -> float | None:
    """Seconds until the instance's capacity block expires (None: no expiry announced, or unreadable)."""
    for name in ESI_ENV_VARS:
        value = os.environ.get(name)
        if value:
            try:
                return float(value) - (time.time() if now is None else now)
            except ValueError:
                return None
    return None


class StepGuard:
    """Preemption points and the expiry-driven save of one trainer's fit loop.

    Args:
        trainer: the RayPPOTrainer (its `global_steps`, `save_checkpoint(state=)`, `driver_state()`).
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        tr = trainer.config.trainer
        self.saves = tr.save_freq > 0 or tr.save_freq_secs > 0
        self.esi_redundant_time = float(tr.esi_redundant_time)
        self.saved_step: int | None = None
        self.snapshot: dict | None = None
        self.step_started = 0.0
        self.longest_step_s = 0.0
        self.longest_save_s = 0.0

    def arm(self) -> None:
        """After the resume: a signal now saves (when this run saves at all)."""
        self.saved_step = self.trainer.global_steps or None  # resumed from it: it is on disk
        if self.saves:
            PREEMPTION.arm(self._last_good)

    def disarm(self) -> None:
        PREEMPTION.disarm()

    def _last_good(self) -> str | None:
        root = self.trainer._checkpoints().root
        step = ck.latest_pointer(root)
        return ck.step_dir(root, step) if step else None

    # ------------------------------------------------------------------ the step
    def begin_step(self) -> None:
        """Before the step count moves on: keep the driver state a checkpoint of the last step holds."""
        if self.saves:
            self.snapshot = self.trainer.driver_state()
        self.step_started = time.monotonic()

    def check(self) -> None:
        """A stage boundary before the updates: abandon the step if a signal came."""
        if not PREEMPTION.requested:
            return
        t = self.trainer
        t.global_steps -= 1
        saved = None
        if t.global_steps > 0 and self.saved_step != t.global_steps:
            saved = t.save_checkpoint(state=self.snapshot)
        print(f"[hybridrl] {PREEMPTION.name}: step {t.global_steps + 1} abandoned before its updates")
        PREEMPTION.exit(saved)

    def end_step(self) -> None:
        self.longest_step_s = max(self.longest_step_s, time.monotonic() - self.step_started)

    def must_save(self) -> bool:
        """Save this step regardless of save_freq: preempted, or the instance expires soon."""
        if not self.saves:
            return False
        return PREEMPTION.requested or self._esi_close()

    def _esi_close(self) -> bool:
        left = esi_seconds_left()
        if left is None or left <= 0 or self.longest_step_s <= 0:
            return False
        save_s = self.longest_save_s or DEFAULT_SAVE_S
        close = left <= save_s + self.longest_step_s + self.esi_redundant_time
        if close:
            print(
                f"[hybridrl] the instance expires in {left:.0f} s (<= save {save_s:.0f} s + step "
                f"{self.longest_step_s:.0f} s + trainer.esi_redundant_time={self.esi_redundant_time:g} s): "
                f"saving step {self.trainer.global_steps}"
            )
        return close

    def saved(self, seconds: float) -> None:
        self.saved_step = self.trainer.global_steps
        self.longest_save_s = max(self.longest_save_s, seconds)

    def after_step(self) -> None:
        """The step is finished: if a signal came, save it (unless saved already) and leave."""
        if PREEMPTION.requested:
            t = self.trainer
            if self.saved_step != t.global_steps:
                t.save_checkpoint()
            PREEMPTION.exit(ck.step_dir(t._checkpoints().root, t.global_steps))

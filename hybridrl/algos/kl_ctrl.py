"""Controllers of the KL-penalty coefficient beta in the reward (`algorithm.kl_ctrl`)."""

from __future__ import annotations

from typing import Any


class FixedKLController:
    """Constant beta.

    Args:
        kl_coef: beta.
    """

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the coefficient is fixed)."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller steering the observed KL towards a target.

    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", the adaptive
    KL controller:
        e_t    = clip(KL_t / KL_target - 1, -0.2, 0.2)
        beta  <- beta * (1 + K_beta * e_t),   K_beta = n_steps / horizon

    Args:
        init_kl_coef: initial beta.
        target_kl: KL_target (> 0).
        horizon: number of samples over which beta may change by about e^(+-0.2) (> 0).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL control needs target_kl > 0 and horizon > 0, got target_kl={target_kl}, "
                f"horizon={horizon}; set algorithm.kl_ctrl.target_kl / horizon"
            )
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust beta after observing `current_kl` over `n_steps` samples (the batch size)."""
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


def get_kl_controller(
    kl_ctrl_type: str, *, kl_coef: float, target_kl: float | None = None, horizon: int | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by `algorithm.kl_ctrl.type`.

    Args:
        kl_ctrl_type: "fixed" or "adaptive".
        kl_coef: beta (initial beta for adaptive).
        target_kl: adaptive only.
        horizon: adaptive only.
    """
    if kl_ctrl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_ctrl_type == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError(
                "algorithm.kl_ctrl.type='adaptive' needs algorithm.kl_ctrl.target_kl and "
                "algorithm.kl_ctrl.horizon"
            )
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown algorithm.kl_ctrl.type {kl_ctrl_type!r}; known: adaptive, fixed")

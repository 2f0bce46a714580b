"""KL coefficient controllers."""

import pytest

from hybridrl.algos import AdaptiveKLController, FixedKLController, get_kl_controller


def test_fixed():
    ctrl = FixedKLController(kl_coef=0.05)
    ctrl.update(current_kl=10.0, n_steps=100)
    assert ctrl.value == 0.05


def test_adaptive_hand_derived():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    ctrl.update(current_kl=0.1, n_steps=10)  # error = clip(0.1/0.05 - 1) = 0.2 -> * (1 + 0.2 * 10/100)
    assert ctrl.value == pytest.approx(0.1 * 1.02)
    ctrl.update(current_kl=0.0, n_steps=10)  # error = clip(-1) = -0.2 -> * (1 - 0.02)
    assert ctrl.value == pytest.approx(0.1 * 1.02 * 0.98)
    ctrl.update(current_kl=0.05, n_steps=10)  # on target: unchanged
    assert ctrl.value == pytest.approx(0.1 * 1.02 * 0.98)


def test_state_dict_round_trip():
    ctrl = AdaptiveKLController(0.1, 0.05, 100)
    ctrl.update(0.2, 50)
    resumed = AdaptiveKLController(0.1, 0.05, 100)
    resumed.load_state_dict(ctrl.state_dict())
    assert resumed.value == ctrl.value
    fixed = FixedKLController(0.3)
    fixed.load_state_dict({"value": 0.7})
    assert fixed.value == 0.7


def test_factory():
    assert isinstance(get_kl_controller("fixed", kl_coef=0.1), FixedKLController)
    adaptive = get_kl_controller("adaptive", kl_coef=0.1, target_kl=0.05, horizon=10)
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.1
    with pytest.raises(ValueError, match="target_kl"):
        get_kl_controller("adaptive", kl_coef=0.1)
    with pytest.raises(ValueError, match="known: adaptive, fixed"):
        get_kl_controller("pid", kl_coef=0.1)
    with pytest.raises(ValueError, match="horizon > 0"):
        AdaptiveKLController(0.1, 0.05, 0)

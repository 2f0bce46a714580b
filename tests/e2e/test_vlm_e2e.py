"""A geo3k-format parquet (images as PNG bytes) through main_ppo with a tiny Qwen2-VL (and Qwen3-VL);
VLM start-up checks."""

from __future__ import annotations

import pytest

from hybridrl.data import visual_task
from hybridrl.models.vlm import build_tiny_vlm
from hybridrl.trainer.ppo.vlm_setup import load_run_processor
from hybridrl.utils.config_loader import ConfigError
from tests.e2e.ppo_runs import assert_finite, compose_config, run

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def vlm_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlm_e2e")
    model = build_tiny_vlm(tmp / "model", "qwen2_vl", seed=0)
    train = visual_task.write_rl_parquet(str(tmp / "train.parquet"), 16, seed=0, split="train")
    val = visual_task.write_rl_parquet(str(tmp / "val.parquet"), 8, seed=0, split="val")
    return model, train, val


def _overrides(vlm_files, *extra):
    model, train, val = vlm_files
    return [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={train}",
        f"data.val_files={val}",
        "data.max_prompt_length=40",
        "data.max_response_length=6",
        "algorithm.adv_estimator=grpo",
        *extra,
    ]


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("remove_padding", [False, True])
def test_main_ppo_two_steps_on_images(vlm_files, tmp_path, remove_padding):
    freeze = "true" if remove_padding else "false"
    rows = run(
        _overrides(
            vlm_files,
            "trainer.backend=local",
            f"actor_rollout_ref.model.use_remove_padding={remove_padding}",
            f"actor_rollout_ref.actor.freeze_vision_tower={freeze}",
        ),
        tmp_path,
    )
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == 2
    assert_finite(steps, ["actor/pg_loss", "actor/grad_norm", "critic/score/mean"])


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_main_ppo_two_steps_on_images_through_the_agent_loops(vlm_files, tmp_path):
    """multi_turn.enable with a VLM: the tool agent's requests carry the rows' pixels (no tool is
    configured, so every trajectory is one assistant turn); 2 GRPO steps run (a smoke test of the
    worker path: that the pixels reach generation is tests/workers/test_vlm_agent.py's check)."""
    rows = run(
        _overrides(
            vlm_files,
            "trainer.backend=local",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
        ),
        tmp_path,
    )
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == 2
    assert_finite(steps, ["actor/pg_loss", "actor/grad_norm", "num_turns/mean"])


@pytest.mark.usefixtures("ray_local")
def test_main_ppo_two_steps_on_videos(vlm_files, tmp_path):
    """A geo3k-like parquet with veRL's `videos` column (3 PNG frames a row; every other row also
    has an image) through main_ppo: 2 GRPO steps, packed forward."""
    model, _, _ = vlm_files
    train = visual_task.write_video_parquet(str(tmp_path / "vtrain.parquet"), 8, seed=0, split="train")
    val = visual_task.write_video_parquet(str(tmp_path / "vval.parquet"), 4, seed=0, split="val")
    overrides = [o for o in _overrides(vlm_files) if not o.startswith(("data.train_files", "data.val_files"))]
    overrides = [o.replace("data.max_prompt_length=40", "data.max_prompt_length=72") for o in overrides]
    rows = run(
        [*overrides, f"data.train_files={train}", f"data.val_files={val}", "data.video_key=videos",
         "trainer.backend=local", "actor_rollout_ref.model.use_remove_padding=true"],
        tmp_path,
    )  # fmt: skip
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == 2
    assert_finite(steps, ["actor/pg_loss", "actor/grad_norm", "critic/score/mean"])


@pytest.mark.usefixtures("ray_local")
def test_main_ppo_two_steps_on_images_with_qwen3_vl(vlm_files, tmp_path):
    """The same geo3k-format parquet through main_ppo with a tiny Qwen3-VL (patch 16, so
    `data.image_patch_size=16` as in veRL's Qwen3-VL scripts): 2 GRPO steps, packed forward."""
    _, train, val = vlm_files
    model = build_tiny_vlm(tmp_path / "qwen3_vl", "qwen3_vl", seed=0)
    rows = run(
        [*_overrides((model, train, val)), "data.image_patch_size=16", "trainer.backend=local",
         "actor_rollout_ref.model.use_remove_padding=true"],
        tmp_path,
    )  # fmt: skip
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == 2
    assert_finite(steps, ["actor/pg_loss", "actor/grad_norm", "critic/score/mean"])


@pytest.mark.parametrize(
    "extra, match",
    [
        (["actor_rollout_ref.actor.strategy=megatron"], "strategy=megatron with a vision-language model"),
        (["data.return_multi_modal_inputs=false"], "return_multi_modal_inputs=False"),
        (["actor_rollout_ref.rollout.name=vllm"], "rollout.name=vllm with a vision-language model"),
        (["actor_rollout_ref.rollout.name=sglang"], "only the HF rollout"),
        (["actor_rollout_ref.rollout.mode=server"], "mode=server with a vision-language model"),
    ],
)
def test_vlm_refusals_at_start_up(vlm_files, tmp_path, extra, match):
    try:
        config = compose_config(_overrides(vlm_files, *extra), tmp_path)
    except ConfigError as exc:  # refused by the schema checks already: must still name the key
        assert extra[0].split("=")[0].split(".")[-1] in str(exc)
        return
    with pytest.raises(ConfigError, match=match):
        load_run_processor(config)


def test_freeze_vision_tower_on_a_text_model_is_refused(tmp_path):
    config = compose_config(["actor_rollout_ref.actor.freeze_vision_tower=true"], tmp_path)
    with pytest.raises(ConfigError, match="is a text model"):
        load_run_processor(config)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_main_ppo_on_images_with_two_fsdp_ranks_on_ray(vlm_files, tmp_path):
    """The per-row pixel inputs are split over 2 Ray FSDP ranks (and gathered back) with their rows."""
    rows = run(
        _overrides(
            vlm_files,
            "trainer.backend=ray",
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.model.use_remove_padding=true",
            "actor_rollout_ref.actor.use_kl_loss=true",
        ),
        tmp_path,
    )
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == 2
    assert_finite(steps, ["actor/pg_loss", "actor/grad_norm", "actor/kl_loss"])


@pytest.mark.slow
def test_sigkill_resume_exact_with_images_and_hf_export_with_processor(vlm_files, tmp_path):
    """tests/e2e/test_resume.py's SIGKILL + resume on the tiny Qwen2-VL (packed, pixels through the
    rollout and the update): the resumed steps 3 and 4 log the uninterrupted run's metrics. The
    checkpoints' HF export carries the processor files and loads with AutoProcessor."""
    from transformers import AutoModelForImageTextToText

    from hybridrl.models.vlm import load_processor
    from tests.e2e.ppo_runs import SMALL
    from tests.e2e.test_resume import check_sigkill_resume

    args = [
        *SMALL,
        *_overrides(vlm_files, "actor_rollout_ref.model.use_remove_padding=true"),
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "trainer.test_freq=-1",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
    ]
    check_sigkill_resume(tmp_path, args)
    hf = tmp_path / "b_ckpt" / "global_step_4" / "actor" / "huggingface"  # written by the resumed run
    for name in ("processor_config.json", "chat_template.jinja", "tokenizer.json", "model.safetensors"):
        assert (hf / name).exists(), sorted(p.name for p in hf.iterdir())
    processor = load_processor(str(hf))
    assert processor.image_processor.patch_size == 14
    assert AutoModelForImageTextToText.from_pretrained(str(hf)).config.vision_config.patch_size == 14


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_main_ppo_on_images_with_ulysses_sp2_on_ray(vlm_files, tmp_path):
    """Ulysses SP=2 over the 2 Ray FSDP ranks of the actor (the workers' own SP groups) with images."""
    rows = run(
        _overrides(
            vlm_files,
            "trainer.backend=ray",
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.model.use_remove_padding=true",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
            "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
            "actor_rollout_ref.actor.use_kl_loss=true",
        ),
        tmp_path,
    )
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == 2
    assert_finite(steps, ["actor/pg_loss", "actor/grad_norm", "actor/kl_loss"])


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_main_ppo_qwen3_vl_with_ulysses_sp2_on_ray(vlm_files, tmp_path):
    """Qwen3-VL (deepstack cut to each SP rank's slice) with Ulysses SP=2 over 2 Ray FSDP ranks."""
    _, train, val = vlm_files
    model = build_tiny_vlm(tmp_path / "qwen3_vl", "qwen3_vl", seed=0)
    rows = run(
        [*_overrides((model, train, val)), "data.image_patch_size=16", "trainer.backend=ray",
         "trainer.n_gpus_per_node=2", "actor_rollout_ref.model.use_remove_padding=true",
         "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
         "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2", "actor_rollout_ref.actor.use_kl_loss=true"],
        tmp_path,
    )  # fmt: skip
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == 2
    assert_finite(steps, ["actor/pg_loss", "actor/grad_norm", "actor/kl_loss"])


@pytest.mark.slow
def test_sigkill_resume_exact_with_qwen3_vl(vlm_files, tmp_path):
    """The SIGKILL + resume check (tests/e2e/test_resume.py) on a tiny Qwen3-VL, packed: the resumed
    steps 3 and 4 log the uninterrupted run's metrics; the HF export keeps patch 16."""
    from hybridrl.models.vlm import load_processor
    from tests.e2e.ppo_runs import SMALL
    from tests.e2e.test_resume import check_sigkill_resume

    _, train, val = vlm_files
    model = build_tiny_vlm(tmp_path / "qwen3_vl", "qwen3_vl", seed=0)
    args = [
        *SMALL,
        *_overrides((model, train, val), "actor_rollout_ref.model.use_remove_padding=true"),
        "data.image_patch_size=16",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "trainer.test_freq=-1",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
    ]
    check_sigkill_resume(tmp_path, args)
    hf = tmp_path / "b_ckpt" / "global_step_4" / "actor" / "huggingface"
    assert load_processor(str(hf)).image_processor.patch_size == 16

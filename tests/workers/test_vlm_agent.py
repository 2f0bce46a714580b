"""Tool responses with images in the tool agent of a tiny Qwen2-VL (real HF engine, real FSDP recompute).

The model is a tiny random Qwen2-VL given a few supervised steps (`vlm_warm_start`) so that its
turns end with EOS; it never writes tool calls itself, so a registered tool-call format (the
public plug point, as in tests/agent/test_tool_agent.py) reads a call to `draw` out of
every assistant turn. `draw` returns a picture drawn in code. Checked: the tool turn holds the
processor's image tokens (mask 0) and the pixels join the row's `multi_modal_inputs`; the next turn
is generated seeing them; the rollout's log-probs equal the FSDP actor's recompute on every policy
token, the tool image changes the second turn's log-probs (not the first's), and one PPO update
runs on the batch.
"""

from __future__ import annotations

import io
import os
import sys

import numpy as np
import pytest
import torch

from hybridrl.agent.parser import ToolCall, ToolCallParser, register_tool_parser
from hybridrl.agent.runner import AgentLoopRunner
from hybridrl.config.rollout import RolloutConfig
from hybridrl.data import visual_task
from hybridrl.data.multimodal import process_row
from hybridrl.engine.multimodal import FED_KEY
from hybridrl.protocol import DataProto
from hybridrl.tools.tool import BaseTool, ToolResponse

pytest.importorskip("PIL")
TOOL_SIDE = 84  # 84 x 84 pixels: a 6 x 6 patch grid, 9 image tokens (the prompt's 56 x 56: 4); Qwen3-VL
# (patch 16) resizes it to 96 x 96: again 6 x 6


@register_tool_parser("test_vlm_always_draw")
class AlwaysDraw(ToolCallParser):
    def parse(self, text):
        return text, [ToolCall("draw", {})]


class DrawTool(BaseTool):
    """A coloured square drawn in code: PNG bytes on odd calls, a PIL image on even ones."""

    def __init__(self):
        super().__init__({}, {"type": "function", "function": {"name": "draw"}})
        self.count = 0

    async def execute(self, instance_id, parameters, **kwargs):
        import random

        from PIL import Image

        self.count += 1
        png = visual_task.draw_shape("blue", "square", random.Random(self.count), size=TOOL_SIDE)
        image = png if self.count % 2 else Image.open(io.BytesIO(png)).convert("RGB")
        return ToolResponse(text="see", image=[image]), 0.0, {}


@pytest.fixture(scope="module", params=["qwen2_vl"])
def vlm(request, tmp_path_factory):
    """The warm-started tiny VLM (Qwen2-VL; a test parametrises `vlm` indirectly for others)."""
    from hybridrl.models.vlm import build_tiny_vlm, load_processor
    from hybridrl.models.vlm_warm_start import format_warm_start

    path = build_tiny_vlm(tmp_path_factory.mktemp("agent_vlm") / "model", request.param, seed=0)
    format_warm_start(
        path, steps=20, batch_size=4, lr=3e-3, num_threads=1
    )  # short "#### colour" turns ending in EOS
    processor = load_processor(path)
    processor.tokenizer.padding_side = "left"
    return path, processor


def _prompts(processor, n):
    tok = processor.tokenizer
    ids, mms = [], []
    for k, row in enumerate(visual_task.make_rl_rows(n, seed=5)):
        _, row_ids, mm = process_row(processor, row["prompt"], row["images"], f"row {k}", {}, {})
        ids.append(row_ids)
        mms.append(mm)
    width = max(len(r) for r in ids)
    input_ids = torch.full((n, width), tok.pad_token_id)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, r in enumerate(ids):
        input_ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    tensors = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
    }
    return DataProto.from_dict(
        tensors, {"multi_modal_inputs": np.array(mms, dtype=object)}, {"seed_index": 1}
    )


def _runner(path, processor, fmt="test_vlm_always_draw", name="draw", tool=None):
    from hybridrl.rollout.hf import HFRollout

    cfg = RolloutConfig(name="hf", dtype="float32", load_format="auto", response_length=96, prompt_length=48,
                        calculate_log_probs=True, temperature=1.0,
                        multi_turn={"enable": True, "format": fmt, "max_assistant_turns": 2},
                        agent={"default_agent_loop": "tool_agent"})  # fmt: skip
    runner = AgentLoopRunner(HFRollout(cfg, path, processor.tokenizer), cfg, processor.tokenizer)
    runner.tools[name] = tool if tool is not None else DrawTool()
    return runner


def _actor(path, use_remove_padding):
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fsdp_testkit import free_port, init_dist

    from hybridrl.config.roles import (
        ActorConfig,
        FSDPConfig,
        MixedPrecisionConfig,
        ModelConfig,
        OptimConfig,
    )
    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.workers.actor import PPOActor

    if not dist.is_initialized():
        init_dist(0, 1, free_port())
    fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32"))
    cfg = ActorConfig(fsdp_config=fsdp, ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=2,
                      optim=OptimConfig(lr=1e-3))  # fmt: skip
    model = ModelConfig(path=path, use_remove_padding=use_remove_padding)
    engine = FSDPEngine.build(model, fsdp, cfg.optim, load_tok=False)
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    sizes = normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=1)
    return PPOActor(cfg, engine.module, engine.optimizer, dp_size=1, batch_sizes=sizes,
                    use_remove_padding=use_remove_padding)  # fmt: skip


def _tool_spans(out, image_id):
    """Per row: [(start, end)] of the mask-0 spans of the response, and the image tokens in them."""
    b = out.batch
    t = b["responses"].shape[1]
    spans = []
    for i in range(len(out)):
        valid = int(b["attention_mask"][i, -t:].sum())
        mask = b["response_mask"][i, :valid].tolist()
        ids = b["responses"][i, :valid].tolist()
        row, start = [], None
        for j, m in enumerate(mask + [1]):
            if m == 0 and start is None:
                start = j
            elif m == 1 and start is not None:
                row.append((start, j, sum(1 for x in ids[start:j] if x == image_id)))
                start = None
        spans.append(row)
    return spans


@pytest.mark.parametrize("vlm", ["qwen2_vl", "qwen3_vl"], indirect=True)
def test_tool_images_enter_the_next_turn_and_train(vlm):
    path, processor = vlm
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    runner = _runner(path, processor)
    prompts = _prompts(processor, 6)
    out = runner.generate_sequences(prompts)
    spans = _tool_spans(out, image_id)
    mm = out.non_tensor_batch["multi_modal_inputs"]
    with_tool = [i for i, s in enumerate(spans) if s]
    assert with_tool, "no trajectory reached a tool call"
    for i, row_spans in enumerate(spans):
        grids = torch.as_tensor(mm[i]["image_grid_thw"])
        # the prompt's image, then one 9-token image per tool turn, the tool turn all mask 0
        assert grids.shape[0] == 1 + len(row_spans), (i, grids)
        assert all(n == 9 for _, _, n in row_spans) and (grids[1:] == torch.tensor([1, 6, 6])).all()
        assert mm[i]["pixel_values"].shape[0] == int(grids.prod(-1).sum())
        resp = out.batch["responses"][i]
        fed = [j for s, e, _ in row_spans for j in range(s, e) if int(resp[j]) == image_id]
        assert torch.as_tensor(mm[i].get(FED_KEY, [])).tolist() == fed
    assert out.meta_info["metrics"]["agent/tool_images/mean"] == pytest.approx(
        sum(len(s) for s in spans) / len(spans)
    )
    second = torch.zeros_like(
        out.batch["response_mask"], dtype=torch.bool
    )  # policy tokens after a tool image
    for i in with_tool:
        second[i, spans[i][0][1] :] = True
    mask = out.batch["response_mask"].bool()
    assert int((second & mask).sum()) > 0, "no policy token after a tool image"
    for use_remove_padding in (False, True):
        actor = _actor(path, use_remove_padding)
        lp = actor.compute_log_prob(out, micro_batch_size=2).log_probs
        torch.testing.assert_close(out.batch["rollout_log_probs"][mask], lp[mask], atol=1e-4, rtol=0)
    # the tool image reaches the model where its tokens are: changing it moves the later turn only
    changed = DataProto(batch=out.batch, non_tensor_batch=dict(out.non_tensor_batch))
    rows = []
    for i in range(len(out)):
        row = dict(mm[i])
        n_prompt = int(torch.as_tensor(row["image_grid_thw"][0]).prod())
        row["pixel_values"] = torch.cat([row["pixel_values"][:n_prompt], -row["pixel_values"][n_prompt:]])
        rows.append(row)
    changed.non_tensor_batch["multi_modal_inputs"] = np.array(rows, dtype=object)
    lp2 = actor.compute_log_prob(changed, micro_batch_size=2).log_probs
    first = mask & ~second
    torch.testing.assert_close(lp2[first], lp[first], atol=1e-5, rtol=0)
    assert float((lp2 - lp)[second & mask].abs().max()) > 1e-4
    # one PPO update on the trajectories (old log-probs = the recompute, random advantages)
    out.batch["old_log_probs"] = lp
    out.batch["advantages"] = torch.randn(lp.shape, generator=torch.Generator().manual_seed(0)) * mask
    metrics = actor.update_policy(out)
    assert np.isfinite(metrics["actor/pg_loss"]).all() and np.isfinite(metrics["actor/grad_norm"]).all()
    runner.close()


def test_tool_images_in_a_text_run_are_an_error_text(vlm):
    """Without a vision-language model the same tool's images are refused per call (an error the
    policy sees), as before."""
    import asyncio

    from hybridrl.agent.parser import parse_call_json
    from hybridrl.agent.tool_agent import TrajectoryTools

    async def go(images):
        tt = TrajectoryTools({"draw": DrawTool()}, None, timeout_s=5.0, images=images)
        return tt, await tt.call_response(parse_call_json('{"name": "draw", "arguments": {}}'))

    tt, resp = asyncio.run(go(False))
    assert resp.text.startswith("Error: tool 'draw' returned images") and not resp.image and tt.errors == 1
    tt, resp = asyncio.run(go(True))
    assert resp.text == "see" and len(resp.image) == 1 and tt.errors == 0


# ---- tool videos (ToolResponse.video) ------------------------------------------------------------
@register_tool_parser("test_vlm_always_film")
class AlwaysFilm(ToolCallParser):
    def parse(self, text):
        return text, [ToolCall("film", {})]


class FilmTool(BaseTool):
    """A 3-frame clip of a moving square drawn in code (t = 2 temporal patches of 4 x 4: 8 video
    tokens): veRL's ``{"video": [frames]}`` on odd calls, a bare list of PNG frames plus an 84 x 84
    picture (9 image tokens) on even ones."""

    def __init__(self):
        super().__init__({}, {"type": "function", "function": {"name": "film"}})
        self.count = 0

    async def execute(self, instance_id, parameters, **kwargs):
        import random

        self.count += 1
        rng = random.Random(self.count)
        frames = [visual_task.draw_shape("green", "disc", rng, size=56) for _ in range(3)]
        if self.count % 2:
            return ToolResponse(text="film", video=[{"video": frames}]), 0.0, {}
        picture = visual_task.draw_shape("blue", "square", rng, size=TOOL_SIDE)
        return ToolResponse(text="film", image=[picture], video=[frames]), 0.0, {}


def test_tool_videos_enter_the_next_turn_and_train(vlm):
    """As the tool-image test, for a tool returning videos (and once in two an image too): the tool
    turn holds the video's tokens (mask 0), its pixels join `pixel_values_videos` after the
    prompt's, the rollout's log-probs equal the FSDP recompute, the video moves the later turn only."""
    path, processor = vlm
    tok = processor.tokenizer
    video_id = tok.convert_tokens_to_ids("<|video_pad|>")
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    runner = _runner(path, processor, "test_vlm_always_film", "film", FilmTool())
    out = runner.generate_sequences(_prompts(processor, 6))
    spans = _tool_spans(out, video_id)
    mm = out.non_tensor_batch["multi_modal_inputs"]
    assert any(spans), "no trajectory reached a tool call"
    for i, row_spans in enumerate(spans):
        assert all(n == 8 for _, _, n in row_spans)  # 3 frames of 56 x 56: t=2, 4 x 4 patches / 2**2
        if not row_spans:
            assert "pixel_values_videos" not in mm[i]
            continue
        grids = torch.as_tensor(mm[i]["video_grid_thw"])
        assert grids.tolist() == [[2, 4, 4]] * len(row_spans)
        assert mm[i]["pixel_values_videos"].shape[0] == int(grids.prod(-1).sum())
        resp = out.batch["responses"][i]
        fed = [j for s, e, _ in row_spans for j in range(s, e) if int(resp[j]) in (video_id, image_id)]
        assert torch.as_tensor(mm[i][FED_KEY]).tolist() == fed
        images = int((resp[torch.as_tensor(fed)] == image_id).sum())
        assert images == 9 * (torch.as_tensor(mm[i]["image_grid_thw"]).shape[0] - 1)  # tool pictures
    assert out.meta_info["metrics"]["agent/tool_videos/mean"] == pytest.approx(
        sum(len(s) for s in spans) / len(spans)
    )
    second = torch.zeros_like(out.batch["response_mask"], dtype=torch.bool)
    for i, row_spans in enumerate(spans):
        if row_spans:
            second[i, row_spans[0][1] :] = True
    mask = out.batch["response_mask"].bool()
    assert int((second & mask).sum()) > 0, "no policy token after a tool video"
    for use_remove_padding in (False, True):
        actor = _actor(path, use_remove_padding)
        lp = actor.compute_log_prob(out, micro_batch_size=2).log_probs
        torch.testing.assert_close(out.batch["rollout_log_probs"][mask], lp[mask], atol=1e-4, rtol=0)
    _grouped_equals_plain(path, out)
    changed = DataProto(batch=out.batch, non_tensor_batch=dict(out.non_tensor_batch))
    rows = []
    for i in range(len(out)):
        row = dict(mm[i])
        if "pixel_values_videos" in row:
            row["pixel_values_videos"] = -row["pixel_values_videos"]
        rows.append(row)
    changed.non_tensor_batch["multi_modal_inputs"] = np.array(rows, dtype=object)
    lp2 = actor.compute_log_prob(changed, micro_batch_size=2).log_probs
    torch.testing.assert_close(lp2[mask & ~second], lp[mask & ~second], atol=1e-5, rtol=0)
    assert float((lp2 - lp)[second & mask].abs().max()) > 1e-4
    out.batch["old_log_probs"] = lp
    out.batch["advantages"] = torch.randn(lp.shape, generator=torch.Generator().manual_seed(0)) * mask
    metrics = actor.update_policy(out)
    assert np.isfinite(metrics["actor/pg_loss"]).all() and np.isfinite(metrics["actor/grad_norm"]).all()
    runner.close()


def _grouped_equals_plain(path, out):
    """The shared-prompt forward on the trajectories (each row twice: groups of 2 whose responses
    hold tool videos and pictures) == the plain packed forward (fp32)."""
    from transformers import AutoModelForImageTextToText

    from hybridrl.engine.forward import forward_log_probs
    from hybridrl.engine.multimodal import attach_multimodal

    twice = DataProto.concat([out, out])
    batch = attach_multimodal(
        twice.batch.select("input_ids", "attention_mask", "position_ids", "responses").clone(), twice
    )
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    mask = twice.batch["response_mask"].bool()
    with torch.no_grad():
        plain = forward_log_probs(model, batch, use_remove_padding=True).log_probs
        grouped = forward_log_probs(model, batch, use_remove_padding=True, prefix_group=True).log_probs
    torch.testing.assert_close(grouped[mask], plain[mask], atol=1e-5, rtol=0)


def test_tool_videos_in_a_text_run_are_an_error_text():
    import asyncio

    from hybridrl.agent.parser import parse_call_json
    from hybridrl.agent.tool_agent import TrajectoryTools

    async def go(images):
        tt = TrajectoryTools({"film": FilmTool()}, None, timeout_s=5.0, images=images)
        return tt, await tt.call_response(parse_call_json('{"name": "film", "arguments": {}}'))

    tt, resp = asyncio.run(go(False))
    assert resp.text.startswith("Error: tool 'film' returned videos") and not resp.video and tt.errors == 1
    tt, resp = asyncio.run(go(True))
    assert resp.text == "film" and len(resp.video) == 1 and tt.errors == 0


def _png(w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


class BrokenMediaTool(BaseTool):
    """Returns the media it is built with (bytes that are no image, a missing file, frames of two
    sizes, ...)."""

    def __init__(self, image=(), video=()):
        super().__init__({}, {"type": "function", "function": {"name": "broken"}})
        self.image, self.video = list(image), list(video)

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="here", image=self.image, video=self.video), 0.0, {}


@pytest.mark.parametrize(
    "media, says",
    [
        ({"image": [b"not a picture"]}, "image 0"),
        ({"image": ["/nonexistent/plot.png"]}, "image file not found"),
        ({"video": [{"video": []}]}, "video 0"),
        ({"video": [[_png(8, 8), _png(16, 16)]]}, "one size"),
    ],
)
def test_tool_media_that_does_not_decode_is_an_error_text(media, says):
    """A tool image or video that does not decode is an error text the policy sees (counted in
    tool_errors), not an exception out of the rollout; good media still pass, decoded."""
    import asyncio

    from PIL import Image

    from hybridrl.agent.parser import parse_call_json
    from hybridrl.agent.tool_agent import TrajectoryTools

    async def go(tool):
        tt = TrajectoryTools({"broken": tool}, None, timeout_s=5.0, images=True)
        return tt, await tt.call_response(parse_call_json('{"name": "broken", "arguments": {}}'))

    tt, resp = asyncio.run(go(BrokenMediaTool(**media)))
    assert resp.text.startswith("Error: tool 'broken' returned media that does not decode: tool 'broken'")
    assert says in resp.text and not resp.image and not resp.video and tt.errors == 1
    tt, resp = asyncio.run(go(BrokenMediaTool(image=[_png(8, 8)], video=[[_png(8, 8), _png(8, 8)]])))
    assert resp.text == "here" and tt.errors == 0
    assert isinstance(resp.image[0], Image.Image) and [f.size for f in resp.video[0]] == [(8, 8), (8, 8)]


@pytest.mark.parametrize("vlm", ["qwen3_vl"], indirect=True)
def test_tool_videos_with_qwen3_vl_are_refused(vlm):
    """A tool returning videos to a Qwen3-VL run stops the rollout with the refusal (its frame
    timestamps are not written; hybridrl.data.video.qwen3_vl_video_refusal), not a wrong layout."""
    path, processor = vlm
    runner = _runner(path, processor, "test_vlm_always_film", "film", FilmTool())
    try:
        with pytest.raises(ValueError, match="videos with a Qwen3-VL model are not supported yet"):
            runner.generate_sequences(_prompts(processor, 6))
    finally:
        runner.close()

"""Images in the agent loops of a vision-language model (docs/vlm.md, "Agent loops").

A trajectory carries its pixel inputs beside its ids: the prompt's (the dataset's
`multi_modal_inputs`), then those of every image a tool returned (veRL's `ToolResponse.image`), in
the order their image tokens appear, and likewise the videos (`ToolResponse.video`:
``pixel_values_videos`` / ``video_grid_thw``, prompt's first). A tool turn with images or videos is
rendered by the chat template with one ``{"type": "image"}`` content part per image, then one
``{"type": "video"}`` per video, before the text (one ``<|image_pad|>`` / ``<|video_pad|>`` each,
inside the vision markers), and each such token is expanded to the image's (video's)
``t * h * w / merge_size**2`` tokens, as the processor does for a prompt. A tool video is any
entry a dataset's ``videos`` column takes (frames, or a file read with PyAV; hybridrl.data.video). The whole tool turn is
mask 0: the next assistant turn is generated with the tool's images as model input, and the
trainer's forward feeds them the same way: the row's ``multi_modal_inputs`` lists their places in
the response (``response_vision_positions``, read by `engine.multimodal`; any other vision token
of the response is a sampled text token, whatever later steps do to ``response_mask``).

A vision token the policy samples (``<|image_pad|>`` / ``<|video_pad|>`` inside an assistant
turn) is a text token to the trainer. Fed back to the rollout engine in a later turn it would
count as an image placeholder without pixels, so the trajectory ends after such a turn (counted
in the trajectory's `vision_token_stops`); the sampled tokens and their log-probs stay as they
are.

Shapes: N patch rows of an image (pixel_values (N, D)), I images (image_grid_thw (I, 3)); M patch
rows and V videos likewise (pixel_values_videos (M, D), video_grid_thw (V, 3)).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridrl.data.multimodal import decode_image

__all__ = ["VisionTurns", "merge_inputs"]

_KEYS = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))


def merge_inputs(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any]:
    """Two rows' worth of processor inputs concatenated (first's images before second's)."""
    out = dict(first or {})
    for key, value in (second or {}).items():
        out[key] = torch.cat([torch.as_tensor(out[key]), torch.as_tensor(value)]) if key in out else value
    return out


class VisionTurns:
    """The image side of a VLM run's agent loops.

    Args:
        processor: the model's processor (`hybridrl.models.vlm.load_processor`): its image
            processor turns tool images into pixel inputs, its tokenizer names the vision tokens.
    """

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        tok = processor.tokenizer
        self.image_token_id = int(
            getattr(processor, "image_token_id", None) or tok.convert_tokens_to_ids("<|image_pad|>")
        )
        video = getattr(processor, "video_token_id", None) or tok.convert_tokens_to_ids("<|video_pad|>")
        self.video_token_id = int(video)
        self.placeholder_ids = {self.image_token_id, self.video_token_id}
        self.merge = int(getattr(processor.image_processor, "merge_size", 2))

    @classmethod
    def for_model(cls, model_path: str | None) -> VisionTurns | None:
        """The VisionTurns of a vision-language model folder; None for a text model (or no path)."""
        if not model_path:
            return None
        from hybridrl.models.vlm import load_processor

        processor = load_processor(model_path)
        return cls(processor) if processor is not None else None

    def image_inputs(self, images: list[Any], where: str) -> dict[str, torch.Tensor]:
        """pixel_values (N, D) and image_grid_thw (I, 3) of a tool's images (PIL, bytes, path, dict).

        Raises:
            ValueError: an image that does not decode, naming `where`.
        """
        pil = [decode_image(im, f"{where} image {k}") for k, im in enumerate(images)]
        enc = self.processor.image_processor(images=pil, return_tensors="pt")
        return {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}

    def video_inputs(self, videos: list[Any], where: str) -> dict[str, torch.Tensor]:
        """pixel_values_videos (M, D) and video_grid_thw (V, 3) of a tool's videos, each in any form
        a dataset's video takes (`hybridrl.data.video.decode_video`: a frame list, ``{"video":
        [frames]}``, a file path or ``{"video": path, "fps": ...}`` with PyAV).

        Raises:
            ValueError: a video that does not decode (or a file without PyAV), naming `where`.
        """
        from hybridrl.data.video import decode_video, refuse_qwen3_vl_videos, video_inputs

        refuse_qwen3_vl_videos(self.processor, where)
        per = [
            video_inputs(self.processor.image_processor, decode_video(v, f"{where} video {k}"))
            for k, v in enumerate(videos)
        ]
        return {
            "pixel_values_videos": torch.cat([v["pixel_values_videos"] for v in per]),
            "video_grid_thw": torch.cat([v["video_grid_thw"] for v in per]),
        }

    def expand(self, ids: list[int], grid_thw: torch.Tensor) -> list[int]:
        """`ids` with its k-th image token repeated t*h*w / merge**2 times for image k of `grid_thw`."""
        n = [int(g.prod()) // self.merge**2 for g in torch.as_tensor(grid_thw)]
        found = sum(1 for i in ids if i == self.image_token_id)
        if found != len(n):
            raise ValueError(
                f"the chat template rendered {found} image token(s) for {len(n)} tool image(s); it must render "
                "one <|image_pad|> per {'type': 'image'} content part (use the model's own chat template)"
            )
        out, k = [], 0
        for i in ids:
            if i == self.image_token_id:
                out += [i] * n[k]
                k += 1
            else:
                out.append(i)
        return out

    def tool_turn(
        self,
        renderer: Any,
        texts: list[str],
        images: list[list[Any]],
        role: str = "tool",
        videos: list[list[Any]] | None = None,
    ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """Ids (image and video tokens expanded) and pixel inputs of one turn of tool responses.

        Args:
            renderer: the loop's `tokenization.ToolTurnRenderer`.
            texts: each response's text; images / videos: each response's images / videos (maybe
                empty lists). A response's content is its images, then its videos, then its text.
        """
        videos = videos or [[] for _ in texts]
        contents: list[Any] = []
        flat_images: list[Any] = []
        flat_videos: list[Any] = []
        for text, ims, vids in zip(texts, images, videos):
            if not ims and not vids:
                contents.append(text)
                continue
            parts = [{"type": "image"} for _ in ims] + [{"type": "video"} for _ in vids]
            contents.append(parts + [{"type": "text", "text": text}])
            flat_images += list(ims)
            flat_videos += list(vids)
        ids = renderer.ids(contents, role=role)
        mm: dict[str, torch.Tensor] = {}
        if flat_images:
            mm = self.image_inputs(flat_images, f"{role} response")
            ids = self.expand(ids, mm["image_grid_thw"])
        if flat_videos:
            from hybridrl.data.video import expand_video_tokens

            mm.update(self.video_inputs(flat_videos, f"{role} response"))
            try:
                ids = expand_video_tokens(ids, self.video_token_id, mm["video_grid_thw"], self.merge)
            except ValueError as exc:
                raise ValueError(
                    f"{exc}: the chat template must render one <|video_pad|> per {{'type': 'video'}} content "
                    "part (use the model's own chat template)"
                ) from exc
        return ids, mm

    def row_inputs(self, mm: dict[str, Any] | None, ids: list[int], mask: list[int]) -> dict[str, Any]:
        """The trajectory's `multi_modal_inputs`: its pixel inputs plus the places (K,) in the
        response of the vision tokens tool turns fed (mask 0)."""
        from hybridrl.engine.multimodal import FED_KEY

        out = dict(mm or {})
        fed = [j for j, (t, m) in enumerate(zip(ids, mask)) if m == 0 and t in self.placeholder_ids]
        if fed:
            out[FED_KEY] = torch.tensor(fed, dtype=torch.long)
        return out

    def sampled_placeholder(self, token_ids: list[int]) -> bool:
        """Whether a generated turn holds an image / video placeholder token."""
        return any(t in self.placeholder_ids for t in token_ids)

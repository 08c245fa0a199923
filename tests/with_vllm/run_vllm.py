"""One vLLM run over a fixed set of image prompts, printed as JSON (tokens and logprobs per prompt).

    python tests/with_vllm/run_vllm.py MODEL [--visenc URL] [--grid-only] [--in-process] [--video] [--control]

``--visenc URL``: vLLM as an ``ec_consumer`` with ``visenc_client.vllm.VisencConnector``; every
image carries its visenc hash as its uuid (the images must already be encoded by visenc); the
connector accepts visenc's weights whatever they are (``accept_other_weights``: the tests run a wrong copy).
``--grid-only``: the images are sent as their ``image_grid_thw`` (taken from visenc, or from the
tower's layout where visenc cannot be reached), no pixels; then one more prompt with pixels.
``--video``: the prompts are videos instead (``videos()``: frames already sampled, as arrays), each
carrying its visenc video hash as its uuid.
``--control``: then, in the same engine, the same prompts again (a second ``generate``, so the first
batch is as without it), each image or video under a uuid visenc has never seen (a valid hash of
something else): the connector finds nothing and vLLM encodes them with its own tower, as it would
alone. Printed as ``CONTROL [...]``.
Run in its own process: vLLM keeps process-wide state.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

#: (width, height) per image of each prompt: sizes that need no resize (multiples of 28) and sizes that do
PROMPTS = [[(300, 200)], [(517, 333), (224, 224)], [(640, 480)], [(336, 196), (97, 131)]]


def picture(width: int, height: int, seed: int) -> bytes:
    """A blocky, noisy RGB PNG (what a client would send)."""
    from PIL import Image

    rnd = random.Random(seed)
    image = Image.new("RGB", (width, height))
    for y in range(0, height, 11):
        for x in range(0, width, 13):
            image.paste((rnd.randrange(256), rnd.randrange(256), rnd.randrange(256)), (x, y, x + 13, y + 11))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def images() -> list[list[bytes]]:
    return [[picture(w, h, 100 * p + i) for i, (w, h) in enumerate(sizes)] for p, sizes in enumerate(PROMPTS)]


#: (frames, width, height) of each video prompt: an even and an odd frame count, sizes that need a resize
VIDEOS = [(4, 200, 120), (5, 97, 61), (6, 300, 90)]


def videos() -> list[list[bytes]]:
    """Each video prompt's frames as PNG files (lossless: vLLM gets the same pixels as arrays)."""
    return [[picture(w, h, 1000 * v + i) for i in range(t)] for v, (t, w, h) in enumerate(VIDEOS)]


#: one image's prompt text for the families built by tests/support/tiny_processors.py (by model_type)
FAMILY_PROMPTS = {
    "mistral3": "[IMG]",
    "llava_onevision": "<image>",
    "glm4v": "<|begin_of_image|><|image|><|end_of_image|>",
    "idefics3": "<image>",
    "smolvlm": "<image>",
    "internvl": "<IMG_CONTEXT>",
    "gemma4": "<|image|>",
}


def text(n_images: int, model_type: str = "qwen2_vl") -> str:
    if model_type in FAMILY_PROMPTS:
        return "user\n" + FAMILY_PROMPTS[model_type] * n_images + "Describe the pictures.\nassistant\n"
    if model_type == "gemma3":
        return "<bos>user\n" + "<start_of_image>" * n_images + "Describe the pictures.\nmodel\n"
    pads = "<|vision_start|><|image_pad|><|vision_end|>" * n_images
    return f"<|im_start|>user\n{pads}Describe the pictures.<|im_end|>\n<|im_start|>assistant\n"


def video_requests(uuids: bool) -> list[dict]:
    """One prompt per video of ``videos()``: its frames as one ``[T, H, W, 3]`` array."""
    import numpy as np
    from PIL import Image

    from visenc_client import image_hash, video_hash

    out = []
    for frames in videos():
        clip = np.stack([np.asarray(Image.open(io.BytesIO(f)).convert("RGB")) for f in frames])
        pads = "<|vision_start|><|video_pad|><|vision_end|>"
        prompt = f"<|im_start|>user\n{pads}Describe the video.<|im_end|>\n<|im_start|>assistant\n"
        # frames the caller sampled: the metadata says so (vLLM samples none of its own)
        t = len(frames)
        meta = {"fps": 2.0, "duration": t / 2, "total_num_frames": t, "frames_indices": list(range(t))}
        meta |= {"video_backend": "opencv", "do_sample_frames": False}
        request: dict = {"prompt": prompt, "multi_modal_data": {"video": (clip, meta)}}
        if uuids:
            request["multi_modal_uuids"] = {"video": [video_hash([image_hash(f) for f in frames])]}
        out.append(request)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--visenc", default=None)
    parser.add_argument("--grid-only", action="store_true")
    parser.add_argument("--in-process", action="store_true")
    parser.add_argument("--video", action="store_true")
    parser.add_argument("--control", action="store_true")
    args = parser.parse_args()
    if args.control and args.grid_only:
        parser.error("--control needs pixels (vLLM encodes the control's items itself)")
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from PIL import Image
    from vllm import LLM, SamplingParams
    from vllm.config import ECTransferConfig

    from visenc_client import Client, VisencClientError, image_hash

    options: dict = {}
    if args.visenc:
        options["ec_transfer_config"] = ECTransferConfig(
            ec_connector="VisencConnector",
            ec_connector_module_path="visenc_client.vllm",
            ec_role="ec_consumer",
            ec_connector_extra_config={"url": args.visenc, "accept_other_weights": True},
        )
    llm = LLM(
        model=args.model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        max_num_seqs=4,
        limit_mm_per_prompt={"image": 2, "video": 1 if args.video else 0},
        seed=0,
        distributed_executor_backend="uni" if args.in_process else None,
        **options,
    )
    model_type = json.loads((Path(args.model) / "config.json").read_text())["model_type"]
    requests = video_requests(args.visenc is not None) if args.video else []
    for datas in [] if args.video else images():
        hashes = [image_hash(d) for d in datas]
        if args.grid_only:
            try:
                with Client(args.visenc) as vc:
                    grids = [list(h.grid_thw) for h in vc.lookup(hashes, pin=False)]
            except VisencClientError:
                from visenc.models.loading import load_tower

                tower = load_tower(args.model)
                grids = [list(tower.layout(*Image.open(io.BytesIO(d)).size).grid_thw) for d in datas]
            data: object = {"image_grid_thw": torch.tensor(grids)}
        else:
            data = [Image.open(io.BytesIO(d)).convert("RGB") for d in datas]
        request = {"prompt": text(len(datas), model_type), "multi_modal_data": {"image": data}}
        if args.visenc:
            request["multi_modal_uuids"] = {"image": hashes}
        requests.append(request)
    if args.grid_only:  # and one with pixels, in the same engine
        datas = images()[0]
        pixels = [Image.open(io.BytesIO(d)).convert("RGB") for d in datas]
        request = {"prompt": text(len(datas), model_type), "multi_modal_data": {"image": pixels}}
        if args.visenc:
            request["multi_modal_uuids"] = {"image": [image_hash(d) for d in datas]}
        requests.append(request)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    print("RESULT " + json.dumps(completions(llm.generate(requests, params, use_tqdm=False))), flush=True)
    if args.control:
        unseen = [unknown_to_visenc(r) for r in requests]
        print("CONTROL " + json.dumps(completions(llm.generate(unseen, params, use_tqdm=False))), flush=True)
    return 0


def completions(outs: list) -> list[dict]:
    """Tokens, the chosen tokens' logprobs and the finish reason of each output."""
    result = []
    for out in outs:
        completion = out.outputs[0]
        chosen = [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)]
        result.append(
            {"tokens": list(completion.token_ids), "logprobs": chosen, "finish_reason": completion.finish_reason}
        )
    return result


def unknown_to_visenc(request: dict) -> dict:
    """``request`` with each item's uuid replaced by a valid hash of something else (visenc has no
    entry under it): the connector looks it up, finds it missing, and vLLM encodes the item."""
    import hashlib

    items = request.get("multi_modal_uuids") or {
        kind: [f"unseen-{kind}-{i}" for i in range(len(data) if isinstance(data, list) else 1)]
        for kind, data in request["multi_modal_data"].items()
    }
    unseen = {
        kind: [hashlib.sha256(f"control:{uuid}".encode()).hexdigest() for uuid in uuids]
        for kind, uuids in items.items()
    }
    return {**request, "multi_modal_uuids": unseen}


if __name__ == "__main__":
    sys.exit(main())

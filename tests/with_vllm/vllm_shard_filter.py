"""The safetensors shards vLLM 0.32 reads for a checkpoint under ``--mm-encoder-only``, printed as JSON.

    python tests/with_vllm/vllm_shard_filter.py FOLDER

vLLM's own code end to end: the model class built as vLLM builds it for ``--mm-encoder-only`` (on the
meta device: its language model marked, nothing allocated), ``DefaultModelLoader._prepare_weights`` (the
files it would read), then ``filter_mm_encoder_only_safetensors_files`` with the prefixes and weights
mapper the loader derives from the model (``_init_mm_encoder_only_weight_filter``), as
``_get_weights_iterator`` calls them. Run in its own process: vLLM's distributed state is process-wide.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if str(ROOT := Path(__file__).resolve().parents[2]) not in sys.path:  # run as a script: tests.support
    sys.path.insert(0, str(ROOT))


def kept_shards(folder: Path) -> list[str]:
    import torch
    from harness.waits import free_port
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.model_loader.weight_utils import filter_mm_encoder_only_safetensors_files

    config = EngineArgs(model=str(folder), mm_encoder_only=True, enforce_eager=True).create_engine_config()
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        with torch.device("meta"):
            model = initialize_model(vllm_config=config)
        loader = DefaultModelLoader(config.load_config)
        loader._init_mm_encoder_only_weight_filter(model, config.model_config)
        hf_folder, files, use_safetensors, index_file = loader._prepare_weights(str(folder), None, None, True, None)
        assert use_safetensors and loader._encoder_only_lm_prefixes is not None
        kept = filter_mm_encoder_only_safetensors_files(
            files,
            hf_folder,
            index_file,
            loader._encoder_only_lm_prefixes,
            weights_mapper=loader._encoder_only_weights_mapper,
        )
    return sorted(Path(f).name for f in kept)


if __name__ == "__main__":
    print(json.dumps(kept_shards(Path(sys.argv[1]))))

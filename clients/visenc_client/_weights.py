"""What a connector expects of the visenc it reads (``Served``), its weights above all (``EngineWeights``)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from visenc_client.checkpoint import tensor_files, weights_identity

log = logging.getLogger("visenc_client.vllm")

#: the option that uses a visenc whatever weights it serves
ACCEPT_OPTION = "accept_other_weights"


def checkpoint_folder(model: str, revision: str | None = None, cache_dir: str | None = None) -> Path | None:
    """The local folder of the engine's checkpoint (``model``, or its hub cache snapshot); ``None`` if none."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        found = snapshot_download(model, revision=revision, cache_dir=cache_dir, local_files_only=True)
    except Exception as e:
        log.debug("VisencConnector: no local snapshot of %s (%s)", model, e)
        return None
    return Path(found)


@functools.lru_cache(maxsize=8)
def _identity(folder: Path, names: tuple[str, ...]) -> str | None:
    files = tensor_files(folder)
    if not files:
        raise ValueError(f"no safetensors files in {folder}")
    if any(n not in files for n in names):
        return None
    return weights_identity({n: files[n] for n in names})


@dataclass(frozen=True)
class EngineWeights:
    """The engine's model and checkpoint ``folder``; ``accept_other``: a visenc serving other weights is used."""

    model: str
    folder: Path | None
    accept_other: bool = False

    def refusal(self, url: str, served: dict[str, Any]) -> str | None:
        theirs, name = served.get("weights"), served.get("name")
        why = self._difference(theirs)
        if why is None:
            return None
        refusal = f"visenc at {url} serves {name!r}, vLLM serves {self.model!r}: {why}"
        if self.accept_other:
            log.warning("VisencConnector: %s; used all the same (%s: true)", refusal, ACCEPT_OPTION)
            return None
        return f"{refusal}; set {ACCEPT_OPTION}: true to use it knowingly"

    def _difference(self, theirs: Any) -> str | None:
        if not isinstance(theirs, dict) or not isinstance(theirs.get("tensors"), list):
            return "it does not say which weights (a built-in tower, or a visenc too old to say): not compared"
        if self.folder is None:
            return "vLLM's checkpoint files were not found on this host: the weights could not be compared"
        try:
            ours = _identity(self.folder, tuple(str(n) for n in theirs["tensors"]))
        except (OSError, ValueError, KeyError) as e:
            return f"vLLM's checkpoint files could not be read ({e}): the weights could not be compared"
        if ours is None:
            return "vLLM's checkpoint lacks tensors visenc's has: other weights (another model)"
        if ours != theirs.get("identity"):
            return f"other weights (visenc's {theirs.get('identity')}, vLLM's {ours}): their rows differ"
        return None


@dataclass(frozen=True)
class Served:
    """What a connector expects of the visenc it reads (``None`` fingerprint or weights: not compared)."""

    hidden: int
    loader: str
    fingerprint: str | None = None
    weights: EngineWeights | None = None

    def refusal(self, url: str, served: dict[str, Any]) -> str | None:
        """Why the visenc at ``url``, which answered ``served``, cannot be used."""
        hidden = int(served.get("hidden_size", -1))
        if hidden != self.hidden:
            return (
                f"visenc at {url} serves {served.get('name')!r} with rows of width {hidden}, but this model's "
                f"image embeddings are {self.hidden} wide: it serves another model"
            )
        if str(served.get("image_loader")) != self.loader:
            return (
                f"visenc at {url} loads images as {served.get('image_loader')!r}, but this is {self.loader}: "
                "serve visenc with --image-loader vllm, in a release that follows this vLLM "
                "(EXIF orientation and transparency would give other rows)"
            )
        if self.fingerprint is not None and served.get("fingerprint") != self.fingerprint:
            return f"visenc at {url} serves fingerprint {served.get('fingerprint')}, expected {self.fingerprint}"
        return None

    def weights_refusal(self, url: str, served: dict[str, Any]) -> str | None:
        return None if self.weights is None else self.weights.refusal(url, served)

"""Every family's handle against its own full transformers ``Processor`` (image processor and a
tokenizer), not only against its image processor and the model's placeholder check.

Per family, at the degenerate sizes and 16 seeded random sizes (8 px to 3x the processor's
largest side, aspect ratios to 40:1), in both image-processor backends:

- the handle's row count (``layout``, from the size alone) equals the number of image
  placeholders the ``Processor`` writes into the prompt;
- the span (``span``: rows and the text around them) equals the prompt text the ``Processor``
  writes for the image, token for token (this found Mistral 3's grid transposed for an image 1 or
  3 pixels tall: the size was read from a shape-only array whose channel axis transformers guessed);
- where the ``Processor`` refuses a size it reads (its channel-axis guess on a 1 or 3 pixel
  side), visenc refuses the image when it is preprocessed.

Rows are checked against the same models in ``test_family_sizes.py``; Mistral 3 has its own,
older test of the same kind (``test_mistral3_processor.py``).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tests.golden.test_family_sizes import DEGENERATE, SIZES_PER_FAMILY, largest_side, random_sizes
from tests.support.tiny_processors import BACKENDS, PROCESSORS, save_with_processor
from transformers import AutoImageProcessor, AutoTokenizer

from visenc.errors import InvalidImage
from visenc.models.base import Rows
from visenc.models.loading import load_tower


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_count_and_span_equal_the_processor(name: str, backend: str, tmp_path: Path) -> None:
    spec = PROCESSORS[name]
    path = save_with_processor(name, tmp_path / name)
    tower = load_tower(str(path), image_backend=backend)
    tok = AutoTokenizer.from_pretrained(path)
    processor = spec.make(AutoImageProcessor.from_pretrained(path, backend=backend), tok)
    image_id = tok.convert_tokens_to_ids(spec.image_token)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    checked = 0
    for width, height in DEGENERATE + random_sizes(rng, largest_side(processor.image_processor), SIZES_PER_FAMILY):
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        try:
            layout = tower.layout(width, height)
        except InvalidImage:
            continue  # sizes the model refuses: test_family_sizes.py checks the VLM refuses them too
        try:
            ids = processor(text=spec.prompt, images=[image], return_tensors="np")["input_ids"][0]
        except ValueError:  # the processor refuses the size it read: visenc too
            with pytest.raises(InvalidImage):
                tower.preprocess(image)
            continue
        where = (name, backend, width, height)
        assert int((ids == image_id).sum()) == layout.num_tokens, where
        checked += 1
        span = "".join(spec.image_token * s.count if isinstance(s, Rows) else s for s in tower.span(width, height))
        assert tok.decode(ids.tolist()) == span, where
    assert checked >= (len(DEGENERATE) + SIZES_PER_FAMILY) // 2, f"{name}: too few sizes accepted"

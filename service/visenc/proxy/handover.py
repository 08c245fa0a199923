"""What visenc is told: a request's images, handed over hash-first in the background, and which it lacks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from visenc.proxy.affinity import Memo
from visenc.proxy.images import Image, Images
from visenc.proxy.settings import ProxySettings
from visenc_client import AsyncClient, VisencClientError

log = logging.getLogger("visenc.proxy")

#: after visenc failed to say in time which images it lacks, new images count as lacking this long
QUIET_S = 1.0


class Handover:
    def __init__(self, settings: ProxySettings, memo: Memo, visenc: AsyncClient, images: Images) -> None:
        self.settings, self.memo, self.visenc, self.images = settings, memo, visenc, images
        self.encode_failures = 0
        self.encodes_skipped = 0
        self._encodes: set[asyncio.Task[None]] = set()
        self._quiet_until = 0.0  # visenc is not asked which images it lacks before then

    def later(self, images: Sequence[Image]) -> None:
        """Hand ``images`` to visenc in the background, but those it accepted before (past the limit: skipped)."""
        images = [i for i in images if not self.memo.handed(i.hash)]
        if not images:
            return
        if len(self._encodes) >= self.settings.max_background_encodes:
            self.encodes_skipped += 1
            return
        task = asyncio.create_task(self.encode(images))
        self._encodes.add(task)
        task.add_done_callback(self._encodes.discard)

    async def drain(self) -> None:
        if self._encodes:
            await asyncio.wait(set(self._encodes))

    async def encode(self, images: Sequence[Image]) -> None:
        """A hash-first encode of ``images`` (``wait=false``); a failure is logged and counted."""
        try:
            datas = [self.images.payload(i) for i in images]
            # the proxy never reads the rows (the engine's connector looks them up itself): nothing is pinned
            await self.visenc.encode([d for d in datas if d is not None], wait=False, pin=False)
        except VisencClientError as e:  # vLLM encodes the images itself
            self.encode_failures += 1
            log.warning("visenc encode of %d images failed (%s): vLLM encodes them", len(images), e)
        except Exception:
            self.encode_failures += 1
            log.exception("visenc encode of %d images failed", len(images))
        else:
            self.memo.hand([i.hash for i in images])

    def ask_absent(self, hashes: Sequence[str]) -> asyncio.Future[list[str]] | None:
        """Start asking visenc which of ``hashes`` it lacks (``None``: nothing to ask)."""
        new = [h for h in dict.fromkeys(hashes) if not self.memo.handed(h)]
        if not new or self.settings.absent_timeout_s <= 0:
            return None
        return asyncio.ensure_future(self._absent(new))

    async def _absent(self, hashes: list[str]) -> list[str]:
        if asyncio.get_running_loop().time() < self._quiet_until:
            return hashes  # visenc failed to answer a moment ago: not asked again yet
        try:
            async with asyncio.timeout(self.settings.absent_timeout_s):
                handles = await self.visenc.lookup(hashes, pin=False)
        except Exception as e:  # too slow or failed: the images count as lacking (a lost hit at most)
            self._quiet_until = asyncio.get_running_loop().time() + QUIET_S
            log.warning("visenc did not say which images it lacks (%s): they count as lacking", type(e).__name__)
            return hashes
        return [h.hash for h in handles if h.status == "missing"]

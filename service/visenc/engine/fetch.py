"""The fetch path: images' entries by their hashes, located at once, then waited for while they are encoded
here or at another replica."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import cast

from visenc.engine.inflight import InFlight
from visenc.engine.job import Job
from visenc.engine.locator import READ, Elsewhere, Encoding, Located, Locator, Stored
from visenc.engine.scheduler import Scheduler
from visenc.engine.videos import Videos
from visenc.errors import DeadlineExceeded, InvalidHash, NotFound, VisencError
from visenc.metrics import Metrics
from visenc_client.format import Entry, is_valid_hash


class Fetch:
    """``locate_many``, then a wait for what is being encoded. Event loop only, no lock; it holds no state
    (a wait is its job's: joined, bumped, left)."""

    def __init__(
        self,
        locator: Locator,
        inflight: InFlight,
        scheduler: Scheduler,
        videos: Videos,
        timeout_s: float,
        metrics: Metrics,
    ) -> None:
        self.locator, self.inflight, self.scheduler, self.videos = locator, inflight, scheduler, videos
        #: how long a fetch waits for a pending image unless its caller says (``fetch_timeout_s``)
        self.timeout_s = timeout_s
        self.metrics = metrics

    async def lookup(self, image_hash: str, namespace: str, *, timeout_s: float | None = None) -> Entry:
        """The entry of an image, waiting (and raising its priority) if it is being encoded."""
        (got,) = await self.lookup_many([image_hash], namespace, timeout_s=timeout_s)
        if isinstance(got, VisencError):
            raise got
        return got

    async def lookup_many(
        self, hashes: Sequence[str], namespace: str, *, timeout_s: float | None = None
    ) -> list[Entry | VisencError]:
        """Each image's entry (or why not), all located in one pass, then waited for together."""
        valid = list(dict.fromkeys(h for h in hashes if is_valid_hash(h)))
        located = dict(zip(valid, await self.locator.locate_many(valid, namespace, READ)))
        out: list[Entry | VisencError | None] = [_rows_of(located.get(h)) for h in hashes]
        slow = {
            i: self._entry(hashes[i], located.get(hashes[i]), namespace, timeout_s)
            for i, o in enumerate(out)
            if o is None
        }
        if slow:  # the rest are served without a pause
            for i, got in zip(slow, await asyncio.gather(*slow.values())):
                out[i] = got
        return cast(list[Entry | VisencError], out)

    async def video(self, manifest: Entry, video: str, namespace: str, timeout_s: float | None) -> Entry:
        """A video's rows: its tubes fetched, then joined in order."""
        tubes = await self.lookup_many(self.videos.tubes(manifest, video), namespace, timeout_s=timeout_s)
        if (error := next((t for t in tubes if isinstance(t, VisencError)), None)) is not None:
            raise error
        return self.videos.joined(video, manifest.grid_thw, namespace, [t for t in tubes if isinstance(t, Entry)])

    async def _entry(
        self, image_hash: str, located: Located | None, namespace: str, timeout_s: float | None
    ) -> Entry | VisencError:
        try:
            match located:
                case None:
                    raise InvalidHash("hash must be 64 lowercase hex digits (SHA-256 of the image bytes)")
                case Stored(Entry(kind="video") as manifest):
                    return await self.video(manifest, image_hash, namespace, timeout_s)
                case Stored(entry):
                    return entry
                case Encoding(job):
                    return await self._wait(job, image_hash, timeout_s)
                case Elsewhere():
                    return await self._wait(
                        self._follow(self.locator.key(namespace, image_hash), image_hash), image_hash, timeout_s
                    )
            return await self._absent(self.locator.key(namespace, image_hash), image_hash)
        except VisencError as e:
            return e

    async def _absent(self, key: str, image_hash: str) -> Entry:
        """An image found nowhere: the answer of an encode here that just finished, its item's error, or 404."""
        if (settling := self.inflight.settling(key)) is not None:  # finished: its answer is on its way
            answer = settling.future
            await asyncio.wait({answer}, timeout=self.timeout_s)
            if answer.done() and not answer.cancelled() and answer.exception() is None:
                return answer.result()
        if (failed := self.inflight.failure(key)) is not None:
            raise failed
        raise NotFound(f"no embedding for image {image_hash}: {self.locator.index.absence(key)}")

    def _follow(self, key: str, image_hash: str) -> Job:
        """A job here that follows another replica's encode of ``key`` (or the one here, if one started)."""
        if (job := self.inflight.joinable(key)) is not None:
            return job
        job = self.inflight.admit(key, image_hash, (self.inflight.next_request(), 0))
        self.scheduler.watch(job)
        self.metrics.claims.labels("fetch_wait").inc()
        return job

    async def _wait(self, job: Job, image_hash: str, timeout_s: float | None) -> Entry:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self.scheduler.bump(job)
        job.join()
        self.metrics.singleflight_waits.inc()
        try:
            done, _ = await asyncio.wait({job.future}, timeout=max(0.0, timeout_s))
        finally:
            self.inflight.leave(job)
            self.metrics.singleflight_waits.dec()
        if not done:
            raise DeadlineExceeded(f"image {image_hash} was not encoded within fetch_timeout_s={self.timeout_s}")
        return job.future.result()


def _rows_of(located: Located | None) -> Entry | None:
    return located.entry if isinstance(located, Stored) and located.entry.kind == "rows" else None

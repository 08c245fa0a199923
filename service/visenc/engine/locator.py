"""Where an image is: L1 and the in-flight map, then one index round trip for the rest, then other replicas."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from visenc.engine.coordination import Coordination
from visenc.engine.entries import EntryCheck
from visenc.engine.inflight import InFlight
from visenc.engine.job import Job, Place
from visenc.index.tiered import Index
from visenc_client.format import Entry, entry_key


@dataclass(frozen=True, slots=True)
class Stored:
    entry: Entry


@dataclass(frozen=True, slots=True)
class Encoding:
    job: Job


@dataclass(frozen=True, slots=True)
class Elsewhere: ...


@dataclass(frozen=True, slots=True)
class Absent: ...


Located = Stored | Encoding | Elsewhere | Absent
ABSENT = Absent()


@dataclass(frozen=True, slots=True)
class Ask:
    """What a look-up is for (``docs/internals.md``, "Pins, leases and the insertion policy")."""

    #: an encode's look-up by hash: L1's answer is a use of its entry (recency, the insertion policy)
    reference: bool
    #: the caller serves the rows: an entry read from Redis that L1 let go keeps them, else its fields alone
    rows: bool
    #: other replicas are asked about what is nowhere here
    replicas: bool


#: an encode's items, answered as handles (``ENCODE_ROWS``: with their rows)
ENCODE = Ask(reference=True, rows=False, replicas=False)
ENCODE_ROWS = Ask(reference=True, rows=True, replicas=False)
#: a read by hash: a fetch, or a video's tubes
READ = Ask(reference=False, rows=True, replicas=True)


class Locator:
    """The one answer to "where is this image?" for intake, the fetch path and videos.

    Event loop only, no lock; it holds no state (L1, the in-flight map and the coordination own theirs)."""

    def __init__(self, index: Index, entries: EntryCheck, inflight: InFlight, coordination: Coordination) -> None:
        self.index, self.entries, self.inflight, self.coordination = index, entries, inflight, coordination
        self.fingerprint = entries.fingerprint

    def key(self, namespace: str, image_hash: str) -> str:
        return entry_key(namespace, self.fingerprint, image_hash)

    async def locate_many(self, hashes: Sequence[str], namespace: str, ask: Ask) -> list[Located]:
        """Nearest first: L1 and the in-flight map; the index for the rest, in batches of
        ``redis_batch_bytes``; those two again (an encode may have started meanwhile); other replicas."""
        keys = [self.key(namespace, h) for h in hashes]
        found = [self._here(k, h, peek=not ask.reference) for k, h in zip(keys, hashes)]
        await self._stored(keys, hashes, found, ask.rows)
        found = [self._here(k, h, peek=True) if f is ABSENT else f for k, h, f in zip(keys, hashes, found)]
        if ask.replicas:
            await self._elsewhere(keys, found)
        return found

    async def place(self, open_: Mapping[str, str], new: set[str]) -> dict[str, Entry | Place]:
        """Where each new image (of ``open_``, key -> hash) is encoded: here or at another replica; an
        entry where one was stored meanwhile, by another replica (held in L1 from now on) or here."""
        placed = await self.coordination.admit(sorted(new)) if new else {}
        for key, got in placed.items():
            if isinstance(got, Entry):
                entry = self.entries.checked(key, open_[key], got)
                placed[key] = Place.HERE if entry is None else entry
                if entry is not None:
                    self.index.store_local(key, entry)
        for key, image_hash in open_.items():  # finished here while we asked
            if (entry := self.entries.peek(key, image_hash)) is not None:
                placed[key] = entry
        return placed

    def _here(self, key: str, image_hash: str, *, peek: bool) -> Located:
        if peek and (entry := self.entries.peek(key, image_hash, video=True)) is not None:
            return Stored(entry)
        job = self.inflight.joinable(key)
        return ABSENT if job is None else Encoding(job)

    async def _stored(self, keys: list[str], hashes: Sequence[str], found: list[Located], rows: bool) -> None:
        todo = [i for i, f in enumerate(found) if f is ABSENT]
        step = self.index.batch_keys
        for lo in range(0, len(todo), step):
            batch = todo[lo : lo + step]
            for i, got in zip(batch, await self.index.get_many([keys[i] for i in batch])):
                if (entry := self.entries.checked(keys[i], hashes[i], got, video=True)) is not None:
                    found[i] = Stored(entry)
            if rows:
                continue
            for i in todo[: lo + step]:  # what L1 let go (Redis still holds it) is kept as its fields
                if (
                    isinstance(f := found[i], Stored)
                    and f.entry.kind == "rows"
                    and self.index.peek(keys[i]) is not f.entry
                ):
                    found[i] = Stored(replace(f.entry, blob=b""))

    async def _elsewhere(self, keys: list[str], found: list[Located]) -> None:
        # an image encoded or failed here: a mark of it in Redis is this replica's own, not waited for
        absent = [i for i, f in enumerate(found) if f is ABSENT and not self.inflight.ended_here(keys[i])]
        there = await asyncio.gather(*(self.coordination.elsewhere(keys[i]) for i in absent))
        for i, encoding in zip(absent, there):
            if encoding:  # a local encode may have started while we asked
                job = self.inflight.joinable(keys[i])
                found[i] = Elsewhere() if job is None else Encoding(job)

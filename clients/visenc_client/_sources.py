"""Where ``VisencConnector`` gets images' rows: each visenc replica in turn, then the shared index.

A source that cannot be reached (refused, reset, a name that does not resolve, a connect past
``connect_timeout_s``, a look-up that does not wait answered nothing for ``answer_timeout_s``) is asked
no more than it costs (``visenc_client._backoff``): one that failed at once (refused, reset) is asked
again by the next look-up, which costs it nothing and finds the source as soon as it is back; one whose
failure took time (a timeout) is skipped by every caller for a while, then asked again by one, so a
replica that hangs costs one look-up its timeout per back-off, never every look-up its timeout.
The shared index holds ready rows only: a read there is bounded as a look-up that does not wait is
(``connect_timeout_s``, then ``answer_timeout_s`` of silence), and a timeout is never retried.
A replica is checked (the model it serves; for ``transport: auto``, whether it shares this host's
memory) the first time it answers, at start-up or later, so a visenc started after the engine is
used as fully as one started before. No vLLM import: the rows are checked against what the engine
reads (``Want``) and handed back as CPU tensors.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from visenc_client._backoff import BACKOFF_FIRST_S, COSTLY_S, Backoff
from visenc_client._client import Client
from visenc_client._exceptions import TransportError, VisencClientError
from visenc_client._types import Handle
from visenc_client._weights import Served
from visenc_client.format import words_tensor

log = logging.getLogger("visenc_client.vllm")

#: the shared index, among the sources' names
INDEX = "redis"


@dataclass(frozen=True, slots=True)
class Want:
    """What the engine will read for one item: its row count and, where the item carries one, its grid."""

    rows: int
    grid: tuple[int, ...] | None


class Absent(Exception):
    """An image's rows cannot be had (said once per fetch, logged by the scheduler side)."""


class Mismatch(Absent):
    """visenc's rows are not what the engine reads for the image (rows, width or grid): no replica of
    the same model answers otherwise, and they are never loaded."""


def torch_rows(rows: np.ndarray, dtype: str | None) -> torch.Tensor:
    """The rows as a CPU tensor that owns its memory: an array read for this call is taken as it is, a
    view of memory that is not ours (a shared-memory segment) is copied once."""
    owned = rows if rows.flags.owndata and rows.flags.writeable else np.array(rows, copy=True)
    return words_tensor(owned, dtype or "float32")


@dataclass
class Replica:
    """One visenc URL: a client for look-ups that wait (read timeout ``timeout_s``) and one for those
    that do not (``answer_timeout_s``), one shared-memory decision for both."""

    url: str
    waiting: Client
    prompt: Client
    #: ``transport: auto``: whether it shares this host's memory is decided at each check
    auto: bool = False
    #: its model was checked (and, for ``transport: auto``, the transport chosen); undone when it stops
    #: answering or a shared-memory read fails (it may answer again from another host)
    checked: bool = False
    #: why it is never asked (it serves another model); ``None`` while it may be
    refused: str | None = None

    def client(self, wait: bool) -> Client:
        return self.waiting if wait else self.prompt

    def close(self) -> None:
        self.waiting.close()
        self.prompt.close()


def _costly(e: VisencClientError, started: float) -> bool:
    """Whether a failure cost its caller time: a timeout, or ``COSTLY_S`` spent however it failed."""
    return isinstance(e, TransportError) and (e.timed_out or time.monotonic() - started >= COSTLY_S)


def check_handle(handle: Handle, want: Want) -> None:
    """``Mismatch`` unless a ready handle's row count and grid are what the engine reads."""
    if handle.num_tokens != want.rows:
        raise Mismatch(f"visenc has {handle.num_tokens} rows, vLLM reads {want.rows}")
    if want.grid is not None and handle.grid_thw is not None and tuple(handle.grid_thw) != want.grid:
        raise Mismatch(
            f"visenc's grid {tuple(handle.grid_thw)} is not vLLM's {want.grid} "
            "(the two decode or resize this image differently)"
        )


def checked_rows(rows: torch.Tensor, want: Want, hidden: int) -> torch.Tensor:
    if tuple(rows.shape) != (want.rows, hidden):
        raise Mismatch(f"visenc has rows {tuple(rows.shape)}, vLLM reads ({want.rows}, {hidden})")
    return rows


#: what one source made of each image asked of it: its rows, or why not
Answers = dict[str, "torch.Tensor | Absent"]


class RowSources:
    """Each replica in turn, then the shared index (the module docstring says how failures are met).
    ``obtain`` is called from several threads at once."""

    def __init__(
        self,
        urls: list[str],
        *,
        served: Served,
        timeout_s: float,
        connect_timeout_s: float,
        answer_timeout_s: float,
        transport: str = "auto",
        namespace: str | None = None,
        api_key: str | None = None,
        redis_url: str | None = None,
        redis_mode: str = "standalone",
        backoff_s: float = BACKOFF_FIRST_S,
    ) -> None:
        if redis_mode not in ("standalone", "cluster"):
            raise ValueError(f"redis_mode must be 'standalone' or 'cluster', not {redis_mode!r}")
        shared: Any = {"auto": "auto", "http": False, "shm": True}[transport]

        def client(url: str, read_s: float) -> Client:
            return Client(
                url,
                timeout=read_s,
                connect_timeout=connect_timeout_s,
                shared_memory=shared,
                namespace=namespace,
                api_key=api_key,
            )

        self.replicas = [Replica(u, client(u, timeout_s), client(u, answer_timeout_s), shared == "auto") for u in urls]
        self.timeout_s = timeout_s
        self.served = served
        self.backoff = Backoff(backoff_s)
        self._redis_url, self._namespace = redis_url, namespace or "default"
        self._redis_cluster = redis_mode == "cluster"  # as the service's redis_mode
        # the index holds ready rows only, so a read there never waits for an encode: each is bounded
        # as a look-up that does not wait is
        self._redis_options: dict[str, Any] = {
            "socket_connect_timeout": connect_timeout_s,
            "socket_timeout": answer_timeout_s,
        }
        self._index: Any = None  # RedisRows, once the fingerprint its keys need is known
        self._index_fingerprint = ""  # that fingerprint, once known
        self._down: set[str] = set()  # sources whose last ask failed (said once in the log)
        self._lock = threading.Lock()
        if served.fingerprint is not None:
            self._open_index(served.fingerprint)

    # --- checking replicas ----------------------------------------------------------------
    def check_at_start(self) -> None:
        """Check every replica that answers now: ``ValueError`` if one cannot be used (another model,
        loader or fingerprint: the engine refuses to start); one that does not answer yet is checked
        when it first does, and skipped meanwhile as any unreachable source."""
        for replica in self.replicas:
            started = time.monotonic()
            try:
                info = replica.prompt.model()
            except VisencClientError as e:
                log.warning("VisencConnector: visenc at %s is not reachable yet (%s)", replica.url, e)
                self.backoff.done(replica.url, not isinstance(e, TransportError), _costly(e, started))
                continue
            refusal = self.served.refusal(replica.url, info)
            if refusal is not None:
                raise ValueError(f"VisencConnector: {refusal}")
            self._check(replica, info)
        if not any(r.checked or r.refused for r in self.replicas):
            log.warning("VisencConnector: no visenc reachable at start-up; images count as not cached until one is")

    def _check(self, replica: Replica, info: dict[str, Any]) -> bool:
        """Accept a replica that answered ``info`` unless it serves other weights (then never asked)."""
        refusal = self.served.weights_refusal(replica.url, info)
        if refusal is None:
            self._accept(replica, info)
            return True
        replica.refused = refusal
        log.error("VisencConnector: %s; it is not asked (vLLM encodes what it would have given)", refusal)
        return False

    def _accept(self, replica: Replica, info: dict[str, Any]) -> None:
        with self._lock:
            for client in (replica.waiting, replica.prompt):
                if replica.auto:
                    client._choose(info)
            replica.checked = True
            if self._index is None and self._redis_url:
                self._open_index(self.served.fingerprint or str(info.get("fingerprint")))
        log.info(
            "VisencConnector: visenc at %s serves %s (fingerprint %s, %s, rows of %s, image loader %s); rows over %s",
            replica.url,
            info.get("name"),
            info.get("fingerprint"),
            info.get("dtype"),
            info.get("hidden_size"),
            info.get("image_loader"),
            "shared memory" if replica.prompt.shared_memory else "HTTP",
        )

    def _open_index(self, fingerprint: str) -> TransportError | None:
        """The shared index's client, where ``redis_url`` is set; the failure where it cannot be opened now."""
        if not self._redis_url:
            return None
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.retry import Retry

        from visenc_client._redis import RedisRows

        # a cache read: one retry of a connection that failed at once (closed meanwhile, reset), which
        # costs nothing; never of a timeout (redis-py retries those too: a Redis that hangs would cost
        # its timeout twice)
        retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
        options: dict[str, Any] = {**self._redis_options, "retry": retry}
        first, self._index_fingerprint = not self._index_fingerprint, fingerprint
        try:
            self._index = RedisRows.from_url(
                self._redis_url,
                fingerprint=fingerprint,
                namespace=self._namespace,
                cluster=self._redis_cluster,
                **options,
            )
        except TransportError as e:  # a Redis Cluster that does not answer yet: opened at a later look-up
            if first:
                log.warning("VisencConnector: the shared index cannot be reached yet (%s); asked again later", e)
            return e
        return None

    def _index_now(self) -> Any:
        """The shared index's client, opened now where it could not be before (``TransportError``)."""
        with self._lock:
            if self._index is None:
                failure = self._open_index(self._index_fingerprint)
                if failure is not None:
                    raise failure
            return self._index

    # --- reading rows -----------------------------------------------------------------------
    def obtain(self, wants: dict[str, Want], wait: bool) -> Answers:
        """Several images' rows in one look-up per source, each checked against what the engine
        reads: each replica in turn for what is still lacking, then the shared index; what none has
        maps to ``Absent``, saying what each source answered. ``wait``: an image still being encoded
        is waited for (else it is absent)."""
        results: Answers = {}
        causes: dict[str, list[str]] = {i: [] for i in wants}
        sources: list[tuple[str, Callable[[dict[str, Want]], Answers]]] = [
            (r.url, functools.partial(self._from_replica, r, wait=wait)) for r in self.replicas
        ]
        sources.append((INDEX, self._from_index))
        for name, ask in sources:
            todo = {i: w for i, w in wants.items() if i not in results}
            if not todo:
                break
            for identifier, got in ask(todo).items():
                if isinstance(got, Absent) and not isinstance(got, Mismatch):  # a mismatch is final
                    causes[identifier].append(f"{name}: {got}")
                else:
                    results[identifier] = got
        for identifier in [i for i in wants if i not in results]:
            results[identifier] = Absent("; ".join(causes[identifier]) or "no visenc configured")
        return results

    def _skip(self, name: str, wants: dict[str, Want]) -> Answers | None:
        """``Absent`` for every image when ``name`` is not asked now (it could not be reached lately)."""
        if self.backoff.usable(name):
            return None
        why = f"not asked: it could not be reached lately (asked again in {self.backoff.skipped_for(name):.1f} s)"
        return {i: Absent(why) for i in wants}

    def _from_replica(self, replica: Replica, wants: dict[str, Want], *, wait: bool) -> Answers:
        if replica.refused is not None:
            return {i: Absent("not asked: it serves another model or other weights") for i in wants}
        skipped = self._skip(replica.url, wants)
        if skipped is not None:
            return skipped
        failure: TransportError | None = None
        started = time.monotonic()
        try:
            return self._ask(replica, wants, wait)
        except TransportError as e:
            if wait and e.timed_out and not e.connecting:  # it took the request: a slow wait, not a dead replica
                return {i: Absent(f"not ready within timeout_s ({self.timeout_s} s)") for i in wants}
            failure = e
            replica.checked = False  # checked again when it answers, wherever from
            return {i: Absent(e.reason) for i in wants}
        except VisencClientError as e:  # it answered, with an error
            return {i: Absent(str(e)) for i in wants}
        finally:
            self._reached(replica.url, failure, started)

    def _reached(self, name: str, failure: TransportError | None, started: float) -> None:
        """Report an ask to the back-off; say in the log when a source goes down or comes back."""
        reached, cost_s = failure is None, time.monotonic() - started
        self.backoff.done(name, reached, failure is not None and _costly(failure, started))
        with self._lock:
            was_down = name in self._down
            (self._down.discard if reached else self._down.add)(name)
        if reached and was_down:
            log.info("VisencConnector: %s answers again", name)
        elif not reached and not was_down:
            log.warning(
                "VisencConnector: %s could not be reached (after %.1f s): the next source is asked; %s",
                name,
                cost_s,
                f"it is skipped for {self.backoff.skipped_for(name):.1f} s, then tried again"
                if self.backoff.skipped_for(name)
                else "it is asked again by the next look-up",
            )

    def _ask(self, replica: Replica, wants: dict[str, Want], wait: bool) -> Answers:
        """One look-up of ``wants`` at ``replica`` (checked first, the first time it answers)."""
        client = replica.client(wait)
        if not replica.checked:
            info = client.model()
            refusal = self.served.refusal(replica.url, info)
            if refusal is not None:
                replica.refused = refusal
                log.error("VisencConnector: %s; it is not asked again", refusal)
                return {i: Absent(refusal) for i in wants}
            if not self._check(replica, info):
                return {i: Absent(str(replica.refused)) for i in wants}
        handles = client.lookup(list(wants), wait=wait, include_rows=not client.shared_memory)
        answers: Answers = {}
        rejected: list[Handle] = []  # ready, pinned for this caller, and never read
        for (identifier, want), handle in zip(wants.items(), handles):
            try:
                if handle.hash != identifier:  # rows of another image, whatever their shape: never taken
                    raise Absent(f"answered for image {handle.hash} in its place")
                answers[identifier] = self._rows_of(client, handle, want)
            except Absent as e:
                answers[identifier] = e
                rejected.append(handle)
            except TransportError:
                raise  # it stopped answering (a shared-memory read's request): the next replica
            except VisencClientError as e:
                answers[identifier] = Absent(str(e))
                replica.checked = not client.shared_memory  # its segments may be on another host now
        client.hand_back(rejected)  # what the replica keeps for them goes now, not when their leases lapse
        return answers

    def _rows_of(self, client: Client, handle: Handle, want: Want) -> torch.Tensor:
        if handle.status != "ready":
            raise Absent(f"{handle.status}{f' ({handle.error})' if handle.error else ''}")
        check_handle(handle, want)
        rows = handle.rows if handle.rows is not None else client.fetch(handle)  # its lease goes with the read
        return checked_rows(torch_rows(rows, handle.dtype), want, self.served.hidden)

    def _from_index(self, wants: dict[str, Want]) -> Answers:
        """Ready rows straight from the shared index (same fingerprint, so the same image loader: only
        the shape is checked)."""
        if self._index is None and not self._index_fingerprint:
            return {}  # no shared index, or none known to read yet
        skipped = self._skip(INDEX, wants)
        if skipped is not None:
            return skipped
        answers: Answers = {}
        failure: TransportError | None = None
        started = time.monotonic()
        try:
            try:
                index = self._index_now()
            except TransportError as e:
                failure = e
                return {i: Absent(str(e)) for i in wants}
            for identifier, want in wants.items():
                try:
                    info = index.info(identifier)
                    rows = index.fetch(identifier)
                    answers[identifier] = checked_rows(torch_rows(rows, info.dtype), want, self.served.hidden)
                except TransportError as e:
                    failure = e
                    return {**answers, **{i: Absent(str(e)) for i in wants if i not in answers}}
                except Absent as e:
                    answers[identifier] = e
                except VisencClientError as e:
                    answers[identifier] = Absent(str(e))
            return answers
        finally:
            self._reached(INDEX, failure, started)

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()
        if self._index is not None:
            self._index.close()

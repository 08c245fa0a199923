"""Where ``VisencConnector`` gets images' rows: each visenc replica in turn, then the shared index; how
unreachable sources are met: docs/internals.md, "The client library"."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from visenc_client._backoff import BACKOFF_FIRST_S, COSTLY_S, Backoff
from visenc_client._client import Client
from visenc_client._exceptions import TransportError, VisencClientError
from visenc_client._shared_index import SharedIndex
from visenc_client._types import Handle
from visenc_client._wants import Absent, Answers, Mismatch, Want, check_handle, checked_rows, torch_rows
from visenc_client._weights import Served
from visenc_client.format import Priority

log = logging.getLogger("visenc_client.vllm")

INDEX = "redis"


@dataclass
class Replica:
    """One visenc URL: a client for look-ups that wait (``timeout_s``) and one for those that do not."""

    url: str
    waiting: Client
    prompt: Client
    auto: bool = False
    checked: bool = False
    refused: str | None = None

    def client(self, wait: bool) -> Client:
        return self.waiting if wait else self.prompt

    def close(self) -> None:
        self.waiting.close()
        self.prompt.close()


def _costly(e: VisencClientError, started: float) -> bool:
    return isinstance(e, TransportError) and (e.timed_out or time.monotonic() - started >= COSTLY_S)


class RowSources:
    """``obtain`` is called from several threads at once."""

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
        priority: Priority | None = None,
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
                priority=priority,
            )

        self.replicas = [Replica(u, client(u, timeout_s), client(u, answer_timeout_s), shared == "auto") for u in urls]
        self.timeout_s = timeout_s
        self.served = served
        self.backoff = Backoff(backoff_s)
        cluster = redis_mode == "cluster"
        self._index = SharedIndex(redis_url, namespace or "default", cluster, connect_timeout_s, answer_timeout_s)
        self._down: set[str] = set()
        self._lock = threading.Lock()
        if served.fingerprint is not None:
            self._index.open(served.fingerprint)

    def check_at_start(self) -> None:
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
        self._index.open_once(self.served.fingerprint or str(info.get("fingerprint")))
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

    def obtain(self, wants: dict[str, Want], wait: bool) -> Answers:
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
            if wait and e.timed_out and not e.connecting:  # a slow wait, not a dead replica
                return {i: Absent(f"not ready within timeout_s ({self.timeout_s} s)") for i in wants}
            failure = e
            replica.checked = False
            return {i: Absent(e.reason) for i in wants}
        except VisencClientError as e:
            return {i: Absent(str(e)) for i in wants}
        finally:
            self._reached(replica.url, failure, started)

    def _reached(self, name: str, failure: TransportError | None, started: float) -> None:
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
        handles = client.lookup(list(wants), wait=wait, include_rows=client.rows.rows_with_lookup)
        answers: Answers = {}
        rejected: list[Handle] = []
        for (identifier, want), handle in zip(wants.items(), handles):
            try:
                if handle.hash != identifier:
                    raise Absent(f"answered for image {handle.hash} in its place")
                answers[identifier] = self._rows_of(client, handle, want)
            except Absent as e:
                answers[identifier] = e
                rejected.append(handle)
            except TransportError:
                raise
            except VisencClientError as e:
                answers[identifier] = Absent(str(e))
                replica.checked = not client.shared_memory
        client.unpin(rejected)
        return answers

    def _rows_of(self, client: Client, handle: Handle, want: Want) -> torch.Tensor:
        if handle.status != "ready":
            raise Absent(f"{handle.status}{f' ({handle.error})' if handle.error else ''}")
        check_handle(handle, want)
        rows = handle.rows if handle.rows is not None else client.fetch(handle)
        return checked_rows(torch_rows(rows, handle.dtype), want, self.served.hidden)

    def _from_index(self, wants: dict[str, Want]) -> Answers:
        if not self._index.readable():
            return {}
        skipped = self._skip(INDEX, wants)
        if skipped is not None:
            return skipped
        failure: TransportError | None = None
        started = time.monotonic()
        try:
            answers, failure = self._index.read(wants, self.served.hidden)
            return answers
        finally:
            self._reached(INDEX, failure, started)

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()
        self._index.close()

"""The shared index (Redis) as a row source for ``RowSources``: ready rows only, read by fingerprint."""

from __future__ import annotations

import logging
import threading
from typing import Any

from visenc_client._exceptions import TransportError, VisencClientError
from visenc_client._wants import Absent, Answers, Want, checked_rows, torch_rows

log = logging.getLogger("visenc_client.vllm")


class SharedIndex:
    """Opened once the fingerprint its keys need is known; read within a look-up's bounds."""

    def __init__(
        self, url: str | None, namespace: str, cluster: bool, connect_timeout_s: float, answer_timeout_s: float
    ) -> None:
        self.url, self._namespace, self._cluster = url, namespace, cluster
        self._options: dict[str, Any] = {
            "socket_connect_timeout": connect_timeout_s,
            "socket_timeout": answer_timeout_s,
        }
        self._rows: Any = None
        self._fingerprint = ""
        self._lock = threading.Lock()

    def readable(self) -> bool:
        return self._rows is not None or bool(self._fingerprint)

    def open(self, fingerprint: str) -> TransportError | None:
        """The failure where it cannot be opened now."""
        if not self.url:
            return None
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.retry import Retry

        from visenc_client._redis import RedisRows

        # never retry a timeout (redis-py does): a Redis that hangs would cost it twice
        retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
        first, self._fingerprint = not self._fingerprint, fingerprint
        try:
            self._rows = RedisRows.from_url(
                self.url,
                fingerprint=fingerprint,
                namespace=self._namespace,
                cluster=self._cluster,
                **self._options,
                retry=retry,
            )
        except TransportError as e:  # opened at a later look-up
            if first:
                log.warning("VisencConnector: the shared index cannot be reached yet (%s); asked again later", e)
            return e
        return None

    def open_once(self, fingerprint: str) -> None:
        with self._lock:
            if self._rows is None and self.url:
                self.open(fingerprint)

    def _opened(self) -> Any:
        with self._lock:
            if self._rows is None:
                failure = self.open(self._fingerprint)
                if failure is not None:
                    raise failure
            return self._rows

    def read(self, wants: dict[str, Want], hidden: int) -> tuple[Answers, TransportError | None]:
        """Each image's rows (only the shape is checked: same fingerprint), and the failure that stopped the reads."""
        try:
            index = self._opened()
        except TransportError as e:
            return {i: Absent(str(e)) for i in wants}, e
        answers: Answers = {}
        for identifier, want in wants.items():
            try:
                info = index.info(identifier)
                rows = index.fetch(identifier)
                answers[identifier] = checked_rows(torch_rows(rows, info.dtype), want, hidden)
            except TransportError as e:
                return {**answers, **{i: Absent(str(e)) for i in wants if i not in answers}}, e
            except Absent as e:
                answers[identifier] = e
            except VisencClientError as e:
                answers[identifier] = Absent(str(e))
        return answers, None

    def close(self) -> None:
        if self._rows is not None:
            self._rows.close()

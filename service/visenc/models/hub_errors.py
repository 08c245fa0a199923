"""What the hub (or the way to it) answered, as one ``ModelUnavailable`` line naming the cause."""

from __future__ import annotations

import logging
import random
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

from visenc.errors import ModelUnavailable

log = logging.getLogger("visenc")

#: the answers that mean "try later", besides every 5xx
TRY_LATER = (408, 429)
#: the first pause before asking again where the hub gave no ``Retry-After``, and the longest
FIRST_PAUSE_S = 1.0
LONGEST_PAUSE_S = 30.0


class Unreachable(ModelUnavailable):
    """No answer from the hub or a "try later" answer: the caches may still serve, else ``Patience`` asks again."""

    #: whether ``Patience`` asks again (a busy hub), or the start ends at once
    waited_out = True

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Offline(Unreachable):
    """``HF_HUB_OFFLINE`` is set: the hub is never asked, so never asked again either."""

    waited_out = False


class Unresolvable(Unreachable):
    """The hub's host name does not resolve (no DNS, a wrong ``HF_ENDPOINT``): no hub is busy, so it is
    not asked again; the caches may still serve."""

    waited_out = False


@dataclass
class Patience:
    """How long one start waits out a hub that says "try later": ``wait_s`` from its creation, all calls together."""

    wait_s: float
    started: float = field(default_factory=time.monotonic)
    pause_s: float = FIRST_PAUSE_S
    tries: int = 1

    def after(self, e: Unreachable) -> bool:
        """Pause, then ``True`` (ask again); ``False`` at once where the pause would end past the limit."""
        left = self.started + self.wait_s - time.monotonic()
        pause = e.retry_after_s if e.retry_after_s is not None else self.pause_s * random.uniform(0.5, 1.0)
        if not e.waited_out or pause > left:
            return False
        asked = f"the hub's Retry-After: {pause:.0f} s" if e.retry_after_s is not None else f"{pause:.1f} s"
        log.warning("%s; asking again after %s (%.0f s left of hub_wait_s=%g)", e, asked, left, self.wait_s)
        if e.retry_after_s is not None:  # at least what the hub asked, replicas told the same spread out
            pause = min(left, pause + random.uniform(0, 0.1) * max(pause, FIRST_PAUSE_S))
        time.sleep(pause)
        self.pause_s = min(2 * self.pause_s, LONGEST_PAUSE_S)
        self.tries += 1
        return True

    def spent(self) -> str:
        return f"asked {self.tries} times over {time.monotonic() - self.started:.0f} s, hub_wait_s={self.wait_s:g}"


@contextmanager
def hub_answers(revision: str) -> Iterator[None]:
    """``Unreachable`` where the hub did not answer or said "try later", else the refusal, as one line."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import get_token

    hub = constants.ENDPOINT
    try:
        yield
    except HFValidationError as e:
        raise ModelUnavailable(f"not a valid hub id ({first_line(e)})") from e
    except GatedRepoError as e:
        fix = "HF_TOKEN has not been granted access" if get_token() else "set HF_TOKEN to a token that has access"
        raise ModelUnavailable(f"a gated repository: accept its terms on {hub}; {fix}") from e
    except RevisionNotFoundError as e:
        raise ModelUnavailable(f"the repository has no revision {revision!r}") from e
    except RepositoryNotFoundError as e:
        hint = "or HF_TOKEN has no access to it" if get_token() else "or it is private: set HF_TOKEN"
        raise ModelUnavailable(f"no such repository on {hub} ({hint})") from e
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else 0
        if status >= 500 or status in TRY_LATER:
            raise Unreachable(f"the hub {hub} answered {status}", retry_after(e.response)) from e
        if status == 401 and get_token():  # refusals of a repository carry their own code (above)
            raise ModelUnavailable(f"the hub {hub} does not accept HF_TOKEN (401: not a valid token)") from e
        raise ModelUnavailable(f"the hub {hub} refused a request ({status}: {first_line(e)})") from e
    except LocalEntryNotFoundError as e:
        cause = e.__cause__  # the HEAD's own failure, where hf_hub_download had one
        response = getattr(cause, "response", None) if isinstance(cause, HfHubHTTPError) else None
        if response is not None and (response.status_code >= 500 or response.status_code in TRY_LATER):
            raise Unreachable(f"the hub {hub} answered {response.status_code}", retry_after(response)) from e
        unresolved(e, hub)
        raise Unreachable(f"the hub {hub} is unreachable") from e
    except OfflineModeIsEnabled as e:
        raise Offline("HF_HUB_OFFLINE is set") from e
    except httpx2.TransportError as e:
        unresolved(e, hub)
        raise Unreachable(f"the hub {hub} is unreachable ({first_line(e)})") from e
    except OSError as e:
        raise ModelUnavailable(f"cannot write the cache: {e}") from e


def unresolved(e: BaseException, hub: str) -> None:
    """``Unresolvable`` where a host name failed to resolve on the way to ``e`` (its causes and contexts)."""
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, socket.gaierror):
            why = cause.strerror or first_line(cause)
            fix = "check HF_ENDPOINT and the host's DNS, or set HF_HUB_OFFLINE=1 to serve from the cache"
            raise Unresolvable(f"the hub {hub}: its host name does not resolve ({why}; {fix})") from e
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__


def retry_after(response: Any) -> float | None:
    """An answer's ``Retry-After`` in seconds (a number or an HTTP date), ``None`` without one."""
    value = (response.headers.get("Retry-After") or "").strip() if response is not None else ""
    if not value:
        return None
    if value.isdigit():
        return float(value)
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

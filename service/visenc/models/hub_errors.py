"""What the hub (or the way to it) answered, as one ``ModelUnavailable`` line naming the cause:
``hub_answers`` around every call to the hub. ``Unreachable``, no answer or a 5xx, is the one failure
the caches may still serve (``models/hub.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from visenc.errors import ModelUnavailable


class Unreachable(ModelUnavailable):
    """No answer from the hub (refused, reset, timed out) or a 5xx: the caches may still serve."""


@contextmanager
def hub_answers(revision: str) -> Iterator[None]:
    """What the hub (or the way to it) answered, as one ``ModelUnavailable`` line: ``Unreachable``
    where it did not answer, a refusal (unknown or gated repository, unknown revision) otherwise."""
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
        if status >= 500:
            raise Unreachable(f"the hub {hub} answered {status}") from e
        if status == 401 and get_token():  # refusals of a repository carry their own code (above)
            raise ModelUnavailable(f"the hub {hub} does not accept HF_TOKEN (401: not a valid token)") from e
        raise ModelUnavailable(f"the hub {hub} refused a request ({status}: {first_line(e)})") from e
    except LocalEntryNotFoundError as e:
        raise Unreachable(f"the hub {hub} is unreachable") from e
    except OfflineModeIsEnabled as e:
        raise Unreachable("HF_HUB_OFFLINE is set") from e
    except httpx2.TransportError as e:
        raise Unreachable(f"the hub {hub} is unreachable ({first_line(e)})") from e
    except OSError as e:
        raise ModelUnavailable(f"cannot write the cache: {e}") from e


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

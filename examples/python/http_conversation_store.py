"""A toolnexus ConversationStore kept in chat-history.

toolnexus (https://pypi.org/project/toolnexus/) remembers `ask(..., id=...)`
conversations through a store with two async methods, `get(id)` and
`save(id, messages)`. This one keeps each conversation as a chat-history
transcript, so any number of processes or replicas can continue the same
conversation, and it survives restarts:

    from toolnexus import create_client
    from http_conversation_store import HttpConversationStore

    store = HttpConversationStore("http://127.0.0.1:8080", api_key=os.environ.get("HISTORY_API_KEY"))
    llm = create_client(base_url="https://api.openai.com/v1", style="openai", model="gpt-4o-mini", store=store)
    result = await llm.ask("Hello!", id="whatsapp:+15551234567")

Saves are optimistic: `save` sends the version that the calling task last
loaded or saved for that id as `If-Match`, so a save that would overwrite a
newer transcript (another process or task answered in between, or started
the same new conversation first) raises `TranscriptConflict` and changes
nothing. Re-running the turn loads the newer transcript first. Only a save
of a conversation the task has never loaded is unconditional.

Saving a transcript that extends the stored one costs about what appending
the new messages costs: chat-history keeps the common prefix as it is.

Needs only httpx (`pip install httpx`).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Mapping, Optional
from urllib.parse import quote

import httpx


class TranscriptConflict(Exception):
    """The stored transcript changed since this store loaded it; nothing was saved."""


class ChatHistoryError(Exception):
    """chat-history answered with an error (an RFC 9457 problem document)."""

    def __init__(self, status: int, problem: dict[str, Any]):
        self.status = status
        self.problem = problem
        super().__init__(f"chat-history answered {status}: {problem.get('detail') or problem}")


class HttpConversationStore:
    """Implements toolnexus' `ConversationStore` over `/v1/users/{id}/transcript`."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: Optional[str] = None,
        timeout: float = 10.0,
        http: Optional[httpx.AsyncClient] = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = http or httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        # The version (ETag) of each conversation as this task last loaded or
        # saved it. Per task, not per store: toolnexus' ask() loads and saves in
        # one task, and two turns of one conversation answered at once by this
        # process must each save against the version they loaded.
        self._etags: ContextVar[Mapping[str, str]] = ContextVar(f"chat_history_etags_{id(self)}", default={})

    async def get(self, id: str) -> Optional[list[dict[str, Any]]]:  # noqa: A002 (the protocol's name)
        """The whole transcript, verbatim and in order, or None when there is none."""
        response = await self._http.get(_path(id))
        if response.status_code == 404 and "ETag" in response.headers:
            # No transcript yet, and the version a save must find to create it.
            self._remember(id, response.headers["ETag"])
            return None
        body = _json_or_raise(response)
        self._remember(id, response.headers["ETag"])
        return body["messages"]

    async def save(self, id: str, messages: list[dict[str, Any]]) -> None:  # noqa: A002
        """Replace the transcript, if it is still the version this task loaded."""
        etag = self._etags.get().get(id)
        headers = {"If-Match": etag} if etag else {}
        response = await self._http.put(_path(id), json={"messages": messages}, headers=headers)
        if response.status_code == 412:
            raise TranscriptConflict(
                f"conversation {id!r} changed since it was loaded (now at version "
                f"{response.headers.get('ETag')}); load it again and retry the turn"
            )
        _json_or_raise(response)
        self._remember(id, response.headers["ETag"])

    def _remember(self, conversation_id: str, etag: str) -> None:
        # A new mapping, never an update in place: tasks started from this one
        # hold the old mapping, and must keep seeing what they loaded.
        self._etags.set({**self._etags.get(), conversation_id: etag})

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "HttpConversationStore":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def _path(conversation_id: str) -> str:
    # Any id works: a phone number, "whatsapp:+44…", an e-mail, a session id.
    return f"/v1/users/{quote(conversation_id, safe='')}/transcript"


def _json_or_raise(response: httpx.Response) -> dict[str, Any]:
    if response.is_success:
        return response.json()
    try:
        problem = response.json()
    except ValueError:
        problem = {"detail": response.text}
    raise ChatHistoryError(response.status_code, problem)

"""A walk through chat-history with a Python client generated from the
service's OpenAPI document by openapi-python-client.

    python -m venv .venv && . .venv/bin/activate
    pip install -r examples/python/requirements.txt
    openapi-python-client generate --path openapi/openapi.json \
        --output-path examples/python/chat_history_client --meta none
    HISTORY_URL=http://127.0.0.1:8080 HISTORY_API_KEY=... \
        python examples/python/scenario.py

Every step checks what came back, and the script exits 1 on the first
mismatch, so it doubles as a smoke test of a running service.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from typing import Any

import httpx

from chat_history_client import AuthenticatedClient, Client
from chat_history_client.api.messages import append_messages, get_history
from chat_history_client.api.transcripts import get_transcript, put_transcript
from chat_history_client.api.users import clear_history, get_user_stats
from chat_history_client.models import (
    AppendResponse,
    DeletedResponse,
    HistoryResponse,
    Message,
    MessageBatch,
    Problem,
    SaveTranscriptResponse,
    TranscriptBody,
    TranscriptResponse,
    UserStatsResponse,
)
from chat_history_client.types import Response

BASE_URL = os.environ.get("HISTORY_URL", "http://127.0.0.1:8080").rstrip("/")
API_KEY = os.environ.get("HISTORY_API_KEY")


class CheckFailed(Exception):
    pass


def check(condition: object, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def expect_ok(response: Response[Any], status: int, kind: type) -> Any:
    """The parsed body of a call that must succeed, or the server's reason why not."""
    check(
        response.status_code == status and isinstance(response.parsed, kind),
        f"expected HTTP {status}, got {int(response.status_code)}: {response.content.decode(errors='replace')}",
    )
    return response.parsed


def expect_problem(response: Response[Any], status: int) -> Problem:
    """A failed call must answer `status` with an RFC 9457 problem document."""
    check(int(response.status_code) == status, f"expected HTTP {status}, got {int(response.status_code)}")
    content_type = response.headers.get("content-type", "")
    check(
        content_type.startswith("application/problem+json"),
        f"expected application/problem+json, got {content_type!r}",
    )
    problem = response.parsed
    check(isinstance(problem, Problem), f"HTTP {status} did not parse as a Problem: {response.content!r}")
    check(problem.type_ and problem.title and problem.detail, f"incomplete problem: {problem.to_dict()}")
    check(problem.status == status, f"problem.status is {problem.status}, expected {status}")
    return problem


def messages(items: list[dict[str, Any]]) -> list[Message]:
    return [Message.from_dict(item) for item in items]


def main() -> None:
    # Only needed when the service has CHAT_HISTORY_API_KEYS configured.
    client: Any = (
        AuthenticatedClient(base_url=BASE_URL, token=API_KEY) if API_KEY else Client(base_url=BASE_URL)
    )
    # A fresh user each run. The colon, plus and space must be percent-encoded
    # in the path; the generated client does that.
    user_id = f"whatsapp:+44 py-{int(time.time() * 1000)}-{uuid.uuid4().hex[:8]}"

    batch = [
        {"role": "system", "content": "You are a concise travel assistant."},
        {"role": "user", "content": "What's the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c":18,"sky":"clear"}'},
        {"role": "user", "content": "Merci ! And tomorrow? 🙂"},
    ]

    with client:
        # 1. Append a batch, safe to retry thanks to the Idempotency-Key.
        key = str(uuid.uuid4())
        body = MessageBatch(messages=messages(batch))
        first = append_messages.sync_detailed(user_id, client=client, body=body, idempotency_key=key)
        appended: AppendResponse = expect_ok(first, 201, AppendResponse)
        check(appended.user_id == user_id, f"append echoed user_id {appended.user_id!r}")
        seqs = [m.seq for m in appended.messages]
        check(seqs == [1, 2, 3, 4, 5], f"append returned seqs {seqs}, expected [1..5]")
        check(
            [m.message.to_dict() for m in appended.messages] == batch,
            "append did not echo the messages verbatim",
        )
        check("Idempotent-Replayed" not in first.headers, "the first append was marked as a replay")
        print(f"append: {len(batch)} messages stored as seq 1..5, version {appended.version}, user {user_id!r}")

        retry = append_messages.sync_detailed(user_id, client=client, body=body, idempotency_key=key)
        replayed: AppendResponse = expect_ok(retry, 201, AppendResponse)
        check(retry.headers.get("Idempotent-Replayed") == "true", "the retry lacks Idempotent-Replayed: true")
        check(replayed.to_dict() == appended.to_dict(), "the retry returned a different response")
        print(f"append retry (same Idempotency-Key): replayed the first response, version {replayed.version}")

        # 2. The window for the next model call: at most 3 messages from the last hour.
        window = get_history.sync_detailed(user_id, client=client, limit=3, max_age=3600)
        history: HistoryResponse = expect_ok(window, 200, HistoryResponse)
        window_seqs = [m.seq for m in history.messages]
        check(window_seqs == [3, 4, 5], f"window has seqs {window_seqs}, expected [3, 4, 5]")
        check([m.message.to_dict() for m in history.messages] == batch[2:], "window differs from what was sent")
        check(history.has_more is True, "has_more should be true: seqs 1 and 2 are older")
        print(f"window (limit=3, max_age=3600): seqs {window_seqs}, oldest first, has_more {history.has_more}")

        # 3. Stats. The version is still the append's: the retry stored nothing.
        stats: UserStatsResponse = expect_ok(
            get_user_stats.sync_detailed(user_id, client=client), 200, UserStatsResponse
        )
        check(stats.message_count == 5, f"stats: message_count {stats.message_count}, expected 5")
        check((stats.first_seq, stats.last_seq) == (1, 5), f"stats: seqs {stats.first_seq}..{stats.last_seq}")
        check(stats.version == appended.version, f"stats: version {stats.version}, expected {appended.version}")
        print(f"stats: {stats.message_count} messages, seq {stats.first_seq}..{stats.last_seq}, version {stats.version}")

        # 4. Whole transcript with optimistic concurrency: ETag out, If-Match back in.
        loaded = get_transcript.sync_detailed(user_id, client=client)
        transcript: TranscriptResponse = expect_ok(loaded, 200, TranscriptResponse)
        etag = loaded.headers.get("ETag")
        check(etag == f'"{transcript.version}"', f"transcript ETag {etag!r}, expected the version quoted")
        check([m.to_dict() for m in transcript.messages] == batch, "transcript differs from what was sent")
        print(f"transcript: {len(transcript.messages)} messages, ETag {etag}")

        reply = {"role": "assistant", "content": "Tomorrow: 21°C and sunny in Paris."}
        save = put_transcript.sync_detailed(
            user_id,
            client=client,
            body=TranscriptBody(messages=transcript.messages + messages([reply])),
            if_match=etag,
        )
        saved: SaveTranscriptResponse = expect_ok(save, 200, SaveTranscriptResponse)
        new_etag = save.headers.get("ETag")
        check(
            (saved.kept, saved.appended, saved.removed) == (5, 1, 0),
            f"save: kept {saved.kept}, appended {saved.appended}, removed {saved.removed}; expected 5, 1, 0",
        )
        check(new_etag == f'"{saved.version}"' and new_etag != etag, f"save answered ETag {new_etag!r}")
        print(
            f"save with If-Match {etag}: kept {saved.kept}, appended {saved.appended}, "
            f"removed {saved.removed}, new ETag {new_etag}"
        )

        stale = put_transcript.sync_detailed(
            user_id,
            client=client,
            body=TranscriptBody(messages=messages(batch + [{"role": "assistant", "content": "A stale edit."}])),
            if_match=etag,
        )
        conflict = expect_problem(stale, 412)
        check(stale.headers.get("ETag") == new_etag, "the 412 should carry the current ETag")
        print(f"save with the stale If-Match {etag}: 412 {conflict.title}: {conflict.detail}")

        # 5. Errors are problem documents too: limit must be 1..1000.
        bad = get_history.sync_detailed(user_id, client=client, limit=0)
        invalid = expect_problem(bad, 400)
        print(f"window with limit=0: 400 {invalid.title}: {invalid.detail}")

        # 6. Forget the user.
        deleted: DeletedResponse = expect_ok(
            clear_history.sync_detailed(user_id, client=client), 200, DeletedResponse
        )
        check(deleted.deleted == 6, f"delete removed {deleted.deleted} messages, expected 6")
        gone = expect_problem(get_user_stats.sync_detailed(user_id, client=client), 404)
        print(f"delete: {deleted.deleted} messages removed; stats now 404 {gone.title}: {gone.detail}")

    print("python scenario: ok")


if __name__ == "__main__":
    try:
        main()
    except (CheckFailed, httpx.HTTPError) as err:
        print(f"python scenario: FAILED against {BASE_URL}: {err}", file=sys.stderr)
        sys.exit(1)

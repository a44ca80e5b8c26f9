"""HttpConversationStore under a real toolnexus client, a real chat-history,
and a fake OpenAI-compatible model server on loopback.

    HISTORY_URL=http://127.0.0.1:8080 HISTORY_API_KEY=... \
        python -m unittest -v examples/python/test_http_conversation_store.py

(run from examples/python, or with it on PYTHONPATH).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import threading
import unittest
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import quote

import httpx
from toolnexus import ConversationStore, create_client, create_toolkit, tool

from http_conversation_store import HttpConversationStore, TranscriptConflict

HISTORY_URL = os.environ.get("HISTORY_URL", "http://127.0.0.1:8080").rstrip("/")
API_KEY = os.environ.get("HISTORY_API_KEY")


class FakeModel(BaseHTTPRequestHandler):
    """`POST /chat/completions`: remembers what it was sent, and answers from
    the conversation it was given, so an answer shows what history reached it.

    - a weather question with no tool result yet: asks for the get_weather tool;
    - after a tool result: reports it;
    - "what is my name?": the name the user gave anywhere earlier, or "unknown";
    - anything else: "noted", with the number of messages it saw.
    """

    requests: list[list[dict[str, Any]]] = []
    # When set, each request waits here for the others: the calls are in flight together.
    barrier: threading.Barrier | None = None

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if FakeModel.barrier is not None:
            FakeModel.barrier.wait(timeout=10)
        messages = payload["messages"]
        FakeModel.requests.append(messages)
        last = messages[-1]
        if last["role"] == "tool":
            reply = {"role": "assistant", "content": f"The weather: {last['content']}"}
        elif "weather" in str(last.get("content")).lower():
            reply = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{len(messages)}",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                    }
                ],
            }
        elif "what is my name" in str(last.get("content")).lower():
            names = [
                m["content"].split("My name is ", 1)[1].rstrip(".")
                for m in messages
                if m["role"] == "user" and "My name is " in str(m.get("content"))
            ]
            reply = {"role": "assistant", "content": f"Your name is {names[0] if names else 'unknown'}."}
        else:
            reply = {"role": "assistant", "content": f"Noted ({len(messages)} messages so far)."}
        body = json.dumps(
            {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "model": payload["model"],
                "choices": [{"index": 0, "message": reply, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"18°C and clear in {city}"


class HttpConversationStoreTest(unittest.IsolatedAsyncioTestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.model = ThreadingHTTPServer(("127.0.0.1", 0), FakeModel)
        threading.Thread(target=cls.model.serve_forever, daemon=True).start()
        cls.model_url = f"http://127.0.0.1:{cls.model.server_address[1]}/v1"

    @classmethod
    def tearDownClass(cls) -> None:
        cls.model.shutdown()

    async def asyncSetUp(self) -> None:
        FakeModel.requests.clear()
        self.conversation = f"whatsapp:+44 toolnexus-{uuid.uuid4().hex[:12]}"
        headers = {"Authorization": f"Bearer {API_KEY}"} if API_KEY else {}
        self.raw = httpx.AsyncClient(base_url=HISTORY_URL, headers=headers)
        self.toolkit = await create_toolkit(extra_tools=[get_weather], builtins=False)

    async def asyncTearDown(self) -> None:
        await self.raw.delete(f"/v1/users/{quote(self.conversation, safe='')}")
        await self.raw.aclose()

    def llm(self, store: HttpConversationStore):
        return create_client(
            base_url=self.model_url,
            style="openai",
            model="fake-model",
            api_key="not-a-real-key",
            system_prompt="You are a helpful assistant.",
            store=store,
        )

    async def stored(self) -> list[dict[str, Any]]:
        response = await self.raw.get(f"/v1/users/{quote(self.conversation, safe='')}/transcript")
        self.assertEqual(response.status_code, 200, response.text)
        return response.json()["messages"]

    def test_it_has_the_protocols_methods(self) -> None:
        for name in ("get", "save"):
            ours, theirs = getattr(HttpConversationStore, name), getattr(ConversationStore, name)
            self.assertTrue(inspect.iscoroutinefunction(ours), name)
            self.assertEqual(
                list(inspect.signature(ours).parameters), list(inspect.signature(theirs).parameters), name
            )

    async def test_an_unknown_conversation_is_none(self) -> None:
        async with HttpConversationStore(HISTORY_URL, api_key=API_KEY) as store:
            self.assertIsNone(await store.get(self.conversation))

    async def test_a_second_client_resumes_the_conversation(self) -> None:
        # The first process: two turns, one of them through a tool.
        async with HttpConversationStore(HISTORY_URL, api_key=API_KEY) as first_store:
            first = self.llm(first_store)
            hello = await first.ask("My name is Ada.", self.toolkit, id=self.conversation)
            self.assertEqual(hello.text, "Noted (2 messages so far).")
            weather = await first.ask("What's the weather in Paris?", self.toolkit, id=self.conversation)
            self.assertEqual(weather.text, "The weather: 18°C and clear in Paris")
            self.assertEqual(weather.tool_call_count, 1)

        saved = await self.stored()
        self.assertEqual(
            [m["role"] for m in saved],
            ["system", "user", "assistant", "user", "assistant", "tool", "assistant"],
        )
        # What chat-history holds is what toolnexus produced, verbatim.
        self.assertEqual(saved, weather.messages)
        self.assertEqual(saved[4]["tool_calls"][0]["function"]["name"], "get_weather")

        # Another process, with its own store and client, continues it.
        async with HttpConversationStore(HISTORY_URL, api_key=API_KEY) as second_store:
            second = self.llm(second_store)
            FakeModel.requests.clear()
            answer = await second.ask("What is my name?", self.toolkit, id=self.conversation)
        self.assertEqual(answer.text, "Your name is Ada.")
        # The model was sent the whole stored conversation, then the new question.
        self.assertEqual(len(FakeModel.requests), 1)
        self.assertEqual(FakeModel.requests[0][: len(saved)], saved)
        self.assertEqual(FakeModel.requests[0][len(saved)], {"role": "user", "content": "What is my name?"})
        self.assertEqual(await self.stored(), answer.messages)
        self.assertEqual(len(answer.messages), len(saved) + 2)

    async def test_a_stale_save_is_refused_and_changes_nothing(self) -> None:
        async with (
            HttpConversationStore(HISTORY_URL, api_key=API_KEY) as one,
            HttpConversationStore(HISTORY_URL, api_key=API_KEY) as other,
        ):
            await self.llm(one).ask("My name is Ada.", id=self.conversation)
            loaded = await one.get(self.conversation)
            # Meanwhile another process answers a turn of the same conversation.
            await self.llm(other).ask("My name is Grace.", id=self.conversation)
            newer = await self.stored()
            with self.assertRaises(TranscriptConflict):
                await one.save(self.conversation, loaded + [{"role": "user", "content": "late"}])
            self.assertEqual(await self.stored(), newer)
            # Retrying the turn loads the newer transcript first, and succeeds.
            again = await self.llm(one).ask("What is my name?", id=self.conversation)
            self.assertEqual(again.text, "Your name is Ada.")
            self.assertEqual(len(await self.stored()), len(newer) + 2)

    async def test_two_clients_starting_one_conversation_do_not_overwrite(self) -> None:
        async with (
            HttpConversationStore(HISTORY_URL, api_key=API_KEY) as one,
            HttpConversationStore(HISTORY_URL, api_key=API_KEY) as other,
        ):
            # Both find no conversation yet; the first to answer saves it.
            self.assertIsNone(await one.get(self.conversation))
            self.assertIsNone(await other.get(self.conversation))
            await one.save(self.conversation, [{"role": "user", "content": "My name is Ada."}])
            with self.assertRaises(TranscriptConflict):
                await other.save(self.conversation, [{"role": "user", "content": "My name is Grace."}])
            self.assertEqual(await self.stored(), [{"role": "user", "content": "My name is Ada."}])

    async def test_two_turns_at_once_in_one_process_do_not_overwrite(self) -> None:
        async with HttpConversationStore(HISTORY_URL, api_key=API_KEY) as store:
            llm = self.llm(store)
            await llm.ask("My name is Ada.", id=self.conversation)
            before = await self.stored()
            # Two messages of one user arrive together: both turns load the
            # same transcript (the model answers neither until it has both
            # calls); the second to save must not erase the first.
            FakeModel.barrier = threading.Barrier(2)
            try:
                results = await asyncio.gather(
                    llm.ask("First at once.", id=self.conversation),
                    llm.ask("Second at once.", id=self.conversation),
                    return_exceptions=True,
                )
            finally:
                FakeModel.barrier = None
            conflicts = [r for r in results if isinstance(r, TranscriptConflict)]
            answers = [r for r in results if not isinstance(r, BaseException)]
            self.assertEqual((len(conflicts), len(answers)), (1, 1), results)
            self.assertEqual(await self.stored(), answers[0].messages)
            self.assertEqual(len(answers[0].messages), len(before) + 2)

    async def test_each_task_saves_against_the_version_it_loaded(self) -> None:
        first = [{"role": "user", "content": "My name is Ada."}]
        async with HttpConversationStore(HISTORY_URL, api_key=API_KEY) as store:
            await store.save(self.conversation, first)
            a_loaded, b_loaded, a_saved = asyncio.Event(), asyncio.Event(), asyncio.Event()

            async def turn_a() -> None:
                history = await store.get(self.conversation)
                a_loaded.set()
                await b_loaded.wait()
                await store.save(self.conversation, history + [{"role": "assistant", "content": "A"}])
                a_saved.set()

            async def turn_b() -> None:
                await a_loaded.wait()
                history = await store.get(self.conversation)
                b_loaded.set()
                # B saves only after A has: against the version B loaded, now stale.
                await a_saved.wait()
                await store.save(self.conversation, history + [{"role": "assistant", "content": "B"}])

            a, b = await asyncio.gather(turn_a(), turn_b(), return_exceptions=True)
            self.assertIsNone(a)
            self.assertIsInstance(b, TranscriptConflict)
            self.assertEqual(await self.stored(), first + [{"role": "assistant", "content": "A"}])


if __name__ == "__main__":
    unittest.main()

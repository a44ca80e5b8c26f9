// A walk through chat-history with a typed client generated from the service's
// OpenAPI document (openapi-typescript for the types, openapi-fetch at run time).
//
//   npm ci && npm run generate && npm run build
//   HISTORY_URL=http://127.0.0.1:8080 HISTORY_API_KEY=... npm run --silent scenario
//
// Every step checks what came back and the script exits 1 on the first
// mismatch, so it doubles as a smoke test of a running service.

import { randomUUID } from "node:crypto";
import { isDeepStrictEqual } from "node:util";
import createClient from "openapi-fetch";
import type { components, paths } from "./generated/schema.js";

type Message = components["schemas"]["Message"];
type Problem = components["schemas"]["Problem"];

const baseUrl = (process.env.HISTORY_URL ?? "http://127.0.0.1:8080").replace(/\/+$/, "");
const apiKey = process.env.HISTORY_API_KEY;

const client = createClient<paths>({
  baseUrl,
  // Only needed when the service has CHAT_HISTORY_API_KEYS configured.
  headers: apiKey ? { Authorization: `Bearer ${apiKey}` } : {},
});

class CheckFailed extends Error {}

function check(cond: unknown, msg: string): asserts cond {
  if (!cond) throw new CheckFailed(msg);
}

function show(value: unknown): string {
  return JSON.stringify(value);
}

/** Check that a failed call answered `status` with an RFC 9457 problem document. */
function expectProblem(response: Response, error: Problem | undefined, status: number): Problem {
  check(response.status === status, `expected HTTP ${status}, got ${response.status}`);
  const contentType = response.headers.get("content-type") ?? "";
  check(
    contentType.startsWith("application/problem+json"),
    `expected application/problem+json, got ${show(contentType)}`,
  );
  check(error !== undefined, `HTTP ${status} came without a body`);
  check(typeof error.type === "string" && error.type !== "", `problem.type missing: ${show(error)}`);
  check(typeof error.title === "string" && error.title !== "", `problem.title missing: ${show(error)}`);
  check(error.status === status, `problem.status is ${show(error.status)}, expected ${status}`);
  check(typeof error.detail === "string" && error.detail !== "", `problem.detail missing: ${show(error)}`);
  return error;
}

/** Fail with the server's own explanation when a call that should succeed did not. */
function expectOk<T>(response: Response, data: T | undefined, error: unknown, status: number): T {
  check(
    response.status === status && data !== undefined,
    `expected HTTP ${status}, got ${response.status}: ${show(error)}`,
  );
  return data;
}

async function main(): Promise<void> {
  // A fresh user each run. The id has a colon, a plus and a space, which must be
  // percent-encoded in the path; openapi-fetch does that for path parameters.
  const userId = `whatsapp:+44 ts-${Date.now()}-${randomUUID().slice(0, 8)}`;
  const path = { user_id: userId };

  const batch: Message[] = [
    { role: "system", content: "You are a concise travel assistant." },
    { role: "user", content: "What's the weather in Paris?" },
    {
      role: "assistant",
      content: null,
      tool_calls: [
        {
          id: "call_1",
          type: "function",
          function: { name: "get_weather", arguments: '{"city":"Paris"}' },
        },
      ],
    },
    { role: "tool", tool_call_id: "call_1", content: '{"temp_c":18,"sky":"clear"}' },
    { role: "user", content: "Merci ! And tomorrow? 🙂" },
  ];

  // 1. Append a batch, safe to retry thanks to the Idempotency-Key.
  const idempotencyKey = randomUUID();
  const append = () =>
    client.POST("/v1/users/{user_id}/messages", {
      params: { path, header: { "Idempotency-Key": idempotencyKey } },
      body: { messages: batch },
    });

  const first = await append();
  const appended = expectOk(first.response, first.data, first.error, 201);
  check(
    first.response.url.includes(`/v1/users/${encodeURIComponent(userId)}/messages`),
    `user_id was not percent-encoded in the path: ${first.response.url}`,
  );
  check(appended.user_id === userId, `append echoed user_id ${show(appended.user_id)}, expected ${show(userId)}`);
  const seqs = appended.messages.map((m) => m.seq);
  check(isDeepStrictEqual(seqs, [1, 2, 3, 4, 5]), `append returned seqs ${show(seqs)}, expected [1,2,3,4,5]`);
  check(
    isDeepStrictEqual(appended.messages.map((m) => m.message), batch),
    `append did not echo the messages verbatim: ${show(appended.messages)}`,
  );
  check(first.response.headers.get("Idempotent-Replayed") === null, "first append was marked as a replay");
  console.log(`append: ${batch.length} messages stored as seq 1..5, version ${appended.version}, user ${show(userId)}`);

  const retry = await append();
  const replayed = expectOk(retry.response, retry.data, retry.error, 201);
  check(
    retry.response.headers.get("Idempotent-Replayed") === "true",
    `retry lacks "Idempotent-Replayed: true" (got ${show(retry.response.headers.get("Idempotent-Replayed"))})`,
  );
  check(isDeepStrictEqual(replayed, appended), `retry returned a different response: ${show(replayed)}`);
  console.log(`append retry (same Idempotency-Key): replayed the first response, seq 1..5, version ${replayed.version}`);

  // 2. The window for the next model call: at most 3 messages from the last hour.
  const window = await client.GET("/v1/users/{user_id}/messages", {
    params: { path, query: { limit: 3, max_age: 3600 } },
  });
  const history = expectOk(window.response, window.data, window.error, 200);
  const windowSeqs = history.messages.map((m) => m.seq);
  check(isDeepStrictEqual(windowSeqs, [3, 4, 5]), `window has seqs ${show(windowSeqs)}, expected [3,4,5]`);
  check(
    isDeepStrictEqual(history.messages.map((m) => m.message), batch.slice(2)),
    `window messages differ from what was sent: ${show(history.messages)}`,
  );
  check(history.has_more === true, "window should report has_more: true (seqs 1 and 2 are older)");
  console.log(`window (limit=3, max_age=3600): seqs ${show(windowSeqs)}, oldest first, has_more ${history.has_more}`);

  // 3. Stats. The version is still the append's: the retry stored nothing.
  const statsResult = await client.GET("/v1/users/{user_id}", { params: { path } });
  const stats = expectOk(statsResult.response, statsResult.data, statsResult.error, 200);
  check(stats.user_id === userId, `stats for ${show(stats.user_id)}, expected ${show(userId)}`);
  check(stats.message_count === 5, `stats: message_count ${stats.message_count}, expected 5`);
  check(stats.first_seq === 1 && stats.last_seq === 5, `stats: seqs ${stats.first_seq}..${stats.last_seq}, expected 1..5`);
  check(stats.version === appended.version, `stats: version ${stats.version}, expected ${appended.version}`);
  console.log(`stats: ${stats.message_count} messages, seq ${stats.first_seq}..${stats.last_seq}, version ${stats.version}`);

  // 4. Whole transcript with optimistic concurrency: ETag out, If-Match back in.
  const loaded = await client.GET("/v1/users/{user_id}/transcript", { params: { path } });
  const transcript = expectOk(loaded.response, loaded.data, loaded.error, 200);
  const etag = loaded.response.headers.get("ETag");
  check(etag === `"${transcript.version}"`, `transcript ETag ${show(etag)}, expected "\\"${transcript.version}\\""`);
  check(transcript.version === stats.version, `transcript version ${transcript.version}, expected ${stats.version}`);
  check(isDeepStrictEqual(transcript.messages, batch), `transcript differs from what was sent: ${show(transcript.messages)}`);
  console.log(`transcript: ${transcript.messages.length} messages, ETag ${etag}`);

  const reply: Message = { role: "assistant", content: "Tomorrow: 21°C and sunny in Paris." };
  const saveResult = await client.PUT("/v1/users/{user_id}/transcript", {
    params: { path, header: { "If-Match": etag } },
    body: { messages: [...transcript.messages, reply] },
  });
  const saved = expectOk(saveResult.response, saveResult.data, saveResult.error, 200);
  const newEtag = saveResult.response.headers.get("ETag");
  check(
    saved.kept === 5 && saved.appended === 1 && saved.removed === 0,
    `save: kept ${saved.kept}, appended ${saved.appended}, removed ${saved.removed}; expected 5, 1, 0`,
  );
  check(newEtag === `"${saved.version}"`, `save ETag ${show(newEtag)}, expected "\\"${saved.version}\\""`);
  check(newEtag !== etag, `save did not change the ETag (${etag})`);
  console.log(`save with If-Match ${etag}: kept ${saved.kept}, appended ${saved.appended}, removed ${saved.removed}, new ETag ${newEtag}`);

  const stale = await client.PUT("/v1/users/{user_id}/transcript", {
    params: { path, header: { "If-Match": etag } },
    body: { messages: [...transcript.messages, { role: "assistant", content: "A stale edit." }] },
  });
  check(stale.data === undefined, `save with a stale If-Match succeeded: ${show(stale.data)}`);
  const conflict = expectProblem(stale.response, stale.error, 412);
  check(
    stale.response.headers.get("ETag") === newEtag,
    `412 carries ETag ${show(stale.response.headers.get("ETag"))}, expected the current ${newEtag}`,
  );
  console.log(`save with the stale If-Match ${etag}: ${stale.response.status} ${conflict.title}: ${conflict.detail}`);

  // 5. Errors are problem documents too: limit must be 1..1000.
  const bad = await client.GET("/v1/users/{user_id}/messages", { params: { path, query: { limit: 0 } } });
  check(bad.data === undefined, `limit=0 was accepted: ${show(bad.data)}`);
  const invalid = expectProblem(bad.response, bad.error, 400);
  console.log(`window with limit=0: ${bad.response.status} ${invalid.title}: ${invalid.detail}`);

  // 6. Forget the user.
  const cleared = await client.DELETE("/v1/users/{user_id}", { params: { path } });
  const deleted = expectOk(cleared.response, cleared.data, cleared.error, 200);
  check(deleted.deleted === 6, `delete removed ${deleted.deleted} messages, expected 6`);
  const gone = await client.GET("/v1/users/{user_id}", { params: { path } });
  check(gone.data === undefined, `stats still answer after delete: ${show(gone.data)}`);
  const notFound = expectProblem(gone.response, gone.error, 404);
  console.log(`delete: ${deleted.deleted} messages removed; stats now ${gone.response.status} ${notFound.title}: ${notFound.detail}`);

  console.log("typescript scenario: ok");
}

function describe(err: unknown): string {
  if (err instanceof CheckFailed) return err.message;
  if (err instanceof Error) {
    // fetch() failures keep the useful part (ECONNREFUSED, ...) in `cause`.
    const cause = err.cause instanceof Error ? ` (${err.cause.message})` : "";
    return `${err.name}: ${err.message}${cause}`;
  }
  return String(err);
}

main().catch((err: unknown) => {
  const reason = describe(err);
  console.error(`typescript scenario: FAILED against ${baseUrl}: ${reason}`);
  process.exit(1);
});

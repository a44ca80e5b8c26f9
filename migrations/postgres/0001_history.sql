-- One row per (tenant, user_id) ever written. It is never deleted, so that
-- `seq` and `version` never repeat for a user, not even after a clear.
CREATE TABLE chat_users (
    tenant          text COLLATE "C" NOT NULL,
    user_id         text COLLATE "C" NOT NULL,
    -- the last seq handed out; the next append starts at last_seq + 1
    last_seq        bigint NOT NULL,
    -- bumped by every write that changes this user's messages
    version         bigint NOT NULL,
    -- kept in step with chat_messages so that stats cost O(1)
    message_count   bigint NOT NULL,
    -- the created_at given to the newest append; later appends never get less
    last_created_at timestamptz NOT NULL,
    -- never later than the user's oldest message: where retention looks
    oldest_at       timestamptz,
    -- set by a transcript save: a digest of the digests of every message in
    -- order, so the next save can tell in O(1) that it only adds messages;
    -- any other write sets it to NULL
    transcript_digest bytea,
    PRIMARY KEY (tenant, user_id)
) WITH (fillfactor = 80);

CREATE INDEX chat_users_oldest_at ON chat_users (tenant, oldest_at)
    WHERE oldest_at IS NOT NULL;

-- `message` is the caller's JSON object as text, exactly as it will be
-- returned (text keeps every digit of a number; cast to jsonb to query it).
CREATE TABLE chat_messages (
    tenant     text COLLATE "C" NOT NULL,
    user_id    text COLLATE "C" NOT NULL,
    seq        bigint NOT NULL,
    created_at timestamptz NOT NULL,
    message    text NOT NULL,
    -- first 16 bytes of the SHA-256 of `message`: a transcript save compares
    -- these instead of whole messages to find what it can keep
    digest     bytea NOT NULL,
    PRIMARY KEY (tenant, user_id, seq)
);

-- Finds where a user's age window starts (and what retention removes)
-- without walking the older history.
CREATE INDEX chat_messages_age ON chat_messages (tenant, user_id, created_at, seq);

-- What an append with an Idempotency-Key stored, so that a retry gets the
-- same answer: the digest of its body and where its messages went. Kept at
-- least 24 hours; the retention task deletes older keys.
CREATE TABLE chat_idempotency (
    tenant         text COLLATE "C" NOT NULL,
    user_id        text COLLATE "C" NOT NULL,
    key            text COLLATE "C" NOT NULL,
    request_digest bytea NOT NULL,
    first_seq      bigint NOT NULL,
    created_at     timestamptz NOT NULL,
    version        bigint NOT NULL,
    stored_at      timestamptz NOT NULL,
    PRIMARY KEY (tenant, user_id, key)
);

CREATE INDEX chat_idempotency_stored_at ON chat_idempotency (stored_at);

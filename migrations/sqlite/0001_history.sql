-- The SQLite twin of migrations/postgres/0001_history.sql: same tables, same
-- keys. Times are whole microseconds since the Unix epoch, UTC. TEXT compares
-- as raw bytes (BINARY collation), like Postgres's "C".
CREATE TABLE chat_users (
    tenant          TEXT NOT NULL,
    user_id         TEXT NOT NULL,
    last_seq        INTEGER NOT NULL,
    version         INTEGER NOT NULL,
    message_count   INTEGER NOT NULL,
    last_created_at INTEGER NOT NULL,
    oldest_at       INTEGER,
    transcript_digest BLOB,
    PRIMARY KEY (tenant, user_id)
) STRICT;

CREATE INDEX chat_users_oldest_at ON chat_users (tenant, oldest_at)
    WHERE oldest_at IS NOT NULL;

CREATE TABLE chat_messages (
    tenant     TEXT NOT NULL,
    user_id    TEXT NOT NULL,
    seq        INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    message    TEXT NOT NULL,
    digest     BLOB NOT NULL,
    PRIMARY KEY (tenant, user_id, seq)
) STRICT;

CREATE INDEX chat_messages_age ON chat_messages (tenant, user_id, created_at, seq);

CREATE TABLE chat_idempotency (
    tenant         TEXT NOT NULL,
    user_id        TEXT NOT NULL,
    key            TEXT NOT NULL,
    request_digest BLOB NOT NULL,
    first_seq      INTEGER NOT NULL,
    created_at     INTEGER NOT NULL,
    version        INTEGER NOT NULL,
    stored_at      INTEGER NOT NULL,
    PRIMARY KEY (tenant, user_id, key)
) STRICT;

CREATE INDEX chat_idempotency_stored_at ON chat_idempotency (stored_at);

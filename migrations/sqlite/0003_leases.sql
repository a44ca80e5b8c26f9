-- Leases that let one process at a time do a job (retention), as on Postgres
-- (migrations/postgres/0002_leases.sql): the store takes the same lease on
-- both backends. Times are whole microseconds since the Unix epoch, UTC.
CREATE TABLE chat_leases (
    name       TEXT PRIMARY KEY,
    holder     TEXT NOT NULL,
    expires_at INTEGER NOT NULL
) STRICT;

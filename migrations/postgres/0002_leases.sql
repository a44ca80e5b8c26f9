-- Leases that let one replica at a time do a job (retention). A lease row
-- rather than a session-level advisory lock, because behind a pooler in
-- transaction mode no session lasts beyond a transaction.
CREATE TABLE chat_leases (
    name       text COLLATE "C" PRIMARY KEY,
    holder     text NOT NULL,
    expires_at timestamptz NOT NULL
);

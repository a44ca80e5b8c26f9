-- Postgres only: leases coordinate replicas that share one Postgres
-- (migrations/postgres/0002_leases.sql). An SQLite file serves one process,
-- so there is nothing to coordinate; this file keeps the version numbers of
-- the two folders in step.
SELECT 1;

-- Nothing to do on Postgres, which has had chat_leases since 0002: this file
-- keeps the version numbers of the two folders in step with
-- migrations/sqlite/0003_leases.sql, where SQLite gets the same table.
SELECT 1;

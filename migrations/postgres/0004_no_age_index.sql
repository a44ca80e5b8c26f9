-- chat_messages_age (0001) cost every append a third B-tree to write. As
-- `created_at` follows `seq` within a user, the primary key finds where an
-- age window starts (a binary search over `seq`) and what retention removes
-- (a walk from the oldest message), so the index goes.
DROP INDEX IF EXISTS chat_messages_age;

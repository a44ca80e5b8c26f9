-- chat_messages_age (0001) cost every append one more B-tree to write. As
-- `created_at` never goes back within a user, the primary key finds where an
-- age window starts (a binary search over `seq`) and what retention removes
-- (the first rows of each user's range), so the index goes. Replicas still
-- on the build before keep serving without it; their forward pages are slower.
DROP INDEX IF EXISTS chat_messages_age;

-- The claim takes runs in (due_at, id) order: runs scheduled in one
-- transaction are due at the same time, and their UUIDv7 ids order them.
-- With `due_at` alone in the index the planner had to read and sort every
-- claimable run to find the first (a batch of 5,000 runs scheduled together
-- made each claim cost milliseconds); with `id` in it, the first unlocked
-- entry of a range scan is the answer.
CREATE INDEX everystep_workflow_ready ON everystep_workflow (due_at, id) WHERE status IN ('scheduled', 'waiting');
DROP INDEX everystep_workflow_due;

-- Execution tokens: every claim of a run (first claim, catchup, successor
-- claim, reclaim after a lost answer) gives the run a new token from this
-- sequence, and every write about a held run matches status, claimer and
-- token. The token tells one execution of a run from any other, also within
-- one worker. Runs claimed before this migration have no token until they are
-- claimed again (their worker's catchup, or a recovery, does it).
CREATE SEQUENCE everystep_claim_token AS bigint;
ALTER TABLE everystep_workflow ADD COLUMN claim_token bigint;

-- The execution that wrote a step row (NULL for rows written before this
-- migration): a write retried after a connection error tells its own
-- earlier attempt from another execution's row.
ALTER TABLE everystep_step ADD COLUMN claim_token bigint;

-- When a step's execution started and ended, by the worker's clock (NULL for
-- rows written before this migration; `finished_at` NULL while `started`).
ALTER TABLE everystep_step ADD COLUMN started_at timestamptz;
ALTER TABLE everystep_step ADD COLUMN finished_at timestamptz;

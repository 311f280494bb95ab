-- name: record_traceback
-- The traceback of a failed step attempt, written by the execution holding
-- the run (nothing when it no longer does); a retry of the same write
-- replaces it.
INSERT INTO everystep_step_traceback (workflow_id, step_id, attempt, claim_token, traceback)
SELECT id, %(step_id)s, %(attempt)s, claim_token, %(traceback)s
FROM everystep_workflow
WHERE id = %(run)s AND (status = 'running') IS TRUE AND claimed_by = %(runner)s
  AND claim_token = %(token)s::bigint
ON CONFLICT (workflow_id, step_id, attempt) DO UPDATE
SET traceback = EXCLUDED.traceback, claim_token = EXCLUDED.claim_token, recorded_at = now()
RETURNING 1;

-- name: step_tracebacks
-- A run's step tracebacks, by step and attempt.
SELECT step_id, attempt, claim_token, traceback, recorded_at
FROM everystep_step_traceback
WHERE workflow_id = %(run)s
ORDER BY step_id, attempt;

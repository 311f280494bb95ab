-- The operators' actions and records: resolving a blocked run's step,
-- the audit trail. Read by everystep/db/ops.py.


-- name: lock_run_status
-- The run's status, its row locked until the transaction ends.
SELECT status
FROM everystep_workflow
WHERE id = %(run)s
FOR UPDATE;

-- name: history_run_status
-- The status of a run that has moved to the history (0015_history.sql).
SELECT status
FROM everystep_workflow_history
WHERE id = %(run)s;

-- name: delete_step
-- A `started` step whose effect did not happen: the next execution runs it.
DELETE FROM everystep_step
WHERE workflow_id = %(run)s AND step_id = %(step_id)s;

-- name: resolve_step
-- A `started` step's outcome, as the operator says it was.
UPDATE everystep_step
SET status = %(status)s, result = %(result)s::jsonb, error = %(error)s::jsonb
WHERE workflow_id = %(run)s AND step_id = %(step_id)s;

-- name: reschedule_resolved
-- A blocked run whose step was resolved goes back to `scheduled`.
UPDATE everystep_workflow
SET status = 'scheduled', claimed_by = NULL, error = NULL, completed_at = NULL
WHERE id = %(run)s;


-- name: audit
-- An operator's action: who, what, on which run or step, the values given.
INSERT INTO everystep_audit (actor, source, action, run_id, step_id, target, details)
VALUES (%(actor)s, %(source)s, %(action)s, %(run)s, %(step_id)s, %(target)s, %(details)s::jsonb);

-- name: audit_records
-- The newest audit records (of one run; before one record), newest first.
SELECT id, at, actor, source, action, run_id, step_id, target, details
FROM everystep_audit
WHERE (%(run)s::uuid IS NULL OR run_id = %(run)s) AND (%(before)s::bigint IS NULL OR id < %(before)s)
ORDER BY id DESC
LIMIT %(limit)s;

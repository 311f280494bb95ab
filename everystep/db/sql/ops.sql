-- The operators' actions and records: resolving a blocked run's step,
-- pruning old runs, the audit trail. Read by everystep/db/ops.py.


-- name: lock_run_status
-- The run's status, its row locked until the transaction ends.
SELECT status
FROM everystep_workflow
WHERE id = %(run)s
FOR UPDATE;

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


-- name: count_prunable
-- Terminal runs completed more than `days` days ago (by the database's
-- clock). A run completes after it is created, so the bound on created_at
-- adds nothing to the condition but lets the (status, created_at) index
-- limit the scan.
SELECT count(*)
FROM everystep_workflow
WHERE status IN ('completed', 'failed', 'stopped', 'cancelled')
  AND created_at < everystep_now() - make_interval(days => %(days)s::int)
  AND completed_at < everystep_now() - make_interval(days => %(days)s::int);

-- name: prune_batch
-- Up to `limit` of the runs count_prunable counts, with their steps (FK
-- cascade); rows locked by someone else are skipped rather than waited for.
DELETE FROM everystep_workflow
WHERE id IN (SELECT id
             FROM everystep_workflow
             WHERE status IN ('completed', 'failed', 'stopped', 'cancelled')
               AND created_at < everystep_now() - make_interval(days => %(days)s::int)
               AND completed_at < everystep_now() - make_interval(days => %(days)s::int)
             LIMIT %(limit)s
             FOR UPDATE SKIP LOCKED);


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

-- name: audit_records_filtered
-- The newest audit records matching the audit page's filters (each holds
-- only when given, not NULL): one actor, one action, one run; before one
-- record; newest first. Run unprepared, so PostgreSQL plans it with its
-- values and drops the conditions whose value is NULL.
SELECT id, at, actor, source, action, run_id, step_id, target, details
FROM everystep_audit
WHERE (%(actor)s::text IS NULL OR actor = %(actor)s::text)
  AND (%(action)s::text IS NULL OR action = %(action)s::text)
  AND (%(run)s::uuid IS NULL OR run_id = %(run)s::uuid)
  AND (%(before)s::bigint IS NULL OR id < %(before)s::bigint)
ORDER BY id DESC
LIMIT %(limit)s;

-- name: environment_table_exists
-- Whether the schema has the environment table (migration 0017), before it is read.
SELECT to_regclass('everystep_environment') IS NOT NULL;

-- name: recorded_environment
-- The environment recorded for this database, if any.
SELECT name
FROM everystep_environment;

-- name: record_environment
-- Record (or change) which environment this database is.
INSERT INTO everystep_environment (one, name, recorded_at, recorded_by)
VALUES (true, %(name)s, everystep_now(), %(by)s)
ON CONFLICT (one) DO UPDATE
SET name = excluded.name, recorded_at = excluded.recorded_at, recorded_by = excluded.recorded_by;

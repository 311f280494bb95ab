-- The operators' actions and records: resolving a blocked run's step,
-- the audit trail. Read by everystep/db/ops.py.


-- name: lock_run_status
-- The run's status, its row locked until the transaction ends.
SELECT status
FROM everystep_workflow
WHERE id = %(run)s
FOR UPDATE;

-- name: history_run_status
-- The status of a run that has moved to the history (0017_history.sql).
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
-- Whether the schema has the environment table (migration 0016), before it is read.
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

-- name: rerun_source
-- The run a re-run copies from, hot or in the history: its status and every
-- recorded step of it (what the copy chooses from). Only an ended run is
-- re-run, and an ended run's steps no longer change.
SELECT w.status,
       to_json(ARRAY(SELECT json_build_object('id', s.id, 'step_id', s.step_id, 'name', s.name, 'status', s.status,
                                              'started_at', s.started_at, 'finished_at', s.finished_at)
                     FROM everystep_step_all s
                     WHERE s.workflow_id = w.id
                     ORDER BY s.id))
FROM everystep_workflow_all w
WHERE w.id = %(run)s;

-- name: insert_rerun
-- The re-run: a new run of the same workflow and args (no idempotency key,
-- no parent), linked back to the run it re-runs, and the recorded outcomes
-- of the steps `step_ids` copied from that run, in their recorded order, so
-- that replay serves them. Notifies the claimers.
-- Its priority, concurrency key and attributes are the original's; it has
-- no deadline.
WITH ins AS (
    INSERT INTO everystep_workflow (id, name, args, status, rerun_of, priority, concurrency_key, attributes)
    SELECT %(id)s, w.name, w.args, 'scheduled', w.id, w.priority, w.concurrency_key, w.attributes
    FROM everystep_workflow_all w
    WHERE w.id = %(run)s
    RETURNING id
)
SELECT id, pg_notify('everystep:' || current_schema(), '')
FROM ins;

-- name: copy_rerun_steps
-- The recorded outcomes of `step_ids` of run `run`, copied to the re-run `id`
-- in their recorded order (the execution token is not: no execution of the
-- re-run wrote them).
INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result, error, started_at, finished_at,
                            attempts)
SELECT %(id)s, s.step_id, s.name, s.args, s.kwargs, s.status, s.result, s.error, s.started_at, s.finished_at,
       s.attempts
FROM everystep_step_all s
WHERE s.workflow_id = %(run)s AND s.step_id = ANY(%(step_ids)s::text[])
ORDER BY s.id;

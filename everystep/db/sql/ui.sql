-- The operators' web UI (everystep/ui/): its pages' reads and the actions
-- it offers beyond the CLI's. Read by everystep/db/ui.py.


-- name: ui_runs
-- One page of runs, newest first, each with its count of steps done and
-- recorded; keyset paging: (before_at, before_id) is the (created_at, id)
-- of the last row shown. Each condition holds only when its value is given
-- (not NULL). Run unprepared, so that it is planned with its values:
-- PostgreSQL then drops the conditions whose value is NULL, and the others
-- can use their indexes. The bound created_at <= before_at limits the scan
-- of the created_at index; the rest breaks ties by id.
SELECT w.id, w.name, w.status, w.idempotency_key, w.claimed_by, w.created_at, w.completed_at,
       s.steps_done, s.steps_total
FROM (
    SELECT id, name, status, idempotency_key, claimed_by, created_at, completed_at
    FROM everystep_workflow_all
    WHERE (%(status)s::text IS NULL OR status = %(status)s::text)
      AND (%(workflow)s::text IS NULL OR name = %(workflow)s::text)
      AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
      AND (%(until)s::timestamptz IS NULL OR created_at < %(until)s::timestamptz)
      AND (%(run_id)s::uuid IS NULL OR id = %(run_id)s::uuid)
      AND (%(key)s::text IS NULL OR idempotency_key = %(key)s::text)
      AND (%(args)s::jsonb IS NULL OR args @> %(args)s::jsonb)
      AND (%(attributes)s::jsonb IS NULL OR attributes @> %(attributes)s::jsonb)
      AND (%(before_at)s::timestamptz IS NULL
           OR created_at <= %(before_at)s::timestamptz
              AND (created_at < %(before_at)s::timestamptz OR id < %(before_id)s::uuid))
    ORDER BY created_at DESC, id DESC
    LIMIT %(limit)s
) w
LEFT JOIN LATERAL (
    SELECT count(*) FILTER (WHERE status = 'done') AS steps_done, count(*) AS steps_total
    FROM everystep_step_all
    WHERE workflow_id = w.id
) s ON true
ORDER BY w.created_at DESC, w.id DESC;

-- name: ui_overview
-- What every open live page shows, in one statement: the newest runs (as
-- ui_runs without conditions), the counts per status (exact up to `cap`, a
-- count above it means "more"; in completed_at order, which only the
-- history's (status, completed_at) index gives: each count is a bounded
-- walk of it, never a scan of a partition for a status it has none of), what the planner's statistics say for the
-- statuses past the cap (reltuples and the most common values of status
-- of the hot table and of every partition of the history, summed: no
-- statement here scans a table; OFFSET 0 keeps pg_stats a lookup per
-- table, not a scan of pg_class), the runners with work in flight, and
-- a change counter.
SELECT
    (SELECT coalesce(json_agg(p), '[]')
     FROM (SELECT w.id, w.name, w.status, w.idempotency_key, w.claimed_by, w.created_at, w.completed_at,
                  s.steps_done, s.steps_total
           FROM (
               SELECT id, name, status, idempotency_key, claimed_by, created_at, completed_at
               FROM everystep_workflow_all
               ORDER BY created_at DESC, id DESC
               LIMIT %(limit)s
           ) w
           LEFT JOIN LATERAL (
               SELECT count(*) FILTER (WHERE status = 'done') AS steps_done, count(*) AS steps_total
               FROM everystep_step_all
               WHERE workflow_id = w.id
           ) s ON true
           ORDER BY w.created_at DESC, w.id DESC) p),
    (SELECT json_object_agg(s.status, (SELECT count(*)
                                       FROM (SELECT 1
                                             FROM everystep_workflow_all w
                                             WHERE w.status = s.status
                                             ORDER BY w.completed_at
                                             LIMIT %(cap)s + 1) c))
     FROM unnest(%(statuses)s::text[]) s(status)),
    (WITH tables AS (
         SELECT c.relname, greatest(c.reltuples, 0) AS rows
         FROM pg_class c
         WHERE c.oid = 'everystep_workflow'::regclass
         UNION ALL
         SELECT c.relname, greatest(c.reltuples, 0)
         FROM pg_inherits i
         JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'everystep_workflow_history'::regclass
     ),
     per_status AS (
         SELECT v.status, sum(t.rows * v.freq) AS n
         FROM tables t
         CROSS JOIN LATERAL (SELECT st.most_common_vals, st.most_common_freqs
                             FROM pg_stats st
                             WHERE st.schemaname = current_schema() AND st.tablename = t.relname
                               AND st.attname = 'status'
                             OFFSET 0) st
         CROSS JOIN LATERAL unnest(st.most_common_vals::text::text[], st.most_common_freqs) AS v(status, freq)
         GROUP BY v.status
     )
     SELECT json_build_object('rows', (SELECT sum(rows) FROM tables), 'values', array_agg(status),
                              'freqs', array_agg(n / nullif((SELECT sum(rows) FROM tables), 0)))
     FROM per_status),
    (SELECT coalesce(json_object_agg(claimed_by, n), '{}')
     FROM (SELECT claimed_by, count(*) AS n
           FROM everystep_claimed
           WHERE claimed_by IS NOT NULL
           GROUP BY claimed_by) r),
    (SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint
     FROM pg_stat_user_tables
     WHERE schemaname = current_schema() AND relname IN ('everystep_workflow', 'everystep_step'));

-- name: read_only_snapshot
-- The first statement of a transaction whose reads all see one snapshot.
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY;

-- name: ui_run_steps
-- Every recorded step of a run, with all its columns, whatever the schema
-- version has.
SELECT to_jsonb(s) - 'workflow_id'
FROM everystep_step_all s
WHERE s.workflow_id = %(run)s
ORDER BY s.id;

-- name: ui_run_crashes
SELECT crashes
FROM everystep_crash
WHERE workflow_id = %(run)s;

-- name: ui_workflow_names
-- The distinct workflow names, by a loose scan of the (name, created_at)
-- index: one index probe per name, however many runs there are.
WITH RECURSIVE n AS (
    SELECT min(name) AS name
    FROM everystep_workflow_all
    UNION ALL
    SELECT (SELECT min(name) FROM everystep_workflow_all WHERE name > n.name)
    FROM n
    WHERE n.name IS NOT NULL
)
SELECT name
FROM n
WHERE name IS NOT NULL
LIMIT %(limit)s;

-- name: ui_failures
-- Failed runs created in the last `hours`, grouped by workflow and
-- exception type, with the newest run of each group.
SELECT name AS workflow, coalesce(error->>'type', '?') AS error_type, count(*) AS runs,
       max(completed_at) AS last_at, (array_agg(id ORDER BY created_at DESC))[1] AS latest_run,
       (array_agg(error->>'message' ORDER BY created_at DESC))[1] AS latest_message
FROM everystep_workflow_all
WHERE status = 'failed' AND created_at >= everystep_now() - make_interval(hours => %(hours)s)
GROUP BY 1, 2
ORDER BY 3 DESC, 1, 2
LIMIT 200;

-- name: ui_workers
-- Every runner of this schema that holds its lock now, fleet-wide: the
-- session holding it (a worker's control connection, application name
-- `everystep <name> control`), since when that session exists, how many
-- pool connections the runner has open, and its runs in flight. The lock
-- key as in session.sql (try_lock), matched in pg_locks as observe.sql says.
WITH control AS (
    SELECT a.pid, a.client_addr, a.backend_start,
           substr(a.application_name, 11, length(a.application_name) - 18) AS name
    FROM pg_stat_activity a
    WHERE a.datname = current_database() AND a.application_name LIKE 'everystep %% control'
)
SELECT c.name, c.pid, host(c.client_addr) AS client, c.backend_start AS since,
       (SELECT count(*)
        FROM pg_stat_activity p
        WHERE p.datname = current_database() AND p.application_name = 'everystep ' || c.name) AS pool_connections,
       (SELECT count(*)
        FROM everystep_claimed h
        WHERE h.claimed_by = c.name) AS in_flight
FROM control c
WHERE EXISTS (
    SELECT 1
    FROM pg_locks l
    WHERE l.pid = c.pid AND l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
      AND l.classid = ((hashtextextended('everystep:' || current_schema() || ':' || c.name, 0) >> 32)
                       & 4294967295)::oid
      AND l.objid = (hashtextextended('everystep:' || current_schema() || ':' || c.name, 0) & 4294967295)::oid
)
ORDER BY c.name;

-- name: ui_reschedule
-- A new run of the same workflow with the same args, priority and
-- attributes (no idempotency key, no concurrency key).
WITH ins AS (
    INSERT INTO everystep_workflow (id, name, args, status, limited, priority, attributes)
    SELECT %(id)s, w.name, w.args, 'scheduled', EXISTS (SELECT FROM everystep_limit l WHERE l.name = w.name),
           w.priority, w.attributes
    FROM everystep_workflow_all w
    WHERE w.id = %(run)s
    RETURNING id
)
SELECT id, pg_notify('everystep:' || current_schema(), '')
FROM ins;

-- name: ui_live_schedule
-- A live schedule with the engine's time, its row locked until the
-- transaction ends.
SELECT *, everystep_now() AS database_now
FROM everystep_schedule
WHERE key = %(key)s AND retired_at IS NULL
FOR UPDATE;

-- name: ui_set_schedule_paused
-- Pause or resume from the UI: a new version, as every change is; any pause
-- or resume clears the auto-pause reason.
UPDATE everystep_schedule
SET paused = %(paused)s, next_fire_at = coalesce(%(next_fire_at)s, next_fire_at),
    paused_reason = NULL, version = version + 1, updated_at = everystep_now()
WHERE key = %(key)s;

-- name: ui_run_links
-- What a run's page shows beyond load_run: its current (or last) execution
-- token, what a parked wait waits for, the run it re-runs, and its re-runs
-- (the partial indexes everystep_workflow_rerun_of and
-- everystep_workflow_history_rerun_of).
SELECT w.claim_token, w.waiting_on, w.wakes, w.rerun_of,
       ARRAY(SELECT r.id FROM everystep_workflow_all r WHERE r.rerun_of = w.id ORDER BY r.id) AS reruns
FROM everystep_workflow_all w
WHERE w.id = %(run)s;

-- name: ui_run_executions
-- The executions of a run that ended other than by the run ending or
-- parking (everystep_execution), in order.
SELECT token, claimer, ended_at, outcome
FROM everystep_execution
WHERE run_id = %(run)s
ORDER BY id;

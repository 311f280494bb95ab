-- Recurring schedules: the scheduler's lock and tick, the definitions and
-- their state. Read by everystep/db/schedules.py.
--
-- One scheduler fires at a time per schema, across the fleet: it holds the
-- transaction-level advisory lock
--     hashtextextended('everystep:scheduler:' || current_schema(), 0)
-- and `everystep schedules apply` waits for it, so a tick never sees half an
-- apply. Every change of a definition is a new version (version + 1).


-- name: try_lock_scheduler
SELECT pg_try_advisory_xact_lock(hashtextextended('everystep:scheduler:' || current_schema(), 0));

-- name: lock_scheduler
SELECT pg_advisory_xact_lock(hashtextextended('everystep:scheduler:' || current_schema(), 0));

-- name: database_now
-- The engine's time (everystep_now(): the server's, as of the transaction's
-- start, in a deployment): the only clock schedules use.
SELECT everystep_now();

-- name: load_schedules
-- Every schedule, retired ones included, with its last run's status.
SELECT s.*, w.status AS last_run_status
FROM everystep_schedule s
LEFT JOIN everystep_workflow_all w ON w.id = s.last_run_id
ORDER BY s.key;

-- name: due_schedules
-- Live schedules whose next fire time has come, locked until the
-- transaction ends. SKIP LOCKED: a schedule an application transaction is
-- changing (everystep.schedules) fires at the next tick, instead of
-- stalling this one.
SELECT s.*, w.status AS last_run_status
FROM everystep_schedule s
LEFT JOIN everystep_workflow_all w ON w.id = s.last_run_id
WHERE s.retired_at IS NULL AND NOT s.paused AND s.next_fire_at <= everystep_now()
ORDER BY s.next_fire_at, s.key
FOR UPDATE OF s SKIP LOCKED;

-- name: load_schedule
SELECT s.*, w.status AS last_run_status
FROM everystep_schedule s
LEFT JOIN everystep_workflow_all w ON w.id = s.last_run_id
WHERE s.key = %(key)s;

-- name: load_schedule_for_update
-- load_schedule, its row locked until the transaction ends.
SELECT s.*, w.status AS last_run_status
FROM everystep_schedule s
LEFT JOIN everystep_workflow_all w ON w.id = s.last_run_id
WHERE s.key = %(key)s
FOR UPDATE OF s;

-- name: put_schedule
-- A schedule's definition, its owner and its next fire time: a new
-- schedule, a new version of a live one, or a retired one revived.
INSERT INTO everystep_schedule (key, workflow, args, cron, timezone, catchup, max_catchup, overlap,
                                max_lateness_seconds, paused, auto_pause_after, source, next_fire_at,
                                created_at, updated_at)
VALUES (%(key)s, %(workflow)s, %(args)s::jsonb, %(cron)s, %(timezone)s, %(catchup)s, %(max_catchup)s,
        %(overlap)s, %(max_lateness_seconds)s, %(paused)s, %(auto_pause_after)s, %(source)s, %(next_fire_at)s,
        everystep_now(), everystep_now())
ON CONFLICT (key) DO UPDATE
SET workflow = EXCLUDED.workflow, args = EXCLUDED.args, cron = EXCLUDED.cron,
    timezone = EXCLUDED.timezone, catchup = EXCLUDED.catchup, max_catchup = EXCLUDED.max_catchup,
    overlap = EXCLUDED.overlap, max_lateness_seconds = EXCLUDED.max_lateness_seconds,
    paused = EXCLUDED.paused, auto_pause_after = EXCLUDED.auto_pause_after, source = EXCLUDED.source,
    version = everystep_schedule.version + 1, updated_at = everystep_now(), next_fire_at = EXCLUDED.next_fire_at,
    retired_at = NULL, last_error = NULL, paused_reason = NULL;

-- name: retire_schedule
-- Only by its owner, unless `source` is NULL (forced).
UPDATE everystep_schedule
SET retired_at = everystep_now(), updated_at = everystep_now(), version = version + 1
WHERE key = %(key)s AND retired_at IS NULL AND (%(source)s::text IS NULL OR source = %(source)s)
RETURNING retired_at;

-- name: schedule_owner
-- Why retire_schedule matched nothing.
SELECT retired_at, source
FROM everystep_schedule
WHERE key = %(key)s;

-- name: set_schedule_paused
-- Pause (with the reason, when the schedule paused itself) or resume;
-- resuming sets the next fire time.
UPDATE everystep_schedule
SET paused = %(paused)s, paused_reason = %(reason)s, next_fire_at = coalesce(%(next_fire_at)s, next_fire_at),
    version = version + 1, updated_at = everystep_now()
WHERE key = %(key)s;

-- name: record_schedule_run
INSERT INTO everystep_schedule_run (schedule_key, fire_at, run_id, fired_at)
VALUES (%(key)s, %(fire_at)s, %(run)s, everystep_now())
ON CONFLICT DO NOTHING;

-- name: schedules_failing
-- Live, unpaused schedules with auto-pause whose latest `auto_pause_after`
-- ended runs (`ended`: the terminal statuses), made since their definition
-- last changed, all failed: key, auto_pause_after and the latest failed
-- run. Locked until the transaction ends.
SELECT s.key, s.auto_pause_after, f.last_run_id
FROM everystep_schedule s
CROSS JOIN LATERAL (
    SELECT count(*) FILTER (WHERE e.status = 'failed') AS failed,
           (array_agg(e.id ORDER BY e.fire_at DESC))[1] AS last_run_id
    FROM (SELECT w.id, w.status, r.fire_at
          FROM everystep_schedule_run r
          JOIN everystep_workflow_all w ON w.id = r.run_id
          WHERE r.schedule_key = s.key AND r.fired_at >= s.updated_at AND w.status = ANY(%(ended)s)
          ORDER BY r.fire_at DESC
          LIMIT s.auto_pause_after) e
) f
WHERE s.auto_pause_after IS NOT NULL AND NOT s.paused AND s.retired_at IS NULL
  AND f.failed >= s.auto_pause_after
ORDER BY s.key
FOR UPDATE OF s SKIP LOCKED;

-- name: auto_paused_schedules
-- Live schedules paused because their runs kept failing.
SELECT count(*)
FROM everystep_schedule
WHERE paused AND paused_reason IS NOT NULL AND retired_at IS NULL;

-- name: advance_schedule
-- Past the fire times just decided, with the latest run made (if any); the
-- error is cleared.
UPDATE everystep_schedule
SET next_fire_at = %(next_fire_at)s, last_fire_at = coalesce(%(fired_at)s, last_fire_at),
    last_run_id = coalesce(%(run)s, last_run_id), last_error = NULL
WHERE key = %(key)s;

-- name: set_schedule_error
-- Why a due schedule did not fire (its next fire time stays).
UPDATE everystep_schedule
SET last_error = %(error)s
WHERE key = %(key)s;

-- name: fire_schedule_now
-- A run of a live schedule's workflow with its args, now, outside its cron
-- times; it becomes the schedule's last run.
WITH
    s AS (
        SELECT workflow, args
        FROM everystep_schedule
        WHERE key = %(key)s AND retired_at IS NULL
        FOR UPDATE
    ),
    ins AS (
        INSERT INTO everystep_workflow (id, name, args, status, limited, priority)
        SELECT %(id)s, workflow, args, 'scheduled', EXISTS (SELECT FROM everystep_limit l WHERE l.name = s.workflow),
               coalesce((SELECT p.priority FROM everystep_priority p WHERE p.name = s.workflow), 0)
        FROM s
        RETURNING id
    ),
    upd AS (
        UPDATE everystep_schedule
        SET last_run_id = ins.id, last_fire_at = everystep_now()
        FROM ins
        WHERE key = %(key)s
    )
SELECT id, pg_notify('everystep:' || current_schema(), '')
FROM ins;

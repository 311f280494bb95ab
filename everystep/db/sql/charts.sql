-- The charts of the operators' console: the per-minute figures the
-- maintenance child keeps in everystep_minute (0015_console.sql), and the
-- bounded reads the pages draw from. Read by everystep/db/charts.py. No
-- statement here reads more than a bounded part of the runs' history: what
-- each costs on a large table is in docs/ui.md.


-- name: roll_up_minutes
-- The runs that ended in each minute from `since` (the last minute rolled
-- up, which may have been incomplete then) to now, by workflow and status,
-- and their totals (workflow '*'), written over what the minutes had. The
-- runs are found through the status index by creation time: a run is
-- counted if it ended at most `lookback_s` seconds after it was created (an
-- older one is not: finding it would mean reading every run that ended, as
-- no index is on completed_at, which the end of every run would pay for).
-- Hot and history both: a run may have moved since it ended.
INSERT INTO everystep_minute AS m (minute, workflow, completed, failed, cancelled, stopped)
SELECT date_trunc('minute', w.completed_at), coalesce(w.name, '*'),
       count(*) FILTER (WHERE w.status = 'completed'), count(*) FILTER (WHERE w.status = 'failed'),
       count(*) FILTER (WHERE w.status = 'cancelled'), count(*) FILTER (WHERE w.status = 'stopped')
FROM everystep_workflow_all w
WHERE w.status IN ('completed', 'failed', 'stopped', 'cancelled')
  AND w.created_at >= %(since)s::timestamptz - make_interval(secs => %(lookback_s)s)
  AND w.completed_at >= %(since)s::timestamptz
GROUP BY GROUPING SETS ((date_trunc('minute', w.completed_at), w.name), (date_trunc('minute', w.completed_at)))
ON CONFLICT (workflow, minute) DO UPDATE
SET completed = EXCLUDED.completed, failed = EXCLUDED.failed, cancelled = EXCLUDED.cancelled,
    stopped = EXCLUDED.stopped;

-- name: last_minute_rolled_up
-- The newest minute of the figures (the rollup starts there again), and the
-- engine's time.
SELECT (SELECT max(minute) FROM everystep_minute WHERE workflow = '*'), everystep_now();

-- name: no_jit_in_transaction
-- For the rest of the transaction, no JIT compilation: the roll-up reads
-- little, but its estimates can pass jit_above_cost, and compiling a plan
-- costs hundreds of milliseconds at every roll-up.
SELECT set_config('jit', 'off', true);

-- name: sample_queue
-- The backlog now, into the current minute's figures: per workflow the runs
-- due and not claimed (everystep_pending, counted up to `cap` in all), how
-- long the oldest of them has waited since it was due, and the runs blocked
-- on an unsafe step (`cap` of them at most, in all); '*' their totals (the
-- longest wait).
WITH due AS (
    SELECT p.name, count(*) AS due, extract(epoch FROM everystep_now() - min(p.since)) AS oldest
    FROM (SELECT name, since FROM everystep_pending LIMIT %(cap)s) p
    GROUP BY p.name
), blocked AS (
    SELECT name, count(*) AS blocked
    FROM (SELECT name FROM everystep_workflow WHERE status = 'blocked' LIMIT %(cap)s) b
    GROUP BY name
), each AS (
    SELECT coalesce(d.name, b.name) AS workflow, coalesce(d.due, 0) AS due, d.oldest,
           coalesce(b.blocked, 0) AS blocked
    FROM due d FULL JOIN blocked b ON b.name = d.name
), sample AS (
    SELECT workflow, due, oldest, blocked FROM each
  UNION ALL
    SELECT '*', coalesce(sum(due), 0), max(oldest), coalesce(sum(blocked), 0) FROM each
)
INSERT INTO everystep_minute AS m (minute, workflow, due, oldest_due_s, blocked)
SELECT date_trunc('minute', everystep_now()), workflow, due, coalesce(oldest, 0), blocked
FROM sample
ON CONFLICT (workflow, minute) DO UPDATE
SET due = EXCLUDED.due, oldest_due_s = EXCLUDED.oldest_due_s, blocked = EXCLUDED.blocked;

-- name: prune_minutes
-- The figures older than `days` days.
DELETE FROM everystep_minute
WHERE minute < everystep_now() - make_interval(days => %(days)s);

-- name: chart_minutes
-- One workflow's figures ('*': every workflow's) over the last `minutes`
-- minutes, oldest first: at most `minutes` rows, read in the primary key.
SELECT minute, completed, failed, cancelled, stopped, blocked, due, oldest_due_s
FROM everystep_minute
WHERE workflow = %(workflow)s AND minute >= date_trunc('minute', everystep_now()) - make_interval(mins => %(minutes)s)
ORDER BY minute;

-- name: chart_step_durations
-- Step duration percentiles (seconds) per step name, over the steps the
-- newest `runs` runs (of one workflow, or of all: NULL) recorded with both
-- times: a bounded read (the created_at or (name, created_at) index, then
-- each run's steps by their unique index) whatever the history's size. The
-- engine's own rows (sleeps, waits, child starts, events) are left out.
WITH r AS (
    SELECT id
    FROM everystep_workflow_all
    WHERE (%(workflow)s::text IS NULL OR name = %(workflow)s::text)
    ORDER BY created_at DESC
    LIMIT %(runs)s
)
SELECT s.name, count(*) AS steps, count(*) FILTER (WHERE s.status = 'failed') AS failed,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM s.finished_at - s.started_at)) AS p50,
       percentile_cont(0.9) WITHIN GROUP (ORDER BY extract(epoch FROM s.finished_at - s.started_at)) AS p90,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM s.finished_at - s.started_at)) AS p99,
       max(extract(epoch FROM s.finished_at - s.started_at))::float8 AS max
FROM r
JOIN everystep_step_all s ON s.workflow_id = r.id
WHERE s.started_at IS NOT NULL AND s.finished_at IS NOT NULL AND s.name NOT LIKE 'everystep.%%'
GROUP BY s.name
ORDER BY count(*) DESC, s.name
LIMIT 50;

-- name: chart_schedule_fires
-- A schedule's newest `limit` fires, newest first, and how each run ended
-- (NULL status: the run was pruned), from its primary key.
SELECT f.fire_at, f.fired_at, f.run_id, w.status, w.completed_at
FROM everystep_schedule_run f
LEFT JOIN everystep_workflow_all w ON w.id = f.run_id
WHERE f.schedule_key = %(key)s
ORDER BY f.fire_at DESC
LIMIT %(limit)s;

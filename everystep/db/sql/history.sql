-- The history: moving finished runs out of the hot tables, the partitions
-- of the history tables, and the retention by end status
-- (0017_history.sql). Read by everystep/db/history.py.
--
-- The history's upkeep (a move, a partition dropped, a retention batch)
-- runs in transactions that first take the history lock
-- (history_lock): a partition is never dropped under a move into it.


-- name: history_lock
-- The history lock of this schema, held to the end of the transaction,
-- waiting at most `timeout` for it (and for every other lock this
-- transaction takes: lock_timeout, for this transaction only).
SELECT set_config('lock_timeout', %(timeout)s, true),
       pg_advisory_xact_lock(hashtextextended('everystep:history:' || current_schema(), 0));

-- name: keys_lock
-- The keys lock, exclusive, to the end of the transaction: a keyed insert
-- (everystep_key_archived, taking it shared) waits for this transaction's
-- move, or this waits for its commit. Waits at most the lock_timeout set
-- by history_lock.
SELECT pg_advisory_xact_lock(hashtextextended('everystep:keys:' || current_schema(), 0));

-- name: archive_candidates
-- Up to `limit` runs of `status` (one of everystep.schema.TERMINAL) that
-- ended at least `after` seconds ago, created at or after `since` (NULL:
-- any time), in creation order, with keys only when `keyed` (the move holds
-- the keys lock); the creation time of the last, the cursor of the next
-- batch (each batch reads the index from where the last stopped, not past
-- the dead entries of every run moved before it, which stay in the index
-- until vacuum); and the partitions their weeks need, created where
-- missing (how many were). Only UUIDv7 ids (version 7) move: another id
-- has no time in it (a run inserted by hand with gen_random_uuid(), say),
-- and its run stays in the hot table until retention deletes it there.
-- A run ends after it was created, so the bound on created_at adds
-- nothing to the condition but lets the (status, created_at) index skip
-- the runs that ended in the last `after` seconds.
WITH c AS MATERIALIZED (
    SELECT id, created_at
    FROM everystep_workflow
    WHERE status = %(status)s
      AND created_at >= coalesce(%(since)s::timestamptz, '-infinity')
      AND created_at <= everystep_now() - make_interval(secs => %(after)s::float8)
      AND completed_at <= everystep_now() - make_interval(secs => %(after)s::float8)
      AND (idempotency_key IS NULL OR %(keyed)s::boolean)
      AND substr(id::text, 15, 1) = '7'
    ORDER BY created_at
    LIMIT %(limit)s
)
SELECT (SELECT coalesce(array_agg(id), '{}') FROM c),
       (SELECT max(created_at) FROM c),
       (SELECT coalesce(sum(everystep_history_partition(w.week)), 0)::int
        FROM (SELECT DISTINCT everystep_history_week(id) AS week FROM c) w);

-- name: archive_batch
-- The move: these runs, if they have ended, leave the hot tables with their
-- steps, messages, events and streams for the history tables, in one statement (a
-- reader's snapshot sees each run in exactly one of them). `*`: the history
-- tables have their hot tables' columns in the same order, so a new column
-- moves with no change here. The foreign keys' cascades delete the crash
-- counts (and find the rest gone already). Rows locked by someone else are
-- left for the next batch.
WITH
    picked AS (
        SELECT id
        FROM everystep_workflow
        WHERE id = ANY(%(ids)s::uuid[]) AND status IN ('completed', 'failed', 'stopped', 'cancelled')
        FOR UPDATE SKIP LOCKED
    ),
    runs AS (
        DELETE FROM everystep_workflow w
        USING picked
        WHERE w.id = picked.id
        RETURNING w.*
    ),
    steps AS (
        DELETE FROM everystep_step s
        USING picked
        WHERE s.workflow_id = picked.id
        RETURNING s.*
    ),
    messages AS (
        DELETE FROM everystep_message m
        USING picked
        WHERE m.run_id = picked.id
        RETURNING m.*
    ),
    events AS (
        DELETE FROM everystep_event e
        USING picked
        WHERE e.run_id = picked.id
        RETURNING e.*
    ),
    streams AS (
        DELETE FROM everystep_stream x
        USING picked
        WHERE x.run_id = picked.id
        RETURNING x.*
    ),
    runs_in AS (
        INSERT INTO everystep_workflow_history
        SELECT * FROM runs
    ),
    steps_in AS (
        INSERT INTO everystep_step_history
        SELECT * FROM steps
    ),
    messages_in AS (
        INSERT INTO everystep_message_history
        SELECT * FROM messages
    ),
    events_in AS (
        INSERT INTO everystep_event_history
        SELECT * FROM events
    ),
    streams_in AS (
        INSERT INTO everystep_stream_history
        SELECT * FROM streams
    )
SELECT count(*)::int
FROM runs;

-- name: history_ahead
-- The partitions of this week and the `weeks` after it (by the engine's
-- clock), created where missing: how many were.
SELECT coalesce(sum(everystep_history_partition(
           date_trunc('week', everystep_now() AT TIME ZONE 'UTC')::date + 7 * n)), 0)::int
FROM generate_series(0, %(weeks)s::int) AS n;

-- name: history_weeks
-- The weeks of the history's partitions, oldest first, from their names
-- (<table>_<yyyymmdd>), each with its number of runs as the planner's
-- statistics estimate it (reltuples: -1 when never counted).
SELECT to_date(right(c.relname, 8), 'YYYYMMDD'), c.reltuples::bigint
FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = 'everystep_workflow_history'::regclass
ORDER BY 1;

-- name: week_expired
-- Whether every run in the partition of `week` is expired: none of a
-- status kept for ever (`kept`), none of a retained status (`statuses`,
-- their `seconds`) that ended less than its retention ago; and the week
-- is over. One probe of the (status, completed_at) index per status in
-- one partition (the bounds on id prune the others; the ORDER BY keeps
-- the planner on the index whatever it guesses of a status's rows).
SELECT %(week)s::date + 7 <= (everystep_now() AT TIME ZONE 'UTC')::date
   AND NOT EXISTS (
           SELECT FROM unnest(%(kept)s::text[]) AS k(status)
           WHERE EXISTS (SELECT FROM (SELECT 1
                                      FROM everystep_workflow_history h
                                      WHERE h.id >= everystep_uuid_at(%(week)s::date::timestamp AT TIME ZONE 'UTC')
                                        AND h.id < everystep_uuid_at((%(week)s::date + 7)::timestamp AT TIME ZONE 'UTC')
                                        AND h.status = k.status
                                      ORDER BY h.completed_at
                                      LIMIT 1) AS one))
   AND NOT EXISTS (
           SELECT FROM unnest(%(statuses)s::text[], %(seconds)s::float8[]) AS r(status, secs)
           WHERE (SELECT max(h.completed_at)
                  FROM everystep_workflow_history h
                  WHERE h.id >= everystep_uuid_at(%(week)s::date::timestamp AT TIME ZONE 'UTC')
                    AND h.id < everystep_uuid_at((%(week)s::date + 7)::timestamp AT TIME ZONE 'UTC')
                    AND h.status = r.status) > everystep_now() - make_interval(secs => r.secs));

-- name: week_runs
-- How many runs the partition of `week` holds.
SELECT count(*)
FROM everystep_workflow_history h
WHERE h.id >= everystep_uuid_at(%(week)s::date::timestamp AT TIME ZONE 'UTC')
  AND h.id < everystep_uuid_at((%(week)s::date + 7)::timestamp AT TIME ZONE 'UTC');

-- name: drop_week_records
-- The schedules' records and the executions of the runs in the partition
-- of `week` that is about to be dropped (but of runs still in the hot
-- table).
WITH executions AS (
    DELETE FROM everystep_execution e
    WHERE e.run_id >= everystep_uuid_at(%(week)s::date::timestamp AT TIME ZONE 'UTC')
      AND e.run_id < everystep_uuid_at((%(week)s::date + 7)::timestamp AT TIME ZONE 'UTC')
      AND NOT EXISTS (SELECT FROM everystep_workflow w WHERE w.id = e.run_id)
)
DELETE FROM everystep_schedule_run r
WHERE r.run_id >= everystep_uuid_at(%(week)s::date::timestamp AT TIME ZONE 'UTC')
  AND r.run_id < everystep_uuid_at((%(week)s::date + 7)::timestamp AT TIME ZONE 'UTC')
  AND NOT EXISTS (SELECT FROM everystep_workflow w WHERE w.id = r.run_id);

-- name: drop_week
-- The partitions of `week` dropped: how many.
SELECT everystep_history_drop(%(week)s::date);

-- name: retention_batch
-- Up to `limit` runs of `status` in the history that ended more than
-- `seconds` ago, deleted with their steps, messages, events, streams, schedule
-- records and executions: how many runs.
WITH
    gone AS (
        DELETE FROM everystep_workflow_history h
        WHERE h.id IN (SELECT id
                       FROM everystep_workflow_history
                       WHERE status = %(status)s
                         AND completed_at <= everystep_now() - make_interval(secs => %(seconds)s::float8)
                       LIMIT %(limit)s)
        RETURNING h.id
    ),
    steps AS (
        DELETE FROM everystep_step_history s
        USING gone
        WHERE s.workflow_id = gone.id
    ),
    messages AS (
        DELETE FROM everystep_message_history m
        USING gone
        WHERE m.run_id = gone.id
    ),
    events AS (
        DELETE FROM everystep_event_history e
        USING gone
        WHERE e.run_id = gone.id
    ),
    streams AS (
        DELETE FROM everystep_stream_history x
        USING gone
        WHERE x.run_id = gone.id
    ),
    records AS (
        DELETE FROM everystep_schedule_run r
        USING gone
        WHERE r.run_id = gone.id
    ),
    executions AS (
        DELETE FROM everystep_execution x
        USING gone
        WHERE x.run_id = gone.id
    )
SELECT count(*)::int
FROM gone;

-- name: retention_batch_hot
-- Up to `limit` runs of `status` still in the hot table that ended more
-- than `seconds` ago (not moved yet, or with an id that never moves),
-- deleted with their steps, messages, events, streams and crash counts (foreign key
-- cascades), schedule records and executions: how many runs. Rows locked by someone
-- else are skipped rather than waited for.
WITH
    gone AS (
        DELETE FROM everystep_workflow
        WHERE id IN (SELECT id
                     FROM everystep_workflow
                     WHERE status = %(status)s
                       AND completed_at <= everystep_now() - make_interval(secs => %(seconds)s::float8)
                     LIMIT %(limit)s
                     FOR UPDATE SKIP LOCKED)
        RETURNING id
    ),
    records AS (
        DELETE FROM everystep_schedule_run r
        USING gone
        WHERE r.run_id = gone.id
    ),
    executions AS (
        DELETE FROM everystep_execution x
        USING gone
        WHERE x.run_id = gone.id
    )
SELECT count(*)::int
FROM gone;

-- name: count_expired
-- How many runs of `status`, hot or in the history, ended more than
-- `seconds` ago (what a dry run of `everystep prune` reports).
SELECT count(*)
FROM everystep_workflow_all
WHERE status = %(status)s AND completed_at <= everystep_now() - make_interval(secs => %(seconds)s::float8);

-- Run attributes (0022_attributes.sql): setting them from a run, finding
-- runs by them, and the bulk actions on the runs a filter finds. Read by
-- everystep/db/attributes.py.
--
-- A filter's conditions each hold only when given (not NULL). The finding
-- statements run unprepared, so PostgreSQL plans them with their values,
-- drops the conditions whose value is NULL and takes the indexes of the
-- others. `contains`: a JSON object the attributes must contain (@>, the
-- GIN index of 0022_attributes.sql: every attribute filter is indexed).


-- name: set_attributes
-- An everystep.set_attributes call as a step row, and the run's attributes
-- merged with the new ones, if the run is held by this execution and the
-- merged object keeps at most `max_keys` keys. Returns whether the row was
-- written, and whether the merge fits (NULL: not held).
WITH
    w AS (
        SELECT id, claim_token,
               (SELECT count(*) FROM jsonb_object_keys(coalesce(attributes, '{}') || %(attributes)s::jsonb))
                   <= %(max_keys)s AS fits
        FROM everystep_workflow
        WHERE id = %(run)s AND (status = 'running') IS TRUE AND claimed_by = %(runner)s
          AND claim_token = %(token)s::bigint
        FOR UPDATE
    ),
    ins AS (
        INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result, claim_token,
                                    started_at, finished_at)
        SELECT w.id, %(step_id)s, %(name)s, jsonb_build_array(%(attributes)s::jsonb), '{}', 'done', 'null',
               w.claim_token, everystep_now(), everystep_now()
        FROM w
        WHERE w.fits
        ON CONFLICT (workflow_id, step_id) DO NOTHING
        RETURNING workflow_id
    ),
    upd AS (
        UPDATE everystep_workflow r
        SET attributes = coalesce(r.attributes, '{}') || %(attributes)s::jsonb
        FROM ins
        WHERE r.id = ins.workflow_id
    )
SELECT EXISTS (SELECT FROM ins), (SELECT fits FROM w);

-- name: find_runs
-- One page of the runs a filter finds, hot or in the history, newest first
-- (by id: a UUIDv7 is time-ordered); keyset paging: `after` is the id of the
-- last run of the previous page, `upto` the newest id to consider. With
-- attributes, find_runs_by_attributes answers a search; this one walks a
-- bulk action's runs chunk after chunk.
SELECT id, name, status, attributes, idempotency_key, created_at, completed_at
FROM everystep_workflow_all
WHERE (%(workflow)s::text IS NULL OR name = %(workflow)s::text)
  AND (%(statuses)s::text[] IS NULL OR status = ANY(%(statuses)s::text[]))
  AND (%(contains)s::jsonb IS NULL OR attributes @> %(contains)s::jsonb)
  AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
  AND (%(until)s::timestamptz IS NULL OR created_at < %(until)s::timestamptz)
  AND (%(after)s::uuid IS NULL OR id < %(after)s::uuid)
  AND (%(upto)s::uuid IS NULL OR id <= %(upto)s::uuid)
ORDER BY id DESC
LIMIT %(limit)s;

-- name: find_runs_by_attributes
-- find_runs with an attribute filter, among the runs created from `from_at`
-- on (the caller widens the window until a page is full). The inner query
-- has no order to keep (OFFSET 0 keeps the outer ORDER BY and LIMIT out of
-- it), so PostgreSQL takes the runs through the GIN index, each partition's
-- in the window, rather than walking the primary key newest first and
-- testing every run on the way (its guess of an attribute's selectivity
-- is a constant, far from a tenant's one run in a thousand).
SELECT id, name, status, attributes, idempotency_key, created_at, completed_at
FROM (
    SELECT id, name, status, attributes, idempotency_key, created_at, completed_at
    FROM everystep_workflow_all
    WHERE attributes @> %(contains)s::jsonb
      AND (%(workflow)s::text IS NULL OR name = %(workflow)s::text)
      AND (%(statuses)s::text[] IS NULL OR status = ANY(%(statuses)s::text[]))
      AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
      AND (%(until)s::timestamptz IS NULL OR created_at < %(until)s::timestamptz)
      AND (%(after)s::uuid IS NULL OR id < %(after)s::uuid)
      AND (%(upto)s::uuid IS NULL OR id <= %(upto)s::uuid)
      AND (%(from_at)s::timestamptz IS NULL OR id >= everystep_uuid_at(%(from_at)s::timestamptz))
    OFFSET 0
) found
ORDER BY id DESC
LIMIT %(limit)s;

-- name: count_runs
-- How many runs a filter finds (find_runs' conditions), hot or in the history.
SELECT count(*)
FROM everystep_workflow_all
WHERE (%(workflow)s::text IS NULL OR name = %(workflow)s::text)
  AND (%(statuses)s::text[] IS NULL OR status = ANY(%(statuses)s::text[]))
  AND (%(contains)s::jsonb IS NULL OR attributes @> %(contains)s::jsonb)
  AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
  AND (%(until)s::timestamptz IS NULL OR created_at < %(until)s::timestamptz)
  AND (%(after)s::uuid IS NULL OR id < %(after)s::uuid)
  AND (%(upto)s::uuid IS NULL OR id <= %(upto)s::uuid);

-- name: open_bulk
-- A bulk action, started or (the same action, arguments and filter, not
-- finished) resumed: its row. The partial unique index keeps one open row
-- per key; a resumed one keeps its bound, cursor and counts.
WITH ins AS (
    INSERT INTO everystep_bulk (key, action, filter, actor, source, total, upto)
    VALUES (%(key)s, %(action)s, %(filter)s::jsonb, %(actor)s, %(source)s, %(total)s, %(upto)s)
    ON CONFLICT (key) WHERE finished_at IS NULL DO NOTHING
    RETURNING id, total, upto, cursor, done, refused, false AS resumed
)
SELECT id, total, upto, cursor, done, refused, resumed FROM ins
UNION ALL
SELECT id, total, upto, cursor, done, refused, true
FROM everystep_bulk
WHERE key = %(key)s AND finished_at IS NULL AND NOT EXISTS (SELECT FROM ins);

-- name: lock_bulk
-- A bulk action's progress, its row locked until the chunk's transaction
-- ends: two processes resuming it at once take its chunks in turn.
SELECT cursor, done, refused, finished_at IS NOT NULL
FROM everystep_bulk
WHERE id = %(id)s
FOR UPDATE;

-- name: advance_bulk
-- A chunk done, in the transaction of its actions: the cursor moves below
-- its oldest run, and the counts grow.
UPDATE everystep_bulk
SET cursor = %(cursor)s, done = done + %(done)s, refused = refused + %(refused)s
WHERE id = %(id)s;

-- name: finish_bulk
-- A bulk action with no run left: finished (a repeated command starts anew).
UPDATE everystep_bulk
SET finished_at = everystep_now()
WHERE id = %(id)s
RETURNING done, refused;

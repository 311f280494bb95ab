-- Runs from the outside: scheduling, messages, cancelling, and reading runs,
-- their steps, messages, events and children. Read by everystep/db/runs.py.
--
-- Scheduling statements call everystep_wake() (0008_perf.sql): it notifies
-- the workers only when one is waiting for runs, once per transaction
-- (delivered at commit). The others notify the claimers themselves:
-- pg_notify('everystep:' || current_schema(), '').


-- name: insert_run
-- A run due at once (due_at takes its default, everystep_now()). With an
-- idempotency key that exists already, nothing is inserted and no row comes
-- back: a key is unique among the hot runs by the unique index, and
-- against the history's by everystep_key_archived (0017_history.sql). Its
-- priority: %(priority)s, else its workflow's default as the workers wrote it (everystep_priority), else %(default_priority)s (the
-- decorator's). Its attributes (0022_attributes.sql): a JSON object, or
-- NULL. Where it waits (ready, or blocked for its workflow's slot or its
-- key's room) is the trigger's (0032_ready.sql).
WITH ins AS (
    INSERT INTO everystep_workflow (id, name, args, idempotency_key, status, trace_context, priority,
                                    concurrency_key, attributes)
    SELECT %(id)s, %(name)s, %(args)s::jsonb, %(key)s, 'scheduled', %(trace)s::jsonb,
           coalesce(%(priority)s::smallint,
                    (SELECT p.priority FROM everystep_priority p WHERE p.name = %(name)s::varchar),
                    %(default_priority)s::smallint),
           %(ckey)s, %(attributes)s::jsonb
    WHERE CASE WHEN %(key)s::varchar IS NULL THEN true ELSE NOT everystep_key_archived(%(name)s, %(key)s) END
    ON CONFLICT (name, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id
)
SELECT id, everystep_wake()
FROM ins;

-- name: insert_run_at
-- A run due `at` a time, or `after` seconds from now by the database's
-- clock (neither: now): `waiting` until then (`scheduled` if the time has
-- come already). Its deadline (0013_timeouts.sql) is the earliest of
-- `deadline`, `deadline_in` seconds from now and `timeout` seconds from its
-- due time (all NULL: none); it is due at its deadline at the latest. Its
-- priority as for insert_run.
WITH ins AS (
    INSERT INTO everystep_workflow (id, name, args, idempotency_key, status, trace_context, due_at,
                                    deadline_at, priority, concurrency_key, attributes)
    SELECT %(id)s, %(name)s, %(args)s::jsonb, %(key)s,
           CASE WHEN least(due.at, due.deadline) > everystep_now() THEN 'waiting' ELSE 'scheduled' END,
           %(trace)s::jsonb, greatest(least(due.at, due.deadline), everystep_now()), due.deadline,
           coalesce(%(priority)s::smallint,
                    (SELECT p.priority FROM everystep_priority p WHERE p.name = %(name)s::varchar),
                    %(default_priority)s::smallint),
           %(ckey)s, %(attributes)s::jsonb
    FROM (SELECT a.at, least(%(deadline)s::timestamptz, everystep_now() + make_interval(secs => %(deadline_in)s::float8),
                             greatest(a.at, everystep_now()) + make_interval(secs => %(timeout)s::float8)) AS deadline
          FROM (SELECT coalesce(%(at)s::timestamptz, everystep_now() + make_interval(secs => %(after)s::float8),
                                everystep_now()) AS at) AS a) AS due
    WHERE CASE WHEN %(key)s::varchar IS NULL THEN true ELSE NOT everystep_key_archived(%(name)s, %(key)s) END
    ON CONFLICT (name, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id
)
SELECT id, everystep_wake()
FROM ins;

-- name: keyed_run
-- The run an idempotency key made before.
SELECT id
FROM everystep_workflow_all
WHERE name = %(name)s AND idempotency_key = %(key)s;

-- name: insert_runs
-- Many scheduled runs of one workflow in one statement (one notification at
-- most; where each waits is the trigger's, 0032_ready.sql). The arrays go in binary (no array literal for the server to
-- parse); only the ids of created runs with a key come back. `timeout`:
-- their workflow's (@workflow(timeout=)), their deadline that many seconds
-- from now (NULL: none). Their priority as for insert_run, their
-- concurrency key one for all; `attributes`: each run's JSON object, or NULL.
WITH ins AS (
    INSERT INTO everystep_workflow (id, name, args, idempotency_key, status, priority, concurrency_key,
                                    deadline_at, attributes)
    SELECT id, %(name)b::varchar, args::jsonb, key, 'scheduled',
           coalesce(%(priority)b::smallint,
                    (SELECT p.priority FROM everystep_priority p WHERE p.name = %(name)b::varchar),
                    %(default_priority)b::smallint),
           %(ckey)b::varchar, everystep_now() + make_interval(secs => %(timeout)b::float8),
           attributes::jsonb
    FROM unnest(%(ids)b::uuid[], %(args)b::text[], %(keys)b::text[], %(attributes)b::text[])
             AS t(id, args, key, attributes)
    WHERE CASE WHEN key IS NULL THEN true ELSE NOT everystep_key_archived(%(name)b::varchar, key) END
    ON CONFLICT (name, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, idempotency_key IS NOT NULL AS with_key
)
SELECT ARRAY(SELECT id FROM ins WHERE with_key), everystep_wake();

-- name: insert_runs_text
-- insert_runs with its parameters in text, for the connections that bind
-- parameters on the client (Django's cursor), which cannot send binary ones.
WITH ins AS (
    INSERT INTO everystep_workflow (id, name, args, idempotency_key, status, priority, concurrency_key,
                                    deadline_at, attributes)
    SELECT id, %(name)s::varchar, args::jsonb, key, 'scheduled',
           coalesce(%(priority)s::smallint,
                    (SELECT p.priority FROM everystep_priority p WHERE p.name = %(name)s::varchar),
                    %(default_priority)s::smallint),
           %(ckey)s::varchar, everystep_now() + make_interval(secs => %(timeout)s::float8),
           attributes::jsonb
    FROM unnest(%(ids)s::uuid[], %(args)s::text[], %(keys)s::text[], %(attributes)s::text[])
             AS t(id, args, key, attributes)
    WHERE CASE WHEN key IS NULL THEN true ELSE NOT everystep_key_archived(%(name)s::varchar, key) END
    ON CONFLICT (name, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, idempotency_key IS NOT NULL AS with_key
)
SELECT ARRAY(SELECT id FROM ins WHERE with_key), everystep_wake();

-- name: keyed_runs
-- The runs these idempotency keys made before.
SELECT idempotency_key, id
FROM everystep_workflow_all
WHERE name = %(name)s AND idempotency_key = ANY(%(keys)s);


-- name: send_message
-- A message for a run, unless the run has ended (the statuses of
-- everystep.schema.TERMINAL) or the same idempotency key sent one already;
-- counted on the run, which is due at once if it is parked waiting for this
-- topic (`on`: 'message:<topic>').
WITH
    run AS (
        SELECT id, status
        FROM everystep_workflow_all
        WHERE id = %(run)s
    ),
    ins AS (
        INSERT INTO everystep_message (run_id, topic, payload, idempotency_key)
        SELECT id, %(topic)s, %(payload)s::jsonb, %(key)s
        FROM run
        WHERE status NOT IN ('completed', 'failed', 'stopped', 'cancelled')
        ON CONFLICT (run_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING 1
    ),
    woke AS (
        UPDATE everystep_workflow w
        SET wakes = wakes + 1,
            due_at = CASE WHEN status = 'waiting' AND waiting_on = %(on)s THEN everystep_now() ELSE due_at END
        WHERE w.id = %(run)s AND EXISTS (SELECT FROM ins)
        RETURNING status = 'waiting' AND waiting_on = %(on)s AS due
    )
SELECT (SELECT status FROM run),
       EXISTS (SELECT FROM ins),
       (SELECT pg_notify('everystep:' || current_schema(), '') FROM woke WHERE due);

-- name: cancel_run
-- A scheduled, waiting or blocked run is `cancelled` at once; a running one
-- gets a durable cancel request that its execution honours at its next step
-- boundary (and that the end of the run honours, whatever ends first). A
-- finished run, or one with a request already, is left as it is. The cancel
-- cascades to the run's unfinished descendants.
WITH RECURSIVE
    tree AS (
        SELECT %(run)s::uuid AS id
        UNION ALL
        SELECT c.id
        FROM everystep_workflow_all c
        JOIN tree ON c.parent_id = tree.id
    ),
    -- The run and its unfinished descendants, each found by its id (the
    -- planner's guess of a recursive tree's size is large: joined to it,
    -- it read the whole hot table for one run).
    hit AS (
        UPDATE everystep_workflow w
        SET status = CASE WHEN status = 'running' THEN status ELSE 'cancelled' END,
            completed_at = CASE WHEN status = 'running' THEN completed_at ELSE everystep_now() END,
            cancel_requested_at = coalesce(cancel_requested_at, everystep_now()),
            cancel_reason = coalesce(%(reason)s, cancel_reason)
        WHERE w.id = ANY (ARRAY(SELECT tree.id FROM tree))
          AND (w.status IN ('scheduled', 'waiting', 'blocked')
               OR w.status = 'running' AND w.cancel_requested_at IS NULL)
        RETURNING w.id, w.status, w.parent_id, w.id = %(run)s::uuid AS root, w.dependents
    ),
    -- Runs that depend on one cancelled here are cancelled too (0031_dags.sql).
    settled AS (
        SELECT everystep_settle(array_agg(id), array_agg(status)) AS released
        FROM hit WHERE dependents AND status = 'cancelled'
        HAVING count(*) > 0
    ),
    -- A parent outside the tree parked on a child cancelled here wakes up.
    woke AS (
        UPDATE everystep_workflow p
        SET wakes = p.wakes + 1,
            due_at = CASE WHEN p.status = 'waiting' AND p.waiting_on = 'child:' || hit.id THEN everystep_now()
                          ELSE p.due_at END
        FROM hit
        WHERE p.id = hit.parent_id AND hit.root AND hit.status = 'cancelled'
        RETURNING p.status = 'waiting' AND p.waiting_on = 'child:' || hit.id AS due
    )
SELECT coalesce((SELECT status FROM hit WHERE root),
                (SELECT status FROM everystep_workflow_history WHERE id = %(run)s)),
       (SELECT pg_notify('everystep:' || current_schema(), '') FROM woke WHERE due),
       (SELECT released FROM settled);

-- name: run_status
SELECT status
FROM everystep_workflow_all
WHERE id = %(run)s;


-- name: get_event
-- The run's status (no row: no such run), whether the event is set, its value.
SELECT w.status, e.run_id IS NOT NULL, e.value
FROM everystep_workflow_all w
LEFT JOIN everystep_event_all e ON e.run_id = w.id AND e.key = %(key)s
WHERE w.id = %(run)s;

-- name: load_run
SELECT id, name, args, idempotency_key, status, claimed_by, result, error, created_at, completed_at,
       due_at, cancel_requested_at, cancel_reason, parent_id, deadline_at, priority, concurrency_key, attributes
FROM everystep_workflow_all
WHERE id = %(run)s;

-- name: load_steps
SELECT id, step_id, name, args, kwargs, status, result, error, started_at, finished_at, attempts
FROM everystep_step_all
WHERE workflow_id = %(run)s
ORDER BY id;

-- name: load_messages
-- In delivery order.
SELECT id, topic, payload, idempotency_key, created_at, consumed_by, consumed_at
FROM everystep_message_all
WHERE run_id = %(run)s
ORDER BY id;

-- name: load_events
SELECT key, value, updated_at
FROM everystep_event_all
WHERE run_id = %(run)s
ORDER BY key;

-- name: children
-- The runs a run started, oldest first.
SELECT id, name, status, created_at, completed_at
FROM everystep_workflow_all
WHERE parent_id = %(run)s
ORDER BY created_at, id;

-- name: list_runs
-- The newest runs (without their payloads), of one parent, status and
-- workflow name, each condition only when given (not NULL). Run unprepared,
-- so that it is planned with its values: PostgreSQL then drops the
-- conditions whose value is NULL, and the others can use their indexes.
SELECT id, name, status, idempotency_key, claimed_by, created_at, completed_at
FROM everystep_workflow_all
WHERE (%(parent)s::uuid IS NULL OR parent_id = %(parent)s::uuid)
  AND (%(status)s::text IS NULL OR status = %(status)s::text)
  AND (%(name)s::text IS NULL OR name = %(name)s::text)
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s;

-- Writes about a held run (fenced), and the reads an execution makes about
-- its own run. Read by everystep/db/fenced.py.
--
-- Every write here is conditional on the run being held by the writing
-- execution, found by its primary key:
--     id = run AND (status = 'running') IS TRUE AND claimed_by = runner AND claim_token = token
-- ("running" is written so that no index on status can serve the lookup;
-- queue.sql says why). Step rows are written under a FOR SHARE lock of the
-- run row, so a concurrent requeue either waits for the step's commit or
-- makes the insert match nothing. A write that matches nothing is explained
-- by why_not_written_end / why_not_written_step.
--
-- The writes that park a run or start a child notify the claimers
-- (pg_notify('everystep:' || current_schema(), ''), delivered at commit).
--
-- What a write returns as the run's cancel request is `cancelling` (see
-- queue.sql): a request, or the run's deadline passed (0013_timeouts.sql).


-- name: complete_started_step
-- A `started` (or `retrying`) step row updated in place with its outcome:
-- the row may be an earlier execution's, when the unsafe mark was removed
-- from the code; its recorded attempts stay.
UPDATE everystep_step s
SET name = %(name)s, args = %(args)s::jsonb, kwargs = %(kwargs)s::jsonb, status = %(status)s,
    result = %(result)s::jsonb, error = %(error)s::jsonb, claim_token = w.claim_token,
    started_at = to_timestamp(%(started_at)s::float8), finished_at = to_timestamp(%(finished_at)s::float8)
FROM (SELECT id, claim_token, cancel_requested_at, deadline_at
      FROM everystep_workflow
      WHERE id = %(run)s AND (status = 'running') IS TRUE AND claimed_by = %(runner)s
        AND claim_token = %(token)s::bigint
      FOR SHARE) w
WHERE s.workflow_id = w.id AND s.step_id = %(step_id)s AND s.status IN ('started', 'retrying')
RETURNING (w.cancel_requested_at IS NOT NULL OR w.deadline_at <= everystep_now()) IS TRUE;

-- name: record_attempt
-- A failed attempt of a step tried again after `wait` seconds: the row is
-- `retrying` (inserted, or updated from an earlier attempt's `retrying` or
-- an unsafe step's `started`), the attempt, timed by the engine's clock,
-- appended to its attempts; nothing if the row holds an outcome or this
-- attempt already.
WITH
    w AS (
        SELECT id, claim_token, cancel_requested_at, deadline_at
        FROM everystep_workflow
        WHERE id = %(run)s AND (status = 'running') IS TRUE AND claimed_by = %(runner)s
          AND claim_token = %(token)s::bigint
        FOR SHARE
    ),
    a AS (
        SELECT jsonb_build_object('attempt', %(attempt)s::int, 'error', %(error)s::jsonb,
                                  'at', extract(epoch FROM everystep_now()),
                                  'retry_at', extract(epoch FROM everystep_now()) + %(wait)s::float8) AS attempt
    )
INSERT INTO everystep_step AS s (workflow_id, step_id, name, args, kwargs, status, result, error, claim_token,
                                 started_at, finished_at, attempts)
SELECT id, %(step_id)s, %(name)s, %(args)s::jsonb, %(kwargs)s::jsonb, %(status)s, %(result)s::jsonb,
       %(error)s::jsonb, claim_token, to_timestamp(%(started_at)s::float8), to_timestamp(%(finished_at)s::float8),
       jsonb_build_array(a.attempt)
FROM w, a
ON CONFLICT (workflow_id, step_id) DO UPDATE
SET status = 'retrying',
    attempts = coalesce(s.attempts, '[]') || EXCLUDED.attempts,
    error = EXCLUDED.error,
    claim_token = EXCLUDED.claim_token,
    started_at = EXCLUDED.started_at,
    finished_at = EXCLUDED.finished_at
WHERE s.status IN ('retrying', 'started')
  AND NOT coalesce(s.attempts, '[]') @> jsonb_build_array(jsonb_build_object('attempt', %(attempt)s::int))
RETURNING (SELECT (cancel_requested_at IS NOT NULL OR deadline_at <= everystep_now()) IS TRUE FROM w),
          (SELECT attempt FROM a);

-- name: cancel_reason
SELECT cancel_reason
FROM everystep_workflow
WHERE id = %(run)s;

-- name: deliver_cancel
-- The reason of the cancel a run's body is about to get: the request's, or
-- 'deadline' for a run past its deadline with no request, which is then
-- written as its request (so that it is on the row, as one from cancel()),
-- and whether that is so. No row: neither (the reason is NULL).
WITH r AS (
    SELECT id, cancel_requested_at IS NULL AS overdue
    FROM everystep_workflow
    WHERE id = %(run)s AND (cancel_requested_at IS NOT NULL OR deadline_at <= everystep_now())
    FOR UPDATE
)
UPDATE everystep_workflow w
SET cancel_requested_at = coalesce(w.cancel_requested_at, everystep_now()),
    cancel_reason = CASE WHEN r.overdue THEN 'deadline' ELSE w.cancel_reason END
FROM r
WHERE w.id = r.id
RETURNING w.cancel_reason, r.overdue;

-- name: step_row
SELECT name, status
FROM everystep_step
WHERE workflow_id = %(run)s AND step_id = %(step_id)s;

-- name: why_not_written_end
-- The end of a run that matched nothing: did this execution end it with
-- this status (the end of a run with a cancel request is `cancelled`,
-- whatever status it was asked for), or does it still hold it?
SELECT status = %(status)s OR status = 'cancelled', status = 'running'
FROM everystep_workflow
WHERE id = %(run)s AND claimed_by = %(runner)s AND claim_token = %(token)s;

-- name: why_not_written_step
-- A step write that matched nothing: is the run still held by this
-- execution, and is the row with this status its own?
SELECT EXISTS (SELECT 1
               FROM everystep_workflow
               WHERE id = %(run)s AND (status = 'running') IS TRUE AND claimed_by = %(runner)s
                 AND claim_token = %(token)s::bigint),
       (SELECT claim_token = %(token)s AND status = %(status)s
        FROM everystep_step
        WHERE workflow_id = %(run)s AND step_id = %(step_id)s);

-- name: start_traced_execution
-- One more traced execution of a held run, and the trace context it
-- continues: only with tracing on. Run through libpq's prepared path
-- (everystep/db/libpq.py): it comes with every traced execution.
UPDATE everystep_workflow
SET trace_context = jsonb_set(coalesce(trace_context, '{}'), '{executions}',
                              to_jsonb(coalesce((trace_context->>'executions')::integer, 0) + 1))
WHERE id = %(run)s AND (status = 'running') IS TRUE AND claimed_by = %(runner)s AND claim_token = %(token)s::bigint
RETURNING trace_context::text;


-- name: record_sleep
-- A durable sleep as a `done` step row whose result is the wake time: `until`,
-- or `seconds` from now by the engine's clock.
WITH
    w AS (
        SELECT id, claim_token
        FROM everystep_workflow
        WHERE id = %(run)s AND (status = 'running') IS TRUE AND claimed_by = %(runner)s
          AND claim_token = %(token)s::bigint
        FOR SHARE
    ),
    wake AS (
        SELECT extract(epoch FROM coalesce(%(until)s::timestamptz,
                                           everystep_now() + make_interval(secs => %(seconds)s::float8))) AS at
    ),
    ins AS (
        INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result, claim_token,
                                    started_at, finished_at)
        SELECT w.id, %(step_id)s, %(name)s, '[]', '{}', 'done', to_jsonb(wake.at), w.claim_token, everystep_now(), everystep_now()
        FROM w, wake
        ON CONFLICT (workflow_id, step_id) DO NOTHING
        RETURNING 1
    )
SELECT wake.at, extract(epoch FROM everystep_now())
FROM ins, wake;

-- name: park_run
-- This execution ends and the run is left `waiting` until `due` (its
-- deadline at the latest, when it has one), claimed by nobody, and the
-- workers are woken to recompute their next due time; unless the time has
-- come already or the run is `cancelling` (then nothing changes, and the row
-- says which).
WITH
    w AS (
        SELECT id, (cancel_requested_at IS NOT NULL OR deadline_at <= everystep_now()) IS TRUE AS cancel,
               to_timestamp(%(due)s::float8) > everystep_now() AS later
        FROM everystep_workflow
        WHERE id = %(run)s AND (status = 'running') IS TRUE AND claimed_by = %(runner)s
          AND claim_token = %(token)s::bigint
        FOR UPDATE
    ),
    p AS (
        UPDATE everystep_workflow r
        SET status = 'waiting', claimed_by = NULL, due_at = least(to_timestamp(%(due)s::float8), r.deadline_at)
        FROM w
        WHERE r.id = w.id AND w.later AND NOT w.cancel
        RETURNING 1
    )
SELECT EXISTS (SELECT FROM p), w.cancel, pg_notify('everystep:' || current_schema(), '')
FROM w;


-- name: begin_wait
-- The start of a wait: a `started` step row whose result holds the topic and
-- the deadline (`timeout` seconds from now by the engine's clock; NULL:
-- none). The wait's row is `done` once it ends, with {"message": payload}
-- or {"timeout": true}.
WITH
    w AS (
        SELECT id, claim_token
        FROM everystep_workflow
        WHERE id = %(run)s AND (status = 'running') IS TRUE AND claimed_by = %(runner)s
          AND claim_token = %(token)s::bigint
        FOR SHARE
    ),
    r AS (
        SELECT jsonb_build_object('topic', %(topic)s::text,
                                  'deadline', extract(epoch FROM everystep_now()) + %(timeout)s::float8) AS result
    ),
    ins AS (
        INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result, claim_token,
                                    started_at)
        SELECT w.id, %(step_id)s, %(name)s, '[]', '{}', 'started', r.result, w.claim_token, everystep_now()
        FROM w, r
        ON CONFLICT (workflow_id, step_id) DO NOTHING
        RETURNING result
    )
SELECT (SELECT result FROM ins), extract(epoch FROM everystep_now())
FROM ins;

-- name: take_message
-- A started wait ends if it can: with the oldest message on its topic not
-- consumed yet (marked consumed by this wait), or with a timeout once
-- `deadline` has passed (database time); `outcome` says which (NULL:
-- neither). Then the step row gets it (`done`) and the run's `waiting_on`
-- is cleared. `seen`: the run's message count as of this statement's
-- snapshot (unlocked), the one it found no message in.
WITH
    w AS (
        SELECT id, claim_token
        FROM everystep_workflow
        WHERE id = %(run)s AND (status = 'running') IS TRUE AND claimed_by = %(runner)s
          AND claim_token = %(token)s::bigint
        FOR SHARE
    ),
    seen AS (
        SELECT wakes
        FROM everystep_workflow
        WHERE id = %(run)s
    ),
    m AS (
        SELECT id, payload
        FROM everystep_message
        WHERE run_id = %(run)s AND topic = %(topic)s AND consumed_by IS NULL AND EXISTS (SELECT FROM w)
        ORDER BY id
        LIMIT 1
        FOR UPDATE
    ),
    taken AS (
        UPDATE everystep_message x
        SET consumed_by = %(step_id)s, consumed_at = everystep_now()
        FROM m
        WHERE x.id = m.id
        RETURNING m.payload
    ),
    outcome AS (
        SELECT CASE WHEN EXISTS (SELECT FROM taken) THEN jsonb_build_object('message', (SELECT payload FROM taken))
                    WHEN everystep_now() >= to_timestamp(%(deadline)s::float8) THEN '{"timeout": true}'::jsonb
               END AS result
    ),
    done AS (
        UPDATE everystep_step s
        SET status = 'done', result = outcome.result, finished_at = everystep_now(), claim_token = w.claim_token
        FROM w, outcome
        WHERE s.workflow_id = w.id AND s.step_id = %(step_id)s AND s.status = 'started'
          AND outcome.result IS NOT NULL
        RETURNING s.result
    ),
    cleared AS (
        UPDATE everystep_workflow
        SET waiting_on = NULL
        WHERE id = %(run)s AND waiting_on IS NOT NULL AND EXISTS (SELECT FROM done)
    )
SELECT (SELECT result FROM done), (SELECT wakes FROM seen), extract(epoch FROM everystep_now())
FROM w;

-- name: start_child
-- The start of a child run as a step row (result {"child": id}) and the
-- child itself (`parent_id` = this run), scheduled: the child exists only if
-- the row was written here. Its deadline is the earlier of this run's and
-- `timeout` seconds from now (its workflow's; NULL: none).
WITH
    w AS (
        SELECT id, claim_token, deadline_at
        FROM everystep_workflow
        WHERE id = %(run)s AND (status = 'running') IS TRUE AND claimed_by = %(runner)s
          AND claim_token = %(token)s::bigint
        FOR SHARE
    ),
    ins AS (
        INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result, claim_token,
                                    started_at, finished_at)
        SELECT w.id, %(step_id)s, %(name)s, jsonb_build_array(%(child_name)s::text), '{}', 'done',
               jsonb_build_object('child', %(child)s::text), w.claim_token, everystep_now(), everystep_now()
        FROM w
        ON CONFLICT (workflow_id, step_id) DO NOTHING
        RETURNING workflow_id, result
    ),
    child AS (
        INSERT INTO everystep_workflow (id, name, args, status, parent_id, deadline_at, priority)
        SELECT %(child)s::uuid, %(child_name)s, %(args)s::jsonb, 'scheduled', workflow_id,
               least(w.deadline_at, everystep_now() + make_interval(secs => %(timeout)s::float8)),
               coalesce((SELECT p.priority FROM everystep_priority p WHERE p.name = %(child_name)s::varchar), 0)
        FROM ins, w
        RETURNING id
    )
SELECT ins.result, pg_notify('everystep:' || current_schema(), '')
FROM ins, child;

-- name: take_child
-- A started wait for a child run ends if it can: with the child's end
-- ({"status", "result", "error"}) once the child has ended (the statuses of
-- everystep.schema.TERMINAL), or with a timeout once `deadline` has passed.
-- The rest as in take_message.
WITH
    w AS (
        SELECT id, claim_token
        FROM everystep_workflow
        WHERE id = %(run)s AND (status = 'running') IS TRUE AND claimed_by = %(runner)s
          AND claim_token = %(token)s::bigint
        FOR SHARE
    ),
    seen AS (
        SELECT wakes
        FROM everystep_workflow
        WHERE id = %(run)s
    ),
    c AS (
        SELECT status, result, error
        FROM everystep_workflow_all
        WHERE id = %(child)s
    ),
    outcome AS (
        SELECT CASE WHEN c.status IN ('completed', 'failed', 'stopped', 'cancelled')
                        THEN jsonb_build_object('status', c.status, 'result', c.result, 'error', c.error)
                    WHEN everystep_now() >= to_timestamp(%(deadline)s::float8) THEN '{"timeout": true}'::jsonb
               END AS result
        FROM (SELECT) AS one
        LEFT JOIN c ON true
    ),
    done AS (
        UPDATE everystep_step s
        SET status = 'done', result = outcome.result, finished_at = everystep_now(), claim_token = w.claim_token
        FROM w, outcome
        WHERE s.workflow_id = w.id AND s.step_id = %(step_id)s AND s.status = 'started'
          AND outcome.result IS NOT NULL
        RETURNING s.result
    ),
    cleared AS (
        UPDATE everystep_workflow
        SET waiting_on = NULL
        WHERE id = %(run)s AND waiting_on IS NOT NULL AND EXISTS (SELECT FROM done)
    )
SELECT (SELECT result FROM done), (SELECT wakes FROM seen), extract(epoch FROM everystep_now())
FROM w;

-- name: park_waiting
-- This execution ends and the run is left `waiting` for `on` (a message
-- topic, a child) until `due` (NULL: for ever; its deadline at the latest,
-- when it has one), claimed by nobody; unless a message came since the run
-- looked (its count is not `wakes` any more) or the run is `cancelling`:
-- then nothing changes, and the row says which.
WITH
    w AS (
        SELECT id, (cancel_requested_at IS NOT NULL OR deadline_at <= everystep_now()) IS TRUE AS cancel
        FROM everystep_workflow
        WHERE id = %(run)s AND (status = 'running') IS TRUE AND claimed_by = %(runner)s
          AND claim_token = %(token)s::bigint
        FOR UPDATE
    ),
    p AS (
        UPDATE everystep_workflow r
        SET status = 'waiting', claimed_by = NULL, waiting_on = %(on)s,
            due_at = least(coalesce(to_timestamp(%(due)s::float8), everystep_now() + interval '100 years'),
                           r.deadline_at)
        FROM w
        WHERE r.id = w.id AND NOT w.cancel AND r.wakes = %(wakes)s
        RETURNING 1
    )
SELECT EXISTS (SELECT FROM p), w.cancel, pg_notify('everystep:' || current_schema(), '')
FROM w;

-- name: set_event
-- A set_event call as a step row, and the event's value (the last one wins).
WITH
    w AS (
        SELECT id, claim_token
        FROM everystep_workflow
        WHERE id = %(run)s AND (status = 'running') IS TRUE AND claimed_by = %(runner)s
          AND claim_token = %(token)s::bigint
        FOR SHARE
    ),
    ins AS (
        INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result, claim_token,
                                    started_at, finished_at)
        SELECT w.id, %(step_id)s, %(name)s, jsonb_build_array(%(key)s::text), '{}', 'done', 'null',
               w.claim_token, everystep_now(), everystep_now()
        FROM w
        ON CONFLICT (workflow_id, step_id) DO NOTHING
        RETURNING workflow_id
    ),
    ev AS (
        INSERT INTO everystep_event (run_id, key, value)
        SELECT workflow_id, %(key)s, %(value)s::jsonb
        FROM ins
        ON CONFLICT (run_id, key) DO UPDATE
        SET value = EXCLUDED.value, updated_at = everystep_now()
    )
SELECT EXISTS (SELECT FROM ins);

-- name: record_transactional_step
-- A transactional step's outcome, in the step's own transaction, with its
-- writes: fenced like every step row. The FOR SHARE of the run row is held
-- to the commit, so a requeue waits for it or makes this match nothing; the
-- unique (workflow, step_id) makes a second execution's insert wait for the
-- first's commit, then match nothing. Returns the cancel request seen.
WITH
    held AS (
        SELECT id, claim_token, (cancel_requested_at IS NOT NULL OR deadline_at <= everystep_now()) IS TRUE
                                AS cancelling
        FROM everystep_workflow
        WHERE id = %(run)s AND claim_token = %(token)s::bigint AND claimed_by = %(runner)s
          AND (status = 'running') IS TRUE
        FOR SHARE
    ),
    ins AS (
        INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result, error, claim_token,
                                    started_at, finished_at)
        SELECT held.id, %(step_id)s, %(name)s, %(args)s::jsonb, %(kwargs)s::jsonb, %(status)s, %(result)s::jsonb,
               %(error)s::jsonb, held.claim_token, to_timestamp(%(started_at)s::float8),
               to_timestamp(%(finished_at)s::float8)
        FROM held
        ON CONFLICT (workflow_id, step_id) DO NOTHING
        RETURNING workflow_id
    )
SELECT held.cancelling
FROM ins
JOIN held ON held.id = ins.workflow_id;

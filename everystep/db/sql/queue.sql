-- The queue: waiting for runs, claiming them (with the slots of limited
-- workflows), the limits themselves, taking back what a runner holds,
-- counting crashes, the group-committed step rows and ends of runs, and
-- requeues. Read by everystep/db/queue.py.
--
-- Terms used throughout:
--   everystep_now()  the engine's clock (0012_testing_clock.sql), as in
--              every statement of everystep/db/sql/: the server's now() in a
--              deployment, which the planner inlines (the plans are those of
--              now()); tests move it.
--   claimable  a run with status IN ('scheduled', 'waiting') AND
--              due_at <= everystep_now(), taken in (due_at, id) order, from one of two lanes
--              (0011_lanes.sql): the runs of unlimited workflows
--              (`NOT limited`), whose partial index
--              everystep_workflow_ready_unlimited (due_at, id) makes the claim
--              a range scan that never reads a run not due yet nor a run of a
--              limited workflow, and stops at the first unlocked entry;
--   claimable of one workflow  and the runs of limited workflows
--              (`limited`), by workflow: the due time compared as
--              (w.name, w.due_at) <= (name, everystep_now()), which only
--              everystep_workflow_ready_limited (name, due_at, id) can serve.
--              Given a name, the planner cannot tell how many claimable runs
--              are that workflow's; walking a (due_at) index for them would
--              read every claimable run of every other workflow first.
--   routed     (routes IS NULL OR w.name LIKE ANY(routes)): the workflows a
--              claimer runs, as LIKE patterns (NULL: all).
--   "running"  written as (status = 'running') IS TRUE in the fenced lookups
--              of a run by its primary key, so that no index on status can
--              serve them: seeing few running rows, the planner would
--              otherwise walk the running entries of the status index (dead
--              ones included, thousands of them between two vacuums under
--              load) rather than look the run up.
--   notify     pg_notify('everystep:' || current_schema(), ''): a channel per
--              schema, so deployments sharing a database (or test schemas)
--              do not wake each other's workers.


-- name: wake_lock_exclusive
-- Taken exclusively by a worker registering as waiting for runs: it waits
-- for the scheduling transactions in flight, which hold it shared (in
-- everystep_wake, 0008_perf.sql).
SELECT pg_advisory_xact_lock(hashtextextended('everystep:wake:' || current_schema(), 0));

-- name: register_waiting
INSERT INTO everystep_waiting (runner)
VALUES (%(runner)s)
ON CONFLICT DO NOTHING;

-- name: stop_waiting
DELETE FROM everystep_waiting
WHERE runner = %(runner)s;


-- name: claim
-- Claim up to %(limit)s claimable runs for this runner, oldest due first:
-- of unlimited workflows from the head of their lane, and of limited ones as
-- far as they have free slots (taken in the same statement); only of
-- workflows matching %(routes)s (LIKE patterns; NULL: every workflow).
--
-- A slot is free when its last run is not running in it any more. A claim
-- that committed after this statement's snapshot has written its newer token
-- on the slot row: the row lock then re-checks the condition on that
-- version, against the run as the snapshot shows it, whose token is older
-- (or NULL): busy. The scalar subquery keeps the check a subplan that the
-- recheck evaluates again (an anti-join would not be). The OFFSET 0 keep the
-- (NOT) EXISTS tests subplans run per row: as joins, the planner (which
-- cannot know that everystep_limit is small) would read and sort every
-- claimable run instead of walking the lane's index to its first unlocked
-- entry.
WITH free AS (
    SELECT s.name, s.slot
    FROM everystep_slot s
    WHERE (SELECT count(*) FROM everystep_workflow h
           WHERE h.id = s.run_id
             AND ((h.status = 'running' AND h.slot = s.slot) OR coalesce(h.claim_token, 0) < s.token)) = 0
      AND EXISTS (SELECT 1 FROM everystep_workflow w
                  WHERE w.status IN ('scheduled', 'waiting') AND w.limited
                    AND w.name = s.name AND (w.name, w.due_at) <= (s.name, everystep_now())
                    AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[]))
                  OFFSET 0)
    LIMIT %(limit)s
    FOR UPDATE OF s SKIP LOCKED
), room AS (
    SELECT name, count(*) AS n FROM free GROUP BY name
), unlimited AS (
    SELECT w.id, w.name, w.due_at
    FROM everystep_workflow w
    WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.due_at <= everystep_now()
      AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[]))
      AND NOT EXISTS (SELECT 1 FROM everystep_limit l WHERE l.name = w.name OFFSET 0)
    ORDER BY w.due_at, w.id
    LIMIT %(limit)s
    FOR UPDATE OF w SKIP LOCKED
), limited AS (
    SELECT w.id, w.name, w.due_at
    FROM room CROSS JOIN LATERAL (
        SELECT w.id, w.name, w.due_at
        FROM everystep_workflow w
        WHERE w.status IN ('scheduled', 'waiting') AND w.limited
          AND w.name = room.name AND (w.name, w.due_at) <= (room.name, everystep_now())
          AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[]))
        ORDER BY w.due_at, w.id
        LIMIT least(room.n, %(limit)s)
        FOR UPDATE OF w SKIP LOCKED
    ) w
), ranked AS (
    SELECT id, name, due_at, row_number() OVER (PARTITION BY name ORDER BY due_at, id) AS k
    FROM (SELECT * FROM unlimited UNION ALL SELECT * FROM limited) AS candidate
), numbered AS (
    SELECT name, slot, row_number() OVER (PARTITION BY name ORDER BY slot) AS k FROM free
), first AS (
    SELECT r.id, f.name AS slot_name, f.slot
    FROM ranked r LEFT JOIN numbered f ON f.name = r.name AND f.k = r.k
    ORDER BY r.due_at, r.id
    LIMIT %(limit)s
), picked AS MATERIALIZED (
    SELECT id, slot_name, slot, nextval('everystep_claim_token') AS token FROM first
), took AS (
    UPDATE everystep_slot s SET run_id = p.id, token = p.token
    FROM picked p
    WHERE s.name = p.slot_name AND s.slot = p.slot
)
UPDATE everystep_workflow w
SET status = 'running', claimed_by = %(runner)s, claim_token = p.token, slot = p.slot
FROM picked p
WHERE w.id = p.id AND w.id = ANY(ARRAY(SELECT id FROM picked))
RETURNING w.id, w.name, w.args,
    to_json(ARRAY(SELECT json_build_array(s.step_id, s.name, s.status, s.result, s.error, s.attempts)
                  FROM everystep_step s WHERE s.workflow_id = w.id)),
    w.claim_token, w.cancel_requested_at IS NOT NULL, extract(epoch FROM everystep_now())::float8, w.slot, w.parent_id;


-- name: claim_unlimited
-- `claim` for a runner of every workflow while no limited workflow has a
-- free slot: the head of the unlimited lane, nothing else. The NOT EXISTS
-- skips a run inserted while its workflow's limit was being set (see
-- 0011_lanes.sql): it is late at worst, never over its limit.
WITH picked AS MATERIALIZED (
    SELECT id, nextval('everystep_claim_token') AS token
    FROM (SELECT w.id
          FROM everystep_workflow w
          WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.due_at <= everystep_now()
            AND NOT EXISTS (SELECT 1 FROM everystep_limit l WHERE l.name = w.name OFFSET 0)
          ORDER BY w.due_at, w.id
          LIMIT %(limit)s
          FOR UPDATE OF w SKIP LOCKED) AS head
)
UPDATE everystep_workflow w
SET status = 'running', claimed_by = %(runner)s, claim_token = p.token, slot = NULL
FROM picked p
WHERE w.id = p.id AND w.id = ANY(ARRAY(SELECT id FROM picked))
RETURNING w.id, w.name, w.args,
    to_json(ARRAY(SELECT json_build_array(s.step_id, s.name, s.status, s.result, s.error, s.attempts)
                  FROM everystep_step s WHERE s.workflow_id = w.id)),
    w.claim_token, w.cancel_requested_at IS NOT NULL, extract(epoch FROM everystep_now())::float8, w.slot, w.parent_id;


-- name: sort_lanes
-- Every claimable run into the lane of its workflow as the limits stand (see
-- 0011_lanes.sql), reading only what may be in the wrong lane: the limited
-- lane's runs whose workflow has no limit any more (its own index), and the
-- claimable runs of the workflows that have a limit (by name: the OFFSET 0
-- keeps that a probe of everystep_workflow_due_by_name per limited workflow,
-- which a join would turn into a scan of the table), never the whole
-- backlog. A run a claim has locked is waited for (a claim is one short
-- statement): claimed meanwhile, it is not claimable any more and stays as it
-- is. Locked in id order, so that two sorts at once wait for each other
-- rather than deadlock.
WITH wrong AS (
    SELECT w.id
    FROM everystep_workflow w
    WHERE w.status IN ('scheduled', 'waiting') AND w.limited
      AND NOT EXISTS (SELECT FROM everystep_limit l WHERE l.name = w.name)
  UNION ALL
    SELECT w.id
    FROM everystep_limit l
    CROSS JOIN LATERAL (SELECT w.id
                        FROM everystep_workflow w
                        WHERE w.name = l.name AND w.status IN ('scheduled', 'waiting') AND NOT w.limited
                        OFFSET 0) w
), locked AS (
    SELECT w.id
    FROM everystep_workflow w
    WHERE w.id = ANY(ARRAY(SELECT id FROM wrong))
    ORDER BY w.id
    FOR UPDATE OF w
)
UPDATE everystep_workflow w
SET limited = NOT w.limited
FROM locked
WHERE w.id = locked.id AND w.status IN ('scheduled', 'waiting')
  AND w.limited <> EXISTS (SELECT FROM everystep_limit l WHERE l.name = w.name)
RETURNING w.id;


-- name: no_jit_in_transaction
-- For the rest of the transaction, no JIT compilation: sort_lanes reads a few
-- index entries in well under a millisecond, but its estimate (the lanes'
-- anti-join against everystep_limit) is above jit_above_cost, and compiling
-- it took 250 ms at every sweep.
SELECT set_config('jit', 'off', true);


-- name: any_limit
SELECT EXISTS (SELECT FROM everystep_limit);


-- name: drop_limits
-- The workflows whose limit was removed: their slots go with them (FK cascade).
DELETE FROM everystep_limit
WHERE name = ANY(%(names)s);

-- name: put_limits
INSERT INTO everystep_limit (name, concurrency)
SELECT * FROM unnest(%(names)s::text[], %(counts)s::int[])
ON CONFLICT (name) DO UPDATE
SET concurrency = EXCLUDED.concurrency, updated_at = everystep_now()
WHERE everystep_limit.concurrency <> EXCLUDED.concurrency;

-- name: drop_slots_above
-- A lowered limit: a run still running in a dropped slot finishes.
DELETE FROM everystep_slot s
USING unnest(%(names)s::text[], %(counts)s::int[]) AS l(name, n)
WHERE s.name = l.name AND s.slot > l.n;

-- name: add_slots
INSERT INTO everystep_slot (name, slot)
SELECT l.name, generate_series(1, l.n)
FROM unnest(%(names)s::text[], %(counts)s::int[]) AS l(name, n)
ON CONFLICT DO NOTHING;

-- name: notify
-- Wake the claimers: a raised limit, a resolved step may make runs claimable.
SELECT pg_notify('everystep:' || current_schema(), '');

-- name: limits
SELECT name, concurrency
FROM everystep_limit
ORDER BY name;


-- name: reclaim_held
-- New tokens for the runs `running` under this runner's name that none of
-- its live executions holds (their tokens: `executing`), returned as claimed.
-- The executions they replace are recorded (everystep_execution): `crashed`
-- at a catchup (no execution is live: the previous incarnation died), else
-- `lost` (a claim whose answer never came back).
WITH old AS (
    SELECT w.id, w.claim_token
    FROM everystep_workflow w
    WHERE w.status = 'running' AND w.claimed_by = %(runner)s
      AND (w.claim_token IS NULL OR w.claim_token <> ALL(%(executing)s::bigint[]))
    FOR UPDATE
), reclaimed AS (
    UPDATE everystep_workflow w
    SET claim_token = nextval('everystep_claim_token')
    FROM old
    WHERE w.id = old.id AND w.status = 'running' AND w.claimed_by = %(runner)s
    RETURNING w.id, w.name, w.args,
        to_json(ARRAY(SELECT json_build_array(s.step_id, s.name, s.status, s.result, s.error, s.attempts)
                      FROM everystep_step s
                      WHERE s.workflow_id = w.id)),
        w.claim_token, w.cancel_requested_at IS NOT NULL, extract(epoch FROM everystep_now())::float8, w.slot,
        w.parent_id
), ended AS (
    INSERT INTO everystep_execution (run_id, token, claimer, outcome)
    SELECT old.id, old.claim_token, %(runner)s,
           CASE WHEN cardinality(%(executing)s::bigint[]) = 0 THEN 'crashed' ELSE 'lost' END
    FROM old
    WHERE old.id IN (SELECT id FROM reclaimed)
)
SELECT * FROM reclaimed;

-- name: held_claims
SELECT id, claim_token
FROM everystep_workflow
WHERE status = 'running' AND claimed_by = %(runner)s;

-- name: cancel_requests
-- Which of these executions of the runner (their tokens) have a cancel
-- request on their run: the worker preempts their async steps.
SELECT claim_token
FROM everystep_workflow
WHERE status = 'running' AND claimed_by = %(runner)s AND claim_token = ANY(%(tokens)s::bigint[])
  AND cancel_requested_at IS NOT NULL;

-- name: running_claimers
SELECT DISTINCT claimed_by
FROM everystep_workflow
WHERE status = 'running' AND claimed_by IS NOT NULL;


-- name: count_crashes
-- One crash more for each claim still held under the same token; the count
-- restarts when the run recorded new steps since its last crash.
INSERT INTO everystep_crash (workflow_id, crashes, steps_seen)
SELECT w.id, 1, (SELECT count(*) FROM everystep_step s WHERE s.workflow_id = w.id)
FROM everystep_workflow w
JOIN unnest(%(ids)s::uuid[], %(tokens)s::bigint[]) AS c(id, token) ON w.id = c.id
WHERE w.status = 'running' AND w.claimed_by = %(claimer)s AND w.claim_token IS NOT DISTINCT FROM c.token
ON CONFLICT (workflow_id) DO UPDATE
SET crashes = CASE WHEN everystep_crash.steps_seen = EXCLUDED.steps_seen
                   THEN everystep_crash.crashes + 1 ELSE 1 END,
    steps_seen = EXCLUDED.steps_seen
RETURNING workflow_id, crashes;

-- name: fail_poisoned
UPDATE everystep_workflow
SET status = 'failed', completed_at = everystep_now(), error = %(error)s::jsonb
WHERE id = ANY(%(ids)s) AND status = 'running' AND claimed_by = %(claimer)s
RETURNING id;


-- name: record_steps
-- Step rows of several runs of one runner (group commit, see
-- everystep/writer.py), each fenced by its own execution's token: the FOR
-- SHARE of its run row keeps a requeue and the write from both winning.
-- The input rows come as parallel arrays (one element per write, numbered
-- n = 1, 2, ...); returns the rows written, with the cancel request seen on
-- their run. Run through libpq's prepared path (everystep/db/libpq.py).
WITH
    i AS (
        SELECT *
        FROM unnest(%(runs)s::uuid[], %(tokens)s::bigint[], %(step_id)s::text[], %(name)s::text[],
                    %(args)s::text[], %(kwargs)s::text[], %(status)s::text[], %(result)s::text[],
                    %(error)s::text[], %(started_at)s::float8[], %(finished_at)s::float8[])
            WITH ORDINALITY AS i(run, token, step_id, step_name, args, kwargs, step_status, step_result,
                                 step_error, started_at, finished_at, n)
    ),
    w AS (
        SELECT id, claim_token, cancel_requested_at
        FROM everystep_workflow
        WHERE id = ANY(%(runs)s::uuid[]) AND (status = 'running') IS TRUE AND claimed_by = %(runner)s
        FOR SHARE
    ),
    ins AS (
        INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result, error, claim_token,
                                    started_at, finished_at)
        SELECT i.run, i.step_id, i.step_name, i.args::jsonb, i.kwargs::jsonb, i.step_status, i.step_result::jsonb,
               i.step_error::jsonb, i.token, to_timestamp(i.started_at), to_timestamp(i.finished_at)
        FROM i
        JOIN w ON w.id = i.run AND w.claim_token = i.token
        ON CONFLICT (workflow_id, step_id) DO NOTHING
        RETURNING workflow_id, step_id
    )
SELECT i.n, w.cancel_requested_at IS NOT NULL
FROM ins
JOIN i ON i.run = ins.workflow_id AND i.step_id = ins.step_id
JOIN w ON w.id = i.run;


-- name: end_runs
-- End runs of this runner's executions, each fenced by its own token, each
-- with the row of its last step when it has one (not ended if that row is
-- there already), and claim one successor per ended run that asks for one,
-- as `claim` does (gated and counted by `held`: the runs this statement's
-- snapshot shows held by their executions; the slot of a run this statement
-- ends is free for its successor, though the snapshot shows it running).
-- Children that end wake their parents. The claim runs first, before the
-- ending UPDATE can wait on a row lock: a snapshot grown stale in such a
-- wait would make the claim lock runs other claimers took meanwhile, and
-- hold those locks to the commit, stalling their ends in turn.
-- Rows: ('c', NULL, NULL, claimed run...) for the successors; ('h', n) for
-- the ends that asked for one, in order (the successors are theirs in that
-- order); ('e', n, status) for the ends written; ('s', n) for the ends whose
-- last step's row exists; ('n', ...) when it woke the claimers (a freed slot
-- no successor took, or a parent made due).
WITH i AS (
    SELECT *
    FROM unnest(%(runs)s::uuid[], %(tokens)s::bigint[], %(statuses)s::text[], %(results)s::text[],
                %(errors)s::text[], %(claims)s::boolean[], %(step_id)s::text[], %(name)s::text[],
                %(args)s::text[], %(kwargs)s::text[], %(status)s::text[], %(result)s::text[],
                %(error)s::text[], %(started_at)s::float8[], %(finished_at)s::float8[])
        WITH ORDINALITY AS i(run, token, status, result, error, claim, step_id, step_name, args, kwargs,
                             step_status, step_result, step_error, started_at, finished_at, n)
), fenced AS MATERIALIZED (
    SELECT i.*, w.name AS workflow, w.slot,
           i.step_id IS NOT NULL AND EXISTS (SELECT 1 FROM everystep_step s
                                             WHERE s.workflow_id = i.run AND s.step_id = i.step_id) AS step_exists
    FROM i JOIN everystep_workflow w ON w.id = i.run
    WHERE w.id = ANY(%(runs)s::uuid[]) AND (w.status = 'running') IS TRUE AND w.claimed_by = %(runner)s
      AND w.claim_token = i.token
), held AS (
    SELECT * FROM fenced WHERE NOT step_exists
), free AS (
    SELECT s.name, s.slot
    FROM everystep_slot s
    WHERE EXISTS (SELECT 1 FROM held WHERE held.claim)
      AND ((SELECT count(*) FROM everystep_workflow h
            WHERE h.id = s.run_id
              AND ((h.status = 'running' AND h.slot = s.slot) OR coalesce(h.claim_token, 0) < s.token)) = 0
           OR EXISTS (SELECT 1 FROM held WHERE held.workflow = s.name AND held.slot = s.slot))
      AND EXISTS (SELECT 1 FROM everystep_workflow w
                  WHERE w.status IN ('scheduled', 'waiting') AND w.limited
                    AND w.name = s.name AND (w.name, w.due_at) <= (s.name, everystep_now())
                    AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[]))
                  OFFSET 0)
    LIMIT (SELECT count(*) FROM held WHERE held.claim)
    FOR UPDATE OF s SKIP LOCKED
), room AS (
    SELECT name, count(*) AS n FROM free GROUP BY name
), unlimited AS (
    SELECT w.id, w.name, w.due_at
    FROM everystep_workflow w
    WHERE EXISTS (SELECT 1 FROM held WHERE held.claim)
      AND w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.due_at <= everystep_now()
      AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[]))
      AND NOT EXISTS (SELECT 1 FROM everystep_limit l WHERE l.name = w.name OFFSET 0)
    ORDER BY w.due_at, w.id
    LIMIT (SELECT count(*) FROM held WHERE held.claim)
    FOR UPDATE OF w SKIP LOCKED
), limited AS (
    SELECT w.id, w.name, w.due_at
    FROM room CROSS JOIN LATERAL (
        SELECT w.id, w.name, w.due_at
        FROM everystep_workflow w
        WHERE w.status IN ('scheduled', 'waiting') AND w.limited
          AND w.name = room.name AND (w.name, w.due_at) <= (room.name, everystep_now())
          AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[]))
        ORDER BY w.due_at, w.id
        LIMIT least(room.n, (SELECT count(*) FROM held WHERE held.claim))
        FOR UPDATE OF w SKIP LOCKED
    ) w
), ranked AS (
    SELECT id, name, due_at, row_number() OVER (PARTITION BY name ORDER BY due_at, id) AS k
    FROM (SELECT * FROM unlimited UNION ALL SELECT * FROM limited) AS candidate
), numbered AS (
    SELECT name, slot, row_number() OVER (PARTITION BY name ORDER BY slot) AS k FROM free
), first AS (
    SELECT r.id, f.name AS slot_name, f.slot
    FROM ranked r LEFT JOIN numbered f ON f.name = r.name AND f.k = r.k
    ORDER BY r.due_at, r.id
    LIMIT (SELECT count(*) FROM held WHERE held.claim)
), picked AS MATERIALIZED (
    SELECT id, slot_name, slot, nextval('everystep_claim_token') AS token FROM first
), took AS (
    UPDATE everystep_slot s SET run_id = p.id, token = p.token
    FROM picked p
    WHERE s.name = p.slot_name AND s.slot = p.slot
), claimed AS (
    UPDATE everystep_workflow w
    SET status = 'running', claimed_by = %(runner)s, claim_token = p.token, slot = p.slot
    FROM picked p
    WHERE w.id = p.id AND w.id = ANY(ARRAY(SELECT id FROM picked))
    RETURNING w.id, w.name, w.args,
        to_json(ARRAY(SELECT json_build_array(s.step_id, s.name, s.status, s.result, s.error, s.attempts)
                      FROM everystep_step s WHERE s.workflow_id = w.id)),
        w.claim_token, w.cancel_requested_at IS NOT NULL, extract(epoch FROM everystep_now())::float8, w.slot, w.parent_id
), ended AS (
    -- A cancel request that reached the row before the end wins over every
    -- other end but `blocked`: the run is `cancelled` (what the body returned
    -- or raised is kept in result/error). A run blocked on an unsafe step's
    -- uncertain effect (one cancelled mid-effect too) waits for an operator:
    -- the request is delivered at its next step call once that is resolved.
    UPDATE everystep_workflow w
    SET status = CASE WHEN w.cancel_requested_at IS NULL OR h.status = 'blocked' THEN h.status ELSE 'cancelled' END,
        result = h.result::jsonb, error = h.error::jsonb,
        completed_at = CASE WHEN h.status = 'blocked' THEN NULL ELSE everystep_now() END
    FROM held h
    WHERE w.id = h.run AND w.id = ANY(%(runs)s::uuid[]) AND (w.status = 'running') IS TRUE
      AND w.claimed_by = %(runner)s AND w.claim_token = h.token
    RETURNING h.n, w.id, w.status, w.name, w.slot, w.parent_id
), step AS (
    INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result, error, claim_token,
                                started_at, finished_at)
    SELECT i.run, i.step_id, i.step_name, i.args::jsonb, i.kwargs::jsonb, i.step_status, i.step_result::jsonb,
           i.step_error::jsonb, i.token, to_timestamp(i.started_at), to_timestamp(i.finished_at)
    FROM ended JOIN i USING (n)
    WHERE i.step_id IS NOT NULL
    ON CONFLICT (workflow_id, step_id) DO NOTHING
), woke AS (
    -- Children that ended wake their parents: a parent parked on one of them is due.
    UPDATE everystep_workflow p
    SET wakes = p.wakes + 1,
        due_at = CASE WHEN p.status = 'waiting' AND p.waiting_on = ANY(e.waits) THEN everystep_now() ELSE p.due_at END
    FROM (SELECT parent_id, array_agg('child:' || id) AS waits
          FROM ended WHERE parent_id IS NOT NULL GROUP BY parent_id) e
    WHERE p.id = e.parent_id
    RETURNING p.status = 'waiting' AND p.waiting_on = ANY(e.waits) AS due
)
SELECT 'c', NULL::bigint, NULL::text, claimed.* FROM claimed
UNION ALL
SELECT 'h', n, NULL, NULL::uuid, NULL::varchar, NULL::jsonb, NULL::json, NULL::bigint, NULL::boolean, NULL::float8,
       NULL::integer, NULL::uuid
FROM held WHERE claim
UNION ALL
SELECT 'e', n, status, NULL::uuid, NULL::varchar, NULL::jsonb, NULL::json, NULL::bigint, NULL::boolean, NULL::float8,
       NULL::integer, NULL::uuid
FROM ended
UNION ALL
SELECT 's', n, NULL, NULL::uuid, NULL::varchar, NULL::jsonb, NULL::json, NULL::bigint, NULL::boolean, NULL::float8,
       NULL::integer, NULL::uuid
FROM fenced WHERE step_exists
UNION ALL
SELECT 'n', NULL, pg_notify('everystep:' || current_schema(), '')::text, NULL::uuid, NULL::varchar, NULL::jsonb,
       NULL::json, NULL::bigint, NULL::boolean, NULL::float8, NULL::integer, NULL::uuid
WHERE EXISTS (SELECT FROM ended
              WHERE ended.slot IS NOT NULL
                AND NOT EXISTS (SELECT FROM picked WHERE picked.slot_name = ended.name AND picked.slot = ended.slot))
   OR EXISTS (SELECT FROM woke WHERE due);


-- name: end_plain_runs
-- `end_runs` for ends that free no slot and wake no parent (their runs are
-- of unlimited workflows, and have no parent), of a runner of every
-- workflow, while no limited workflow has a free slot: successors come from
-- the head of the unlimited lane. Rows as for `end_runs`, and ('l') when a
-- limited workflow has a free slot and runs to claim: the caller goes back
-- to `end_runs` then.
WITH i AS (
    SELECT *
    FROM unnest(%(runs)s::uuid[], %(tokens)s::bigint[], %(statuses)s::text[], %(results)s::text[],
                %(errors)s::text[], %(claims)s::boolean[], %(step_id)s::text[], %(name)s::text[],
                %(args)s::text[], %(kwargs)s::text[], %(status)s::text[], %(result)s::text[],
                %(error)s::text[], %(started_at)s::float8[], %(finished_at)s::float8[])
        WITH ORDINALITY AS i(run, token, status, result, error, claim, step_id, step_name, args, kwargs,
                             step_status, step_result, step_error, started_at, finished_at, n)
), fenced AS MATERIALIZED (
    SELECT i.*,
           i.step_id IS NOT NULL AND EXISTS (SELECT 1 FROM everystep_step s
                                             WHERE s.workflow_id = i.run AND s.step_id = i.step_id) AS step_exists
    FROM i JOIN everystep_workflow w ON w.id = i.run
    WHERE w.id = ANY(%(runs)s::uuid[]) AND (w.status = 'running') IS TRUE AND w.claimed_by = %(runner)s
      AND w.claim_token = i.token
), held AS (
    SELECT * FROM fenced WHERE NOT step_exists
), picked AS MATERIALIZED (
    SELECT id, nextval('everystep_claim_token') AS token
    FROM (SELECT w.id
          FROM everystep_workflow w
          WHERE EXISTS (SELECT 1 FROM held WHERE held.claim)
            AND w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.due_at <= everystep_now()
            AND NOT EXISTS (SELECT 1 FROM everystep_limit l WHERE l.name = w.name OFFSET 0)
          ORDER BY w.due_at, w.id
          LIMIT (SELECT count(*) FROM held WHERE held.claim)
          FOR UPDATE OF w SKIP LOCKED) AS head
), claimed AS (
    UPDATE everystep_workflow w
    SET status = 'running', claimed_by = %(runner)s, claim_token = p.token, slot = NULL
    FROM picked p
    WHERE w.id = p.id AND w.id = ANY(ARRAY(SELECT id FROM picked))
    RETURNING w.id, w.name, w.args,
        to_json(ARRAY(SELECT json_build_array(s.step_id, s.name, s.status, s.result, s.error, s.attempts)
                      FROM everystep_step s WHERE s.workflow_id = w.id)),
        w.claim_token, w.cancel_requested_at IS NOT NULL, extract(epoch FROM everystep_now())::float8, w.slot, w.parent_id
), ended AS (
    UPDATE everystep_workflow w
    SET status = CASE WHEN w.cancel_requested_at IS NULL OR h.status = 'blocked' THEN h.status ELSE 'cancelled' END,
        result = h.result::jsonb, error = h.error::jsonb,
        completed_at = CASE WHEN h.status = 'blocked' THEN NULL ELSE everystep_now() END
    FROM held h
    WHERE w.id = h.run AND w.id = ANY(%(runs)s::uuid[]) AND (w.status = 'running') IS TRUE
      AND w.claimed_by = %(runner)s AND w.claim_token = h.token
    RETURNING h.n, w.status
), step AS (
    INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result, error, claim_token,
                                started_at, finished_at)
    SELECT i.run, i.step_id, i.step_name, i.args::jsonb, i.kwargs::jsonb, i.step_status, i.step_result::jsonb,
           i.step_error::jsonb, i.token, to_timestamp(i.started_at), to_timestamp(i.finished_at)
    FROM ended JOIN i USING (n)
    WHERE i.step_id IS NOT NULL
    ON CONFLICT (workflow_id, step_id) DO NOTHING
)
SELECT 'c', NULL::bigint, NULL::text, claimed.* FROM claimed
UNION ALL
SELECT 'h', n, NULL, NULL::uuid, NULL::varchar, NULL::jsonb, NULL::json, NULL::bigint, NULL::boolean, NULL::float8,
       NULL::integer, NULL::uuid
FROM held WHERE claim
UNION ALL
SELECT 'e', n, status, NULL::uuid, NULL::varchar, NULL::jsonb, NULL::json, NULL::bigint, NULL::boolean, NULL::float8,
       NULL::integer, NULL::uuid
FROM ended
UNION ALL
SELECT 's', n, NULL, NULL::uuid, NULL::varchar, NULL::jsonb, NULL::json, NULL::bigint, NULL::boolean, NULL::float8,
       NULL::integer, NULL::uuid
FROM fenced WHERE step_exists
UNION ALL
SELECT 'l', NULL, NULL, NULL::uuid, NULL::varchar, NULL::jsonb, NULL::json, NULL::bigint, NULL::boolean, NULL::float8,
       NULL::integer, NULL::uuid
WHERE EXISTS (SELECT 1 FROM everystep_slot s
              WHERE (SELECT count(*) FROM everystep_workflow h
                     WHERE h.id = s.run_id
                       AND ((h.status = 'running' AND h.slot = s.slot) OR coalesce(h.claim_token, 0) < s.token)) = 0
                AND EXISTS (SELECT 1 FROM everystep_workflow w
                            WHERE w.status IN ('scheduled', 'waiting') AND w.limited
                              AND w.name = s.name AND (w.name, w.due_at) <= (s.name, everystep_now())
                            OFFSET 0));


-- name: requeue_held
-- Runs held by these executions of a runner back to `scheduled` (a drain, a
-- dead claimer's runs), each only under the token it was claimed with; each
-- execution ended so is recorded with `why` (drained, swept, escaped).
WITH q AS (
    UPDATE everystep_workflow w
    SET status = 'scheduled', claimed_by = NULL
    FROM unnest(%(ids)s::uuid[], %(tokens)s::bigint[]) AS c(id, token)
    WHERE w.id = c.id AND w.status = 'running' AND w.claimed_by = %(runner)s
      AND w.claim_token IS NOT DISTINCT FROM c.token
    RETURNING w.id, c.token
), ended AS (
    INSERT INTO everystep_execution (run_id, token, claimer, outcome)
    SELECT id, token, %(runner)s, %(why)s
    FROM q
)
SELECT id, pg_notify('everystep:' || current_schema(), '')
FROM q;

-- name: requeue_claimer
-- Every running run of a claimer whose lock the caller holds (a worker's own
-- shutdown), each execution ended so recorded as `shutdown`.
WITH q AS (
    UPDATE everystep_workflow
    SET status = 'scheduled', claimed_by = NULL
    WHERE status = 'running' AND claimed_by = %(claimer)s
    RETURNING id, claim_token
), ended AS (
    INSERT INTO everystep_execution (run_id, token, claimer, outcome)
    SELECT id, claim_token, %(claimer)s, 'shutdown'
    FROM q
)
SELECT id, pg_notify('everystep:' || current_schema(), '')
FROM q;

-- name: requeue_from_dead_claimers
-- Each run only if it is still claimed by the claimer given with it (one the
-- caller found dead and whose lock it holds); each execution ended so is
-- recorded as `requeued` (an operator's requeue).
WITH q AS (
    UPDATE everystep_workflow w
    SET status = 'scheduled', claimed_by = NULL
    FROM unnest(%(ids)s::uuid[], %(claimers)s::text[]) AS c(id, claimer)
    WHERE w.id = c.id AND w.status = 'running' AND w.claimed_by IS NOT DISTINCT FROM c.claimer
    RETURNING w.id, w.claim_token, c.claimer
), ended AS (
    INSERT INTO everystep_execution (run_id, token, claimer, outcome)
    SELECT id, claim_token, claimer, 'requeued'
    FROM q
)
SELECT id, pg_notify('everystep:' || current_schema(), '')
FROM q;


-- name: next_due_in
-- Seconds until the earliest waiting run is due (database time): a min()
-- on each lane's index, one index probe each.
SELECT extract(epoch FROM least(
    (SELECT min(due_at) FROM everystep_workflow
     WHERE status IN ('scheduled', 'waiting') AND NOT limited AND due_at > everystep_now()),
    (SELECT min(due_at) FROM everystep_workflow
     WHERE status IN ('scheduled', 'waiting') AND limited AND due_at > everystep_now())) - everystep_now());

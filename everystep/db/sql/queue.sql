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
--   priority   (0014_priorities.sql) the unlimited lane's runs of priority 0
--              only are in everystep_workflow_ready_unlimited; the others in
--              everystep_workflow_ready_priority (priority DESC, due_at, id),
--              read before (> 0) and after (< 0) them, one priority at a
--              time: high_levels and low_levels are loose scans of the
--              priorities there (one probe each), and per priority the range
--              of its due runs is walked in time order. A limited
--              workflow's runs of another priority than 0 are in
--              everystep_workflow_ready_limited_priority (name, priority
--              DESC, due_at, id): limited_high and limited_low, beside
--              limited, per workflow with free slots.
--   keyed      (0014) the runs with a concurrency key of a workflow with a
--              per-key limit: `keyed` (and `limited`), in
--              everystep_workflow_ready_keyed (name, concurrency_key, due_at,
--              id), claimed through their key's everystep_key row: the ready
--              keys with room, least recently claimed first (round robin).
--   routed     (routes IS NULL OR w.name LIKE ANY(routes)): the workflows a
--              claimer runs, as LIKE patterns (NULL: all); and not one of
--              `skipped` (w.name <> ALL(skipped)), the workflows it found it
--              cannot import (empty: none).
--   "running"  written as (status = 'running') IS TRUE in the fenced lookups
--              of a run by its primary key, so that no index on status can
--              serve them: seeing few running rows, the planner would
--              otherwise walk the running entries of the status index (dead
--              ones included, thousands of them between two vacuums under
--              load) rather than look the run up.
--   cancelling (cancel_requested_at IS NOT NULL OR deadline_at <= everystep_now()) IS TRUE:
--              the run is to be cancelled, asked by everystep.cancel() or
--              because its deadline passed (0013_timeouts.sql); what a claim
--              and a step's write return to the run's execution. Without a
--              deadline, the second test is NULL: free.
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
WITH RECURSIVE high_levels(priority) AS (
    (SELECT w.priority FROM everystep_workflow w
     WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.priority > 0
     ORDER BY w.priority DESC
     LIMIT 1)
  UNION ALL
    SELECT (SELECT w.priority FROM everystep_workflow w
            WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.priority > 0
              AND w.priority < lv.priority
            ORDER BY w.priority DESC
            LIMIT 1)
    FROM high_levels lv
    WHERE lv.priority IS NOT NULL
), low_levels(priority) AS (
    (SELECT w.priority FROM everystep_workflow w
     WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.priority < 0
     ORDER BY w.priority DESC
     LIMIT 1)
  UNION ALL
    SELECT (SELECT w.priority FROM everystep_workflow w
            WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.priority < 0
              AND w.priority < lv.priority
            ORDER BY w.priority DESC
            LIMIT 1)
    FROM low_levels lv
    WHERE lv.priority IS NOT NULL
), free AS (
    SELECT s.name, s.slot
    FROM everystep_slot s
    WHERE (SELECT count(*) FROM everystep_workflow h
           WHERE h.id = s.run_id
             AND ((h.status = 'running' AND h.slot = s.slot) OR coalesce(h.claim_token, 0) < s.token)) = 0
      AND (EXISTS (SELECT 1 FROM everystep_workflow w
                   WHERE w.status IN ('scheduled', 'waiting') AND w.limited AND NOT w.keyed AND w.priority = 0
                     AND w.name = s.name AND (w.name, w.due_at) <= (s.name, everystep_now())
                     AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
                   OFFSET 0)
           OR EXISTS (SELECT 1 FROM everystep_workflow w
                      WHERE w.status IN ('scheduled', 'waiting') AND w.limited AND NOT w.keyed AND w.priority <> 0
                        AND w.name = s.name AND w.due_at <= everystep_now()
                        AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
                      OFFSET 0)
           OR EXISTS (SELECT 1 FROM everystep_workflow w
                      WHERE w.status IN ('scheduled', 'waiting') AND w.keyed
                        AND w.name = s.name AND w.due_at <= everystep_now()
                        AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
                      OFFSET 0))
    LIMIT %(limit)s
    FOR UPDATE OF s SKIP LOCKED
), room AS (
    SELECT name, count(*) AS n FROM free GROUP BY name
), keys AS (
    SELECT k.name, k.key,
           (SELECT kl.per_key FROM everystep_key_limit kl WHERE kl.name = k.name)
             - (SELECT count(*) FROM everystep_workflow r
                WHERE r.status = 'running' AND r.concurrency_key IS NOT NULL
                  AND r.name = k.name AND r.concurrency_key = k.key) AS n
    FROM everystep_key k
    WHERE k.ready AND (SELECT count(*) FROM everystep_workflow h
           WHERE h.id = k.run_id AND coalesce(h.claim_token, 0) < k.token) = 0
      AND EXISTS (SELECT 1 FROM everystep_workflow w
                  WHERE w.status IN ('scheduled', 'waiting') AND w.keyed
                    AND w.name = k.name AND w.concurrency_key = k.key AND w.due_at <= everystep_now()
                    AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
                  OFFSET 0)
      AND (SELECT count(*) FROM everystep_workflow r
           WHERE r.status = 'running' AND r.concurrency_key IS NOT NULL
             AND r.name = k.name AND r.concurrency_key = k.key)
          < (SELECT kl.per_key FROM everystep_key_limit kl WHERE kl.name = k.name)
    ORDER BY k.claimed_at NULLS FIRST, k.name, k.key
    LIMIT %(limit)s
    FOR UPDATE OF k SKIP LOCKED
), high AS (
    SELECT w.id, w.name, w.due_at, w.priority
    FROM high_levels lv CROSS JOIN LATERAL (
        SELECT w.id, w.name, w.due_at, w.priority
        FROM everystep_workflow w
        WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.priority > 0
          AND w.priority = lv.priority AND w.due_at <= everystep_now()
          AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
          AND NOT EXISTS (SELECT 1 FROM everystep_limit l WHERE l.name = w.name OFFSET 0)
          AND NOT (w.concurrency_key IS NOT NULL
                   AND EXISTS (SELECT 1 FROM everystep_key_limit kl WHERE kl.name = w.name OFFSET 0))
        ORDER BY w.due_at, w.id
        LIMIT %(limit)s
        FOR UPDATE OF w SKIP LOCKED
    ) w
    WHERE lv.priority IS NOT NULL
    LIMIT %(limit)s
), unlimited AS (
    SELECT w.id, w.name, w.due_at, w.priority
    FROM everystep_workflow w
    WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.priority = 0
      AND w.due_at <= everystep_now()
      AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
      AND NOT EXISTS (SELECT 1 FROM everystep_limit l WHERE l.name = w.name OFFSET 0)
      AND NOT (w.concurrency_key IS NOT NULL
               AND EXISTS (SELECT 1 FROM everystep_key_limit kl WHERE kl.name = w.name OFFSET 0))
    ORDER BY w.due_at, w.id
    LIMIT %(limit)s - (SELECT count(*) FROM high)
    FOR UPDATE OF w SKIP LOCKED
), low AS (
    SELECT w.id, w.name, w.due_at, w.priority
    FROM low_levels lv CROSS JOIN LATERAL (
        SELECT w.id, w.name, w.due_at, w.priority
        FROM everystep_workflow w
        WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.priority < 0
          AND w.priority = lv.priority AND w.due_at <= everystep_now()
          AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
          AND NOT EXISTS (SELECT 1 FROM everystep_limit l WHERE l.name = w.name OFFSET 0)
          AND NOT (w.concurrency_key IS NOT NULL
                   AND EXISTS (SELECT 1 FROM everystep_key_limit kl WHERE kl.name = w.name OFFSET 0))
        ORDER BY w.due_at, w.id
        LIMIT %(limit)s - (SELECT count(*) FROM high) - (SELECT count(*) FROM unlimited)
        FOR UPDATE OF w SKIP LOCKED
    ) w
    WHERE lv.priority IS NOT NULL
    LIMIT %(limit)s - (SELECT count(*) FROM high) - (SELECT count(*) FROM unlimited)
), limited_high AS (
    SELECT w.id, w.name, w.due_at, w.priority
    FROM room CROSS JOIN LATERAL (
        SELECT w.id, w.name, w.due_at, w.priority
        FROM everystep_workflow w
        WHERE w.status IN ('scheduled', 'waiting') AND w.limited AND NOT w.keyed AND w.priority > 0
          AND w.name = room.name AND w.due_at <= everystep_now()
          AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
        ORDER BY w.priority DESC, w.due_at, w.id
        LIMIT least(room.n, %(limit)s)
        FOR UPDATE OF w SKIP LOCKED
    ) w
), limited AS (
    SELECT w.id, w.name, w.due_at, w.priority
    FROM room CROSS JOIN LATERAL (
        SELECT w.id, w.name, w.due_at, w.priority
        FROM everystep_workflow w
        WHERE w.status IN ('scheduled', 'waiting') AND w.limited AND NOT w.keyed AND w.priority = 0
          AND w.name = room.name AND (w.name, w.due_at) <= (room.name, everystep_now())
          AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
        ORDER BY w.due_at, w.id
        LIMIT least(room.n, %(limit)s)
        FOR UPDATE OF w SKIP LOCKED
    ) w
), limited_low AS (
    SELECT w.id, w.name, w.due_at, w.priority
    FROM room CROSS JOIN LATERAL (
        SELECT w.id, w.name, w.due_at, w.priority
        FROM everystep_workflow w
        WHERE w.status IN ('scheduled', 'waiting') AND w.limited AND NOT w.keyed AND w.priority < 0
          AND w.name = room.name AND w.due_at <= everystep_now()
          AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
        ORDER BY w.priority DESC, w.due_at, w.id
        LIMIT least(room.n, %(limit)s)
        FOR UPDATE OF w SKIP LOCKED
    ) w
), keyed AS (
    SELECT w.id, w.name, w.due_at, w.priority, w.concurrency_key
    FROM keys CROSS JOIN LATERAL (
        SELECT w.id, w.name, w.due_at, w.priority, w.concurrency_key
        FROM everystep_workflow w
        WHERE w.status IN ('scheduled', 'waiting') AND w.keyed
          AND w.name = keys.name AND w.concurrency_key = keys.key AND w.due_at <= everystep_now()
          AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
        ORDER BY w.due_at, w.id
        LIMIT least(keys.n, %(limit)s)
        FOR UPDATE OF w SKIP LOCKED
    ) w
), candidate AS (
    SELECT id, name, due_at, priority, NULL::varchar AS ckey, false AS slotted, 1::bigint AS round FROM high
    UNION ALL
    SELECT id, name, due_at, priority, NULL, false, 1 FROM unlimited
    UNION ALL
    SELECT id, name, due_at, priority, NULL, false, 1 FROM low
    UNION ALL
    SELECT id, name, due_at, priority, NULL, true, 1 FROM limited_high
    UNION ALL
    SELECT id, name, due_at, priority, NULL, true, 1 FROM limited
    UNION ALL
    SELECT id, name, due_at, priority, NULL, true, 1 FROM limited_low
    UNION ALL
    SELECT id, name, due_at, priority, concurrency_key, EXISTS (SELECT FROM everystep_limit l WHERE l.name = keyed.name),
           row_number() OVER (PARTITION BY name, concurrency_key ORDER BY due_at, id)
    FROM keyed
), ranked AS (
    SELECT id, name, due_at, priority, ckey, slotted, round,
           row_number() OVER (PARTITION BY name ORDER BY priority DESC, round, due_at, id) AS k
    FROM candidate
), numbered AS (
    SELECT name, slot, row_number() OVER (PARTITION BY name ORDER BY slot) AS k FROM free
), first AS (
    SELECT r.id, f.name AS slot_name, f.slot, r.name, r.ckey
    FROM ranked r LEFT JOIN numbered f ON f.name = r.name AND f.k = r.k
    WHERE NOT r.slotted OR f.slot IS NOT NULL
    ORDER BY r.priority DESC, r.round, r.due_at, r.id
    LIMIT %(limit)s
), picked AS MATERIALIZED (
    SELECT id, slot_name, slot, name, ckey, nextval('everystep_claim_token') AS token FROM first
), took AS (
    UPDATE everystep_slot s SET run_id = p.id, token = p.token
    FROM picked p
    WHERE s.name = p.slot_name AND s.slot = p.slot
), took_keys AS (
    UPDATE everystep_key k SET run_id = p.id, token = p.token, claimed_at = everystep_now()
    FROM (SELECT DISTINCT ON (name, ckey) name, ckey, id, token
          FROM picked WHERE ckey IS NOT NULL
          ORDER BY name, ckey, token DESC) p
    WHERE k.name = p.name AND k.key = p.ckey
)
UPDATE everystep_workflow w
SET status = 'running', claimed_by = %(runner)s, claim_token = p.token,
    slot = CASE WHEN p.ckey IS NULL THEN p.slot ELSE coalesce(p.slot, 0) END
FROM picked p
WHERE w.id = p.id AND w.id = ANY(ARRAY(SELECT id FROM picked))
RETURNING w.id, w.name, w.args,
    to_json(ARRAY(SELECT json_build_array(s.step_id, s.name, s.status, s.result, s.error, s.attempts)
                  FROM everystep_step s WHERE s.workflow_id = w.id)),
    w.claim_token, (w.cancel_requested_at IS NOT NULL OR w.deadline_at <= everystep_now()) IS TRUE, extract(epoch FROM everystep_now())::float8, w.slot, w.parent_id;


-- name: claim_unlimited
-- `claim` for a runner of every workflow while the whole claim would take
-- nothing this one does not see: the head of the unlimited lane's index of
-- priority-0 runs, nothing else. Otherwise (`elsewhere`: a due run in the
-- priority lane, one probe of the first entry of
-- everystep_workflow_due_prioritized; a limited workflow with a free slot
-- and runs to claim; a ready key with room and runs to claim: the tests of
-- `end_plain_runs`'s ('l') row) it claims nothing and returns one row of
-- NULLs: the caller takes the whole `claim` then, which orders the
-- priorities and fills the slots. The NOT EXISTS skips a run inserted
-- while its workflow's limit was being set (see 0011_lanes.sql): it is late
-- at worst, never over its limit.
WITH elsewhere AS MATERIALIZED (
    -- abs(priority) > 0, as the index's predicate: see 0018_due_prioritized.sql.
    SELECT EXISTS (SELECT 1 FROM everystep_workflow w
                   WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND abs(w.priority) > 0
                     AND w.due_at <= everystep_now())
        OR EXISTS (SELECT 1 FROM everystep_slot s
                  WHERE (SELECT count(*) FROM everystep_workflow h
                         WHERE h.id = s.run_id
                           AND ((h.status = 'running' AND h.slot = s.slot) OR coalesce(h.claim_token, 0) < s.token)) = 0
                    AND (EXISTS (SELECT 1 FROM everystep_workflow w
                                 WHERE w.status IN ('scheduled', 'waiting') AND w.limited AND NOT w.keyed
                                   AND w.priority = 0
                                   AND w.name = s.name AND (w.name, w.due_at) <= (s.name, everystep_now())
                                 OFFSET 0)
                         OR EXISTS (SELECT 1 FROM everystep_workflow w
                                    WHERE w.status IN ('scheduled', 'waiting') AND w.limited AND NOT w.keyed
                                      AND w.priority <> 0 AND w.name = s.name AND w.due_at <= everystep_now()
                                    OFFSET 0)))
        OR EXISTS (SELECT 1 FROM everystep_key k
                  WHERE k.ready AND (SELECT count(*) FROM everystep_workflow h
                         WHERE h.id = k.run_id AND coalesce(h.claim_token, 0) < k.token) = 0
                    AND EXISTS (SELECT 1 FROM everystep_workflow w
                                WHERE w.status IN ('scheduled', 'waiting') AND w.keyed
                                  AND w.name = k.name AND w.concurrency_key = k.key AND w.due_at <= everystep_now()
                                OFFSET 0)
                    AND (SELECT count(*) FROM everystep_workflow r
                         WHERE r.status = 'running' AND r.concurrency_key IS NOT NULL
                           AND r.name = k.name AND r.concurrency_key = k.key)
                        < (SELECT kl.per_key FROM everystep_key_limit kl WHERE kl.name = k.name)) AS waiting
), picked AS MATERIALIZED (
    SELECT w.id, nextval('everystep_claim_token') AS token
    FROM (SELECT w.id
          FROM everystep_workflow w
          WHERE NOT (SELECT waiting FROM elsewhere)
            AND w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.priority = 0
            AND w.due_at <= everystep_now()
            AND NOT EXISTS (SELECT 1 FROM everystep_limit l WHERE l.name = w.name OFFSET 0)
            AND NOT (w.concurrency_key IS NOT NULL
                     AND EXISTS (SELECT 1 FROM everystep_key_limit kl WHERE kl.name = w.name OFFSET 0))
          ORDER BY w.due_at, w.id
          LIMIT %(limit)s
          FOR UPDATE OF w SKIP LOCKED) w
), claimed AS (
    UPDATE everystep_workflow w
    SET status = 'running', claimed_by = %(runner)s, claim_token = p.token, slot = NULL
    FROM picked p
    WHERE w.id = p.id AND w.id = ANY(ARRAY(SELECT id FROM picked))
    RETURNING w.id, w.name, w.args,
        to_json(ARRAY(SELECT json_build_array(s.step_id, s.name, s.status, s.result, s.error, s.attempts)
                      FROM everystep_step s WHERE s.workflow_id = w.id)),
        w.claim_token, (w.cancel_requested_at IS NOT NULL OR w.deadline_at <= everystep_now()) IS TRUE,
        extract(epoch FROM everystep_now())::float8, w.slot, w.parent_id
)
SELECT * FROM claimed
UNION ALL
SELECT NULL::uuid, NULL::varchar, NULL::jsonb, NULL::json, NULL::bigint, NULL::boolean, NULL::float8, NULL::integer,
       NULL::uuid
WHERE (SELECT waiting FROM elsewhere);


-- name: sort_lanes
-- Every claimable run into the lane of its workflow as the limits stand (see
-- 0011_lanes.sql and 0014_priorities.sql: a run is `keyed` when it has a
-- concurrency key and its workflow a per-key limit, and `limited` when its
-- workflow has a limit or it is keyed), reading only what may be in the
-- wrong lane: the limited and keyed lanes' runs whose workflow has no such
-- limit any more (their own indexes), and the claimable runs of the
-- workflows that have one (by name: the OFFSET 0 keeps that a probe of
-- everystep_workflow_due_by_name per workflow, which a join would turn into
-- a scan of the table), never the whole backlog. A run a claim has locked is
-- waited for (a claim is one short statement): claimed meanwhile, it is not
-- claimable any more and stays as it is. Locked in id order, so that two
-- sorts at once wait for each other rather than deadlock. A run that becomes
-- keyed gets its key's row, ready.
WITH wrong AS (
    SELECT w.id
    FROM everystep_workflow w
    WHERE w.status IN ('scheduled', 'waiting') AND w.limited AND NOT w.keyed AND w.priority = 0
      AND NOT EXISTS (SELECT FROM everystep_limit l WHERE l.name = w.name)
  UNION ALL
    SELECT w.id
    FROM everystep_workflow w
    WHERE w.status IN ('scheduled', 'waiting') AND w.limited AND NOT w.keyed AND w.priority <> 0
      AND NOT EXISTS (SELECT FROM everystep_limit l WHERE l.name = w.name)
  UNION ALL
    SELECT w.id
    FROM everystep_workflow w
    WHERE w.status IN ('scheduled', 'waiting') AND w.keyed
      AND NOT EXISTS (SELECT FROM everystep_key_limit kl WHERE kl.name = w.name)
  UNION ALL
    SELECT w.id
    FROM everystep_limit l
    CROSS JOIN LATERAL (SELECT w.id
                        FROM everystep_workflow w
                        WHERE w.name = l.name AND w.status IN ('scheduled', 'waiting') AND NOT w.limited
                        OFFSET 0) w
  UNION ALL
    SELECT w.id
    FROM everystep_key_limit kl
    CROSS JOIN LATERAL (SELECT w.id
                        FROM everystep_workflow w
                        WHERE w.name = kl.name AND w.status IN ('scheduled', 'waiting') AND NOT w.keyed
                          AND w.concurrency_key IS NOT NULL
                        OFFSET 0) w
), locked AS (
    SELECT w.id
    FROM everystep_workflow w
    WHERE w.id = ANY(ARRAY(SELECT id FROM wrong))
    ORDER BY w.id
    FOR UPDATE OF w
), lane AS (
    SELECT w.id,
           w.concurrency_key IS NOT NULL AND EXISTS (SELECT FROM everystep_key_limit kl WHERE kl.name = w.name) AS keyed,
           EXISTS (SELECT FROM everystep_limit l WHERE l.name = w.name) AS limited
    FROM everystep_workflow w JOIN locked USING (id)
), moved AS (
    UPDATE everystep_workflow w
    SET limited = lane.limited OR lane.keyed, keyed = lane.keyed
    FROM lane
    WHERE w.id = lane.id AND w.status IN ('scheduled', 'waiting')
      AND (w.limited, w.keyed) IS DISTINCT FROM (lane.limited OR lane.keyed, lane.keyed)
    RETURNING w.id, w.name, w.concurrency_key, w.keyed
), key_rows AS (
    INSERT INTO everystep_key (name, key)
    SELECT DISTINCT name, concurrency_key FROM moved WHERE keyed
    ON CONFLICT (name, key) DO UPDATE SET ready = true
)
SELECT id FROM moved;


-- name: idle_keys
-- The keys with no claimable and no running run are not ready any more: the
-- claims do not read them (a tenant gone for good costs nothing). Keys a
-- claim or a producer holds are skipped. A producer whose run this sweep's
-- snapshot missed, of a key it found ready, leaves its run to ready_keys.
WITH idle AS (
    SELECT k.name, k.key
    FROM everystep_key k
    WHERE k.ready
      AND NOT EXISTS (SELECT FROM everystep_workflow w
                      WHERE w.status IN ('scheduled', 'waiting') AND w.keyed
                        AND w.name = k.name AND w.concurrency_key = k.key)
      AND NOT EXISTS (SELECT FROM everystep_workflow r
                      WHERE r.status = 'running' AND r.concurrency_key IS NOT NULL
                        AND r.name = k.name AND r.concurrency_key = k.key)
    FOR UPDATE OF k SKIP LOCKED
)
UPDATE everystep_key k
SET ready = false
FROM idle
WHERE k.name = idle.name AND k.key = idle.key
RETURNING k.key;

-- name: ready_keys
-- Every key with claimable keyed runs ready, its row made if it has none
-- (the maintenance child's sweep, after idle_keys): reads the keyed lane.
INSERT INTO everystep_key (name, key)
SELECT DISTINCT w.name, w.concurrency_key
FROM everystep_workflow w
WHERE w.status IN ('scheduled', 'waiting') AND w.keyed
  AND EXISTS (SELECT FROM everystep_key_limit kl WHERE kl.name = w.name)
  AND NOT EXISTS (SELECT FROM everystep_key k WHERE k.name = w.name AND k.key = w.concurrency_key AND k.ready)
ON CONFLICT (name, key) DO UPDATE SET ready = true
RETURNING key;


-- name: no_jit_in_transaction
-- For the rest of the transaction, no JIT compilation: sort_lanes reads a few
-- index entries in well under a millisecond, but its estimate (the lanes'
-- anti-join against everystep_limit) is above jit_above_cost, and compiling
-- it took 250 ms at every sweep.
SELECT set_config('jit', 'off', true);


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

-- name: drop_key_limits
-- The workflows whose per-key limit was removed: their keys' rows go with
-- them (FK cascade).
DELETE FROM everystep_key_limit
WHERE name = ANY(%(names)s);

-- name: put_key_limits
INSERT INTO everystep_key_limit (name, per_key)
SELECT * FROM unnest(%(names)s::text[], %(counts)s::int[])
ON CONFLICT (name) DO UPDATE
SET per_key = EXCLUDED.per_key, updated_at = everystep_now()
WHERE everystep_key_limit.per_key <> EXCLUDED.per_key;

-- name: key_limits
SELECT name, per_key
FROM everystep_key_limit
ORDER BY name;

-- name: drop_priorities
DELETE FROM everystep_priority
WHERE name = ANY(%(names)s);

-- name: put_priorities
INSERT INTO everystep_priority (name, priority)
SELECT * FROM unnest(%(names)s::text[], %(priorities)s::smallint[])
ON CONFLICT (name) DO UPDATE
SET priority = EXCLUDED.priority, updated_at = everystep_now()
WHERE everystep_priority.priority <> EXCLUDED.priority;

-- name: priorities
SELECT name, priority
FROM everystep_priority
ORDER BY name;

-- name: put_rate_limits
-- Rate limits as configured: a new bucket starts empty (its first token
-- comes `per`/`rate` seconds on: a fleet started with a backlog keeps to
-- the rate from its first call); a changed one keeps its tokens, at most
-- the new burst.
INSERT INTO everystep_rate_limit (name, rate, per, burst, tokens)
SELECT name, rate, per, burst, 0
FROM unnest(%(names)s::text[], %(rates)s::float8[], %(pers)s::float8[], %(bursts)s::int[])
    AS r(name, rate, per, burst)
ON CONFLICT (name) DO UPDATE
SET rate = EXCLUDED.rate, per = EXCLUDED.per, burst = EXCLUDED.burst,
    tokens = least(everystep_rate_limit.tokens, EXCLUDED.burst), updated_at = everystep_now()
WHERE (everystep_rate_limit.rate, everystep_rate_limit.per, everystep_rate_limit.burst)
      IS DISTINCT FROM (EXCLUDED.rate, EXCLUDED.per, EXCLUDED.burst);

-- name: rate_limits
SELECT name, rate, per, burst
FROM everystep_rate_limit
ORDER BY name;

-- name: take_token
-- One token of a rate limit, if one is there, in one statement (the row
-- lock orders the takers fleet-wide): the bucket refilled to now (`rate`
-- tokens every `per` seconds, at most `burst`) has one, and the `burst`-th
-- last take is at least `per` seconds ago. "Now" is the engine's clock at
-- the moment the row is locked: everystep_now() plus the time since the
-- transaction began (clock_timestamp() less transaction_timestamp(), which
-- is now(): the wait for the lock, mostly), so that takers queued behind
-- each other do not all take at the moment they started to wait. Rows: (true, 0, now, the
-- same moment by the server's clock rather than the engine's) taken;
-- (false, seconds, now, NULL) none: come back in that many seconds (epoch
-- seconds), the later of the next token's time and the last such promise
-- plus one token's interval (0030), so that the takers that found none come
-- back one per token; none at all: no such rate limit.
WITH took AS (
    UPDATE everystep_rate_limit r
    SET tokens = least(r.burst, r.tokens + greatest(extract(epoch FROM (everystep_now() + (clock_timestamp() - transaction_timestamp())) - r.refilled_at)::float8, 0)
                                           * r.rate / r.per) - 1,
        refilled_at = greatest(r.refilled_at, (everystep_now() + (clock_timestamp() - transaction_timestamp()))),
        takes = (r.takes || (everystep_now() + (clock_timestamp() - transaction_timestamp())))[greatest(1, cardinality(r.takes) + 2 - r.burst):]
    WHERE r.name = %(name)s
      AND least(r.burst, r.tokens + greatest(extract(epoch FROM (everystep_now() + (clock_timestamp() - transaction_timestamp())) - r.refilled_at)::float8, 0)
                                    * r.rate / r.per) >= 1
      AND (cardinality(r.takes) < r.burst
           OR r.takes[cardinality(r.takes) + 1 - r.burst] <= (everystep_now() + (clock_timestamp() - transaction_timestamp())) - make_interval(secs => r.per))
    RETURNING extract(epoch FROM r.takes[cardinality(r.takes)])::float8 AS at,
              extract(epoch FROM r.takes[cardinality(r.takes)] - everystep_now() + transaction_timestamp())::float8
                  AS real_at
),
promised AS (
    UPDATE everystep_rate_limit r
    SET promised_at = n.now + make_interval(secs => greatest(
        (1 - least(r.burst, r.tokens + greatest(extract(epoch FROM n.now - r.refilled_at)::float8, 0)
                                       * r.rate / r.per)) * r.per / r.rate,
        CASE WHEN cardinality(r.takes) >= r.burst
             THEN extract(epoch FROM r.takes[cardinality(r.takes) + 1 - r.burst] + make_interval(secs => r.per)
                                     - n.now)::float8
             ELSE 0 END,
        extract(epoch FROM r.promised_at - n.now)::float8 + r.per / r.rate,
        0.001))
    FROM (SELECT everystep_now() + (clock_timestamp() - transaction_timestamp()) AS now) n
    WHERE r.name = %(name)s AND NOT EXISTS (SELECT FROM took)
    RETURNING extract(epoch FROM r.promised_at - n.now)::float8 AS wait, extract(epoch FROM n.now)::float8 AS now
)
SELECT true, 0::float8, at, real_at FROM took
UNION ALL
SELECT false, wait, now, NULL::float8
FROM promised;


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
        w.claim_token, (w.cancel_requested_at IS NOT NULL OR w.deadline_at <= everystep_now()) IS TRUE,
        extract(epoch FROM everystep_now())::float8, w.slot, w.parent_id
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
-- request on their run, or are past its deadline: the worker preempts
-- their async steps.
SELECT claim_token
FROM everystep_workflow
WHERE status = 'running' AND claimed_by = %(runner)s AND claim_token = ANY(%(tokens)s::bigint[])
  AND (cancel_requested_at IS NOT NULL OR deadline_at <= everystep_now());

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
RETURNING id, CASE WHEN dependents THEN everystep_settle(ARRAY[id], ARRAY['failed']) END;


-- name: record_steps
-- Step rows of several runs of one runner (group commit, see
-- everystep/writer.py), each fenced by its own execution's token: the FOR
-- SHARE of its run row keeps a requeue and the write from both winning.
-- The input rows come as parallel arrays (one element per write, numbered
-- n = 1, 2, ...); returns the rows written, with the cancel request seen on
-- their run (`cancelling`). Run through libpq's prepared path (everystep/db/libpq.py).
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
        SELECT id, claim_token, cancel_requested_at, deadline_at
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
SELECT i.n, (w.cancel_requested_at IS NOT NULL OR w.deadline_at <= everystep_now()) IS TRUE
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
WITH RECURSIVE high_levels(priority) AS (
    (SELECT w.priority FROM everystep_workflow w
     WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.priority > 0
     ORDER BY w.priority DESC
     LIMIT 1)
  UNION ALL
    SELECT (SELECT w.priority FROM everystep_workflow w
            WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.priority > 0
              AND w.priority < lv.priority
            ORDER BY w.priority DESC
            LIMIT 1)
    FROM high_levels lv
    WHERE lv.priority IS NOT NULL
), low_levels(priority) AS (
    (SELECT w.priority FROM everystep_workflow w
     WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.priority < 0
     ORDER BY w.priority DESC
     LIMIT 1)
  UNION ALL
    SELECT (SELECT w.priority FROM everystep_workflow w
            WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.priority < 0
              AND w.priority < lv.priority
            ORDER BY w.priority DESC
            LIMIT 1)
    FROM low_levels lv
    WHERE lv.priority IS NOT NULL
), i AS (
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
      AND (EXISTS (SELECT 1 FROM everystep_workflow w
                   WHERE w.status IN ('scheduled', 'waiting') AND w.limited AND NOT w.keyed AND w.priority = 0
                     AND w.name = s.name AND (w.name, w.due_at) <= (s.name, everystep_now())
                     AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
                   OFFSET 0)
           OR EXISTS (SELECT 1 FROM everystep_workflow w
                      WHERE w.status IN ('scheduled', 'waiting') AND w.limited AND NOT w.keyed AND w.priority <> 0
                        AND w.name = s.name AND w.due_at <= everystep_now()
                        AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
                      OFFSET 0)
           OR EXISTS (SELECT 1 FROM everystep_workflow w
                      WHERE w.status IN ('scheduled', 'waiting') AND w.keyed
                        AND w.name = s.name AND w.due_at <= everystep_now()
                        AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
                      OFFSET 0))
    LIMIT (SELECT count(*) FROM held WHERE held.claim)
    FOR UPDATE OF s SKIP LOCKED
), room AS (
    SELECT name, count(*) AS n FROM free GROUP BY name
), keys AS (
    SELECT k.name, k.key,
           (SELECT kl.per_key FROM everystep_key_limit kl WHERE kl.name = k.name)
             - (SELECT count(*) FROM everystep_workflow r
                WHERE r.status = 'running' AND r.concurrency_key IS NOT NULL
                  AND r.name = k.name AND r.concurrency_key = k.key
                  AND NOT EXISTS (SELECT 1 FROM held WHERE held.run = r.id)) AS n
    FROM everystep_key k
    WHERE EXISTS (SELECT 1 FROM held WHERE held.claim)
      AND k.ready AND (SELECT count(*) FROM everystep_workflow h
           WHERE h.id = k.run_id AND coalesce(h.claim_token, 0) < k.token) = 0
      AND EXISTS (SELECT 1 FROM everystep_workflow w
                  WHERE w.status IN ('scheduled', 'waiting') AND w.keyed
                    AND w.name = k.name AND w.concurrency_key = k.key AND w.due_at <= everystep_now()
                    AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
                  OFFSET 0)
      AND (SELECT count(*) FROM everystep_workflow r
           WHERE r.status = 'running' AND r.concurrency_key IS NOT NULL
             AND r.name = k.name AND r.concurrency_key = k.key
             AND NOT EXISTS (SELECT 1 FROM held WHERE held.run = r.id))
          < (SELECT kl.per_key FROM everystep_key_limit kl WHERE kl.name = k.name)
    ORDER BY k.claimed_at NULLS FIRST, k.name, k.key
    LIMIT (SELECT count(*) FROM held WHERE held.claim)
    FOR UPDATE OF k SKIP LOCKED
), high AS (
    SELECT w.id, w.name, w.due_at, w.priority
    FROM high_levels lv CROSS JOIN LATERAL (
        SELECT w.id, w.name, w.due_at, w.priority
        FROM everystep_workflow w
        WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.priority > 0
          AND w.priority = lv.priority AND w.due_at <= everystep_now()
          AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
          AND NOT EXISTS (SELECT 1 FROM everystep_limit l WHERE l.name = w.name OFFSET 0)
          AND NOT (w.concurrency_key IS NOT NULL
                   AND EXISTS (SELECT 1 FROM everystep_key_limit kl WHERE kl.name = w.name OFFSET 0))
        ORDER BY w.due_at, w.id
        LIMIT (SELECT count(*) FROM held WHERE held.claim)
        FOR UPDATE OF w SKIP LOCKED
    ) w
    WHERE EXISTS (SELECT 1 FROM held WHERE held.claim) AND lv.priority IS NOT NULL
    LIMIT (SELECT count(*) FROM held WHERE held.claim)
), unlimited AS (
    SELECT w.id, w.name, w.due_at, w.priority
    FROM everystep_workflow w
    WHERE EXISTS (SELECT 1 FROM held WHERE held.claim)
      AND w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.priority = 0
      AND w.due_at <= everystep_now()
      AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
      AND NOT EXISTS (SELECT 1 FROM everystep_limit l WHERE l.name = w.name OFFSET 0)
      AND NOT (w.concurrency_key IS NOT NULL
               AND EXISTS (SELECT 1 FROM everystep_key_limit kl WHERE kl.name = w.name OFFSET 0))
    ORDER BY w.due_at, w.id
    LIMIT (SELECT count(*) FROM held WHERE held.claim) - (SELECT count(*) FROM high)
    FOR UPDATE OF w SKIP LOCKED
), low AS (
    SELECT w.id, w.name, w.due_at, w.priority
    FROM low_levels lv CROSS JOIN LATERAL (
        SELECT w.id, w.name, w.due_at, w.priority
        FROM everystep_workflow w
        WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.priority < 0
          AND w.priority = lv.priority AND w.due_at <= everystep_now()
          AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
          AND NOT EXISTS (SELECT 1 FROM everystep_limit l WHERE l.name = w.name OFFSET 0)
          AND NOT (w.concurrency_key IS NOT NULL
                   AND EXISTS (SELECT 1 FROM everystep_key_limit kl WHERE kl.name = w.name OFFSET 0))
        ORDER BY w.due_at, w.id
        LIMIT (SELECT count(*) FROM held WHERE held.claim) - (SELECT count(*) FROM high) - (SELECT count(*) FROM unlimited)
        FOR UPDATE OF w SKIP LOCKED
    ) w
    WHERE EXISTS (SELECT 1 FROM held WHERE held.claim) AND lv.priority IS NOT NULL
    LIMIT (SELECT count(*) FROM held WHERE held.claim) - (SELECT count(*) FROM high) - (SELECT count(*) FROM unlimited)
), limited_high AS (
    SELECT w.id, w.name, w.due_at, w.priority
    FROM room CROSS JOIN LATERAL (
        SELECT w.id, w.name, w.due_at, w.priority
        FROM everystep_workflow w
        WHERE w.status IN ('scheduled', 'waiting') AND w.limited AND NOT w.keyed AND w.priority > 0
          AND w.name = room.name AND w.due_at <= everystep_now()
          AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
        ORDER BY w.priority DESC, w.due_at, w.id
        LIMIT least(room.n, (SELECT count(*) FROM held WHERE held.claim))
        FOR UPDATE OF w SKIP LOCKED
    ) w
), limited AS (
    SELECT w.id, w.name, w.due_at, w.priority
    FROM room CROSS JOIN LATERAL (
        SELECT w.id, w.name, w.due_at, w.priority
        FROM everystep_workflow w
        WHERE w.status IN ('scheduled', 'waiting') AND w.limited AND NOT w.keyed AND w.priority = 0
          AND w.name = room.name AND (w.name, w.due_at) <= (room.name, everystep_now())
          AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
        ORDER BY w.due_at, w.id
        LIMIT least(room.n, (SELECT count(*) FROM held WHERE held.claim))
        FOR UPDATE OF w SKIP LOCKED
    ) w
), limited_low AS (
    SELECT w.id, w.name, w.due_at, w.priority
    FROM room CROSS JOIN LATERAL (
        SELECT w.id, w.name, w.due_at, w.priority
        FROM everystep_workflow w
        WHERE w.status IN ('scheduled', 'waiting') AND w.limited AND NOT w.keyed AND w.priority < 0
          AND w.name = room.name AND w.due_at <= everystep_now()
          AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
        ORDER BY w.priority DESC, w.due_at, w.id
        LIMIT least(room.n, (SELECT count(*) FROM held WHERE held.claim))
        FOR UPDATE OF w SKIP LOCKED
    ) w
), keyed AS (
    SELECT w.id, w.name, w.due_at, w.priority, w.concurrency_key
    FROM keys CROSS JOIN LATERAL (
        SELECT w.id, w.name, w.due_at, w.priority, w.concurrency_key
        FROM everystep_workflow w
        WHERE w.status IN ('scheduled', 'waiting') AND w.keyed
          AND w.name = keys.name AND w.concurrency_key = keys.key AND w.due_at <= everystep_now()
          AND (%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[])) AND w.name <> ALL(%(skipped)s::text[])
        ORDER BY w.due_at, w.id
        LIMIT least(keys.n, (SELECT count(*) FROM held WHERE held.claim))
        FOR UPDATE OF w SKIP LOCKED
    ) w
), candidate AS (
    SELECT id, name, due_at, priority, NULL::varchar AS ckey, false AS slotted, 1::bigint AS round FROM high
    UNION ALL
    SELECT id, name, due_at, priority, NULL, false, 1 FROM unlimited
    UNION ALL
    SELECT id, name, due_at, priority, NULL, false, 1 FROM low
    UNION ALL
    SELECT id, name, due_at, priority, NULL, true, 1 FROM limited_high
    UNION ALL
    SELECT id, name, due_at, priority, NULL, true, 1 FROM limited
    UNION ALL
    SELECT id, name, due_at, priority, NULL, true, 1 FROM limited_low
    UNION ALL
    SELECT id, name, due_at, priority, concurrency_key, EXISTS (SELECT FROM everystep_limit l WHERE l.name = keyed.name),
           row_number() OVER (PARTITION BY name, concurrency_key ORDER BY due_at, id)
    FROM keyed
), ranked AS (
    SELECT id, name, due_at, priority, ckey, slotted, round,
           row_number() OVER (PARTITION BY name ORDER BY priority DESC, round, due_at, id) AS k
    FROM candidate
), numbered AS (
    SELECT name, slot, row_number() OVER (PARTITION BY name ORDER BY slot) AS k FROM free
), first AS (
    SELECT r.id, f.name AS slot_name, f.slot, r.name, r.ckey
    FROM ranked r LEFT JOIN numbered f ON f.name = r.name AND f.k = r.k
    WHERE NOT r.slotted OR f.slot IS NOT NULL
    ORDER BY r.priority DESC, r.round, r.due_at, r.id
    LIMIT (SELECT count(*) FROM held WHERE held.claim)
), picked AS MATERIALIZED (
    SELECT id, slot_name, slot, name, ckey, nextval('everystep_claim_token') AS token FROM first
), took AS (
    UPDATE everystep_slot s SET run_id = p.id, token = p.token
    FROM picked p
    WHERE s.name = p.slot_name AND s.slot = p.slot
), took_keys AS (
    UPDATE everystep_key k SET run_id = p.id, token = p.token, claimed_at = everystep_now()
    FROM (SELECT DISTINCT ON (name, ckey) name, ckey, id, token
          FROM picked WHERE ckey IS NOT NULL
          ORDER BY name, ckey, token DESC) p
    WHERE k.name = p.name AND k.key = p.ckey
), claimed AS (
    UPDATE everystep_workflow w
    SET status = 'running', claimed_by = %(runner)s, claim_token = p.token,
        slot = CASE WHEN p.ckey IS NULL THEN p.slot ELSE coalesce(p.slot, 0) END
    FROM picked p
    WHERE w.id = p.id AND w.id = ANY(ARRAY(SELECT id FROM picked))
    RETURNING w.id, w.name, w.args,
        to_json(ARRAY(SELECT json_build_array(s.step_id, s.name, s.status, s.result, s.error, s.attempts)
                      FROM everystep_step s WHERE s.workflow_id = w.id)),
        w.claim_token, (w.cancel_requested_at IS NOT NULL OR w.deadline_at <= everystep_now()) IS TRUE, extract(epoch FROM everystep_now())::float8, w.slot, w.parent_id
), ended AS (
    -- A cancel request that reached the row before the end wins over every
    -- other end but `blocked`: the run is `cancelled` (what the body returned
    -- or raised is kept in result/error), and so does a deadline passed, as a
    -- request with the reason 'deadline'. A run blocked on an unsafe step's
    -- uncertain effect (one cancelled mid-effect too) waits for an operator:
    -- the request is delivered at its next step call once that is resolved.
    UPDATE everystep_workflow w
    SET status = CASE WHEN (w.cancel_requested_at IS NULL AND (w.deadline_at <= everystep_now()) IS NOT TRUE)
                           OR h.status = 'blocked' THEN h.status ELSE 'cancelled' END,
        result = h.result::jsonb, error = h.error::jsonb,
        completed_at = CASE WHEN h.status = 'blocked' THEN NULL ELSE everystep_now() END,
        cancel_reason = CASE WHEN w.cancel_requested_at IS NULL AND w.deadline_at <= everystep_now()
                                  AND h.status <> 'blocked' THEN 'deadline' ELSE w.cancel_reason END
    FROM held h
    WHERE w.id = h.run AND w.id = ANY(%(runs)s::uuid[]) AND (w.status = 'running') IS TRUE
      AND w.claimed_by = %(runner)s AND w.claim_token = h.token
    RETURNING h.n, w.id, w.status, w.name, w.slot, w.parent_id, w.dependents
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
), settled AS (
    -- Runs others depend on release or cancel their dependents in this
    -- transaction (everystep_settle, 0031_dags.sql), plain runs skip it.
    SELECT everystep_settle(array_agg(id), array_agg(status)) AS released
    FROM ended WHERE dependents
    HAVING count(*) > 0
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
   OR EXISTS (SELECT FROM woke WHERE due)
UNION ALL
SELECT 'r', released, NULL, NULL::uuid, NULL::varchar, NULL::jsonb, NULL::json, NULL::bigint, NULL::boolean,
       NULL::float8, NULL::integer, NULL::uuid
FROM settled;


-- name: end_plain_runs
-- `end_runs` for ends that free no slot and wake no parent (their runs are
-- of unlimited workflows, and have no parent), of a runner of every
-- workflow, while no limited workflow has a free slot and no run of another
-- priority than 0 is due in the unlimited lane: successors come from the head
-- of that lane's priority-0 runs (as in `claim_unlimited`). Rows as for
-- `end_runs`, and ('l') when the whole claim would take runs this one does
-- not see: a limited workflow has a free slot and runs to claim, or a run of
-- another priority is due (then this one claims none); the caller goes back
-- to `end_runs` then.
WITH prioritized AS MATERIALIZED (
    -- abs(priority) > 0, as the index's predicate: see 0018_due_prioritized.sql.
    SELECT EXISTS (SELECT 1 FROM everystep_workflow w
                   WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND abs(w.priority) > 0
                     AND w.due_at <= everystep_now()) AS waiting
), i AS (
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
), plain AS (
    SELECT w.id
    FROM everystep_workflow w
    WHERE EXISTS (SELECT 1 FROM held WHERE held.claim) AND NOT (SELECT waiting FROM prioritized)
      AND w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.priority = 0 AND w.due_at <= everystep_now()
      AND NOT EXISTS (SELECT 1 FROM everystep_limit l WHERE l.name = w.name OFFSET 0)
      AND NOT (w.concurrency_key IS NOT NULL
               AND EXISTS (SELECT 1 FROM everystep_key_limit kl WHERE kl.name = w.name OFFSET 0))
    ORDER BY w.due_at, w.id
    LIMIT (SELECT count(*) FROM held WHERE held.claim)
    FOR UPDATE OF w SKIP LOCKED
), picked AS MATERIALIZED (
    SELECT id, nextval('everystep_claim_token') AS token
    FROM plain
), claimed AS (
    UPDATE everystep_workflow w
    SET status = 'running', claimed_by = %(runner)s, claim_token = p.token, slot = NULL
    FROM picked p
    WHERE w.id = p.id AND w.id = ANY(ARRAY(SELECT id FROM picked))
    RETURNING w.id, w.name, w.args,
        to_json(ARRAY(SELECT json_build_array(s.step_id, s.name, s.status, s.result, s.error, s.attempts)
                      FROM everystep_step s WHERE s.workflow_id = w.id)),
        w.claim_token, (w.cancel_requested_at IS NOT NULL OR w.deadline_at <= everystep_now()) IS TRUE, extract(epoch FROM everystep_now())::float8, w.slot, w.parent_id
), ended AS (
    UPDATE everystep_workflow w
    SET status = CASE WHEN (w.cancel_requested_at IS NULL AND (w.deadline_at <= everystep_now()) IS NOT TRUE)
                           OR h.status = 'blocked' THEN h.status ELSE 'cancelled' END,
        result = h.result::jsonb, error = h.error::jsonb,
        completed_at = CASE WHEN h.status = 'blocked' THEN NULL ELSE everystep_now() END,
        cancel_reason = CASE WHEN w.cancel_requested_at IS NULL AND w.deadline_at <= everystep_now()
                                  AND h.status <> 'blocked' THEN 'deadline' ELSE w.cancel_reason END
    FROM held h
    WHERE w.id = h.run AND w.id = ANY(%(runs)s::uuid[]) AND (w.status = 'running') IS TRUE
      AND w.claimed_by = %(runner)s AND w.claim_token = h.token
    RETURNING h.n, w.id, w.status, w.dependents
), step AS (
    INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result, error, claim_token,
                                started_at, finished_at)
    SELECT i.run, i.step_id, i.step_name, i.args::jsonb, i.kwargs::jsonb, i.step_status, i.step_result::jsonb,
           i.step_error::jsonb, i.token, to_timestamp(i.started_at), to_timestamp(i.finished_at)
    FROM ended JOIN i USING (n)
    WHERE i.step_id IS NOT NULL
    ON CONFLICT (workflow_id, step_id) DO NOTHING
), settled AS (
    -- Runs others depend on release or cancel their dependents in this
    -- transaction (everystep_settle, 0031_dags.sql), plain runs skip it.
    SELECT everystep_settle(array_agg(id), array_agg(status)) AS released
    FROM ended WHERE dependents
    HAVING count(*) > 0
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
WHERE (SELECT waiting FROM prioritized)
   OR EXISTS (SELECT 1 FROM everystep_slot s
              WHERE (SELECT count(*) FROM everystep_workflow h
                     WHERE h.id = s.run_id
                       AND ((h.status = 'running' AND h.slot = s.slot) OR coalesce(h.claim_token, 0) < s.token)) = 0
                AND (EXISTS (SELECT 1 FROM everystep_workflow w
                             WHERE w.status IN ('scheduled', 'waiting') AND w.limited AND NOT w.keyed
                               AND w.priority = 0
                               AND w.name = s.name AND (w.name, w.due_at) <= (s.name, everystep_now())
                             OFFSET 0)
                     OR EXISTS (SELECT 1 FROM everystep_workflow w
                                WHERE w.status IN ('scheduled', 'waiting') AND w.limited AND NOT w.keyed
                                  AND w.priority <> 0 AND w.name = s.name AND w.due_at <= everystep_now()
                                OFFSET 0)))
   OR EXISTS (SELECT 1 FROM everystep_key k
              WHERE k.ready AND (SELECT count(*) FROM everystep_workflow h
                     WHERE h.id = k.run_id AND coalesce(h.claim_token, 0) < k.token) = 0
                AND EXISTS (SELECT 1 FROM everystep_workflow w
                            WHERE w.status IN ('scheduled', 'waiting') AND w.keyed
                              AND w.name = k.name AND w.concurrency_key = k.key AND w.due_at <= everystep_now()
                            OFFSET 0)
                AND (SELECT count(*) FROM everystep_workflow r
                     WHERE r.status = 'running' AND r.concurrency_key IS NOT NULL
                       AND r.name = k.name AND r.concurrency_key = k.key)
                    < (SELECT kl.per_key FROM everystep_key_limit kl WHERE kl.name = k.name))
UNION ALL
SELECT 'r', released, NULL, NULL::uuid, NULL::varchar, NULL::jsonb, NULL::json, NULL::bigint, NULL::boolean,
       NULL::float8, NULL::integer, NULL::uuid
FROM settled;


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
-- on each lane's index; the priority lane's is ordered by priority first, so
-- its min() is one probe per priority it holds (levels: a loose scan of its
-- distinct priorities, one index probe each).
WITH RECURSIVE levels(priority) AS (
    (SELECT w.priority FROM everystep_workflow w
     WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.priority <> 0
     ORDER BY w.priority DESC
     LIMIT 1)
  UNION ALL
    SELECT (SELECT w.priority FROM everystep_workflow w
            WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.priority <> 0
              AND w.priority < lv.priority
            ORDER BY w.priority DESC
            LIMIT 1)
    FROM levels lv
    WHERE lv.priority IS NOT NULL
)
SELECT extract(epoch FROM least(
    (SELECT min(due_at) FROM everystep_workflow
     WHERE status IN ('scheduled', 'waiting') AND NOT limited AND priority = 0 AND due_at > everystep_now()),
    (SELECT min((SELECT min(w.due_at) FROM everystep_workflow w
                 WHERE w.status IN ('scheduled', 'waiting') AND NOT w.limited AND w.priority <> 0
                   AND w.priority = lv.priority AND w.due_at > everystep_now()))
     FROM levels lv WHERE lv.priority IS NOT NULL),
    (SELECT min(due_at) FROM everystep_workflow
     WHERE status IN ('scheduled', 'waiting') AND limited AND NOT keyed AND priority = 0
       AND due_at > everystep_now()),
    (SELECT min(due_at) FROM everystep_workflow
     WHERE status IN ('scheduled', 'waiting') AND limited AND NOT keyed AND priority <> 0
       AND due_at > everystep_now()),
    (SELECT min(due_at) FROM everystep_workflow
     WHERE status IN ('scheduled', 'waiting') AND keyed AND due_at > everystep_now())) - everystep_now());

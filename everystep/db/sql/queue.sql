-- The queue: waiting for runs, claiming them, the concurrency limits and
-- their slots, taking back what a runner holds, counting crashes, the
-- group-committed step rows and ends of runs, and requeues. Read by
-- everystep/db/queue.py.
--
-- Where a run waits is not on its row (0032_ready.sql): a scheduled or
-- waiting run is in everystep_timer (due later), everystep_blocked (due, no
-- room in its workflow's limit or its key) or everystep_ready (may run now),
-- a running one in everystep_claimed. The trigger everystep_queue moves it
-- at every change of its row's status or due time; the claim is the function
-- everystep_claim. No statement here repeats a policy of those functions.
--
-- Terms used throughout:
--   everystep_now()  the engine's clock (0012_testing_clock.sql), as in
--              every statement of everystep/db/sql/: the server's now() in a
--              deployment, which the planner inlines; tests move it.
--   "running"  written as (status = 'running') IS TRUE in the fenced lookups
--              of a run by its primary key (a habit of the days the status
--              was indexed: a probe of the primary key whatever the plan).
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
-- Claim up to %(limit)s ready runs for this runner, of the workflows matching
-- %(routes)s (LIKE patterns; NULL: every workflow) and not in %(skipped)s:
-- everystep_claim (0032_ready.sql), which admits the runs whose time came
-- and takes the ready ones by priority, then in the order they became ready.
SELECT * FROM everystep_claim(%(runner)s, %(limit)s, %(routes)s, %(skipped)s);

-- name: resort
-- After the limits changed, and at every sweep of the maintenance child: the
-- runs that a worker of a version before 0032 made running with its own
-- claim are held (0040; looked for among the first %(head)s runs of the
-- queue, or in all of it when NULL, 0042), the timers whose time came are
-- admitted (a claim does it too, but none may run), the ready runs of a
-- workflow limited since they were admitted take a slot or wait for one
-- (read only where some workflow has a limit, 0041, and then only that
-- workflow's, 0042), and every workflow with blocked runs admits what its
-- room allows (0032_ready.sql). How many runs moved.
SELECT everystep_hold_strays(%(head)s::integer) + everystep_promote(10000) + everystep_readmit()
       + everystep_unblock();

-- name: unblock
-- Blocked runs admitted where there is room (everystep_unblock): a claim
-- that found nothing ready runs it, for a release and an admission that ran
-- at once and missed each other.
SELECT everystep_unblock();

-- name: idle_keys
-- The keys with no run admitted or running and none blocked go: a tenant
-- gone for good costs the pumps nothing. A producer that admits a run of the
-- key again makes its row again (everystep_take_room).
DELETE FROM everystep_key k
WHERE k.held = 0
  AND NOT EXISTS (SELECT FROM everystep_blocked b WHERE b.name = k.name AND b.ckey = k.key)
RETURNING k.key;

-- name: queue_dead_tuples
-- The dead row versions of the queue's own tables (0032_ready.sql): a row
-- inserted and deleted at every run, whose dead entries at the front of the
-- ready order each claim steps over until a vacuum removes them, and
-- autovacuum visits a database once a minute. Whether this role may vacuum
-- them all (a member of their owner: a superuser too), and how many.
-- By the statistics' functions, not the view pg_stat_user_tables, which
-- reads every table's figures first (32 ms a call on a busy server).
SELECT bool_and(pg_has_role(c.relowner, 'MEMBER')), coalesce(sum(pg_stat_get_dead_tuples(c.oid)), 0)::bigint
FROM pg_class c
WHERE c.oid IN ('everystep_ready'::regclass, 'everystep_claimed'::regclass, 'everystep_timer'::regclass);

-- name: vacuum_queue
-- (Outside a transaction.) Skips a table another vacuum holds.
VACUUM (SKIP_LOCKED) everystep_ready, everystep_claimed, everystep_timer;

-- name: compact_queue
-- After the vacuum: queue table %(queue)s, if it still holds `dead` dead
-- rows (a snapshot held open kept the vacuum from removing them) and at most
-- `live` live ones, is rewritten with its live rows alone (everystep_compact,
-- 0037_compact_queue.sql); the claims step over every dead entry at the
-- front of their order. Not one another vacuum is at (the vacuum skipped
-- it: autovacuum's, say), nor one a reader holds: the queue's statements
-- take stronger locks, a reader's may last (a pg_dump holds every table it
-- dumps to its end), and claims would queue behind the rewrite's lock for
-- `wait_ms` at every sweep, in vain. A row if it rewrote it (not if it did
-- not get its lock within `wait_ms`).
-- (The candidate is MATERIALIZED: the planner would order the checks by
-- cost and could call everystep_compact first.)
WITH candidate AS MATERIALIZED (
    SELECT q FROM (SELECT %(queue)s::regclass AS q) t
    WHERE pg_stat_get_dead_tuples(q) >= %(dead)s AND pg_stat_get_live_tuples(q) <= %(live)s
      AND NOT EXISTS (SELECT FROM pg_stat_progress_vacuum v WHERE v.relid = q)
      AND NOT EXISTS (SELECT FROM pg_locks l
                      WHERE l.relation = q AND l.mode = 'AccessShareLock' AND l.pid <> pg_backend_pid())
)
SELECT q::text FROM candidate WHERE everystep_compact(q, %(wait_ms)s);

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
    WHERE w.id = ANY(ARRAY(SELECT c.run_id FROM everystep_claimed c WHERE c.claimed_by = %(runner)s))
      AND w.status = 'running' AND w.claimed_by = %(runner)s
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
WHERE id = ANY(ARRAY(SELECT c.run_id FROM everystep_claimed c WHERE c.claimed_by = %(runner)s))
  AND status = 'running' AND claimed_by = %(runner)s;

-- name: cancel_requests
-- Which of these executions of the runner (their tokens) have a cancel
-- request on their run, or are past its deadline: the worker preempts
-- their async steps.
SELECT claim_token
FROM everystep_workflow
WHERE id = ANY(ARRAY(SELECT c.run_id FROM everystep_claimed c WHERE c.claimed_by = %(runner)s))
  AND status = 'running' AND claimed_by = %(runner)s AND claim_token = ANY(%(tokens)s::bigint[])
  AND (cancel_requested_at IS NOT NULL OR deadline_at <= everystep_now());

-- name: running_claimers
SELECT DISTINCT claimed_by
FROM everystep_claimed
WHERE claimed_by IS NOT NULL;


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
-- there already), and claim one successor per ended run that asks for one
-- (everystep_claim, as `claim`), or two: one claimed ahead, for the next
-- slot the worker frees. The claim runs first, before the ending UPDATE can
-- wait on a row lock: its own statements take their snapshots as they run.
-- The room an ended run held goes to the next blocked run in this
-- transaction (the trigger of 0032_ready.sql); children that end wake their
-- parents; runs others depend on settle their dependents.
-- Rows: ('c', priority, NULL, claimed run...) for the successors; ('h', n,
-- how many) for the ends that asked for some, in order (the successors are
-- theirs: one each in that order, then the second ones); ('e', n, status)
-- for the ends written; ('s', n) for the ends whose last step's row exists;
-- ('r', n) the dependents released.
WITH i AS (
    SELECT *
    FROM unnest(%(runs)s::uuid[], %(tokens)s::bigint[], %(statuses)s::text[], %(results)s::text[],
                %(errors)s::text[], %(claims)s::integer[], %(step_id)s::text[], %(name)s::text[],
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
), claimed AS MATERIALIZED (
    SELECT * FROM everystep_claim(%(runner)s, (SELECT coalesce(sum(held.claim), 0) FROM held)::integer,
                                  %(routes)s::text[], %(skipped)s::text[])
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
    RETURNING h.n, w.id, w.status, w.parent_id, w.dependents
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
), settled AS (
    -- Runs others depend on release or cancel their dependents in this
    -- transaction (everystep_settle, 0031_dags.sql), plain runs skip it.
    SELECT everystep_settle(array_agg(id), array_agg(status)) AS released
    FROM ended WHERE dependents
    HAVING count(*) > 0
)
-- (The priority looked up run by run: a join could be planned as a scan.)
SELECT 'c', (SELECT w.priority FROM everystep_workflow w WHERE w.id = claimed.id)::bigint, NULL::text, claimed.*
FROM claimed
UNION ALL
SELECT 'h', n, claim::text, NULL::uuid, NULL::varchar, NULL::jsonb, NULL::json, NULL::bigint, NULL::boolean,
       NULL::float8, NULL::integer, NULL::uuid
FROM held WHERE claim > 0
UNION ALL
SELECT 'e', n, status, NULL::uuid, NULL::varchar, NULL::jsonb, NULL::json, NULL::bigint, NULL::boolean, NULL::float8,
       NULL::integer, NULL::uuid
FROM ended
UNION ALL
SELECT 's', n, NULL, NULL::uuid, NULL::varchar, NULL::jsonb, NULL::json, NULL::bigint, NULL::boolean, NULL::float8,
       NULL::integer, NULL::uuid
FROM fenced WHERE step_exists
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
    WHERE id = ANY(ARRAY(SELECT c.run_id FROM everystep_claimed c WHERE c.claimed_by = %(claimer)s))
      AND status = 'running' AND claimed_by = %(claimer)s
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
-- Seconds until the earliest timer is due (database time; <= 0: one is due
-- and the next claim admits it), one probe of its index; NULL when none.
-- Ready runs are not counted: a worker with a free slot claims them, and
-- is notified of new ones.
SELECT extract(epoch FROM (SELECT min(due_at) FROM everystep_timer) - everystep_now());

-- Where a run waits, apart from what it is (docs/design.md, "A run's
-- life"). The run row (everystep_workflow) stays the record: its identity,
-- arguments, status, holder and outcome. Where a `scheduled` or `waiting`
-- run waits is a narrow row in one of three tables:
--
--   everystep_timer    due later (a delay, a sleep, a retry's back-off, a
--                      wait's time-out, a parked wait's far future);
--   everystep_blocked  due, but its workflow's concurrency limit has no free
--                      slot, or its key no room;
--   everystep_ready    may run now: the claim reads this table only, in
--                      (priority DESC, ready_at, run_id) order;
--
-- and a `running` one is held: everystep_claimed, by whom (the dead-claimer
-- sweep, a worker's catch-up, the autoscaler's count read it).
--
-- Admission happens at the event that makes a run runnable, in that event's
-- transaction, and nowhere else: the trigger everystep_queue calls
-- everystep_admit when a run becomes (or stays, with a new due time)
-- scheduled or waiting; everystep_release when a run holding a slot or a
-- key's room stops running, which admits the next blocked run
-- (everystep_pump); everystep_promote when a timer's time has come (each
-- claim, first). A slot is held from admission to the end of the running:
-- everystep_slot.run_id is its holder, NULL when free; a key's room is
-- everystep_key.held, its runs admitted or running.
--
-- Locks: a run's queue rows are changed only by a transaction holding its
-- run row's lock. The statements that change run rows (an end, a cancel, a
-- wake) hold it and reach the queue rows through the trigger; those that
-- start from the queue rows (the claim, the promotion, the pump) take the
-- run row FOR UPDATE SKIP LOCKED, so neither waits for the other in a
-- cycle.
--
-- Nothing about the queue is indexed on the run row any more, so that the
-- claim's and the end's updates of status, claimed_by, claim_token and slot
-- are HOT: the lanes' partial indexes go, and so do the status and running
-- indexes (the sweep reads everystep_claimed; the history move and the
-- count of runs blocked on an unsafe step read the hot table's rows, its
-- runs in flight and those of the last minute).

CREATE TABLE everystep_ready (
    run_id   uuid PRIMARY KEY,
    name     varchar(300) NOT NULL,
    priority smallint NOT NULL,
    ready_at timestamptz NOT NULL,                      -- its place in line: when it became due
    slot     integer                                    -- the slot it holds (0: a key's room only); NULL: none
);
CREATE INDEX everystep_ready_order ON everystep_ready (priority DESC, ready_at, run_id);

CREATE TABLE everystep_claimed (
    run_id     uuid PRIMARY KEY,
    name       varchar(300) NOT NULL,
    claimed_by varchar(255)
);
CREATE INDEX everystep_claimed_by ON everystep_claimed (claimed_by);

CREATE TABLE everystep_timer (
    run_id uuid PRIMARY KEY,
    due_at timestamptz NOT NULL
);
CREATE INDEX everystep_timer_due ON everystep_timer (due_at);

CREATE TABLE everystep_blocked (
    run_id   uuid PRIMARY KEY,
    name     varchar(300) NOT NULL,
    ckey     varchar(255),                              -- its concurrency key, when its workflow has a per-key limit
    priority smallint NOT NULL,
    due_at   timestamptz NOT NULL
);
CREATE INDEX everystep_blocked_order ON everystep_blocked (name, ckey, priority DESC, due_at, run_id);
CREATE INDEX everystep_blocked_by_name ON everystep_blocked (name, priority DESC, due_at, run_id);

-- The runs due and not held, by workflow, with the moment each became due
-- (a timer past its time counts before a claim admits it): what the
-- backlog gauges, the minute samples and the unserved check count.
CREATE VIEW everystep_pending AS
SELECT r.name, r.ready_at AS since FROM everystep_ready r
UNION ALL
SELECT b.name, b.due_at FROM everystep_blocked b
UNION ALL
SELECT w.name, t.due_at FROM everystep_timer t JOIN everystep_workflow w ON w.id = t.run_id
WHERE t.due_at <= everystep_now();

-- A key's room taken: its runs admitted (ready) or running.
ALTER TABLE everystep_key ADD COLUMN held integer NOT NULL DEFAULT 0;

-- Room for a run of workflow `wf` with key `ckey` (NULL: none): -1 when it
-- needs none (no limit applies), the slot it took (0: only its key's room),
-- or NULL when there is none (nothing taken).
CREATE FUNCTION everystep_take_room(run uuid, wf varchar, ckey varchar) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    per_key integer := CASE WHEN ckey IS NOT NULL
                            THEN (SELECT kl.per_key FROM everystep_key_limit kl WHERE kl.name = wf) END;
    limited boolean := EXISTS (SELECT FROM everystep_limit l WHERE l.name = wf);
    got integer;
BEGIN
    IF per_key IS NULL AND NOT limited THEN
        RETURN -1;
    END IF;
    IF per_key IS NOT NULL THEN
        INSERT INTO everystep_key AS k (name, key, held, claimed_at) VALUES (wf, ckey, 1, everystep_now())
        ON CONFLICT (name, key) DO UPDATE SET held = k.held + 1, claimed_at = everystep_now()
        WHERE k.held < per_key
        RETURNING 0 INTO got;
        IF got IS NULL THEN
            RETURN NULL;
        END IF;
    END IF;
    IF limited THEN
        got := NULL;
        UPDATE everystep_slot s SET run_id = run, token = NULL
        WHERE (s.name, s.slot) = (SELECT f.name, f.slot FROM everystep_slot f
                                  WHERE f.name = wf AND f.run_id IS NULL
                                  ORDER BY f.slot LIMIT 1 FOR UPDATE SKIP LOCKED)
        RETURNING s.slot INTO got;
        IF got IS NULL AND per_key IS NOT NULL THEN  -- no slot: the key's room goes back
            UPDATE everystep_key k SET held = k.held - 1 WHERE k.name = wf AND k.key = ckey;
        END IF;
        RETURN got;
    END IF;
    RETURN 0;
END $$;

-- Where a scheduled or waiting run waits (its run row locked by the caller):
-- a timer until it is due; then ready, with the room it needs, or blocked.
-- Its place in line: since its due time; a scheduled one since it was
-- created (or its due time, if earlier). True when it is ready.
CREATE FUNCTION everystep_admit(run everystep_workflow) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    due timestamptz := CASE WHEN run.status = 'scheduled' THEN least(run.due_at, run.created_at) ELSE run.due_at END;
    got integer;
BEGIN
    IF run.due_at > everystep_now() THEN
        INSERT INTO everystep_timer (run_id, due_at) VALUES (run.id, run.due_at);
        RETURN false;
    END IF;
    got := everystep_take_room(run.id, run.name, run.concurrency_key);
    IF got IS NULL THEN
        INSERT INTO everystep_blocked (run_id, name, ckey, priority, due_at)
        VALUES (run.id, run.name,
                CASE WHEN EXISTS (SELECT FROM everystep_key_limit kl WHERE kl.name = run.name)
                     THEN run.concurrency_key END,
                run.priority, due);
        RETURN false;
    END IF;
    INSERT INTO everystep_ready (run_id, name, priority, ready_at, slot)
    VALUES (run.id, run.name, run.priority, due, nullif(got, -1));
    PERFORM everystep_wake();
    RETURN true;
END $$;

-- Admit blocked runs of workflow `wf` while it has room: first those of the
-- key `freed` (the one whose room a run gave back; NULL: none), then, a key
-- at a time least recently served first (the fair queues' round robin), or
-- by priority and time for a workflow without a per-key limit. Returns how
-- many it admitted. Blocked runs whose run row someone else holds (being
-- cancelled, say) are left for the next pump.
CREATE FUNCTION everystep_pump(wf varchar, freed varchar) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    keyed boolean := EXISTS (SELECT FROM everystep_key_limit kl WHERE kl.name = wf);
    limited boolean := EXISTS (SELECT FROM everystep_limit l WHERE l.name = wf);
    admitted integer := 0;
    b record;
    got integer;
BEGIN
    LOOP
        b := NULL;
        IF freed IS NOT NULL AND keyed THEN
            SELECT x.run_id, x.ckey, x.priority, x.due_at INTO b
            FROM everystep_blocked x JOIN everystep_workflow w ON w.id = x.run_id
            WHERE x.name = wf AND x.ckey = freed
            ORDER BY x.priority DESC, x.due_at, x.run_id
            LIMIT 1 FOR UPDATE SKIP LOCKED;
            IF b.run_id IS NULL THEN
                -- That key has none waiting. Without a workflow limit no
                -- other key's room changed: done; else on to the others.
                EXIT WHEN NOT limited;
                freed := NULL;
                CONTINUE;
            END IF;
        ELSIF keyed THEN
            SELECT x.run_id, x.ckey, x.priority, x.due_at INTO b
            FROM everystep_key k
            CROSS JOIN LATERAL (SELECT x.run_id, x.ckey, x.priority, x.due_at
                                FROM everystep_blocked x JOIN everystep_workflow w ON w.id = x.run_id
                                WHERE x.name = k.name AND x.ckey = k.key
                                ORDER BY x.priority DESC, x.due_at, x.run_id
                                LIMIT 1 FOR UPDATE SKIP LOCKED) x
            WHERE k.name = wf AND k.held < (SELECT kl.per_key FROM everystep_key_limit kl WHERE kl.name = wf)
            ORDER BY k.claimed_at NULLS FIRST, k.key
            LIMIT 1;
            IF b.run_id IS NULL THEN  -- no key with room has a run waiting: runs with no key, if any
                SELECT x.run_id, x.ckey, x.priority, x.due_at INTO b
                FROM everystep_blocked x JOIN everystep_workflow w ON w.id = x.run_id
                WHERE x.name = wf AND x.ckey IS NULL
                ORDER BY x.priority DESC, x.due_at, x.run_id
                LIMIT 1 FOR UPDATE SKIP LOCKED;
            END IF;
        ELSE
            SELECT x.run_id, x.ckey, x.priority, x.due_at INTO b
            FROM everystep_blocked x JOIN everystep_workflow w ON w.id = x.run_id
            WHERE x.name = wf
            ORDER BY x.priority DESC, x.due_at, x.run_id
            LIMIT 1 FOR UPDATE SKIP LOCKED;
        END IF;
        EXIT WHEN b.run_id IS NULL;
        got := everystep_take_room(b.run_id, wf, b.ckey);
        IF got IS NULL THEN
            EXIT WHEN NOT keyed OR limited;  -- no slot left
            freed := NULL;
            CONTINUE;  -- (a race on the key's room) another key
        END IF;
        DELETE FROM everystep_blocked WHERE run_id = b.run_id;
        -- A limited workflow's run keeps its place in time; a key's next run
        -- goes to the back of the line (the keys take turns).
        INSERT INTO everystep_ready (run_id, name, priority, ready_at, slot)
        VALUES (b.run_id, wf, b.priority, CASE WHEN keyed THEN everystep_now() ELSE b.due_at END, nullif(got, -1));
        admitted := admitted + 1;
    END LOOP;
    IF admitted > 0 THEN  -- the claimers learn of them at once, waiting or not (a freed slot)
        PERFORM pg_notify('everystep:' || current_schema(), '');
    END IF;
    RETURN admitted;
END $$;

-- Run `run` (of `wf`, key `ckey`) gives back the slot (or the key's room)
-- it held, and the next blocked runs are admitted.
CREATE FUNCTION everystep_release(run uuid, wf varchar, ckey varchar, held_slot integer) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF held_slot > 0 THEN
        UPDATE everystep_slot SET run_id = NULL WHERE name = wf AND slot = held_slot AND run_id = run;
    END IF;
    IF ckey IS NOT NULL THEN
        UPDATE everystep_key k SET held = greatest(k.held - 1, 0) WHERE k.name = wf AND k.key = ckey;
    END IF;
    PERFORM everystep_pump(wf, ckey);
END $$;

-- Run `run` leaves the queue (it is cancelled, or due at another time): its
-- queue row goes, with the room a ready one held.
CREATE FUNCTION everystep_unqueue(run uuid) RETURNS void LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r record;
BEGIN
    DELETE FROM everystep_ready x WHERE x.run_id = run RETURNING x.name, x.slot INTO r;
    IF r.slot IS NOT NULL THEN
        PERFORM everystep_release(run, r.name,
                                  (SELECT w.concurrency_key FROM everystep_workflow w WHERE w.id = run), r.slot);
        RETURN;
    END IF;
    IF r.name IS NULL THEN
        DELETE FROM everystep_timer WHERE run_id = run;
        DELETE FROM everystep_blocked WHERE run_id = run;
    END IF;
END $$;

-- The runs whose time has come (up to `lim`, earliest first) are admitted.
CREATE FUNCTION everystep_promote(lim integer) RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    n integer;
BEGIN
    WITH due AS (
        SELECT t.run_id FROM everystep_timer t
        WHERE t.due_at <= everystep_now()
        ORDER BY t.due_at
        LIMIT lim
        FOR UPDATE SKIP LOCKED
    ), runs AS (
        SELECT w FROM everystep_workflow w
        WHERE w.id IN (SELECT run_id FROM due)
        ORDER BY w.due_at, w.id
        FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM everystep_timer t USING runs WHERE t.run_id = (runs.w).id
    )
    SELECT count(everystep_admit(runs.w)) INTO n FROM runs;
    RETURN n;
END $$;

-- The claim: up to `lim` ready runs for `runner`, of the workflows matching
-- `routes` (LIKE patterns; NULL: all) but not `skipped`, highest priority
-- first, then in the order they became ready. Due timers are admitted first.
CREATE FUNCTION everystep_claim(runner varchar, lim integer, routes text[], skipped text[])
RETURNS TABLE (id uuid, name varchar, args jsonb, steps json, claim_token bigint, cancelling boolean,
               now float8, slot integer, parent_id uuid)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    IF lim <= 0 THEN
        RETURN;
    END IF;
    -- Its own updates of the run rows are not the trigger's (it moved the
    -- queue rows itself): for the rest of this transaction.
    PERFORM set_config('everystep.claiming', 'on', true);
    PERFORM everystep_promote(500);
    RETURN QUERY
    WITH candidate AS (
        SELECT r.run_id, r.slot FROM everystep_ready r
        WHERE (routes IS NULL OR r.name LIKE ANY(routes)) AND r.name <> ALL(skipped)
        ORDER BY r.priority DESC, r.ready_at, r.run_id
        LIMIT lim
        FOR UPDATE SKIP LOCKED
    ), held AS (
        SELECT w.id FROM everystep_workflow w
        WHERE w.id IN (SELECT run_id FROM candidate) AND w.status IN ('scheduled', 'waiting')
        FOR UPDATE SKIP LOCKED
    ), taken AS (
        DELETE FROM everystep_ready r USING held WHERE r.run_id = held.id
        RETURNING r.run_id, r.name, r.slot
    ), holder AS (
        INSERT INTO everystep_claimed (run_id, name, claimed_by)
        SELECT t.run_id, t.name, runner FROM taken t
    )
    UPDATE everystep_workflow w
    SET status = 'running', claimed_by = runner, claim_token = nextval('everystep_claim_token'), slot = t.slot
    FROM taken t
    WHERE w.id = t.run_id
    RETURNING w.id, w.name, w.args,
        to_json(ARRAY(SELECT json_build_array(s.step_id, s.name, s.status, s.result, s.error, s.attempts)
                      FROM everystep_step s WHERE s.workflow_id = w.id)),
        w.claim_token, (w.cancel_requested_at IS NOT NULL OR w.deadline_at <= everystep_now()) IS TRUE,
        extract(epoch FROM everystep_now())::float8, w.slot, w.parent_id;
END $$;

-- Every workflow with blocked runs admits what its room allows: the
-- catch-up of a release and an admission that ran at once (each skipped
-- the other's uncommitted row), run by a claim that found nothing ready and
-- by the maintenance sweep. The workflows are read by a loose scan of the
-- blocked runs' index (one probe each).
CREATE FUNCTION everystep_unblock() RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    wf varchar;
    admitted integer := 0;
BEGIN
    FOR wf IN
        WITH RECURSIVE names(name) AS (
            (SELECT b.name FROM everystep_blocked b ORDER BY b.name LIMIT 1)
          UNION ALL
            SELECT (SELECT b.name FROM everystep_blocked b WHERE b.name > n.name ORDER BY b.name LIMIT 1)
            FROM names n WHERE n.name IS NOT NULL
        )
        SELECT name FROM names WHERE name IS NOT NULL
    LOOP
        admitted := admitted + everystep_pump(wf, NULL);
    END LOOP;
    RETURN admitted;
END $$;

-- The ready runs that hold no room but whose workflow has a limit now (set
-- after they were admitted) are admitted again: they take a slot or wait
-- for one. Run where the limits are written, and by the maintenance sweep.
CREATE FUNCTION everystep_readmit() RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r everystep_workflow;
    n integer := 0;
BEGIN
    FOR r IN
        SELECT w.*
        FROM everystep_ready x JOIN everystep_workflow w ON w.id = x.run_id
        WHERE x.slot IS NULL
          AND (EXISTS (SELECT FROM everystep_limit l WHERE l.name = x.name)
               OR (w.concurrency_key IS NOT NULL
                   AND EXISTS (SELECT FROM everystep_key_limit kl WHERE kl.name = x.name)))
        ORDER BY x.ready_at, x.run_id
        FOR UPDATE SKIP LOCKED
    LOOP
        DELETE FROM everystep_ready WHERE run_id = r.id;
        PERFORM everystep_admit(r);
        n := n + 1;
    END LOOP;
    RETURN n;
END $$;

-- The trigger: admission and release at the changes of a run's row. A run
-- made `running` other than by everystep_claim (by hand, or by a worker of
-- the previous version during a rolling upgrade) is held by its claimed_by.
CREATE FUNCTION everystep_queue() RETURNS trigger LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.status IN ('scheduled', 'waiting') THEN
        PERFORM everystep_unqueue(OLD.id);
    ELSIF TG_OP = 'UPDATE' AND OLD.status = 'running' AND NEW.status <> 'running' THEN
        DELETE FROM everystep_claimed WHERE run_id = OLD.id;
    END IF;
    IF NEW.status IN ('scheduled', 'waiting') THEN
        PERFORM everystep_admit(NEW);
    ELSIF NEW.status = 'running' AND (TG_OP = 'INSERT' OR OLD.status <> 'running') THEN
        INSERT INTO everystep_claimed (run_id, name, claimed_by) VALUES (NEW.id, NEW.name, NEW.claimed_by)
        ON CONFLICT (run_id) DO NOTHING;
    END IF;
    IF TG_OP = 'UPDATE' AND OLD.status = 'running' AND NEW.status <> 'running' AND OLD.slot IS NOT NULL THEN
        PERFORM everystep_release(OLD.id, OLD.name, OLD.concurrency_key, OLD.slot);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER everystep_queue_insert AFTER INSERT ON everystep_workflow
FOR EACH ROW WHEN (NEW.status IN ('scheduled', 'waiting', 'running'))
EXECUTE FUNCTION everystep_queue();

-- Not at everystep_claim's own updates (it moved the queue rows itself,
-- and says so in everystep.claiming), nor at a change the queue does not see.
CREATE TRIGGER everystep_queue_update AFTER UPDATE OF status, due_at, priority ON everystep_workflow
FOR EACH ROW WHEN (
    (OLD.status IN ('scheduled', 'waiting') AND NEW.status <> 'running'
     AND (NEW.status <> OLD.status OR NEW.due_at <> OLD.due_at OR NEW.priority <> OLD.priority))
    OR (OLD.status IN ('scheduled', 'waiting') AND NEW.status = 'running'
        AND current_setting('everystep.claiming', true) IS DISTINCT FROM 'on')
    OR (OLD.status = 'running' AND NEW.status <> 'running')
    OR (OLD.status NOT IN ('scheduled', 'waiting', 'running') AND NEW.status IN ('scheduled', 'waiting', 'running')))
EXECUTE FUNCTION everystep_queue();

-- The lanes and the status indexes leave the run row.
DROP INDEX everystep_workflow_status;
DROP INDEX everystep_workflow_running;
DROP INDEX everystep_workflow_due_by_name;
DROP INDEX everystep_workflow_ready_unlimited;
DROP INDEX everystep_workflow_ready_priority;
DROP INDEX everystep_workflow_due_prioritized;
DROP INDEX everystep_workflow_ready_limited;
DROP INDEX everystep_workflow_ready_limited_priority;
DROP INDEX everystep_workflow_ready_keyed;
DROP INDEX everystep_workflow_running_keyed;
-- Room on each page for the claim's and the end's new row versions (HOT).
ALTER TABLE everystep_workflow SET (fillfactor = 50);

-- The runs in flight: the holders, slots and keys of the running ones, then
-- every scheduled or waiting run admitted in its due order.
INSERT INTO everystep_claimed (run_id, name, claimed_by)
SELECT id, name, claimed_by FROM everystep_workflow WHERE status = 'running';
UPDATE everystep_slot SET run_id = NULL, token = NULL;
UPDATE everystep_slot s SET run_id = w.id
FROM everystep_workflow w
WHERE w.status = 'running' AND w.name = s.name AND w.slot = s.slot;
UPDATE everystep_key k SET held = (SELECT count(*) FROM everystep_workflow w
                                   WHERE w.status = 'running' AND w.name = k.name AND w.concurrency_key = k.key);
SELECT count(everystep_admit(waiting.w))
FROM (SELECT w FROM everystep_workflow w
      WHERE w.status IN ('scheduled', 'waiting')
      ORDER BY w.due_at, w.id) AS waiting;

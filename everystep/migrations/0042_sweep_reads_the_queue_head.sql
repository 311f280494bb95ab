-- The maintenance sweep read the whole queue twice at every sweep, and the
-- two reads grew with the backlog (at 50,000 ready runs, under load and at
-- a sweep every 0.5 s: 20 ms and 30 ms a sweep, a tenth of a core):
--
-- * The readmission (a ready run admitted before its workflow got a limit
--   takes a slot or waits for one), wherever some workflow has a limit,
--   read every ready run's record to test its key. It now finds the ready
--   rows of the limited workflows that hold no room by their name, on the
--   narrow ready table, and reads records only when there are some.
-- * The stray check (the queue rows a worker of a version before 0032 left
--   behind when it claimed a run itself) read every queued run's record.
--   It can now read only the head of the queue: the first `head` runs of
--   the ready order and the `head` earliest due timers, where the claims
--   meet a stray. The maintenance child reads the whole queue once a
--   minute and the head at the other sweeps: everystep_hold_strays(head),
--   NULL for the whole queue, which the function without an argument (the
--   previous version's sweep) now calls. The head's records are read by
--   key whatever the statistics say of the tables.
--
-- The same results otherwise; additive.

-- One stray: out of the queue, and held by its claimed_by if it runs.
CREATE FUNCTION everystep_hold_stray(run uuid, wf varchar, run_status varchar, claimer varchar) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM everystep_unqueue(run);
    IF run_status = 'running' THEN
        INSERT INTO everystep_claimed (run_id, name, claimed_by) VALUES (run, wf, claimer)
        ON CONFLICT (run_id) DO NOTHING;
    END IF;
    RETURN 1;
END $$;

CREATE FUNCTION everystep_hold_strays(head integer) RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r record;
    n integer := 0;
    head_runs uuid[];
    seqscan text := current_setting('enable_seqscan');
BEGIN
    IF head IS NULL THEN
        FOR r IN
            SELECT w.id, w.name, w.status, w.claimed_by FROM everystep_workflow w
            WHERE w.id IN (SELECT x.run_id FROM everystep_ready x
                           UNION ALL SELECT b.run_id FROM everystep_blocked b
                           UNION ALL SELECT t.run_id FROM everystep_timer t WHERE t.due_at <= everystep_now())
              AND w.status NOT IN ('scheduled', 'waiting')
            FOR UPDATE SKIP LOCKED
        LOOP
            n := n + everystep_hold_stray(r.id, r.name, r.status, r.claimed_by);
        END LOOP;
        RETURN n;
    END IF;
    -- The head in the queue's orders and its records by key, whatever the
    -- statistics say of the tables (a plan made while they were small would
    -- read them all).
    PERFORM set_config('enable_seqscan', 'off', true);
    head_runs := ARRAY((SELECT x.run_id FROM everystep_ready x ORDER BY x.priority DESC, x.ready_at, x.run_id
                        LIMIT head)
                       UNION ALL (SELECT t.run_id FROM everystep_timer t WHERE t.due_at <= everystep_now()
                                  ORDER BY t.due_at LIMIT head));
    FOR r IN
        SELECT w.id, w.name, w.status, w.claimed_by FROM everystep_workflow w
        WHERE w.id = ANY(head_runs) AND w.status NOT IN ('scheduled', 'waiting')
        FOR UPDATE SKIP LOCKED
    LOOP
        n := n + everystep_hold_stray(r.id, r.name, r.status, r.claimed_by);
    END LOOP;
    PERFORM set_config('enable_seqscan', seqscan, true);
    RETURN n;
END $$;

-- The whole queue (as the maintenance child of the version before calls it).
CREATE OR REPLACE FUNCTION everystep_hold_strays() RETURNS integer LANGUAGE sql VOLATILE AS $$
    SELECT everystep_hold_strays(NULL::integer);
$$;

-- The ready runs of the limited workflows that hold no room are found on
-- the narrow ready table by their name first (a join of every ready run
-- with its record, which the planner chose when it read the names in the
-- same statement, took 35 ms at 50,000 ready runs of other workflows), and
-- their records are read only when there are some.
CREATE OR REPLACE FUNCTION everystep_readmit() RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r everystep_workflow;
    n integer := 0;
    candidates uuid[];
BEGIN
    IF NOT EXISTS (SELECT FROM everystep_limit) AND NOT EXISTS (SELECT FROM everystep_key_limit) THEN
        RETURN 0;
    END IF;
    -- (A scan of the ready rows whatever the plan: the names are an array.)
    candidates := ARRAY(SELECT y.run_id FROM everystep_ready y
                        WHERE y.slot IS NULL
                          AND y.name = ANY(ARRAY(SELECT l.name FROM everystep_limit l
                                                 UNION ALL SELECT kl.name FROM everystep_key_limit kl)));
    IF cardinality(candidates) = 0 THEN
        RETURN 0;  -- (nearly always: no record is read)
    END IF;
    FOR r IN
        SELECT w.*
        FROM everystep_ready x JOIN everystep_workflow w ON w.id = x.run_id
        WHERE x.run_id = ANY(candidates) AND x.slot IS NULL
          AND (EXISTS (SELECT FROM everystep_limit l WHERE l.name = x.name) OR w.concurrency_key IS NOT NULL)
        ORDER BY x.ready_at, x.run_id
        FOR UPDATE SKIP LOCKED
    LOOP
        DELETE FROM everystep_ready WHERE run_id = r.id;
        PERFORM everystep_admit(r);
        n := n + 1;
    END LOOP;
    RETURN n;
END $$;

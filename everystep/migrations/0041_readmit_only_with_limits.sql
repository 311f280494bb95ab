-- The maintenance sweep's readmission reads every ready run and its record
-- (47 ms a sweep at 60,000 ready runs, every 5 s, growing with the
-- backlog), though only a workflow with a concurrency or per-key limit can
-- have ready runs to admit again: with no limit at all it now returns at
-- once. The same function otherwise; additive.
CREATE OR REPLACE FUNCTION everystep_readmit() RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r everystep_workflow;
    n integer := 0;
BEGIN
    IF NOT EXISTS (SELECT FROM everystep_limit) AND NOT EXISTS (SELECT FROM everystep_key_limit) THEN
        RETURN 0;
    END IF;
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

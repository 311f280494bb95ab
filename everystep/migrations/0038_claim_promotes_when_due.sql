-- The claim admits due timers only when there is one. Admitting them was a
-- statement of its own at every claim (everystep_promote: a locking walk of
-- the timers, then the runs, then a delete), 46 us of the server's time a
-- claim in `w1` where no run ever waits for its time; a probe of the
-- timers' index decides now. The same function otherwise; additive.
CREATE OR REPLACE FUNCTION everystep_claim(runner varchar, lim integer, routes text[], skipped text[])
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
    -- The timers whose time came are admitted first; a probe of the
    -- timers' index tells whether there is one (most claims: none). It
    -- locks what it finds, as the admission does: a queue table is never
    -- only read by the queue (a reader stops its rewrite, 0037).
    IF EXISTS (SELECT FROM everystep_timer t WHERE t.due_at <= everystep_now() FOR UPDATE SKIP LOCKED) THEN
        PERFORM everystep_promote(500);
    END IF;
    RETURN QUERY
    WITH candidate AS (
        SELECT r.ctid AS tid, r.run_id FROM everystep_ready r
        WHERE (routes IS NULL OR r.name LIKE ANY(routes)) AND r.name <> ALL(skipped)
        ORDER BY r.priority DESC, r.ready_at, r.run_id
        LIMIT lim
        FOR UPDATE SKIP LOCKED
    ), held AS (
        SELECT w.id FROM everystep_workflow w
        WHERE w.id IN (SELECT run_id FROM candidate) AND w.status IN ('scheduled', 'waiting')
        FOR UPDATE SKIP LOCKED
    ), taken AS (
        DELETE FROM everystep_ready r USING candidate c, held h WHERE r.ctid = c.tid AND h.id = c.run_id
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

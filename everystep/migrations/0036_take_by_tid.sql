-- The claim and the admission of due timers delete the queue rows they
-- took (a ready row; a due timer) by the physical address they locked them
-- at (ctid), a TID probe each. A claiming session plans once (generic,
-- sequential scans off: db/sql/session.sql), and a vacuum of a queue table
-- while it held a row or two (autovacuum, the maintenance sweep's) leaves
-- statistics that call it tiny: both sides of the deletes' joins then looked
-- like one row, and the plan walked the table's whole primary key with the
-- taken rows inside (held_back: 1,000 ready rows and 522 buffers read to
-- take 8, 4 to 14 ms a claim), so every claim read the whole backlog until
-- the next analyze. A TID probe costs less than any walk of an index under
-- any statistics. A row it locked is its own until the commit: its ctid
-- does not move. The same functions otherwise; additive.
CREATE OR REPLACE FUNCTION everystep_promote(lim integer) RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    n integer;
BEGIN
    WITH due AS (
        SELECT t.ctid AS tid, t.run_id FROM everystep_timer t
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
        DELETE FROM everystep_timer t USING due, runs WHERE t.ctid = due.tid AND due.run_id = (runs.w).id
    )
    SELECT count(everystep_admit(runs.w)) INTO n FROM runs;
    RETURN n;
END $$;

-- The claim: up to `lim` ready runs for `runner`, of the workflows matching
-- `routes` (LIKE patterns; NULL: all) but not `skipped`, highest priority
-- first, then in the order they became ready. Due timers are admitted first.
-- The queue rows it takes (ready, and due timers) are deleted by the
-- physical address it locked them at (ctid): a TID probe each, cheaper
-- than any walk of an index under any statistics (0036).
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
    PERFORM everystep_promote(500);
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

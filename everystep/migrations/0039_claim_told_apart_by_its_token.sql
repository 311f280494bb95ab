-- The claim no longer sets a transaction setting for the trigger to skip
-- its updates, and the trigger's one WHEN clause of four branches is two
-- short ones. Every statement that updates a run's status (the claim's and
-- the end's of every batch) prepared that clause anew, and the claim ran
-- set_config as a statement of its own: together ~8% of the server's time
-- a run in a cycle of batched ends and claims. A claim is told apart by
-- what only a claim does: it gives the run a new execution token as it
-- makes it running. The same function otherwise, the same firings but a
-- change between two ended statuses (a no-op of the function); additive.
CREATE OR REPLACE FUNCTION everystep_claim(runner varchar, lim integer, routes text[], skipped text[])
RETURNS TABLE (id uuid, name varchar, args jsonb, steps json, claim_token bigint, cancelling boolean,
               now float8, slot integer, parent_id uuid)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    IF lim <= 0 THEN
        RETURN;
    END IF;
    -- The timers whose time came are admitted first; a probe of the
    -- timers' index tells whether there is one (most claims: none). It
    -- locks what it finds, as the admission does: a queue table is never
    -- only read by the queue (a reader stops its rewrite, 0037).
    IF EXISTS (SELECT FROM everystep_timer t WHERE t.due_at <= everystep_now() FOR UPDATE SKIP LOCKED) THEN
        PERFORM everystep_promote(500);
    END IF;
    -- It moves the queue rows itself; the trigger knows its update of the
    -- run rows by the new execution tokens and leaves them alone.
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

DROP TRIGGER everystep_queue_update ON everystep_workflow;

-- A change of status, but not a claim's (everystep_claim moves the queue
-- rows itself, and only a claim gives a run a new execution token as it
-- makes it running): a run made running by hand is held by its claimed_by.
-- Each statement that updates these columns prepares the WHEN clauses
-- anew, so the claim's and the end's (status) is a short one.
CREATE TRIGGER everystep_queue_status AFTER UPDATE OF status ON everystep_workflow
FOR EACH ROW WHEN (NEW.status <> OLD.status
                   AND (NEW.status <> 'running' OR NEW.claim_token IS NOT DISTINCT FROM OLD.claim_token))
EXECUTE FUNCTION everystep_queue();

-- A waiting run's due time or priority changed, its status not (else the
-- trigger above fired).
CREATE TRIGGER everystep_queue_place AFTER UPDATE OF due_at, priority ON everystep_workflow
FOR EACH ROW WHEN (NEW.status = OLD.status AND NEW.status IN ('scheduled', 'waiting')
                   AND (NEW.due_at <> OLD.due_at OR NEW.priority <> OLD.priority))
EXECUTE FUNCTION everystep_queue();

-- A run made running by a worker of a version before 0032, with its own
-- claim, during a rolling upgrade: the status trigger cannot tell its new
-- execution token from everystep_claim's (0039) and leaves it alone. Its
-- queue row stays behind (at the head of the ready order, where the claims
-- of the new workers find it and skip it) and it has no everystep_claimed
-- row (which the dead-claimer recovery reads). The maintenance sweep holds
-- such runs as the trigger did before 0039: their queue rows go (a slot
-- held is released), and a running one is held by its claimed_by.
CREATE FUNCTION everystep_hold_strays() RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r record;
    n integer := 0;
BEGIN
    FOR r IN
        SELECT w.id, w.name, w.status, w.claimed_by FROM everystep_workflow w
        WHERE w.id IN (SELECT x.run_id FROM everystep_ready x
                       UNION ALL SELECT b.run_id FROM everystep_blocked b
                       UNION ALL SELECT t.run_id FROM everystep_timer t WHERE t.due_at <= everystep_now())
          AND w.status NOT IN ('scheduled', 'waiting')
        FOR UPDATE SKIP LOCKED
    LOOP
        PERFORM everystep_unqueue(r.id);
        IF r.status = 'running' THEN
            INSERT INTO everystep_claimed (run_id, name, claimed_by) VALUES (r.id, r.name, r.claimed_by)
            ON CONFLICT (run_id) DO NOTHING;
        END IF;
        n := n + 1;
    END LOOP;
    RETURN n;
END $$;

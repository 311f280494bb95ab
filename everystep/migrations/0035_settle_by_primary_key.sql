-- The end of a dependency finds the edges it meets by a probe of the
-- primary key per completed run. The delete of 0034 read them with
-- `depends_on = ANY(ARRAY(SELECT ...))`: a worker's writer plans its
-- statements once (plan_cache_mode force_generic_plan, bitmap scans off:
-- db/sql/session.sql says why), and for that form the generic plan, with
-- one dependency holding half the edges (a graph's root), scans the whole
-- table: 1 ms per end with 20,000 edges, where a probe takes 8 µs. A join
-- with the ended runs is planned as a nested loop over the primary key.
-- The same function otherwise; additive, nothing else changes.
CREATE OR REPLACE FUNCTION everystep_settle(ids uuid[], statuses text[]) RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    released integer := 0;
    touched uuid[];
    maybe_last uuid[];
BEGIN
    IF ids IS NULL OR cardinality(ids) = 0 THEN
        RETURN 0;
    END IF;
    WITH met AS (
        -- A join with the ended runs, not `= ANY(...)`: a probe of the primary
        -- key per completed run under any cached plan (see 0035).
        DELETE FROM everystep_dependency d
        USING unnest(ids, statuses) AS e(id, status)
        WHERE d.depends_on = e.id AND e.status = 'completed' AND NOT d.met
        RETURNING d.run_id
    )
    SELECT array_agg(DISTINCT run_id) INTO touched FROM met;
    IF touched IS NOT NULL THEN
        SELECT array_agg(t.id ORDER BY t.id) INTO maybe_last
        FROM unnest(touched) AS t(id)
        LEFT JOIN LATERAL (
            SELECT true AS open
            FROM everystep_dependency d
            WHERE d.run_id = t.id AND NOT d.met
            ORDER BY d.depends_on DESC
            LIMIT 1
            FOR SHARE SKIP LOCKED
        ) o ON true
        WHERE o.open IS NULL;
    END IF;
    IF maybe_last IS NOT NULL THEN
        -- `= ANY(maybe_last)` and `(status = 'waiting') IS TRUE`: a probe of the
        -- primary key per dependent, whatever plan is cached for the function.
        PERFORM 1 FROM everystep_workflow w
        WHERE w.id = ANY(maybe_last)
        ORDER BY w.id
        FOR UPDATE;
        WITH freed AS (
            UPDATE everystep_workflow w
            SET due_at = everystep_now(), waiting_on = NULL
            WHERE w.id = ANY(maybe_last) AND (w.status = 'waiting') IS TRUE
              AND w.waiting_on = 'dependencies' AND w.awaiting = 0
              AND NOT EXISTS (SELECT FROM everystep_dependency d WHERE d.run_id = w.id AND NOT d.met)
            RETURNING 1
        )
        SELECT count(*) INTO released FROM freed;
    END IF;
    IF EXISTS (SELECT FROM unnest(statuses) AS s WHERE s IN ('failed', 'stopped', 'cancelled')) THEN
        WITH RECURSIVE down(id, reason) AS (
            SELECT d.run_id, 'dependency ' || coalesce(m.key, e.id::text) || ' ' || e.status
            FROM unnest(ids, statuses) AS e(id, status)
            JOIN everystep_dependency d ON d.depends_on = e.id
            LEFT JOIN everystep_dag_member m ON m.run_id = e.id
            WHERE e.status IN ('failed', 'stopped', 'cancelled')
          UNION
            SELECT d.run_id, 'dependency ' || coalesce(m.key, down.id::text) || ' cancelled'
            FROM down
            JOIN everystep_dependency d ON d.depends_on = down.id
            LEFT JOIN everystep_dag_member m ON m.run_id = down.id
        ), hit AS (
            SELECT DISTINCT ON (id) id, reason FROM down ORDER BY id, reason
        ), locked AS (
            SELECT w.id FROM everystep_workflow w
            WHERE w.id = ANY(ARRAY(SELECT id FROM hit))
            ORDER BY w.id
            FOR UPDATE OF w
        )
        UPDATE everystep_workflow w
        SET status = 'cancelled', completed_at = everystep_now(), cancel_requested_at = everystep_now(),
            cancel_reason = hit.reason, waiting_on = NULL
        FROM hit
        WHERE w.id = ANY(ARRAY(SELECT id FROM locked)) AND w.id = hit.id
          AND (w.status = 'waiting') IS TRUE AND w.waiting_on = 'dependencies';
    END IF;
    IF released > 0 THEN
        PERFORM pg_notify('everystep:' || current_schema(), '');
    END IF;
    RETURN released;
END $$;

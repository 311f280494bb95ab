-- The end of a dependency marks its edges met instead of counting down a
-- number on each dependent's row. A fan-in of many runs had every end of
-- its dependencies update its one row and hold the lock to the commit, so
-- the ends of the two workers queued behind each other's WAL flush: a graph
-- drained at a third of the speed of the same runs without one. An edge is
-- a row of its own, so ends that meet different edges never wait for each
-- other; only an end that may be a dependent's last locks the dependent.
--
-- `awaiting` now counts only the seal of a graph not yet sealed (1, else
-- 0); what a run still waits for is its edges not met. Additive: a column
-- and an index; the edges of runs already completed are met, and the runs
-- waiting keep waiting for the same things. Where the roles of `everystep
-- roles` are used, apply them again: a worker now updates `met`.
ALTER TABLE everystep_dependency ADD COLUMN met boolean NOT NULL DEFAULT false;

UPDATE everystep_dependency d
SET met = true
FROM everystep_workflow_all w
WHERE w.id = d.depends_on AND w.status = 'completed';

UPDATE everystep_workflow w
SET awaiting = CASE WHEN EXISTS (SELECT FROM everystep_dag_member m JOIN everystep_dag g ON g.key = m.dag
                                 WHERE m.run_id = w.id AND g.sealed_at IS NULL AND g.cancelled_at IS NULL)
                    THEN 1 ELSE 0 END
WHERE w.awaiting IS NOT NULL;

-- The edges a dependent still waits for: what the end of a dependency
-- looks at, one dependent at a time, however many edges the dependent has
-- (newest dependency first: the one that ends last, as runs are claimed
-- oldest first, so the edge an end locks is seldom one about to be met, and
-- the entries of edges met, at the index's other end, are not walked over).
CREATE INDEX everystep_dependency_open ON everystep_dependency (run_id, depends_on) WHERE NOT met;

-- The end of runs with dependents (ids, with the statuses they ended with):
-- the edges out of a completed one are met, and a dependent whose edges are
-- all met (and whose graph is sealed) is due at once: its release. The
-- dependents of a failed, stopped or cancelled one are cancelled, and
-- theirs, transitively, each with the reason 'dependency <key> <status>'
-- (<key>: the member key of its dependency, else that run's id). A blocked
-- one holds its dependents. Returns how many runs it released.
--
-- Exactly one end releases a dependent, however its dependencies' ends
-- interleave. After marking its edges, an end looks for an edge of the
-- dependent not met and not being met by another transaction in flight
-- (SKIP LOCKED), and locks the one it finds FOR SHARE: that edge's own end
-- then waits for this commit, and sees it. Finding none, the end may be the
-- last: it locks the dependent's row (in id order) and counts the edges not
-- met in a snapshot taken after the lock. Two such ends in flight at once
-- queue on that lock, and the second counts after the first committed.
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
        UPDATE everystep_dependency d
        SET met = true
        WHERE d.depends_on = ANY(ARRAY(SELECT e.id FROM unnest(ids, statuses) AS e(id, status)
                                       WHERE e.status = 'completed'))
          AND NOT d.met
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

-- What the supervisor's metrics and health checks read, and what a worker
-- says about itself for them. Read by everystep/db/observe.py.
--
-- A runner is live when its advisory lock is held in this database. The
-- lock's 64-bit key is hashtextextended('everystep:' || current_schema() ||
-- ':' || name, 0) (session.sql, try_lock); pg_locks shows a 64-bit advisory
-- key as classid (high 32 bits), objid (low 32 bits) and objsubid 1.


-- name: statement_timeout
-- Bound every statement of this session (the observer's connection).
SELECT set_config('statement_timeout', %(milliseconds)s, false);

-- name: queue_stats
-- Counts of the unfinished statuses, and the age of the oldest pending run
-- by the engine's clock: a waiting run is pending from its due time on, a
-- scheduled one since it was created (or requeued).
SELECT count(*) FILTER (WHERE status IN ('scheduled', 'waiting') AND due_at <= everystep_now()),
       count(*) FILTER (WHERE status = 'running'),
       count(*) FILTER (WHERE status = 'blocked'),
       coalesce(extract(epoch FROM everystep_now() - min(CASE WHEN status = 'waiting' THEN due_at ELSE created_at END)
                                           FILTER (WHERE status IN ('scheduled', 'waiting') AND due_at <= everystep_now())),
                0),
       count(*) FILTER (WHERE status = 'waiting' AND due_at > everystep_now())
FROM everystep_workflow
WHERE status IN ('scheduled', 'waiting', 'running', 'blocked');

-- name: runners_without_lock
-- The runner names, among `runners`, whose lock nobody holds, in their order.
SELECT expected.name
FROM unnest(%(runners)s::text[]) WITH ORDINALITY AS expected(name, position)
WHERE NOT EXISTS (
    SELECT 1
    FROM pg_locks l
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.classid = ((hashtextextended('everystep:' || current_schema() || ':' || expected.name, 0) >> 32)
                       & 4294967295)::oid
      AND l.objid = (hashtextextended('everystep:' || current_schema() || ':' || expected.name, 0)
                     & 4294967295)::oid
)
ORDER BY expected.position;

-- name: publish_route
-- Which workflows this runner claims (LIKE patterns; NULL: all).
INSERT INTO everystep_route (runner, patterns)
VALUES (%(runner)s, %(patterns)s)
ON CONFLICT (runner) DO UPDATE
SET patterns = EXCLUDED.patterns, updated_at = everystep_now();

-- name: unserved_runs
-- Claimable runs, by workflow name, that no live runner claims: none of
-- their routes matches.
WITH live AS MATERIALIZED (
    SELECT r.patterns
    FROM everystep_route r
    WHERE EXISTS (
        SELECT 1
        FROM pg_locks l
        WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND l.classid = ((hashtextextended('everystep:' || current_schema() || ':' || r.runner, 0) >> 32)
                           & 4294967295)::oid
          AND l.objid = (hashtextextended('everystep:' || current_schema() || ':' || r.runner, 0)
                         & 4294967295)::oid
    )
)
SELECT w.name, count(*)
FROM everystep_workflow w
WHERE status IN ('scheduled', 'waiting') AND due_at <= everystep_now()
  AND NOT EXISTS (SELECT 1 FROM live WHERE live.patterns IS NULL OR w.name LIKE ANY(live.patterns))
GROUP BY w.name
ORDER BY w.name;

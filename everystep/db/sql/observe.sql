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
-- Counts of the unfinished runs: due (everystep_pending: ready, blocked for
-- room, or past their timer), running (held), blocked on an unsafe step (the
-- only count that reads the run table), the age of the oldest pending run by
-- the engine's clock (pending since it became due: a scheduled run since it
-- was created or requeued), and the runs due later.
SELECT (SELECT count(*) FROM everystep_pending),
       (SELECT count(*) FROM everystep_claimed),
       (SELECT count(*) FROM everystep_workflow WHERE status = 'blocked'),
       coalesce((SELECT extract(epoch FROM everystep_now() - min(since)) FROM everystep_pending), 0),
       (SELECT count(*) FROM everystep_timer WHERE due_at > everystep_now());

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
-- Which workflows this runner claims (LIKE patterns; NULL: all), and which
-- it found it cannot import (not claimed).
INSERT INTO everystep_route (runner, patterns, unknown)
VALUES (%(runner)s, %(patterns)s, %(unknown)s)
ON CONFLICT (runner) DO UPDATE
SET patterns = EXCLUDED.patterns, unknown = EXCLUDED.unknown, updated_at = everystep_now();

-- name: publish_route_before_0019
-- The same, in a schema the migration 0019 has not reached yet.
INSERT INTO everystep_route (runner, patterns)
VALUES (%(runner)s, %(patterns)s)
ON CONFLICT (runner) DO UPDATE
SET patterns = EXCLUDED.patterns, updated_at = everystep_now();

-- name: unknown_workflows
-- The workflows each of these runners found it cannot import.
SELECT runner, unknown
FROM everystep_route
WHERE runner = ANY(%(runners)s) AND cardinality(unknown) > 0
ORDER BY runner;

-- name: unserved_runs
-- Claimable runs, by workflow name, that no live runner claims: none of
-- their routes matches, or the runners they match cannot import them.
WITH live AS MATERIALIZED (
    SELECT r.patterns, r.unknown
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
FROM everystep_pending w
WHERE NOT EXISTS (SELECT 1 FROM live WHERE (live.patterns IS NULL OR w.name LIKE ANY(live.patterns))
                                     AND w.name <> ALL(live.unknown))
GROUP BY w.name
ORDER BY w.name;


-- name: server
-- Which PostgreSQL server this session talks to: the cluster's system
-- identifier (a physical standby shares its primary's), the postmaster's
-- start (differs between servers, and across restarts), and the WAL
-- timeline of a primary (a promotion starts a new one; NULL in recovery).
SELECT s.system_identifier, pg_postmaster_start_time(),
       CASE WHEN pg_is_in_recovery() THEN NULL
            ELSE ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::int END
FROM pg_control_system() s;


-- name: fleet_load
-- The load of a fleet, for an autoscaler (KEDA's postgresql trigger runs this
-- text with its two parameters written in): the fleet's runs held
-- (everystep_claimed) and ready to run now (everystep_ready), counted up to
-- `bound` in all (maxReplicaCount x the run slots of a pod: a larger count
-- adds no pod). Bounded whatever the size of the tables: both hold only the
-- runs in flight, and the scans stop at the bound. `patterns`: the fleet's
-- workers.workflows as LIKE patterns (`routes_of`); ARRAY['%'] for all.
SELECT count(*) FROM (
    (SELECT FROM everystep_claimed c WHERE c.name LIKE ANY (%(patterns)s::text[]) LIMIT %(bound)s)
  UNION ALL
    (SELECT FROM everystep_ready r WHERE r.name LIKE ANY (%(patterns)s::text[]) LIMIT %(bound)s)
  LIMIT %(bound)s
) fleet_load;


-- name: table_health
-- What vacuum has left in the hot tables (0017_history.sql: they hold the
-- runs in flight, and every finished run's dead tuples until vacuum): per
-- table, the statistics collector's live and dead tuples and the Unix
-- time of the last autovacuum and of the last vacuum of any kind (NULL:
-- never since the statistics were reset).
SELECT relname::text, n_live_tup, n_dead_tup, extract(epoch FROM last_autovacuum)::float8,
       extract(epoch FROM greatest(last_vacuum, last_autovacuum))::float8
FROM pg_stat_user_tables
WHERE schemaname = current_schema()
  AND relname IN ('everystep_workflow', 'everystep_step', 'everystep_message', 'everystep_event')
ORDER BY relname;

-- name: vacuum_horizon
-- What holds back vacuum in this database: the age in seconds of the
-- oldest transaction or snapshot of another session (a backend_xmin: an
-- idle-in-transaction session, a long analytics query) or prepared
-- transaction, the oldest xmin's age in transaction ids (replication
-- slots included), and the longest idle-in-transaction session in
-- seconds. Wall-clock ages (statement_timestamp()), not the engine's
-- clock: pg_stat_activity's times are the server's.
SELECT coalesce(greatest(
           (SELECT max(extract(epoch FROM statement_timestamp() - coalesce(a.xact_start, a.query_start)))
            FROM pg_stat_activity a
            WHERE a.datname = current_database() AND a.backend_xmin IS NOT NULL AND a.pid <> pg_backend_pid()),
           (SELECT max(extract(epoch FROM statement_timestamp() - p.prepared))
            FROM pg_prepared_xacts p
            WHERE p.database = current_database())), 0)::float8,
       coalesce(greatest(
           (SELECT max(age(a.backend_xmin))
            FROM pg_stat_activity a
            WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()),
           (SELECT max(age(p.transaction)) FROM pg_prepared_xacts p WHERE p.database = current_database()),
           (SELECT max(greatest(age(s.xmin), age(s.catalog_xmin))) FROM pg_replication_slots s)), 0)::bigint,
       coalesce((SELECT max(extract(epoch FROM statement_timestamp() - a.state_change))
                 FROM pg_stat_activity a
                 WHERE a.datname = current_database()
                   AND a.state IN ('idle in transaction', 'idle in transaction (aborted)')
                   AND a.pid <> pg_backend_pid()), 0)::float8;

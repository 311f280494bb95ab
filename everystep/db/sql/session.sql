-- Session settings, liveness locks and LISTEN's channel. Read by
-- everystep/db/session.py.


-- name: synchronous_commit
-- This session's commits wait for their WAL flush when the server, the
-- role, the database or the URL turned that off; stronger settings
-- (remote_apply, ...) are kept.
SELECT set_config('synchronous_commit', 'on', false)
WHERE current_setting('synchronous_commit') = 'off';

-- name: durable_transaction
-- The same for one transaction only, as its first statement (a connection
-- through a transaction-mode pooler keeps no session setting).
SELECT set_config('synchronous_commit', 'on', true)
WHERE current_setting('synchronous_commit') = 'off';

-- name: claiming_settings
-- The planner settings of the sessions that claim runs: a worker's control
-- session, and its writer's (everystep/writer.py), which claims successors.
-- Their claim statements (claim, end_runs) take PostgreSQL 2-3 ms to plan,
-- several times what they take to run, and under plan_cache_mode `auto` it
-- plans them afresh at every execution: they are planned once (generic).
-- A generic plan is made with the statistics of the moment, which may say
-- that a few runs are claimable when thousands are: then fetching them all
-- through a bitmap and sorting them looks cheaper than walking the ready
-- index in order to the first unlocked one, and every claim pays for it.
-- Without bitmap scans the index walk is the plan. (Turning sorts off
-- instead makes the small sorts of the claims' window functions look dear,
-- with worse plans.) And the plan may be made while the run table is empty
-- or was never analyzed (a new deployment; a server without autovacuum
-- never corrects it): reading the whole table then looks cheaper than
-- probing its key, and every end of a run pays a read of the whole hot
-- table as it grows (4 ms of a 5.6 ms end at 23,000 rows). Every statement
-- of these sessions finds its rows by a key: sequential scans are off.
-- Reset by reset_plan_cache_mode, reset_enable_bitmapscan and
-- reset_enable_seqscan.
SELECT set_config('plan_cache_mode', 'force_generic_plan', false),
       set_config('enable_bitmapscan', 'off', false),
       set_config('enable_seqscan', 'off', false);

-- name: reset_plan_cache_mode
RESET plan_cache_mode;

-- name: reset_enable_bitmapscan
RESET enable_bitmapscan;

-- name: reset_enable_seqscan
RESET enable_seqscan;

-- name: control_keepalives
-- Server-side TCP keepalives of a worker's control session: the server
-- drops the session of a vanished host, and so frees its lock, in seconds
-- (no effect over a Unix socket).
SELECT set_config('tcp_keepalives_idle', %(idle)s, false),
       set_config('tcp_keepalives_interval', %(interval)s, false),
       set_config('tcp_keepalives_count', %(count)s, false),
       set_config('tcp_user_timeout', %(user_timeout)s, false);

-- name: current_schema
SELECT current_schema();

-- name: ping
SELECT 1;


-- name: try_lock
-- A runner's session-level advisory lock, if it is free: its key is scoped
-- to the schema, so two deployments sharing a database (or two test
-- schemas) never collide. Held, it says the runner lives.
SELECT pg_try_advisory_lock(hashtextextended('everystep:' || current_schema() || ':' || %(runner)s, 0));

-- name: unlock
SELECT pg_advisory_unlock(hashtextextended('everystep:' || current_schema() || ':' || %(runner)s, 0));

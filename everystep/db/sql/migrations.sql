-- The migration applier's own statements (everystep/db/migrations.py). The
-- migrations themselves are the numbered files of everystep/migrations/.


-- name: migration_lock
-- Concurrent migrators of one schema queue up (until the transaction ends).
SELECT pg_advisory_xact_lock(hashtextextended('everystep:migrate:' || current_schema(), 0));

-- name: create_migration_ledger
CREATE TABLE IF NOT EXISTS everystep_migration (
    name       text PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: migration_ledger_exists
-- Whether the schema has the applier's ledger, before it is read.
SELECT to_regclass('everystep_migration') IS NOT NULL;

-- name: migration_ledger_readable
-- Whether the ledger exists and this role may read it (a worker role
-- granted before 0019 may not: its check of the schema's version is skipped).
SELECT CASE WHEN to_regclass('everystep_migration') IS NULL THEN false
            ELSE has_table_privilege(to_regclass('everystep_migration'), 'SELECT') END;

-- name: applied_migrations
SELECT name
FROM everystep_migration;

-- name: record_migration
INSERT INTO everystep_migration (name)
VALUES (%(name)s);

-- Which environment a database is (staging, production, ...), recorded by
-- `everystep migrate --environment NAME`: the CLI refuses to act on a
-- database whose recorded environment is not the one its context expects,
-- and the UI shows it in its header. At most one row. Additive: nothing
-- existing changes.
CREATE TABLE everystep_environment (
    one         boolean PRIMARY KEY DEFAULT true CHECK (one),  -- the single row
    name        varchar(64) NOT NULL,                           -- staging, production, ...
    recorded_at timestamptz NOT NULL DEFAULT everystep_now(),
    recorded_by varchar(255) NOT NULL                           -- the Unix user@host that recorded it
);

-- The audit page's filter by person: the newest records of one actor.
CREATE INDEX everystep_audit_actor ON everystep_audit (actor, id);

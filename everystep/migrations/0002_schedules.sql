-- Recurring schedules: the definitions applied from the manifest (the
-- `schedules:` section of everystep.yaml), and the state the scheduler
-- advances as it fires them. Rows are retired, never deleted.

CREATE TABLE everystep_schedule (
    key                  varchar(200) PRIMARY KEY,
    -- the definition, as `everystep schedules apply` wrote it
    workflow             varchar(300) NOT NULL,         -- module.qualname
    args                 jsonb NOT NULL,
    cron                 text NOT NULL,
    timezone             text NOT NULL,                 -- IANA name the cron is read in
    catchup              varchar(16) NOT NULL CHECK (catchup IN ('skip', 'fire_once', 'fire_all')),
    max_catchup          integer NOT NULL CHECK (max_catchup >= 1),
    overlap              varchar(16) NOT NULL CHECK (overlap IN ('allow', 'forbid')),
    max_lateness_seconds double precision NOT NULL CHECK (max_lateness_seconds > 0),
    paused               boolean NOT NULL,
    version              integer NOT NULL DEFAULT 1,    -- +1 on every applied change
    -- the state, advanced by the scheduler in the transaction that fires
    next_fire_at         timestamptz NOT NULL,          -- the earliest fire time not yet decided
    last_fire_at         timestamptz,                   -- the fire time of the latest run it made
    last_run_id          uuid REFERENCES everystep_workflow (id) ON DELETE SET NULL,
    last_error           text,                          -- why a due time did not fire; cleared when it does
    created_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now(),
    retired_at           timestamptz                    -- retired schedules never fire
);

-- The scheduler's question every few seconds: which live schedules are due.
CREATE INDEX everystep_schedule_due ON everystep_schedule (next_fire_at) WHERE retired_at IS NULL AND NOT paused;

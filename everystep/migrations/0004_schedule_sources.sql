-- Schedules owned by sources, auto-pause, and the runs each schedule made.
-- Additive: rows applied before this migration belong to the source
-- `deployment` (the manifest's default), and keep firing as they were.

ALTER TABLE everystep_schedule
    -- who owns the key: the manifest's `source:` (default deployment), or the
    -- application API (default api); only its owner changes or retires it
    ADD COLUMN source varchar(100) NOT NULL DEFAULT 'deployment',
    -- pause after this many failed runs in a row; NULL: never
    ADD COLUMN auto_pause_after integer CHECK (auto_pause_after >= 1),
    -- why the schedule paused itself; cleared by the next write of its definition
    ADD COLUMN paused_reason text;

-- The runs a schedule made, by fire time: what auto-pause counts. A pruned
-- run takes its row with it.
CREATE TABLE everystep_schedule_run (
    schedule_key varchar(200) NOT NULL,
    fire_at      timestamptz NOT NULL,
    run_id       uuid NOT NULL REFERENCES everystep_workflow (id) ON DELETE CASCADE,
    fired_at     timestamptz NOT NULL DEFAULT now(),   -- database time of the firing
    PRIMARY KEY (schedule_key, fire_at)
);

-- Pruning a run finds its row here.
CREATE INDEX everystep_schedule_run_run ON everystep_schedule_run (run_id);

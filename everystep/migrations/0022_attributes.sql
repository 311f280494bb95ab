-- Searchable run attributes: schedule(..., attributes={...}) and
-- everystep.set_attributes write a flat JSON object of scalars on the run;
-- everystep.find_runs, `everystep runs list --where K=V`, the bulk actions
-- and the UI find runs by them (`attributes @> '{"k": "v"}'`).
--
-- NULL when a run has none: the index is partial, so a run without
-- attributes adds no index entry at its insert, its claim or its end, and
-- the claim and end statements do not change. jsonb_path_ops: the smallest
-- GIN operator class, one hashed entry per key and value, for @> only.
--
-- Additive and in place: two nullable columns (no table rewrite), the view
-- across both parts recreated with the new column at its end, and two
-- indexes built over rows that are all NULL (each partition is still read
-- once while its index is built).
ALTER TABLE everystep_workflow ADD COLUMN attributes jsonb;
ALTER TABLE everystep_workflow_history ADD COLUMN attributes jsonb;

CREATE OR REPLACE VIEW everystep_workflow_all AS
SELECT * FROM everystep_workflow
UNION ALL
SELECT * FROM everystep_workflow_history;

CREATE INDEX everystep_workflow_attributes ON everystep_workflow USING gin (attributes jsonb_path_ops)
    WHERE attributes IS NOT NULL;
CREATE INDEX everystep_workflow_history_attributes ON everystep_workflow_history
    USING gin (attributes jsonb_path_ops) WHERE attributes IS NOT NULL;

-- The bulk actions on the runs a filter finds (everystep.operations.bulk,
-- `everystep runs cancel|requeue|rerun|resolve-step --where ...`): their
-- progress, advanced in the transaction of each chunk's actions, so an
-- action interrupted halfway is resumed where it stopped by the same
-- command, and no run is acted on twice.
CREATE TABLE everystep_bulk (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key         text NOT NULL,                           -- the action, its arguments and its filter, as JSON
    action      varchar(32) NOT NULL,                    -- cancel requeue rerun resolve-step
    filter      jsonb NOT NULL,
    actor       varchar(255) NOT NULL,                   -- who started it
    source      varchar(16) NOT NULL,                    -- cli, ui, api
    total       bigint NOT NULL,                         -- the runs the filter found at the start
    upto        uuid,                                    -- the newest of them: runs made later are left alone
    cursor      uuid,                                    -- the oldest run acted on so far (runs go newest first)
    done        bigint NOT NULL DEFAULT 0,
    refused     bigint NOT NULL DEFAULT 0,
    started_at  timestamptz NOT NULL DEFAULT everystep_now(),
    finished_at timestamptz
);
-- One unfinished action per key: what a repeated command resumes.
CREATE UNIQUE INDEX everystep_bulk_open ON everystep_bulk (key) WHERE finished_at IS NULL;

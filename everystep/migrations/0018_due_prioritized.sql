-- The priority lane's runs by due time alone: whether a run of another
-- priority than 0 is due now is one probe of its first entry. The plain
-- claim and end (claim_unlimited, end_plain_runs) read only the priority-0
-- runs and give way to the whole statements while one is; a prioritized run
-- delayed or sleeping for later keeps no one on the whole claim meanwhile.
-- Its predicate says "another priority than 0" as abs(priority) > 0, and
-- so do those probes: PostgreSQL proves that from the same words only, so
-- the probes cannot take the priority lane's own index (a walk of every
-- prioritized run not due yet), and the whole statements' priority heads
-- (priority > 0, priority < 0) cannot take this one (it has not their
-- order), whatever the tables held when a connection planned them.
-- Additive: a partial index of the unlimited lane's prioritized runs.
CREATE INDEX everystep_workflow_due_prioritized ON everystep_workflow (due_at)
    WHERE status IN ('scheduled', 'waiting') AND NOT limited AND abs(priority) > 0;

-- Two lanes of claimable runs: the runs of workflows without a concurrency
-- limit, which a claim takes straight from the head of their own index, and
-- the runs of limited workflows, which a claim takes per workflow as far as
-- it has free slots. Before this, both lived in one index: a claim for
-- unlimited runs read past every due run of a saturated limited workflow,
-- and checked each against everystep_limit, at every claim.
--
-- `limited` is written when a run is inserted (its workflow has a row in
-- everystep_limit then) and rewritten for the claimable runs of a workflow
-- whose limit is set or removed (everystep.store.apply_limits, and the
-- maintenance child for a run inserted while a limit changed). The claim of
-- the unlimited lane still skips a run whose workflow has a limit, so a run
-- in the wrong lane is late at worst, never over its limit.
ALTER TABLE everystep_workflow ADD COLUMN limited boolean NOT NULL DEFAULT false;

UPDATE everystep_workflow w SET limited = true
    FROM everystep_limit l
    WHERE w.name = l.name AND w.status IN ('scheduled', 'waiting');

-- The unlimited lane, in claim order.
CREATE INDEX everystep_workflow_ready_unlimited ON everystep_workflow (due_at, id)
    WHERE status IN ('scheduled', 'waiting') AND NOT limited;
-- The limited lane, per workflow in claim order. (everystep_workflow_due_by_name,
-- every claimable run by name, stays: the autoscaler's bounded count of a
-- fleet's due runs walks it, one probe per workflow name.)
CREATE INDEX everystep_workflow_ready_limited ON everystep_workflow (name, due_at, id)
    WHERE status IN ('scheduled', 'waiting') AND limited;

DROP INDEX everystep_workflow_ready;

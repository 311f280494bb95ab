-- The trace context of the code that scheduled a run (W3C traceparent and
-- tracestate, as the application's propagator wrote them), so that every
-- execution of the run continues that trace; and how many executions were
-- traced. NULL when the run was scheduled with tracing off. Nullable and
-- without a default: adding it rewrites nothing, and runs in flight go on.
ALTER TABLE everystep_workflow ADD COLUMN trace_context jsonb;

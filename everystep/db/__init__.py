"""The data layer: every SQL statement everystep runs, behind one typed
function each. Nobody else writes SQL.

The statements are in everystep/db/sql/, one file per group, each under its
name (`-- name: claim`), whole and commented; everystep.db.queries loads
them. The functions are in one module per group, re-exported here, so
consumers write `from everystep import db` and `db.claim(conn, ...)`:

- queue: waiting for runs, claiming, limits and slots, what a runner holds,
  crash counting, the group-committed step rows and ends of runs, requeues
- fenced: the writes about a held run, each conditional on the writing
  execution's claim and token, and why one matched nothing
- runs: scheduling, messages, cancelling, reading runs and their steps
- schedules: recurring schedules, the scheduler's lock and tick
- history: moving finished runs to the partitioned history, its
  partitions, retention by end status
- ops, ui, observe: the operators' actions and audit trail, the web UI's
  reads, what metrics and health checks read
- streams: durable streams' entries, written in the group commit, and their readers
- attributes: run attributes, finding runs by them, bulk actions' progress
- charts: the console's per-minute figures and the bounded reads its charts draw
- session: session settings, pooled connections, liveness locks, LISTEN
- testing: the engine's clock (everystep_now), and what everystep.testing reads
- libpq: the prepared fast path of the hot statements
- migrations: the applier of everystep/migrations/
- rows: what the functions return

everystep/db/schema.sql shows the tables, indexes and functions the
migrations leave, for reading; tests/test_schema.py keeps it true.
"""

from everystep.db.attributes import (
    AttributeFilter,
    BulkCursor,
    BulkProgress,
    TooManyAttributes,
    advance_bulk,
    count_runs,
    find_runs,
    finish_bulk,
    lock_bulk,
    open_bulk,
    runs_in_order,
    set_attributes,
)
from everystep.db.charts import (
    CHART_DUE_CAP,
    CHART_LOOKBACK_S,
    chart_minutes,
    chart_schedule_fires,
    chart_step_durations,
    prune_minutes,
    roll_up_minutes,
)
from everystep.db.fenced import (
    LOST,
    OTHER,
    WRITTEN,
    abegin_step_transaction,
    arecord_transactional_step,
    begin_step_transaction,
    begin_wait,
    cancel_reason,
    complete_started_step,
    deliver_cancel,
    park_run,
    park_waiting,
    record_attempt,
    record_sleep,
    record_transactional_step,
    set_event,
    start_child,
    start_traced_execution,
    step_row,
    take_child,
    take_message,
    why_not_written,
)
from everystep.db.history import (
    Moved,
    Week,
    archive_batch,
    count_expired,
    drop_week,
    history_ahead,
    history_weeks,
    retention_batch,
    retention_batch_hot,
    week_expired,
)
from everystep.db.migrations import check_schema, migrate, missing_migrations
from everystep.db.observe import (
    fleet_load,
    publish_route,
    queue_stats,
    runners_without_lock,
    server,
    set_statement_timeout,
    table_health,
    unknown_workflows,
    unserved_runs,
    vacuum_horizon,
)
from everystep.db.ops import (
    ResolveRefused,
    audit,
    audit_entry,
    audit_records,
    audit_records_filtered,
    insert_rerun,
    record_environment,
    recorded_environment,
    rerun_source,
    resolve_step,
)
from everystep.db.queue import (
    apply_limits,
    cancel_requests,
    claim,
    claim_before_commit,
    compact_queue,
    count_crashes,
    end_runs,
    finish_run,
    held_claims,
    key_limits,
    limits,
    next_due_in,
    priorities,
    put_rate_limits,
    queue_dead_tuples,
    rate_limits,
    reclaim_held,
    record_step,
    record_steps,
    requeue_claimer,
    requeue_from_dead_claimers,
    requeue_held,
    routes_of,
    running_claimers,
    sort_lanes,
    stop_waiting,
    sweep_keys,
    take_token,
    vacuum_queue,
    wait_for_runs,
)
from everystep.db.rows import (
    NO_DEADLINE,
    Attempt,
    BatchEnd,
    CancelDelivery,
    CancelOutcome,
    Claim,
    ClaimedRun,
    Deadline,
    Ended,
    EndedRuns,
    EndWrite,
    EventValue,
    Parking,
    QueueStats,
    RunFilter,
    Scheduled,
    Sent,
    Server,
    Sleep,
    StepRow,
    StepState,
    StepWrite,
    StreamEntryRow,
    StreamLook,
    StreamState,
    StreamWrite,
    TableHealth,
    TokenTake,
    TracedExecution,
    VacuumHorizon,
    Wait,
    Written,
)
from everystep.db.runs import (
    acancel_run,
    aget_event,
    ainsert_run,
    ainsert_runs,
    aload_run,
    asend_message,
    cancel_run,
    children,
    get_event,
    insert_run,
    insert_runs,
    list_runs,
    load_events,
    load_messages,
    load_run,
    load_steps,
    send_message,
)
from everystep.db.schedules import (
    ScheduleRefused,
    advance_schedule,
    auto_paused_schedules,
    database_now,
    due_schedules,
    fire_schedule_now,
    load_schedule,
    load_schedules,
    lock_scheduler,
    put_schedule,
    record_schedule_run,
    retire_schedule,
    schedules_failing,
    set_schedule_error,
    set_schedule_paused,
    try_lock_scheduler,
)
from everystep.db.session import (
    CONNECTION_ERRORS,
    Executor,
    TransactionPooledConnection,
    listen,
    notifications,
    ping,
    prepare_claiming_session,
    prepare_control_session,
    prepare_session,
    reset_claiming_session,
    try_lock,
    unlock,
)
from everystep.db.streams import (
    alisten_streams,
    aread_stream,
    listen_streams,
    notify_streams,
    read_stream,
    run_streams,
    stream_state,
    write_streams,
)
from everystep.db.testing import (
    advance_clock,
    clock_frozen,
    create_schema,
    current_schema,
    drop_schema,
    next_due_moment,
    reset_clock,
    run_statuses,
    runs_of_workflow,
    set_clock,
)
from everystep.db.tracebacks import record_traceback, step_tracebacks
from everystep.db.ui import (
    UI_STATUS_CAP,
    ui_failures,
    ui_overview,
    ui_reschedule,
    ui_run,
    ui_runs,
    ui_set_schedule_paused,
    ui_workers,
    ui_workflow_names,
)
from everystep.schema import TERMINAL

__all__ = [
    "CONNECTION_ERRORS", "LOST", "OTHER", "TERMINAL", "UI_STATUS_CAP", "WRITTEN",
    # rows
    "NO_DEADLINE", "Attempt", "BatchEnd", "CancelDelivery", "CancelOutcome", "Claim", "ClaimedRun", "Deadline",
    "EndWrite", "Ended", "EndedRuns", "EventValue",
    "Executor", "Parking", "QueueStats", "ResolveRefused", "RunFilter", "ScheduleRefused", "Scheduled", "Sent",
    "Server", "Sleep", "StepRow", "StepState", "StepWrite", "TableHealth", "TokenTake", "TracedExecution",
    "TransactionPooledConnection", "VacuumHorizon", "Wait", "Written",
    # session, migrations
    "listen", "migrate", "missing_migrations", "notifications", "ping", "prepare_claiming_session",
    "prepare_control_session", "prepare_session", "check_schema",
    "reset_claiming_session", "try_lock", "unlock",
    # queue
    "apply_limits", "cancel_requests", "claim", "claim_before_commit", "count_crashes", "end_runs", "finish_run",
    "held_claims",
    "limits", "next_due_in", "reclaim_held", "record_step", "record_steps", "requeue_claimer",
    "requeue_from_dead_claimers", "requeue_held", "routes_of", "running_claimers", "sort_lanes", "stop_waiting",
    "wait_for_runs", "key_limits", "priorities", "put_rate_limits", "rate_limits", "sweep_keys", "take_token",
    "compact_queue", "queue_dead_tuples", "vacuum_queue",
    # fenced
    "abegin_step_transaction", "arecord_transactional_step", "begin_step_transaction", "record_transactional_step",
    "begin_wait", "cancel_reason", "complete_started_step", "deliver_cancel", "park_run", "park_waiting",
    "record_attempt", "record_sleep", "set_event", "start_child", "start_traced_execution", "step_row", "take_child",
    "take_message", "why_not_written",
    # runs
    "acancel_run", "aget_event", "ainsert_run", "ainsert_runs", "aload_run", "asend_message",
    "cancel_run", "children", "get_event", "insert_run", "insert_runs", "list_runs", "load_events",
    "load_messages", "load_run", "load_steps", "send_message",
    # schedules
    "advance_schedule", "auto_paused_schedules", "database_now", "due_schedules", "fire_schedule_now",
    "load_schedule", "load_schedules", "lock_scheduler", "put_schedule", "record_schedule_run", "retire_schedule",
    "schedules_failing", "set_schedule_error", "set_schedule_paused", "try_lock_scheduler",
    # testing
    "advance_clock", "clock_frozen", "create_schema", "current_schema", "drop_schema", "next_due_moment", "reset_clock",
    "run_statuses", "runs_of_workflow", "set_clock",
    # ops, observe, ui
    "audit", "audit_entry", "audit_records", "audit_records_filtered", "record_environment", "recorded_environment",
    "insert_rerun", "rerun_source", "resolve_step",
    "Moved", "Week", "archive_batch", "count_expired", "drop_week", "history_ahead", "history_weeks", "retention_batch",
    "retention_batch_hot", "week_expired",
    "fleet_load", "publish_route", "queue_stats", "runners_without_lock", "server", "set_statement_timeout",
    "table_health", "unknown_workflows", "unserved_runs", "vacuum_horizon",
    "ui_failures", "ui_overview", "ui_reschedule", "ui_run", "ui_runs", "ui_set_schedule_paused", "ui_workers",
    "ui_workflow_names",
    # the console: re-runs, execution history, charts
    "insert_rerun", "rerun_source",
    "CHART_DUE_CAP", "CHART_LOOKBACK_S", "chart_minutes", "chart_schedule_fires", "chart_step_durations",
    "prune_minutes", "roll_up_minutes",
    # streams
    "StreamEntryRow", "StreamLook", "StreamState", "StreamWrite", "alisten_streams", "aread_stream",
    "listen_streams", "notify_streams", "read_stream", "run_streams", "stream_state", "write_streams",
    # the tracebacks of failed step attempts
    "record_traceback", "step_tracebacks",
    # run attributes, bulk actions
    "AttributeFilter", "BulkCursor", "BulkProgress", "TooManyAttributes", "advance_bulk", "count_runs",
    "find_runs", "finish_bulk", "lock_bulk", "open_bulk", "runs_in_order", "set_attributes",
]

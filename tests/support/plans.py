"""The plans of the statements a connection runs, read with auto_explain."""

from __future__ import annotations

import psycopg


def record_plans(conn: psycopg.Connection) -> list[str]:
    """From now on, the plan of every statement `conn` runs, the nested ones
    (inside PL/pgSQL functions) too, as auto_explain logs them: the list
    fills as they run."""
    conn.execute("LOAD 'auto_explain'")
    for setting in ("auto_explain.log_min_duration = 0", "auto_explain.log_nested_statements = on",
                    "client_min_messages = log"):
        conn.execute(f"SET {setting}")
    plans: list[str] = []
    conn.add_notice_handler(lambda notice: plans.append(notice.message_primary))
    return plans

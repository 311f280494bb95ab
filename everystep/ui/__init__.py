"""The operators' web UI: live runs, step graphs, actions, schedules, workers,
failures and the audit trail. `core` holds what it does (no web framework),
`web` the Starlette app, `server` uvicorn, `django` the views to mount in a
Django project."""

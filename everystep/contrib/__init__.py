"""Integrations of everystep with other libraries, each behind an extra."""

"""Workflow modules and child-process entry points that the tests start."""

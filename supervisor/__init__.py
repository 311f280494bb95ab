"""The everystep supervisor: a process manager for everystep workers.

Entry point: `everystep-supervisor -c everystep.yaml` (supervisor.__main__).
Nothing is imported here, so that the entry point can set up the Prometheus
multiprocess folder before prometheus_client is first imported."""

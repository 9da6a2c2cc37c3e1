"""worker_svc package."""

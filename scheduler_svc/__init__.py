"""scheduler_svc package."""

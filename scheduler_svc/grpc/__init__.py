"""The scheduler's gRPC edge: the client API (pagedserve.v1.Generation) and the worker port (WorkerControl)."""

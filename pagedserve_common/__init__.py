"""What both services need: the scheduler and the worker import this, never each other."""

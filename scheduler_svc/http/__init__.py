"""The OpenAI-compatible HTTP front: a FastAPI app served by uvicorn inside the scheduler's event loop."""

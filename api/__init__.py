"""tierplan API service and CLI: FastAPI endpoints (later steps), storage, metrics, and the `tierplan` command."""

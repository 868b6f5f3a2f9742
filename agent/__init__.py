"""In-engine agent and sidecar (step 2): taps signals, enforces plans through runtime mechanisms."""
